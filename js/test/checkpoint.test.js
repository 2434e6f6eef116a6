// The checkpoint format (read what Python wrote, write what Python reads), CheckpointState,
// LinearLRScheduler and the errors bad input gets.
import assert from 'node:assert/strict';
import { existsSync, readFileSync } from 'node:fs';
import { test } from 'node:test';
import {
  CheckpointError, CheckpointState, InputMismatchError, LinearLRScheduler, Module, ModelError, OnnxTrainError,
  Optimizer, RunError, encodeCheckpoint, ort, readCheckpoint,
} from 'onnxtrain-web/node';
import { fixturePath } from './fixtures.js';

const artifact = (name) => fixturePath(`artifacts/${name}`);
const checkpointBytes = () => new Uint8Array(readFileSync(artifact('checkpoint')));
const isError = (ErrorClass, pattern) => (error) => {
  assert.ok(error instanceof ErrorClass, `expected ${ErrorClass.name}, got ${error?.constructor?.name}: ${error?.message}`);
  assert.ok(error instanceof OnnxTrainError);
  assert.match(error.message, pattern);
  return true;
};

test('a checkpoint Python wrote reads with its parameters, optimizer state and properties', async () => {
  const state = await CheckpointState.load(fixturePath('python_step20'));
  assert.deepEqual(state.parameters.keys(), ['conv1.weight', 'conv1.bias', 'conv2.weight', 'conv2.bias', 'fc.weight', 'fc.bias']);
  const weight = state.parameters.get('conv1.weight');
  assert.deepEqual(weight.dims, [8, 1, 3, 3]);
  assert.equal(weight.dtype, 'float32');
  assert.equal(weight.requiresGrad, true);
  assert.ok(weight.data instanceof Float32Array && weight.data.length === 72);
  assert.deepEqual(state.optimizerState, { step: 20, learningRate: 0.003, states: ['momentum0', 'momentum1'] });
  assert.equal(state.nominal, false);
});

test('toBytes and fromBytes round-trip, byte for byte and value for value', () => {
  const state = CheckpointState.fromBytes(readFileSync(fixturePath('python_step20')));
  state.properties.set('epoch', 3);
  state.properties.set('note', 'from node');
  state.properties.set('best', 0.875);
  const bytes = state.toBytes({ includeOptimizerState: true });
  const again = CheckpointState.fromBytes(bytes);
  const { epoch, note, best } = again.properties.toObject();
  assert.deepEqual({ epoch, note, best }, { epoch: 3, note: 'from node', best: 0.875 });
  assert.deepEqual(again.optimizerState, state.optimizerState);
  for (const [name, parameter] of state.parameters) assert.deepEqual(again.parameters.get(name).data, parameter.data);
  assert.deepEqual(again.toBytes({ includeOptimizerState: true }), bytes);
  const data = readCheckpoint(bytes);
  assert.equal(data.optimizer.values.get('fc.bias').get('momentum1').length, 10);
  assert.equal(CheckpointState.fromBytes(state.toBytes()).optimizerState, null, 'optimizer state only when asked');

  // integers beyond 2**53 round-trip as BigInts; a BigInt within is a number; "__proto__" is a name
  const other = CheckpointState.fromBytes(bytes);
  other.properties.set('big', 2n ** 60n + 1n);
  other.properties.set('small', 12n);
  other.properties.set('mark', '@onnxtrain-bigint0');  // looks like the writer's mark for a BigInt
  other.properties.set('__proto__', 5);
  other.properties.set('wholeNumber', 2 ** 60);  // a Number beyond 2**53: its exact value, as a BigInt
  const third = CheckpointState.fromBytes(other.toBytes());
  assert.equal(third.properties.get('big'), 2n ** 60n + 1n);
  assert.equal(third.properties.get('wholeNumber'), 2n ** 60n);
  assert.equal(third.properties.get('small'), 12);
  assert.equal(third.properties.get('mark'), '@onnxtrain-bigint0');
  assert.equal(third.properties.get('__proto__'), 5);
  assert.equal(third.properties.get('constructor'), undefined);
  assert.equal(Object.getPrototypeOf(third.properties.toObject()), Object.prototype);
});

