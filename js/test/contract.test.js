// The rest of the graph contract against the Python runtime: training-mode BatchNormalization
// (running statistics written back into frozen parameters) and fp16 artifacts (dynamic loss
// scaling: skipped steps, scale backoff and growth tracking in the state's properties).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import { bindPlatform, CheckpointState, Module, Optimizer, ort } from 'onnxtrain-web/node';
import { fixturePath, maxAbsDiff, settings } from './fixtures.js';

/**
 * Train the small MLP `name` as tests/js/fixtures.py does; return the state and skip flags.
 * With `ortFormat`, from the models converted to ORT format (.ort) by onnxruntime's converter.
 */
async function trainSmall(name, ortFormat = false) {
  const small = JSON.parse(readFileSync(fixturePath('small/data.json'), 'utf8'));
  const artifact = (file) => fixturePath(`small/${name}/${file}`);
  const model = (file) => (ortFormat ? artifact(`ort_format/${file.replace('.onnx', '.ort')}`) : artifact(file));
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(model('training_model.onnx'), state, model('eval_model.onnx'));
  const optimizer = await Optimizer.create(model('optimizer_model.onnx'), module);
  optimizer.setLearningRate(small.learning_rate);
  const x = Float32Array.from(small.x);
  const y = Int32Array.from(small.y);
  const [count, features] = small.x_dims;
  const skipped = [];
  for (let k = 0; k < small.steps; k++) {
    if (name === 'fp16' && k === small.overflow_step) state.properties.set('loss_scale', small.overflow_scale);
    const start = (k * small.rows) % count;
    await module.trainStep(new ort.Tensor('float32', x.slice(start * features, (start + small.rows) * features), [small.rows, features]),
      new ort.Tensor('int32', y.slice(start, start + small.rows), [small.rows]));
    await optimizer.step();
    module.lazyResetGrad();
    skipped.push(optimizer.lastStepSkipped);
  }
  return { state, module, optimizer, skipped, small };
}

/** Every parameter (trainable and frozen) and the optimizer moments equal Python's run. */
async function assertMatchesPython(name, state) {
  const expected = await CheckpointState.load(fixturePath(`small/${name}/python_steps`));
  const { tolerance } = settings();
  for (const [param, parameter] of expected.parameters) {
    const diff = maxAbsDiff(state.parameters.get(param).data, parameter.data);
    assert.ok(diff <= tolerance, `${name}: parameter ${param} differs from Python's by ${diff}`);
  }
  assert.deepEqual(state.optimizerState, expected.optimizerState);
  return expected;
}

test('training-mode BatchNormalization: running statistics are written back as in Python', async () => {
  const { state } = await trainSmall('batchnorm');
  const initial = await CheckpointState.load(fixturePath('small/batchnorm/checkpoint'));
  assert.equal(state.parameters.get('bn.running_mean').requiresGrad, false);
  assert.ok(maxAbsDiff(state.parameters.get('bn.running_mean').data, initial.parameters.get('bn.running_mean').data) > 1e-3,
    'the running mean moved');
  await assertMatchesPython('batchnorm', state);
});

test('fp16 artifacts: overflowing steps are skipped, the scale backs off and grows as in Python', async () => {
  const { state, optimizer, skipped, small } = await trainSmall('fp16');
  const expected = await assertMatchesPython('fp16', state);
  assert.deepEqual(state.properties.toObject(), expected.properties.toObject());
  assert.ok(skipped.slice(0, small.overflow_step).every((s) => !s), 'no skip before the forced overflow');
  assert.equal(skipped[small.overflow_step], true, 'the step with the overflowing scale is skipped');
  assert.equal(skipped.at(-1), false, 'training recovers once the scale has backed off');
  assert.equal(optimizer.stepCount, skipped.filter((s) => !s).length, 'skipped steps do not count');
});

test('fp16 artifacts: a loss scale or growth tracker that is not a count refuses the step, never skips silently', async () => {
  const small = JSON.parse(readFileSync(fixturePath('small/data.json'), 'utf8'));
  const artifact = (file) => fixturePath(`small/fp16/${file}`);
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state);
  const optimizer = await Optimizer.create(artifact('optimizer_model.onnx'), module);
  const [, features] = small.x_dims;
  const x = new ort.Tensor('float32', Float32Array.from(small.x).slice(0, small.rows * features), [small.rows, features]);
  const y = new ort.Tensor('int32', Int32Array.from(small.y).slice(0, small.rows), [small.rows]);
  for (const [name, value, message] of [['loss_scale', '65536x', /"loss_scale" is 65536x; .*a positive finite number/],
    ['loss_scale', 0, /"loss_scale" is 0/], ['loss_scale_growth_tracker', 2.5, /"loss_scale_growth_tracker" is 2.5; .*integer >= 0/]]) {
    const before = state.properties.get(name);
    state.properties.set(name, value);
    await assert.rejects(module.trainStep(x, y), (error) => error.name === 'CheckpointError' && message.test(error.message));
    state.properties.set(name, before);
  }
  await module.trainStep(x, y);
  state.properties.delete('loss_scale');
  await assert.rejects(optimizer.step(), (error) => error.name === 'CheckpointError' && /"loss_scale" is undefined/.test(error.message));
  assert.equal(optimizer.stepCount, 0);
});

