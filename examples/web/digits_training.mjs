/**
 * The digits training loop shared by the Node example and the web page: load the artifacts
 * into onnxtrain-web, train a few shuffled epochs with AdamW, evaluate the test split after
 * each epoch. Whatever binds onnxtrain-web (Node or web) is passed in as `api`.
 */

import { accuracy, gather, shuffled } from './digits_data.mjs';

/**
 * @param {object} options
 * @param {any} options.api  the onnxtrain-web module (`onnxtrain-web` or `onnxtrain-web/node`)
 * @param {(name: string) => string} options.artifact  path or URL of an artifact file by name
 * @param {{train: any, test: any}} options.data  from decodeDigits
 * @param {number} [options.epochs]
 * @param {number} [options.batchSize]
 * @param {number} [options.learningRate]
 * @param {number} [options.seed]
 * @param {object} [options.sessionOptions]  onnxruntime session options (execution providers)
 * @param {(progress: {epoch: number, epochs: number, step: number, steps: number, loss: number, testAccuracy?: number}) => void} [options.onProgress]
 */
export async function trainDigits({ api, artifact, data, epochs = 8, batchSize = 32, learningRate = 3e-3, seed = 0,
  sessionOptions, onProgress = () => {} }) {
  const { ort } = api;
  const started = performance.now();
  const state = await api.CheckpointState.load(artifact('checkpoint'));
  const module = await api.Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'), { sessionOptions });
  const optimizer = await api.Optimizer.create(artifact('optimizer_model.onnx'), module, { sessionOptions });
  optimizer.setLearningRate(learningRate);
  const stepsPerEpoch = Math.ceil(data.train.count / batchSize);
  const testAll = Array.from({ length: data.test.count }, (_, i) => i);
  const [testImages, testLabels] = gather(ort, data.test, testAll);
  const history = [];
  let testAccuracy = 0;
  for (let epoch = 1; epoch <= epochs; epoch++) {
    const order = shuffled(data.train.count, seed + epoch);
    let lossSum = 0;
    for (let step = 0; step < stepsPerEpoch; step++) {
      const [images, labels] = gather(ort, data.train, order.slice(step * batchSize, (step + 1) * batchSize));
      const { loss } = await module.trainStep(images, labels);
      await optimizer.step();
      module.lazyResetGrad();
      lossSum += loss.data[0];
      onProgress({ epoch, epochs, step: step + 1, steps: stepsPerEpoch, loss: loss.data[0] });
    }
    const { logits } = await module.evalStep(testImages, testLabels);
    testAccuracy = accuracy(logits.data, testLabels.data);
    history.push({ epoch, meanLoss: lossSum / stepsPerEpoch, testAccuracy });
    onProgress({ epoch, epochs, step: stepsPerEpoch, steps: stepsPerEpoch, loss: lossSum / stepsPerEpoch, testAccuracy });
  }
  return { state, module, optimizer, history, testAccuracy, seconds: (performance.now() - started) / 1000 };
}
