// Checkpoints saved by onnxruntime-training (ODTC flatbuffers), as the Python side reads them
// (tests/test_upstream_checkpoint.py): the files in tests/data/upstream were written by upstream
// 1.19.2 itself, expected.json holds what upstream computed when it resumed from the same file.
import assert from 'node:assert/strict';
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';
import { pathToFileURL } from 'node:url';
import { CheckpointError, CheckpointState, Module, Optimizer, ort, readCheckpoint } from 'onnxtrain-web/node';
import { shortestFloat32 } from '../src/core/upstream_checkpoint.js';
import { fixturePath, upstreamData } from './fixtures.js';

const EXPECTED = JSON.parse(readFileSync(upstreamData('expected.json'), 'utf8'));
const TRAINABLE = ['fc1.weight', 'fc1.bias', 'fc2.weight'];
const trained = () => new Uint8Array(readFileSync(upstreamData('checkpoint_trained')));
const isCheckpointError = (pattern) => (error) => {
  assert.ok(error instanceof CheckpointError, `expected CheckpointError, got ${error?.constructor?.name}: ${error?.message}`);
  assert.match(error.message, pattern);
  return true;
};

/** Every |a - b| <= atol + rtol * |b| (numpy's assert_allclose). */
function assertClose(actual, expected, rtol, atol, what) {
  assert.equal(actual.length, expected.length, `${what}: length`);
  for (let i = 0; i < expected.length; i++) {
    const diff = Math.abs(actual[i] - expected[i]);
    assert.ok(diff <= atol + rtol * Math.abs(expected[i]), `${what}[${i}]: ${actual[i]} vs ${expected[i]} (difference ${diff})`);
  }
}

test('an upstream checkpoint reads with its parameters, optimizer state and properties', async () => {
  const state = await CheckpointState.load(upstreamData('checkpoint_trained'));
  // upstream writes the trainable parameters first, then the frozen ones
  assert.deepEqual([...state.parameters.keys()].sort(), Object.keys(EXPECTED.saved_parameters).sort());
  assert.equal(state.parameters.keys().at(-1), 'fc2.bias');
  for (const [name, value] of Object.entries(EXPECTED.saved_parameters)) {
    const parameter = state.parameters.get(name);
    assert.equal(parameter.requiresGrad, TRAINABLE.includes(name), name);
    assert.equal(parameter.dtype, 'float32');
    assert.deepEqual(parameter.dims, [value.length, ...(Array.isArray(value[0]) ? [value[0].length] : [])]);
    assert.deepEqual(parameter.data, Float32Array.from(value.flat()), name);
  }
  // the learning rate upstream resumes with: its default, whatever the file holds
  assert.deepEqual(state.optimizerState, { step: 3, learningRate: 0.001, states: ['momentum0', 'momentum1'] });
  const data = readCheckpoint(trained());
  assert.deepEqual([...data.optimizer.values.keys()].sort(), [...TRAINABLE].sort());
  for (const states of data.optimizer.values.values()) {
    for (const value of states.values()) assert.ok(value.some((v) => v !== 0));
  }
  assert.deepEqual(state.properties.toObject(), { epoch: 7, best_loss: 0.1, device: 'device-a' });
  assert.equal(state.nominal, false);
});

test('an SGD checkpoint resumes at upstream\'s learning rate and step (its all-zero momentum0 dropped)', async () => {
  const artifact = (name) => fixturePath(`upstream/artifacts_sgd/${name}`);
  const state = await CheckpointState.load(upstreamData('checkpoint_sgd'));
  const module = await Module.create(artifact('training_model.onnx'), state);
  const optimizer = await Optimizer.create(artifact('optimizer_model.onnx'), module);
  assert.equal(optimizer.stepCount, 2);
  assertClose([optimizer.getLearningRate()], [EXPECTED.sgd.resumed_learning_rate], 1e-7, 0, 'learning rate');
  const x = new ort.Tensor('float32', Float32Array.from(EXPECTED.input.flat()), [EXPECTED.input.length, EXPECTED.input[0].length]);
  const y = new ort.Tensor('int32', Int32Array.from(EXPECTED.labels), [EXPECTED.labels.length]);
  const { loss } = await module.trainStep(x, y);
  await optimizer.step();
  assertClose([loss.data[0]], [EXPECTED.sgd.resumed_loss], 1e-5, 0, 'loss');
  for (const [name, value] of Object.entries(EXPECTED.sgd.resumed_parameters)) {
    assertClose(state.parameters.get(name).data, value.flat(), 1e-5, 1e-6, name);
  }
});

