/**
 * Train the digits CNN in Node.js with onnxtrain-web on stock onnxruntime-node.
 *
 *   python examples/digits_for_js.py examples/node/data     # model, artifacts, data
 *   (cd js && npm ci)                                        # onnxruntime-node
 *   node examples/node/train_digits.mjs examples/node/data
 *
 * Trains a few epochs, prints loss and test accuracy, saves the checkpoint (with optimizer
 * state, readable by onnxtrain.api in Python) and an inference model, and checks the
 * inference model's accuracy with a plain onnxruntime InferenceSession.
 * In an application, import from 'onnxtrain-web/node' instead of the relative path.
 */

import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import * as api from '../../js/src/node.js';
import { accuracy, decodeDigits, gather } from '../web/digits_data.mjs';
import { trainDigits } from '../web/digits_training.mjs';

const dataDir = process.argv[2] ?? 'examples/node/data';
const epochs = Number(process.argv[3] ?? 8);
const index = JSON.parse(await readFile(join(dataDir, 'digits.json'), 'utf8'));
const bytes = await readFile(join(dataDir, 'digits.bin'));
const data = decodeDigits(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength), index);

const result = await trainDigits({
  api, data, epochs, artifact: (name) => join(dataDir, 'artifacts', name),
  onProgress: ({ epoch, epochs: total, testAccuracy, loss }) => {
    if (testAccuracy !== undefined) console.log(`epoch ${epoch}/${total}: mean loss ${loss.toFixed(4)}, test accuracy ${(100 * testAccuracy).toFixed(1)}%`);
  },
});
console.log(`trained ${result.optimizer.stepCount} steps in ${result.seconds.toFixed(1)} s`);

const checkpoint = join(dataDir, 'trained_checkpoint');
await api.CheckpointState.save(result.state, checkpoint, { includeOptimizerState: true });
const inferencePath = join(dataDir, 'inference_model.onnx');
await result.module.exportModelForInferencing(['logits'], inferencePath);
const session = await api.ort.InferenceSession.create(inferencePath);
const all = Array.from({ length: data.test.count }, (_, i) => i);
const [images, labels] = gather(api.ort, data.test, all);
const { logits } = await session.run({ image: images });
console.log(`inference model ${inferencePath}: test accuracy ${(100 * accuracy(logits.data, labels.data)).toFixed(1)}%`);
console.log(`checkpoint ${checkpoint}`);
