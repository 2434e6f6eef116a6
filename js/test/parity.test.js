// The digits CNN trained by onnxtrain-web on onnxruntime-node (and on onnxruntime-web's wasm
// backend) against the Python runtime (onnxtrain.api on Python onnxruntime).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import * as node from 'onnxtrain-web/node';
import { batch, accuracy } from '../../examples/web/digits_data.mjs';
import { digits, fixturePath, maxAbsDiff, settings } from './fixtures.js';

const artifact = (name) => fixturePath(`artifacts/${name}`);

/** Train `steps` steps from batch 0 with `api`, reading the artifacts through `source`. */
async function trainSteps(api, source, steps) {
  const { batch_size: size, learning_rate: lr } = settings();
  const data = await digits();
  const state = await api.CheckpointState.load(source('checkpoint'));
  const module = await api.Module.create(source('training_model.onnx'), state, source('eval_model.onnx'));
  const optimizer = await api.Optimizer.create(source('optimizer_model.onnx'), module);
  optimizer.setLearningRate(lr);
  const losses = [];
  for (let k = 0; k < steps; k++) {
    const { loss } = await module.trainStep(...batch(api.ort, data.train, k * size, size));
    await optimizer.step();
    module.lazyResetGrad();
    losses.push(loss.data[0]);
  }
  return { state, module, optimizer, losses };
}

test('20 AdamW steps on onnxruntime-node match the Python runtime within the tolerance', async (t) => {
  const { steps, tolerance } = settings();
  const { state, optimizer, losses } = await trainSteps(node, artifact, steps);
  assert.ok(losses[steps - 1] < losses[0], `the loss went down: ${losses[0]} -> ${losses[steps - 1]}`);
  const expected = await node.CheckpointState.load(fixturePath('python_step20'));
  assert.equal(expected.optimizerState.step, steps);
  assert.equal(optimizer.stepCount, steps);
  const initial = await node.CheckpointState.load(artifact('checkpoint'));
  let worst = 0;
  for (const [name, parameter] of expected.parameters) {
    const got = state.parameters.get(name).data;
    const diff = maxAbsDiff(got, parameter.data);
    worst = Math.max(worst, diff);
    assert.ok(diff <= tolerance, `parameter ${name}: max |node - python| = ${diff} > ${tolerance}`);
    // and training did move it: the comparison is not between two unchanged copies
    assert.ok(maxAbsDiff(got, initial.parameters.get(name).data) > 100 * tolerance, `parameter ${name} did not change`);
  }
  t.diagnostic(`largest |node - python| over all parameters after ${steps} steps: ${worst.toExponential(2)}`);
  // Python -> Node -> Python: pytest resumes this checkpoint in Python and compares with an
  // uninterrupted 40-step Python run
  // (with properties JSON has no numbers for: Python must read them back as floats)
  state.properties.set('best_loss', Infinity);
  state.properties.set('ratio', NaN);
  for (const [name, value] of expected.properties) state.properties.set(name, value);  // Python's, as read here
  await node.CheckpointState.save(state, fixturePath('node_step20'), { includeOptimizerState: true });
  const reread = await node.CheckpointState.load(fixturePath('node_step20'));
  assert.deepEqual(reread.optimizerState, { step: steps, learningRate: settings().learning_rate, states: ['momentum0', 'momentum1'] });
  assert.deepEqual([reread.properties.get('best_loss'), reread.properties.get('ratio')], [Infinity, NaN]);
  // Python's integers beyond 2**53 are BigInts here, exact (tests/js/fixtures.py BIG_PROPERTIES)
  assert.equal(reread.properties.get('time_ns'), 1764300000123456789n);
  assert.equal(reread.properties.get('seed'), 2n ** 63n - 25n);
  assert.equal(reread.properties.get('low'), -(2n ** 63n));
  assert.equal(reread.properties.get('__proto__'), 'kept');
  assert.equal(reread.properties.get('toString'), undefined, 'no inherited names');
});

test('the web entry point (onnxruntime-web, wasm backend) trains like onnxruntime-node', async (t) => {
  const web = await import('onnxtrain-web'); // under Node, onnxruntime-web runs its wasm build
  assert.equal(web.platform.name, 'web');
  const bytesOf = (name) => new Uint8Array(readFileSync(artifact(name)));
  const steps = 5;
  const onWasm = await trainSteps(web, bytesOf, steps);
  const onNode = await trainSteps(node, artifact, steps);
  let worst = 0;
  for (const name of onNode.state.parameters.keys()) {
    const diff = maxAbsDiff(onWasm.state.parameters.get(name).data, onNode.state.parameters.get(name).data);
    worst = Math.max(worst, diff);
    assert.ok(diff <= settings().tolerance, `parameter ${name}: max |wasm - node| = ${diff}`);
  }
  assert.ok(Math.abs(onWasm.losses[steps - 1] - onNode.losses[steps - 1]) < 1e-4);
  t.diagnostic(`largest |wasm - node| over all parameters after ${steps} steps: ${worst.toExponential(2)}`);
});