test('bad checkpoint bytes get a CheckpointError that says what is wrong', async () => {
  const good = checkpointBytes();
  assert.throws(() => CheckpointState.fromBytes(good.subarray(0, 5)), isError(CheckpointError, /not a safetensors file: 5 bytes/));
  assert.throws(() => CheckpointState.fromBytes(good.subarray(0, good.length - 4)), isError(CheckpointError, /corrupt/));
  assert.throws(() => CheckpointState.fromBytes(new TextEncoder().encode('definitely not a checkpoint')), isError(CheckpointError, /header length/));
  const garbledHeader = good.slice();
  garbledHeader[9] = 0x00;
  assert.throws(() => CheckpointState.fromBytes(garbledHeader), isError(CheckpointError, /header is not JSON/));
  // a safetensors file from elsewhere: same container, another format tag (same length)
  const renamed = good.slice();
  const tag = new TextEncoder().encode('onnxtrain.checkpoint');
  const at = Buffer.from(renamed).indexOf(Buffer.from(tag));
  assert.ok(at > 0);
  renamed.set(new TextEncoder().encode('someone.elses.file00'), at);
  assert.throws(() => CheckpointState.fromBytes(renamed), isError(CheckpointError, /not an onnxtrain checkpoint/));
  await assert.rejects(CheckpointState.load(fixturePath('no_such_checkpoint')), isError(CheckpointError, /does not exist/));
  await assert.rejects(CheckpointState.load(fixturePath('artifacts')), isError(CheckpointError, /is a directory/));
  if (existsSync('/dev/zero')) {  // reading it would never end
    await assert.rejects(CheckpointState.load('/dev/zero'), isError(CheckpointError, /is not a regular file/));
  }
});

/** A checkpoint without tensors whose metadata is `state` (an object or its JSON text, hand-written as a damaged file's). */
function metadataOnly(state) {
  const text = typeof state === 'string' ? state : JSON.stringify(state);
  const header = new TextEncoder().encode(JSON.stringify({
    __metadata__: { format: 'onnxtrain.checkpoint', version: '1', state: text } }));
  const padded = new Uint8Array(8 + Math.ceil(header.length / 8) * 8).fill(0x20);
  new DataView(padded.buffer).setBigUint64(0, BigInt(padded.length - 8), true);
  padded.set(header, 8);
  return padded;
}

test('metadata that cannot be met is a CheckpointError: huge or BigInt sizes, an optimizer without its state', () => {
  const entry = { name: 'w', requires_grad: true, dtype: 'float32', shape: [2 ** 20, 2 ** 20] };
  assert.throws(() => CheckpointState.fromBytes(metadataOnly({ parameters: [entry], nominal: true })),
    isError(CheckpointError, /nominal parameter "w" of shape \[1048576, 1048576\] float32 could not be allocated/));
  const bigint = metadataOnly(JSON.stringify({ parameters: [{ ...entry, shape: [1] }], nominal: true })
    .replace('[1]', '[4611686018427387904]'));  // 2**62: read as a BigInt
  assert.throws(() => CheckpointState.fromBytes(bigint), isError(CheckpointError, /malformed parameter entry.*4611686018427387904/));
  const data = readCheckpoint(checkpointBytes());
  data.optimizer = { step: 3, learningRate: 1e-3, states: ['momentum0', 'momentum1'], values: new Map() };
  assert.throws(() => CheckpointState.fromBytes(encodeCheckpoint(data)),
    isError(CheckpointError, /took 3 steps with states \["momentum0","momentum1"\], but the checkpoint holds none/));
});

test('a checkpoint that lacks a parameter the training model takes is refused, naming it', async () => {
  const data = readCheckpoint(checkpointBytes());
  data.parameters.delete('fc.bias');
  const state = CheckpointState.fromBytes(encodeCheckpoint(data));
  await assert.rejects(Module.create(artifact('training_model.onnx'), state),
    isError(CheckpointError, /takes parameters \["fc\.bias"\] that the checkpoint does not hold/));
});