test('training resumes from an upstream checkpoint as upstream does', async () => {
  const artifact = (name) => fixturePath(`upstream/artifacts/${name}`);
  const state = CheckpointState.fromBytes(trained());
  const module = await Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'));
  const optimizer = await Optimizer.create(artifact('optimizer_model.onnx'), module);
  assert.equal(optimizer.getLearningRate(), 0.001);
  assert.equal(optimizer.stepCount, 3);
  optimizer.setLearningRate(EXPECTED.learning_rate);
  const x = new ort.Tensor('float32', Float32Array.from(EXPECTED.input.flat()), [EXPECTED.input.length, EXPECTED.input[0].length]);
  // the training model takes int32 labels (expected.json's are upstream's int64)
  const y = new ort.Tensor('int32', Int32Array.from(EXPECTED.labels), [EXPECTED.labels.length]);
  const losses = [];
  for (let k = 0; k < 2; k++) {
    const { loss } = await module.trainStep(x, y);
    losses.push(loss.data[0]);
    await optimizer.step();
    module.lazyResetGrad();
  }
  assertClose(losses, EXPECTED.resumed_losses, 1e-5, 0, 'losses');
  for (const [name, value] of Object.entries(EXPECTED.resumed_parameters)) {
    assertClose(state.parameters.get(name).data, value.flat(), 1e-5, 1e-6, name);
  }
  assert.equal(optimizer.stepCount, 5);
  assert.equal(state.properties.get('epoch'), 7);
});

test('saving an upstream checkpoint writes onnxtrain\'s format with the same contents', () => {
  const original = readCheckpoint(trained());
  const bytes = CheckpointState.fromBytes(trained()).toBytes({ includeOptimizerState: true });
  assert.notEqual(new TextDecoder().decode(bytes.subarray(4, 8)), 'ODTC');
  const converted = readCheckpoint(bytes);
  assert.deepEqual(converted.properties, original.properties);
  assert.equal(converted.optimizer?.step, 3);
  assert.equal(converted.optimizer?.learningRate, 0.001);
  assert.deepEqual(converted.parameters, original.parameters);
  assert.deepEqual(converted.optimizer?.values, original.optimizer?.values);
});

test('an optimizer state listed twice is refused before its bytes are read again', () => {
  // 20,000 references to one 4 MB momentum0 tensor (tests/upstream_odtc.py repeated_momentum_bytes)
  const bytes = new Uint8Array(readFileSync(fixturePath('upstream/repeated_momentum')));
  assert.throws(() => readCheckpoint(bytes), (error) => error instanceof CheckpointError &&
    /holds optimizer state "momentum0" of "w" twice/.test(error.message));
});

test('a nominal upstream checkpoint is refused with the way out', async () => {
  await assert.rejects(CheckpointState.load(upstreamData('nominal_checkpoint')),
    isCheckpointError(/nominal checkpoint.*without shapes.*generate_artifacts/));
});

test('every truncation is a CheckpointError', () => {
  const data = trained();
  assert.deepEqual([...data.subarray(-4)], [0, 0, 0, 0]); // the last string's terminator and padding: nothing reads them
  for (let length = 0; length < data.length - 4; length++) {
    assert.throws(() => CheckpointState.fromBytes(data.slice(0, length)), (error) => error instanceof CheckpointError,
      `truncated to ${length} bytes`);
  }
});

test('damaged bytes give a CheckpointError or a consistent state, never another error', () => {
  const data = trained();
  let seed = 1;
  const random = (n) => { // a small deterministic generator (xorshift32)
    seed ^= seed << 13; seed ^= seed >>> 17; seed ^= seed << 5;
    return (seed >>> 0) % n;
  };
  let errors = 0;
  for (let round = 0; round < 400; round++) {
    const damaged = data.slice();
    for (let flips = 1 + random(3); flips > 0; flips--) damaged[8 + random(data.length - 8)] ^= 1 + random(255);
    let record;
    try {
      record = readCheckpoint(damaged);
    } catch (error) {
      assert.ok(error instanceof CheckpointError, `round ${round}: ${error?.constructor?.name}: ${error?.message}`);
      errors += 1;
      continue;
    }
    for (const parameter of record.parameters.values()) {
      const count = parameter.shape.reduce((n, d) => n * d, 1);
      assert.equal(/** @type {any} */ (parameter.value).length, count);
    }
  }
  assert.ok(errors > 0);
});