test('the exported inference model computes the eval model\'s logits without the loss inputs', async () => {
  const { module } = await trainSteps(node, artifact, 3);
  const data = await digits();
  const [images, labels] = batch(node.ort, data.test, 0, data.test.count);
  const { logits } = await module.evalStep(images, labels);
  const bytes = await module.exportModelForInferencing(['logits']);
  const session = await node.ort.InferenceSession.create(bytes);
  assert.deepEqual(session.inputNames, ['image']);
  assert.deepEqual(session.outputNames, ['logits']);
  const inferred = await session.run({ image: images });
  assert.ok(maxAbsDiff(inferred.logits.data, logits.data) < 1e-5);
  assert.equal(accuracy(inferred.logits.data, labels.data), accuracy(logits.data, labels.data));
  const parameters = module.exportParameters();
  assert.deepEqual(Object.keys(parameters), module.state.parameters.keys());
  assert.deepEqual(parameters['fc.weight'].dims, [10, 64]);
  await assert.rejects(module.exportModelForInferencing(['loss']), (error) =>
    error instanceof node.ModelError && /depend on the loss inputs \["labels"\]/.test(error.message));
  // an input requested as an output stays the input; a repeated output gets an alias (as Python's)
  const both = await node.ort.InferenceSession.create(await module.exportModelForInferencing(['logits', 'image', 'logits']));
  assert.deepEqual(both.inputNames, ['image']);
  assert.deepEqual(both.outputNames, ['logits', 'image', 'logits_alias_1']);
  const out = await both.run({ image: images });
  assert.deepEqual(out.logits_alias_1.data, out.logits.data);
  assert.deepEqual(out.image.data, images.data);
});

test('gradients accumulate until lazyResetGrad, as in the Python runtime', async () => {
  const data = await digits();
  const state = await node.CheckpointState.load(artifact('checkpoint'));
  assert.equal(state.parameters.get('fc.bias').grad, null, 'no gradient before a Module adopts the state');
  const module = await node.Module.create(artifact('training_model.onnx'), state);
  const zeros = state.parameters.get('fc.bias').grad;
  assert.ok(zeros instanceof Float32Array && zeros.length > 0 && zeros.every((g) => g === 0), 'zeros until a step, as upstream');
  const [images, labels] = batch(node.ort, data.train, 0, 16);
  await module.trainStep(images, labels);
  const once = state.parameters.get('fc.bias').grad;
  await module.trainStep(images, labels);
  const twice = state.parameters.get('fc.bias').grad;
  assert.ok(maxAbsDiff(twice, once.map((g) => 2 * g)) < 1e-6, 'second step adds its gradient');
  module.lazyResetGrad();
  await module.trainStep(images, labels);
  assert.ok(maxAbsDiff(state.parameters.get('fc.bias').grad, once) < 1e-6, 'after lazyResetGrad the gradient is overwritten');
  assert.ok(maxAbsDiff(once, new Float32Array(once.length)) > 1e-4, 'the gradient is not zero');
});

test('getContiguousParameters and copyBufferToParameters round-trip in the training model order', async () => {
  const state = await node.CheckpointState.load(artifact('checkpoint'));
  const module = await node.Module.create(artifact('training_model.onnx'), state);
  const flat = module.getContiguousParameters();
  assert.equal(flat.dims[0], module.getParametersSize(false));
  assert.equal(module.getParametersSize(), 8 * 9 + 8 + 16 * 72 + 16 + 640 + 10);
  const doubled = flat.data.map((v) => 2 * v);
  module.copyBufferToParameters(doubled);
  assert.deepEqual(Array.from(state.parameters.get('conv1.weight').data), Array.from(doubled.subarray(0, 72)));
  assert.throws(() => module.copyBufferToParameters(new Float32Array(5)),
    { name: 'InputMismatchError', message: /has 5 elements; expected 1898/ });
  assert.throws(() => module.copyBufferToParameters(new Float64Array(1898)),
    { name: 'InputMismatchError', message: /must hold float32 values \(trainable parameters\), got Float64Array/ });
});

test('ORT-format artifacts (.ort, without the ONNX metadata) train exactly like the .onnx ones', async () => {
  const ortFormat = (name) => fixturePath(`ort_format/${name.replace('.onnx', '.ort')}`);
  const fromOrt = await trainSteps(node, (name) => (name === 'checkpoint' ? artifact(name) : ortFormat(name)), 3);
  const fromOnnx = await trainSteps(node, artifact, 3);
  assert.deepEqual(fromOrt.module.inputNames(), ['image', 'labels']);
  for (const name of fromOnnx.state.parameters.keys()) {
    assert.deepEqual(fromOrt.state.parameters.get(name).data, fromOnnx.state.parameters.get(name).data, name);
  }
  await assert.rejects(fromOrt.module.exportModelForInferencing(['logits']), /needs the eval model as ONNX \(\.onnx\), not ORT format/);
});

test('a Python checkpoint with optimizer state resumes in Node exactly where Python would have continued', async () => {
  const { batch_size: size, steps, tolerance } = settings();
  const data = await digits();
  const state = await node.CheckpointState.load(fixturePath('python_step20'));
  const module = await node.Module.create(artifact('training_model.onnx'), state);
  const optimizer = await node.Optimizer.create(artifact('optimizer_model.onnx'), module);
  assert.equal(optimizer.stepCount, steps, 'the step count comes from the checkpoint');
  assert.equal(optimizer.getLearningRate(), settings().learning_rate, 'so does the learning rate');
  for (let k = steps; k < 2 * steps; k++) {
    await module.trainStep(...batch(node.ort, data.train, k * size, size));
    await optimizer.step();
    module.lazyResetGrad();
  }
  const uninterrupted = await node.CheckpointState.load(fixturePath('python_step40'));
  for (const [name, parameter] of uninterrupted.parameters) {
    const diff = maxAbsDiff(state.parameters.get(name).data, parameter.data);
    assert.ok(diff <= tolerance, `parameter ${name}: max |resumed in node - python| = ${diff}`);
  }
  assert.equal(optimizer.stepCount, 2 * steps);
});