test('ORT-format models carry the same training metadata: statistics written back, the loss scale', async () => {
  for (const name of ['batchnorm', 'fp16']) {
    const { state, module } = await trainSmall(name, true);
    const expected = await assertMatchesPython(name, state);
    assert.deepEqual(state.properties.toObject(), expected.properties.toObject(), name);
    assert.deepEqual(module.outputNames(), ['loss'], name);
  }
});

test('sessions are created without the memory pattern unless the options ask for it', async () => {
  const seen = [];
  const recording = {
    ...ort,
    InferenceSession: { create: (bytes, options) => { seen.push(options); return ort.InferenceSession.create(bytes, options); } },
  };
  const api = bindPlatform({ name: 'recording', ort: recording, readBytes: async (path) => new Uint8Array(readFileSync(path)) });
  const artifact = (file) => fixturePath(`small/batchnorm/${file}`);
  const state = await api.CheckpointState.load(artifact('checkpoint'));
  const module = await api.Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'),
    { sessionOptions: { executionProviders: ['cpu'] } });
  await api.Optimizer.create(artifact('optimizer_model.onnx'), module);
  assert.deepEqual(seen, [{ enableMemPattern: false, executionProviders: ['cpu'] },
    { enableMemPattern: false, executionProviders: ['cpu'] }, { enableMemPattern: false }]);
  await api.Module.create(artifact('training_model.onnx'), state, null, { sessionOptions: { enableMemPattern: true } });
  assert.deepEqual(seen.at(-1), { enableMemPattern: true });
});

test('an input declared without a shape takes any rank (onnxruntime reports it as a scalar)', async () => {
  const artifact = (file) => fixturePath(`shapeless/${file}`);
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'));
  for (const dims of [[3], [2, 3], [2, 2, 3]]) {
    const size = dims.reduce((a, b) => a * b, 1);
    const { loss } = await module.evalStep(new ort.Tensor('float32', new Float32Array(size).fill(1), dims),
      new ort.Tensor('float32', new Float32Array(size), dims));
    assert.ok(Math.abs(loss.data[0] - 14 / 3) < 1e-6, `loss ${loss.data[0]} for an input of shape [${dims}]`);
  }
  // and trains
  const { loss } = await module.trainStep(new ort.Tensor('float32', new Float32Array(3).fill(1), [3]),
    new ort.Tensor('float32', new Float32Array(3), [3]));
  assert.ok(Math.abs(loss.data[0] - 14 / 3) < 1e-6);
});

test('a class label out of range fails the step with a RunError naming the labels; the state is as before', async () => {
  const { RunError } = await import('onnxtrain-web/node');
  const small = JSON.parse(readFileSync(fixturePath('small/data.json'), 'utf8'));
  const artifact = (file) => fixturePath(`small/plain/${file}`);
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'));
  const [, features] = small.x_dims;
  const x = new ort.Tensor('float32', Float32Array.from(small.x).slice(0, 2 * features), [2, features]);
  await module.trainStep(x, new ort.Tensor('int32', Int32Array.of(0, 1), [2]));
  const before = [...state.parameters].map(([name, p]) => [name, Float32Array.from(p.grad ?? [])]);
  for (const labels of [[0, -1], [0, 99]]) {
    await assert.rejects(module.trainStep(x, new ort.Tensor('int32', Int32Array.from(labels), [2])), (error) => {
      assert.ok(error instanceof RunError, `${error?.constructor?.name}: ${error?.message}`);
      assert.match(error.message, /training step: onnxruntime failed the run[\s\S]*check the integer inputs \[/);
      return true;
    });
    for (const [name, grad] of before) assert.deepEqual(Float32Array.from(state.parameters.get(name).grad ?? []), grad);
  }
});

test('every output of the base model exports, the heads the loss does not read too; eval steps return the loss', async () => {
  const artifact = (file) => fixturePath(`two_heads/${file}`);
  const data = JSON.parse(readFileSync(artifact('two_heads.json'), 'utf8'));
  const state = await CheckpointState.load(artifact('checkpoint'));
  const module = await Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'));
  const x = new ort.Tensor('float32', Float32Array.from(data.x), data.x_dims);
  const target = new ort.Tensor('float32', new Float32Array(data.outputs.score.values.length), data.outputs.score.dims);
  assert.deepEqual(Object.keys(await module.evalStep(x, target)), ['loss']);
  assert.deepEqual(module.outputNames(false), ['loss']);
  // "probs": a head the loss does not read; "features": an Identity of a value it reads
  const names = ['score', 'probs', 'features'];
  const session = await ort.InferenceSession.create(await module.exportModelForInferencing(names));
  assert.deepEqual(session.inputNames, ['x']);
  assert.deepEqual(session.outputNames, names);
  const outputs = await session.run({ x });
  for (const name of names) {
    assert.deepEqual(outputs[name].dims, data.outputs[name].dims, name);
    assert.ok(maxAbsDiff(outputs[name].data, Float32Array.from(data.outputs[name].values)) < 1e-6, name);
  }
  await assert.rejects(module.exportModelForInferencing(['nowhere']), /\["nowhere"\] are not typed values of the eval model/);
});