test('a parameter whose dtype or shape differs from the model is refused, naming both', async () => {
  const data = readCheckpoint(checkpointBytes());
  data.parameters.set('fc.bias', { ...data.parameters.get('fc.bias'), shape: [5, 2] });
  await assert.rejects(Module.create(artifact('training_model.onnx'), CheckpointState.fromBytes(encodeCheckpoint(data))),
    isError(CheckpointError, /"fc\.bias" has shape \[5, 2\] in the checkpoint; the training model expects float32 \[10\]/));
  const wide = readCheckpoint(checkpointBytes());
  const record = wide.parameters.get('fc.bias');
  wide.parameters.set('fc.bias', { ...record, dtype: 'float64', value: Float64Array.from(record.value) });
  await assert.rejects(Module.create(artifact('training_model.onnx'), CheckpointState.fromBytes(encodeCheckpoint(wide))),
    isError(CheckpointError, /"fc\.bias" is float64 in the checkpoint; the training model expects float32/));
});

test('integer inputs of another integer type are converted where every value fits, as in Python', async () => {
  const images = new ort.Tensor('float32', Float32Array.from({ length: 3 * 64 }, (_, i) => (i % 17) / 17), [3, 1, 8, 8]);
  const labels = [Int32Array.of(1, 7, 3), BigInt64Array.of(1n, 7n, 3n), Uint8Array.of(1, 7, 3)];
  const types = ['int32', 'int64', 'uint8'];
  const losses = [];
  for (const [i, data] of labels.entries()) {
    const module = await Module.create(artifact('training_model.onnx'), await CheckpointState.load(artifact('checkpoint')),
      artifact('eval_model.onnx'));
    const tensor = new ort.Tensor(types[i], data, [3]);
    losses.push([(await module.trainStep(images, tensor)).loss.data[0], (await module.evalStep({ image: images, labels: tensor })).loss.data[0]]);
  }
  assert.deepEqual(losses[1], losses[0]);
  assert.deepEqual(losses[2], losses[0]);
});