test('a garbage file with the identifier is named corrupt', () => {
  const garbage = new Uint8Array(80);
  garbage.set([0x08, 0, 0, 0, 0x4f, 0x44, 0x54, 0x43, 0xf4, 0xff, 0xff, 0xff, 0x10, 0, 0, 0]);
  assert.throws(() => CheckpointState.fromBytes(garbage, 'garbage'),
    isCheckpointError(/onnxruntime-training checkpoint "garbage" .*(truncated or corrupt|version)/));
});

test('learning rates and float properties read as Python reads them (shortest float32 decimal)', () => {
  const view = new DataView(new ArrayBuffer(4));
  const cases = JSON.parse(readFileSync(fixturePath('upstream/float32.json'), 'utf8'));
  assert.ok(cases.length > 1000);
  for (const [bits, expected] of cases) {
    view.setUint32(0, bits);
    const value = view.getFloat32(0);
    assert.ok(Object.is(shortestFloat32(value), expected), `float32 ${value} (bits ${bits}): ${shortestFloat32(value)}, Python ${expected}`);
  }
});

// ------------------------------------------------------------------ external data
// Past ~1.8 GB upstream keeps the tensors' bytes in "<checkpoint>.data" (at offsets the
// flatbuffer records); tests/js/fixtures.py builds one in that layout with the flatbuffers package.

const external = (name) => fixturePath(`upstream/external/${name}`);
const VALUES = () => JSON.parse(readFileSync(external('values.json'), 'utf8'));

/** @param {CheckpointState} state */
function assertExternalValues(state) {
  const values = VALUES();
  assert.deepEqual(state.parameters.keys(), values.map((v) => v.name));
  const arrays = { float32: Float32Array, float64: Float64Array, float16: Uint16Array, int8: Int8Array, bool: Uint8Array };
  for (const { name, requires_grad: requiresGrad, dtype, shape, values: expected } of values) {
    const parameter = state.parameters.get(name);
    assert.equal(parameter.requiresGrad, requiresGrad, name);
    assert.equal(parameter.dtype, dtype, name);
    assert.deepEqual(parameter.dims, shape, name);
    const want = dtype === 'int64' ? BigInt64Array.from(expected, BigInt) : arrays[dtype].from(expected);
    assert.deepEqual(parameter.data, want, name);
  }
}

test('tensors in the external data file are read at their offsets (path, URL, or bytes with externalData)', async () => {
  assertExternalValues(await CheckpointState.load(external('checkpoint')));
  assertExternalValues(await CheckpointState.load(pathToFileURL(external('checkpoint'))));
  assertExternalValues(await CheckpointState.load(pathToFileURL(external('checkpoint')).href));
  const bytes = readFileSync(external('checkpoint'));
  assertExternalValues(CheckpointState.fromBytes(bytes, 'checkpoint', { externalData: readFileSync(external('checkpoint.data')) }));
  assert.throws(() => CheckpointState.fromBytes(bytes),
    isCheckpointError(/keeps its tensors in "<checkpoint>\.data", which was not given: .*externalData/));
});

test('a missing or short external data file is named', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'onnxtrain-upstream-'));
  try {
    const checkpoint = join(dir, 'checkpoint');
    copyFileSync(external('checkpoint'), checkpoint);
    await assert.rejects(CheckpointState.load(checkpoint),
      isCheckpointError(/keeps its tensors in ".*checkpoint\.data", which cannot be read: .*does not exist/));
    const data = readFileSync(external('checkpoint.data'));
    writeFileSync(`${checkpoint}.data`, data.subarray(0, data.length - 1));
    await assert.rejects(CheckpointState.load(checkpoint),
      isCheckpointError(/tensor "mask" needs bytes \d+-\d+ of ".*checkpoint\.data", which has \d+/));
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
