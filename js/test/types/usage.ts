// Compiled (not run) by types.test.js with tsc --strict: the declarations in types/ must accept
// the documented usage and reject the misuse marked @ts-expect-error.
import { CheckpointError, CheckpointState, LinearLRScheduler, Module, Optimizer, ort } from 'onnxtrain-web/node';
import * as web from 'onnxtrain-web';

export async function documentedUsage(): Promise<number> {
  const state = await CheckpointState.load('out/checkpoint');
  const module = await Module.create('out/training_model.onnx', state, 'out/eval_model.onnx',
    { sessionOptions: { executionProviders: ['cpu'] } });
  const optimizer = await Optimizer.create('out/optimizer_model.onnx', module);
  const scheduler = new LinearLRScheduler(optimizer, 2, 10, 1e-3);
  const images = new ort.Tensor('float32', new Float32Array(64), [1, 1, 8, 8]);
  const labels = new ort.Tensor('int32', Int32Array.of(1), [1]);
  const { loss } = await module.trainStep(images, labels);
  await module.evalStep({ image: images, labels });
  await optimizer.step();
  scheduler.step();
  module.lazyResetGrad();
  state.properties.set('epoch', 1);
  const bytes: Uint8Array = await CheckpointState.save(state, null, { includeOptimizerState: true });
  const again = await web.CheckpointState.load(bytes);
  // an onnxruntime-training checkpoint whose tensors are in its .data file
  const upstream = CheckpointState.fromBytes(bytes, 'upstream', { externalData: new Uint8Array(0) });
  const inference: Uint8Array = await module.exportModelForInferencing(['logits']);
  const error: Error = new CheckpointError('x');
  return state.parameters.get('fc.bias').dims[0] + optimizer.stepCount + inference.length + Number(again.nominal) + upstream.parameters.size +
    Number(loss.data) + error.message.length;
}

export async function misuse(): Promise<void> {
  // @ts-expect-error a checkpoint source is a path, URL or bytes
  await CheckpointState.load(5);
  const state = CheckpointState.fromBytes(new Uint8Array(0));
  // @ts-expect-error externalData is bytes
  CheckpointState.fromBytes(new Uint8Array(0), 'upstream', { externalData: 'checkpoint.data' });
  // @ts-expect-error properties are numbers or strings
  state.properties.set('flag', true);
  // @ts-expect-error the learning rate is a number
  new LinearLRScheduler({ stepCount: 0, setLearningRate() {} }, 0, 10, '0.1');
}