test('inputs of the wrong type, rank, count or name get an InputMismatchError', async () => {
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state);
  const images = new ort.Tensor('float32', new Float32Array(2 * 64), [2, 1, 8, 8]);
  const labels = new ort.Tensor('int32', Int32Array.of(1, 2), [2]);
  await assert.rejects(module.trainStep(images, new ort.Tensor('int64', BigInt64Array.of(1n, 1n << 40n), [2])),
    isError(InputMismatchError, /input "labels" is int64 \[2\]; expected int32 \["batch"\] \(element type int64 with values in \[1, 1099511627776\], outside int32's range\)/));
  await assert.rejects(module.trainStep(images, new ort.Tensor('float32', Float32Array.of(1, 2), [2])),
    isError(InputMismatchError, /input "labels" is float32 \[2\]; expected int32 \["batch"\] \(element type float32 instead of int32\)/));
  await assert.rejects(module.trainStep(new ort.Tensor('float32', new Float32Array(2 * 64), [2, 64]), labels),
    isError(InputMismatchError, /input "image" is float32 \[2, 64\]; expected float32 \["batch", 1, 8, 8\] \(rank 2 instead of 4\)/));
  await assert.rejects(module.trainStep(new ort.Tensor('float32', new Float32Array(2 * 81), [2, 1, 9, 9]), labels),
    isError(InputMismatchError, /dim 2 is 9, the model fixes it to 8/));
  // a named symbolic dim takes one size in every input (onnxruntime could broadcast a 1 silently)
  await assert.rejects(module.trainStep(images, new ort.Tensor('int32', Int32Array.of(1), [1])),
    isError(InputMismatchError, /input "labels" is int32 \[1\]; .*dim 0 \("batch"\) is 1 but input "image" gave "batch" = 2/));
  await assert.rejects(module.trainStep(images), isError(InputMismatchError, /got 1 inputs, expected 2 \(\["image","labels"\]\)/));
  await assert.rejects(module.trainStep({ image: images, label: labels }), isError(InputMismatchError, /unknown inputs \["label"\]/));
  await assert.rejects(module.trainStep(images, Int32Array.of(1, 2)), isError(InputMismatchError, /"labels" must be an onnxruntime Tensor/));
  const { loss } = await module.trainStep({ image: images, labels });
  assert.ok(Number.isFinite(loss.data[0]));
  await assert.rejects(module.evalStep(images, labels), isError(ModelError, /needs the eval model/));
});

test('setting a parameter checks its dtype and size; steps on one state must not overlap', async () => {
  const state = await CheckpointState.load(artifact('checkpoint'));
  assert.throws(() => state.parameters.set('fc.bias', new Float32Array(3)), isError(InputMismatchError, /shape \[10\] \(10 elements\); got 3 values/));
  assert.throws(() => state.parameters.set('fc.bias', new Float64Array(10)), isError(InputMismatchError, /expected a Float32Array, got Float64Array/));
  assert.throws(() => state.parameters.get('fc.weights'), isError(CheckpointError, /parameter "fc.weights" is not in the checkpoint/));
  state.parameters.set('fc.bias', new Float32Array(10).fill(0.5));
  assert.equal(state.parameters.get('fc.bias').data[3], 0.5);
  assert.throws(() => state.properties.set('flag', true), /property "flag" must be a number or a string, got boolean/);

  const module = await Module.create(artifact('training_model.onnx'), state);
  const optimizer = await Optimizer.create(artifact('optimizer_model.onnx'), module);
  const images = new ort.Tensor('float32', new Float32Array(2 * 64), [2, 1, 8, 8]);
  const labels = new ort.Tensor('int32', Int32Array.of(1, 2), [2]);
  const first = module.trainStep(images, labels);
  await assert.rejects(optimizer.step(), isError(OnnxTrainError, /a training step on the same state is still running/));
  // changes the step would write its results over are refused too, not lost
  const flat = module.getContiguousParameters();
  assert.throws(() => state.parameters.set('fc.bias', new Float32Array(10)),
    isError(OnnxTrainError, /cannot set parameter "fc.bias": a training step on the same state is still running/));
  assert.throws(() => module.copyBufferToParameters(flat), isError(OnnxTrainError, /cannot copy a buffer into the parameters/));
  assert.throws(() => module.lazyResetGrad(), isError(OnnxTrainError, /cannot reset the gradients/));
  await first;
  await optimizer.step();
  assert.equal(optimizer.stepCount, 1);
  assert.throws(() => module.copyBufferToParameters([0.5]), isError(InputMismatchError, /got Array; pass a typed array/));
  assert.throws(() => module.copyBufferToParameters(null), isError(InputMismatchError, /got null/));
  assert.throws(() => state.parameters.set('fc.bias', { data: new Float32Array(10) }),
    isError(InputMismatchError, /without a tensor's type and dims/));
  await optimizer.release();
  await optimizer.release(); // releasing twice is harmless
  await assert.rejects(optimizer.step(), isError(RunError, /optimizer step: onnxruntime failed the run/));
  const lr = optimizer.getLearningRate();
  assert.throws(() => optimizer.setLearningRate(-0.1), { name: 'RangeError', message: /learning rate must be >= 0, got -0.1/ });
  assert.throws(() => optimizer.setLearningRate(NaN), /learning rate must be a finite number/);
  assert.throws(() => new LinearLRScheduler(optimizer, 0, 10, -1e-3), /initialLr must be >= 0, got -0.001/);
  assert.equal(optimizer.getLearningRate(), lr, 'a refused rate leaves the one before');
});

test('a nominal checkpoint needs its values before a step; saving it keeps it nominal', async () => {
  const data = readCheckpoint(checkpointBytes());
  const state = CheckpointState.fromBytes(encodeCheckpoint({ ...data, nominal: true }));
  assert.equal(state.nominal, true);
  assert.equal(readCheckpoint(state.toBytes()).nominal, true);
  const module = await Module.create(artifact('training_model.onnx'), state);
  const images = new ort.Tensor('float32', new Float32Array(64), [1, 1, 8, 8]);
  const labels = new ort.Tensor('int32', Int32Array.of(3), [1]);
  await assert.rejects(module.trainStep(images, labels), isError(CheckpointError, /have no value \(nominal checkpoint\)/));
  // an update of the placeholders would count a step (AdamW's bias correction then one off)
  const optimizer = await Optimizer.create(artifact('optimizer_model.onnx'), module);
  await assert.rejects(optimizer.step(), isError(CheckpointError, /have no value \(nominal checkpoint\)/));
  assert.equal(optimizer.stepCount, 0);
  state.parameters.set('fc.bias', data.parameters.get('fc.bias').value);
  assert.throws(() => state.toBytes(), isError(CheckpointError, /cannot save: parameters \["conv1.weight"/));
  module.copyBufferToParameters(Float32Array.from({ length: module.getParametersSize() }, (_, i) => Math.sin(i) / 10));
  const { loss } = await module.trainStep(images, labels);
  assert.ok(Number.isFinite(loss.data[0]));
});

test('an optimizer model that does not fit the training model is refused', async () => {
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state);
  await assert.rejects(Optimizer.create(artifact('training_model.onnx'), module),
    isError(ModelError, /optimizer model's first inputs must be \["learning_rate","step"\], got \["image","labels"\]/));
  await assert.rejects(Module.create(new Uint8Array([1, 2, 3, 4]), state), isError(ModelError, /training model/));
});

test('a checkpoint of a stateless optimizer after some steps does not resume AdamW; before any step it does', async () => {
  const data = readCheckpoint(checkpointBytes());
  const sgd = (step) => CheckpointState.fromBytes(encodeCheckpoint({
    ...data, optimizer: { step, learningRate: 0.01, states: [], values: new Map() },
  }));
  const resumed = await Module.create(artifact('training_model.onnx'), sgd(5));
  await assert.rejects(Optimizer.create(artifact('optimizer_model.onnx'), resumed),
    isError(CheckpointError, /optimizer model uses \["momentum0","momentum1"\]: .* from zero after 5 steps/));
  const fresh = await Module.create(artifact('training_model.onnx'), sgd(0));
  assert.equal((await Optimizer.create(artifact('optimizer_model.onnx'), fresh)).stepCount, 0);
});

test('LinearLRScheduler warms up linearly, then decays linearly to 0 (same values as Python)', () => {
  const optimizer = { stepCount: 0, lr: NaN, setLearningRate(lr) { this.lr = lr; } };
  const scheduler = new LinearLRScheduler(optimizer, 2, 6, 0.1);
  const seen = [];
  for (let i = 0; i < 7; i++) {
    seen.push(Math.round(optimizer.lr * 1e4) / 1e4);
    optimizer.stepCount += 1;
    scheduler.step();
  }
  assert.deepEqual(seen, [0, 0.05, 0.1, 0.075, 0.05, 0.025, 0]);
  assert.throws(() => new LinearLRScheduler(optimizer, -1, 6, 0.1), /warmupStepCount must be an integer >= 0/);
});

test('saving writes a new file with the umask applied and keeps the mode of a file it replaces', async () => {
  const { chmodSync, mkdtempSync, statSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const state = await CheckpointState.load(artifact('checkpoint'));
  const target = join(mkdtempSync(join(tmpdir(), 'onnxtrain-mode-')), 'checkpoint');
  await CheckpointState.save(state, target);
  const umask = process.umask();
  assert.equal(statSync(target).mode & 0o777, 0o666 & ~umask);
  chmodSync(target, 0o640);
  await CheckpointState.save(state, target);
  assert.equal(statSync(target).mode & 0o777, 0o640);
});

test('saving through a symbolic link writes the file it names and keeps the link', async () => {
  const { lstatSync, mkdirSync, mkdtempSync, readFileSync: read, symlinkSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const folder = mkdtempSync(join(tmpdir(), 'onnxtrain-link-'));
  mkdirSync(join(folder, 'run3'));
  const state = await CheckpointState.load(artifact('checkpoint'));
  await CheckpointState.save(state, join(folder, 'run3', 'checkpoint'));
  symlinkSync(join('run3', 'checkpoint'), join(folder, 'latest'));
  state.properties.set('epoch', 4);
  await CheckpointState.save(state, join(folder, 'latest'));
  assert.ok(lstatSync(join(folder, 'latest')).isSymbolicLink());
  const reread = await CheckpointState.load(new Uint8Array(read(join(folder, 'run3', 'checkpoint'))));
  assert.equal(reread.properties.get('epoch'), 4);
});
