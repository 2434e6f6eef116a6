// Compiled (not run) by training_session.test.js with tsc --strict: the TrainingSession
// declarations accept upstream's documented usage and reject the misuse marked @ts-expect-error.
import { CheckpointState, ModelError, TrainingSession, ort } from 'onnxtrain-web/node';
import * as web from 'onnxtrain-web';

export async function documentedUsage(): Promise<number> {
  const session = await TrainingSession.create({
    checkpointState: 'out/checkpoint', trainModel: 'out/training_model.onnx',
    evalModel: 'out/eval_model.onnx', optimizerModel: new Uint8Array(0),
  }, { executionProviders: ['cpu'] });
  const image = new ort.Tensor('float32', new Float32Array(64), [1, 1, 8, 8]);
  const labels = new ort.Tensor('int32', Int32Array.of(1), [1]);
  const { loss } = await session.runTrainStep({ image, labels });
  await session.runTrainStep({ image, labels }, ['loss'], { logSeverityLevel: 3 });
  await session.runTrainStep({ image, labels }, { logSeverityLevel: 3 });
  await session.runOptimizerStep();
  await session.lazyResetGrad();
  const { logits } = await session.runEvalStep({ image, labels }, { logits: null });
  const size: number = await session.getParametersSize(false);
  const flat = await session.getContiguousParameters();
  await session.loadParametersBuffer(new Uint8Array(flat.data.buffer), true);
  const names: readonly string[] = [...session.trainingInputNames, ...session.trainingOutputNames,
    ...session.evalInputNames, ...session.evalOutputNames];
  session.optimizer?.setLearningRate(1e-3);
  const bytes: Uint8Array = await CheckpointState.save(session.state, null, { includeOptimizerState: true });
  await session.module.exportModelForInferencing(['logits']);
  await session.release();
  const onWeb: web.TrainingSession = await web.TrainingSession.create({ checkpointState: bytes, trainModel: bytes });
  const error: Error = new ModelError('x');
  return Number(loss.data) + Number(logits.data) + size + names.length + error.message.length + onWeb.trainingInputNames.length;
}

export async function misuse(session: TrainingSession): Promise<void> {
  // @ts-expect-error trainModel is required
  await TrainingSession.create({ checkpointState: 'out/checkpoint' });
  // @ts-expect-error upstream's option names: trainModel, not trainingModel
  await TrainingSession.create({ checkpointState: 'out/checkpoint', trainModel: 'a.onnx', trainingModel: 'a.onnx' });
  // @ts-expect-error the parameters buffer is bytes
  await session.loadParametersBuffer(new Float32Array(4));
  // @ts-expect-error trainableOnly is a boolean
  await session.getParametersSize('all');
  // @ts-expect-error the names are read-only
  session.trainingInputNames = [];
  // @ts-expect-error feeds are by name, not positional
  await session.runTrainStep([new ort.Tensor('float32', new Float32Array(1), [1])]);
}
