// TrainingSession, upstream's onnxruntime-web/training API over CheckpointState/Module/Optimizer:
// the same losses, parameters and eval outputs as the Module/Optimizer path from the same
// checkpoint, upstream's parameter buffers (float32 bytes) byte for byte, the call forms of
// runTrainStep/runEvalStep, and the errors bad input gets. Its declarations are checked by
// types.test.js (test/types/training_session.ts).
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';
import * as core from 'onnxtrain-web/core';
import {
  CheckpointState, InputMismatchError, Module, ModelError, OnnxTrainError, Optimizer, TrainingSession, bindPlatform,
  ort, platform,
} from 'onnxtrain-web/node';
import { batch } from '../../examples/web/digits_data.mjs';
import { digits, fixturePath, maxAbsDiff, settings, upstreamData } from './fixtures.js';

const digitsArtifact = (name) => fixturePath(`artifacts/${name}`);
const smallArtifact = (model, name) => fixturePath(`small/${model}/${name}`);
const isError = (ErrorClass, pattern) => (error) => {
  assert.ok(error instanceof ErrorClass, `expected ${ErrorClass.name}, got ${error?.constructor?.name}: ${error?.message}`);
  assert.match(error.message, pattern);
  return true;
};

/** The four artifacts of the digits CNN as TrainingSession.create takes them. */
const digitsOptions = (parts = ['evalModel', 'optimizerModel']) => ({
  checkpointState: digitsArtifact('checkpoint'),
  trainModel: digitsArtifact('training_model.onnx'),
  ...(parts.includes('evalModel') ? { evalModel: digitsArtifact('eval_model.onnx') } : {}),
  ...(parts.includes('optimizerModel') ? { optimizerModel: digitsArtifact('optimizer_model.onnx') } : {}),
});

/** The small MLP `model`'s artifacts, and its k-th batch of 16 rows as feeds {x, labels}. */
function small(model) {
  const data = JSON.parse(readFileSync(fixturePath('small/data.json'), 'utf8'));
  const [count, features] = data.x_dims;
  const x = Float32Array.from(data.x);
  const y = Int32Array.from(data.y);
  const feeds = (k, Tensor = ort.Tensor) => {
    const start = (k * data.rows) % count;
    return {
      x: new Tensor('float32', x.slice(start * features, (start + data.rows) * features), [data.rows, features]),
      labels: new Tensor('int32', y.slice(start, start + data.rows), [data.rows]),
    };
  };
  const options = {
    checkpointState: smallArtifact(model, 'checkpoint'), trainModel: smallArtifact(model, 'training_model.onnx'),
    evalModel: smallArtifact(model, 'eval_model.onnx'), optimizerModel: smallArtifact(model, 'optimizer_model.onnx'),
  };
  return { options, feeds, learningRate: data.learning_rate };
}

/** The bytes of a typed array (a view, not a copy). */
const bytesOf = (array) => new Uint8Array(array.buffer, array.byteOffset, array.byteLength);

test('the digits CNN trains through TrainingSession exactly as through Module and Optimizer', async () => {
  const { batch_size: size, learning_rate: lr } = settings();
  const data = await digits();
  const session = await TrainingSession.create(digitsOptions());
  assert.ok(session instanceof core.TrainingSession, 'the bound class extends the core one');
  assert.deepEqual(session.trainingInputNames, ['image', 'labels']);
  assert.deepEqual(session.trainingOutputNames, ['loss', 'logits']);
  assert.deepEqual(session.evalInputNames, ['image', 'labels']);
  assert.deepEqual(session.evalOutputNames, ['loss', 'logits']);
  assert.ok(Object.isFrozen(session.trainingInputNames));
  session.optimizer.setLearningRate(lr);

  const state = await CheckpointState.load(digitsArtifact('checkpoint'));
  const module = await Module.create(digitsArtifact('training_model.onnx'), state, digitsArtifact('eval_model.onnx'));
  const optimizer = await Optimizer.create(digitsArtifact('optimizer_model.onnx'), module);
  optimizer.setLearningRate(lr);

  // four updates; the second and fourth from gradients accumulated over two batches
  const sessionLosses = [];
  const moduleLosses = [];
  let k = 0;
  for (const accumulate of [1, 2, 1, 2]) {
    for (let j = 0; j < accumulate; j++, k++) {
      const [image, labels] = batch(ort, data.train, k * size, size);
      const outputs = await session.runTrainStep({ image, labels });
      assert.deepEqual(Object.keys(outputs), ['loss', 'logits']);
      assert.ok(outputs.loss instanceof ort.Tensor && outputs.loss.type === 'float32');
      assert.deepEqual(outputs.logits.dims, [size, 10]);
      sessionLosses.push(outputs.loss.data[0]);
      moduleLosses.push((await module.trainStep(image, labels)).loss.data[0]);
    }
    await session.runOptimizerStep();
    await session.lazyResetGrad();
    await optimizer.step();
    module.lazyResetGrad();
  }
  assert.deepEqual(sessionLosses, moduleLosses);
  assert.equal(session.optimizer.stepCount, 4);
  const initial = await CheckpointState.load(digitsArtifact('checkpoint'));
  for (const name of state.parameters.keys()) {
    const got = session.state.parameters.get(name);
    assert.deepEqual(got.data, state.parameters.get(name).data, `parameter ${name}`);
    assert.deepEqual(got.grad, state.parameters.get(name).grad, `gradient of ${name}`);
    assert.ok(maxAbsDiff(got.data, initial.parameters.get(name).data) > 1e-4, `parameter ${name} moved`);
  }
  assert.deepEqual(session.optimizer.getState('fc.weight'), optimizer.getState('fc.weight'));

  // eval outputs: the eval model on the same parameters
  const [image, labels] = batch(ort, data.test, 0, 64);
  const evaluated = await session.runEvalStep({ image, labels });
  const expected = await module.evalStep(image, labels);
  assert.deepEqual(Object.keys(evaluated), ['loss', 'logits']);
  assert.deepEqual(evaluated.logits.dims, [64, 10]);
  assert.deepEqual(evaluated.logits.data, expected.logits.data);
  assert.deepEqual(evaluated.loss.data, expected.loss.data);
  // and the contiguous parameters (upstream's default: the trainable ones; here all are)
  const flat = await session.getContiguousParameters();
  assert.deepEqual(flat.data, module.getContiguousParameters(true).data);
  assert.equal(await session.getParametersSize(), await session.getParametersSize(false));
  await session.release();
});

test('gradients accumulate across runTrainStep calls until lazyResetGrad', async () => {
  const { options, feeds } = small('plain');
  const session = await TrainingSession.create(options);
  const gradOf = () => session.state.parameters.get('fc1.weight').grad;
  await session.runTrainStep(feeds(0));
  const once = gradOf();
  await session.runTrainStep(feeds(0));
  assert.ok(maxAbsDiff(gradOf(), once.map((g) => 2 * g)) < 1e-6, 'the second step adds its gradient');
  await session.lazyResetGrad();
  await session.runTrainStep(feeds(0));
  assert.ok(maxAbsDiff(gradOf(), once) < 1e-7, 'after lazyResetGrad the gradient is overwritten');
  assert.ok(once.some((g) => Math.abs(g) > 1e-4), 'the gradient is not zero');
  await session.release();
});

test('runTrainStep and runEvalStep take fetches (names or an object) and options as upstream', async () => {
  const data = await digits();
  const session = await TrainingSession.create(digitsOptions(['evalModel']));
  const [image, labels] = batch(ort, data.train, 0, 8);
  const feeds = { image, labels };
  const all = await session.runEvalStep(feeds);
  // an array of names: those outputs, in that order
  const named = await session.runEvalStep(feeds, ['logits', 'loss']);
  assert.deepEqual(Object.keys(named), ['logits', 'loss']);
  assert.deepEqual(named.logits.data, all.logits.data);
  // an object by output name: null for a new Tensor, a Tensor to write the output into
  const into = new ort.Tensor('float32', new Float32Array(80), [8, 10]);
  const written = await session.runEvalStep(feeds, { logits: into }, { logSeverityLevel: 3 });
  assert.deepEqual(Object.keys(written), ['logits']);
  assert.equal(written.logits, into, 'the pre-allocated Tensor is returned');
  assert.deepEqual(into.data, all.logits.data);
  assert.deepEqual(Object.keys(await session.runEvalStep(feeds, { loss: null })), ['loss']);
  // an object without output names is the run options: every output
  assert.deepEqual(Object.keys(await session.runEvalStep(feeds, { logSeverityLevel: 3, tag: 'eval' })), ['loss', 'logits']);
  assert.deepEqual(Object.keys(await session.runEvalStep(feeds, undefined, { tag: 'eval' })), ['loss', 'logits']);
  // the training step takes the same forms
  const trained = await session.runTrainStep(feeds, ['loss'], {});
  assert.deepEqual(Object.keys(trained), ['loss']);
  assert.equal(trained.loss.data[0], all.loss.data[0], 'the same parameters give the same loss');

  await assert.rejects(session.runEvalStep(feeds, ['probabilities']),
    isError(InputMismatchError, /runEvalStep: fetches names unknown outputs \["probabilities"\]; the outputs are \["loss","logits"\]/));
  await assert.rejects(session.runTrainStep(feeds, []), isError(TypeError, /fetches is an empty array/));
  await assert.rejects(session.runTrainStep(feeds, { logist: null }, {}),
    isError(InputMismatchError, /fetches names none of the outputs \["loss","logits"\]/));
  await assert.rejects(session.runTrainStep(feeds, 'loss'), isError(TypeError, /second argument must be fetches/));
  await assert.rejects(session.runTrainStep(feeds, ['loss'], 'fast'), isError(TypeError, /options must be an object/));
  await assert.rejects(session.runEvalStep(feeds, { logits: new ort.Tensor('float32', new Float32Array(10), [1, 10]) }),
    isError(InputMismatchError, /Tensor given for output "logits" is float32 \[1, 10\]; the output is float32 \[8, 10\]/));
  await session.release();
});

test('getContiguousParameters and loadParametersBuffer: float32 bytes, trainable only or all, byte for byte', async () => {
  // the BatchNorm MLP: 6 trainable parameters, then 2 frozen running statistics
  const { options, feeds } = small('batchnorm');
  const session = await TrainingSession.create(options);
  const state = session.state;
  const trainable = state.parameters.keys().filter((name) => state.parameters.get(name).requiresGrad);
  const frozen = state.parameters.keys().filter((name) => !state.parameters.get(name).requiresGrad);
  assert.deepEqual(frozen, ['bn.running_mean', 'bn.running_var']);
  const sizeOf = (names) => names.reduce((n, name) => n + state.parameters.get(name).data.length, 0);
  assert.equal(await session.getParametersSize(), sizeOf(trainable));
  assert.equal(await session.getParametersSize(true), sizeOf(trainable));
  assert.equal(await session.getParametersSize(false), sizeOf(trainable) + sizeOf(frozen));

  // the buffers are the parameters concatenated in the training model's order, as Module's
  const concatenated = (names) => Float32Array.from(names.flatMap((name) => [...state.parameters.get(name).data]));
  const trainableFlat = await session.getContiguousParameters();
  assert.equal(trainableFlat.type, 'float32');
  assert.deepEqual(trainableFlat.dims, [sizeOf(trainable)]);
  assert.deepEqual(trainableFlat.data, concatenated(trainable));
  assert.deepEqual(trainableFlat.data, session.module.getContiguousParameters(true).data);
  const allFlat = await session.getContiguousParameters(false);
  assert.deepEqual(allFlat.dims, [sizeOf(trainable) + sizeOf(frozen)]);
  assert.deepEqual(allFlat.data, concatenated([...trainable, ...frozen]));

  // bit patterns a float32 holds (-0, subnormals, the largest finite), from an unaligned offset
  const values = new Float32Array(sizeOf(trainable));
  for (let i = 0; i < values.length; i++) values[i] = Math.fround((i % 7 - 3) * 0.37 + i * 1e-3);
  values.set([-0, 1e-45, -1.1754942e-38, 3.4028234663852886e38], 0);
  const padded = new Uint8Array(values.byteLength + 5);
  padded.set(bytesOf(values), 3);
  const frozenBefore = frozen.map((name) => state.parameters.get(name).data);
  await session.loadParametersBuffer(padded.subarray(3, 3 + values.byteLength));
  const reread = await session.getContiguousParameters();
  assert.deepEqual(bytesOf(reread.data), bytesOf(values), 'the bytes come back as they were loaded');
  assert.ok(Object.is(reread.data[0], -0));
  assert.deepEqual(state.parameters.get(trainable[0]).data, values.subarray(0, state.parameters.get(trainable[0]).data.length));
  frozen.forEach((name, i) => assert.deepEqual(state.parameters.get(name).data, frozenBefore[i], `${name} untouched`));

  // all parameters: the running statistics too
  const everything = Float32Array.from(allFlat.data, (v, i) => v + (i % 3) * 0.25);
  await session.loadParametersBuffer(new Uint8Array(everything.buffer.slice(0)), false);
  assert.deepEqual(bytesOf((await session.getContiguousParameters(false)).data), bytesOf(everything));
  assert.deepEqual(state.parameters.get('bn.running_var').data, everything.subarray(-16));

  // the loaded parameters are what the next steps use: as Module.copyBufferToParameters gives
  const reference = await CheckpointState.load(options.checkpointState);
  const module = await Module.create(options.trainModel, reference, options.evalModel);
  module.copyBufferToParameters(everything, false);
  const { loss } = await session.runEvalStep(feeds(1));
  assert.deepEqual(loss.data, (await module.evalStep(feeds(1))).loss.data);
  assert.deepEqual((await session.runTrainStep(feeds(1))).loss.data, (await module.trainStep(feeds(1))).loss.data);

  // a buffer of the wrong byte length, or not bytes (the training step moved the running statistics)
  const before = new Uint8Array(bytesOf((await session.getContiguousParameters(false)).data));
  const size = sizeOf(trainable);
  for (const length of [4 * size - 1, 4 * size + 4, 4 * (size + sizeOf(frozen)), 0]) {
    await assert.rejects(session.loadParametersBuffer(new Uint8Array(length)), isError(InputMismatchError,
      new RegExp(`buffer has ${length} bytes; expected ${4 * size} \\(${size} float32 values, the trainable parameters`)));
  }
  await assert.rejects(session.loadParametersBuffer(new Uint8Array(4 * size), false),
    isError(InputMismatchError, new RegExp(`expected ${4 * (size + sizeOf(frozen))} \\(.*all parameters`)));
  await assert.rejects(session.loadParametersBuffer(values), isError(InputMismatchError, /must be a Uint8Array .*got Float32Array/));
  await assert.rejects(session.loadParametersBuffer(reread), isError(InputMismatchError, /got a Tensor/));
  await assert.rejects(session.getContiguousParameters('false'), isError(TypeError, /trainableOnly must be true or false/));
  assert.deepEqual(bytesOf((await session.getContiguousParameters(false)).data), before, 'refused loads change nothing');
  await session.release();
});

test('an onnxruntime-training checkpoint (ODTC) resumes through TrainingSession as upstream did', async () => {
  const expected = JSON.parse(readFileSync(upstreamData('expected.json'), 'utf8'));
  const artifact = (name) => fixturePath(`upstream/artifacts/${name}`);
  const session = await TrainingSession.create({
    checkpointState: new Uint8Array(readFileSync(upstreamData('checkpoint_trained'))),
    trainModel: new Uint8Array(readFileSync(artifact('training_model.onnx'))),
    optimizerModel: artifact('optimizer_model.onnx'),
  });
  session.optimizer.setLearningRate(expected.learning_rate);
  // fc2.bias is frozen in that checkpoint
  assert.equal(await session.getParametersSize(false) - await session.getParametersSize(), expected.saved_parameters['fc2.bias'].length);
  const [input, labels] = session.trainingInputNames;
  const feeds = {
    [input]: new ort.Tensor('float32', Float32Array.from(expected.input.flat()), [expected.input.length, expected.input[0].length]),
    [labels]: new ort.Tensor('int32', Int32Array.from(expected.labels), [expected.labels.length]),
  };
  for (const [k, want] of expected.resumed_losses.entries()) {
    const { [session.trainingOutputNames[0]]: loss } = await session.runTrainStep(feeds);
    assert.ok(Math.abs(loss.data[0] - want) <= 1e-5 * Math.abs(want), `loss ${k}: ${loss.data[0]} vs upstream's ${want}`);
    await session.runOptimizerStep();
    await session.lazyResetGrad();
  }
  assert.equal(session.optimizer.stepCount, 5);
  await session.release();
});

test('the web entry point binds TrainingSession to onnxruntime-web (wasm), which trains like node', async () => {
  const web = await import('onnxtrain-web');
  assert.equal(web.TrainingSession.platform.name, 'web');
  assert.equal(TrainingSession.platform, platform);
  const { options, feeds, learningRate } = small('plain');
  const asBytes = Object.fromEntries(Object.entries(options).map(([key, path]) => [key, new Uint8Array(readFileSync(path))]));
  const onWasm = await web.TrainingSession.create(asBytes);
  const onNode = await TrainingSession.create(options, { executionProviders: ['cpu'] });
  for (const session of [onWasm, onNode]) {
    session.optimizer.setLearningRate(learningRate);
    for (let k = 0; k < 3; k++) {
      await session.runTrainStep(feeds(k, session === onWasm ? web.ort.Tensor : ort.Tensor));
      await session.runOptimizerStep();
      await session.lazyResetGrad();
    }
  }
  const wasmParams = await onWasm.getContiguousParameters(false);
  assert.ok(wasmParams instanceof web.ort.Tensor);
  assert.ok(maxAbsDiff(wasmParams.data, (await onNode.getContiguousParameters(false)).data) <= settings().tolerance);
  await onWasm.release();
  await onNode.release();
});

test('bad input and misuse get onnxtrain-web\'s errors', async () => {
  const data = await digits();
  const [image, labels] = batch(ort, data.train, 0, 4);
  const bare = await TrainingSession.create(digitsOptions([]));
  // no optimizer model, no eval model
  await assert.rejects(bare.runOptimizerStep(), isError(ModelError, /runOptimizerStep needs the optimizer model: pass optimizerModel/));
  await assert.rejects(bare.runEvalStep({ image, labels }), isError(ModelError, /runEvalStep needs the eval model: pass evalModel/));
  assert.throws(() => bare.evalInputNames, isError(ModelError, /evalInputNames needs the eval model/));
  assert.throws(() => bare.evalOutputNames, isError(ModelError, /evalOutputNames needs the eval model/));
  assert.equal(bare.optimizer, null);
  // feeds
  await assert.rejects(bare.runTrainStep({ image }), isError(InputMismatchError, /training step: input "labels" is missing/));
  await assert.rejects(bare.runTrainStep({ image, labels, label: labels }), isError(InputMismatchError, /unknown inputs \["label"\]/));
  await assert.rejects(bare.runTrainStep({ image: labels, labels }), isError(InputMismatchError, /input "image" is int32 \[4\]; expected float32/));
  await assert.rejects(bare.runTrainStep([image, labels]), isError(TypeError, /feeds must be an object .* got an array/));
  await assert.rejects(bare.runTrainStep(image), isError(TypeError, /feeds must be an object .* got a Tensor/));
  await assert.rejects(bare.runOptimizerStep('now'), isError(TypeError, /runOptimizerStep: options must be an object/));
  // two steps at once on one state
  const first = bare.runTrainStep({ image, labels });
  await assert.rejects(bare.runTrainStep({ image, labels }), isError(OnnxTrainError, /a training step on the same state is still running/));
  await first;

  // after release(): every call is refused; the names and the state stay readable
  await bare.release();
  await bare.release(); // a second release does nothing
  for (const [what, call] of [['runTrainStep', () => bare.runTrainStep({ image, labels })],
    ['runEvalStep', () => bare.runEvalStep({ image, labels })], ['runOptimizerStep', () => bare.runOptimizerStep()],
    ['lazyResetGrad', () => bare.lazyResetGrad()], ['getParametersSize', () => bare.getParametersSize()],
    ['getContiguousParameters', () => bare.getContiguousParameters()],
    ['loadParametersBuffer', () => bare.loadParametersBuffer(new Uint8Array(0))]]) {
    await assert.rejects(call(), isError(OnnxTrainError, new RegExp(`^${what}: this TrainingSession was released`)));
  }
  assert.deepEqual(bare.trainingInputNames, ['image', 'labels']);
  assert.equal(bare.state.parameters.get('fc.bias').dims[0], 10);

  // create
  await assert.rejects(TrainingSession.create({ checkpointState: digitsArtifact('checkpoint') }),
    isError(TypeError, /trainingOptions.trainModel is required/));
  await assert.rejects(TrainingSession.create({ ...digitsOptions([]), checkpointState: '' }),
    isError(TypeError, /trainingOptions.checkpointState is required/));
  await assert.rejects(TrainingSession.create({ ...digitsOptions([]), evalModle: digitsArtifact('eval_model.onnx') }),
    isError(TypeError, /unknown trainingOptions \["evalModle"\]; expected \["checkpointState","trainModel","evalModel","optimizerModel"\]/));
  await assert.rejects(TrainingSession.create(digitsArtifact('checkpoint')), isError(TypeError, /trainingOptions must be an object/));
  await assert.rejects(TrainingSession.create(digitsOptions([]), 'cpu'), isError(TypeError, /sessionOptions must be an object/));
  await assert.rejects(TrainingSession.create({ ...digitsOptions([]), optimizerModel: new Uint8Array([1, 2, 3]) }), isError(ModelError, /optimizer model/));
  await assert.rejects(TrainingSession.create({ ...digitsOptions([]), trainModel: fixturePath('artifacts/missing.onnx') }),
    isError(ModelError, /the training model ".*missing.onnx" does not exist/));
  // empty strings mean "none", as upstream's
  const minimal = await TrainingSession.create({ ...digitsOptions([]), evalModel: '', optimizerModel: '' });
  assert.equal(minimal.optimizer, null);
  await minimal.release();
  // the core's class has no binding; bindPlatform gives one
  await assert.rejects(core.TrainingSession.create(digitsOptions([])), isError(OnnxTrainError, /from onnxtrain-web\/core has no onnxruntime binding/));
  const bound = bindPlatform(platform).TrainingSession;
  const session = await bound.create(digitsOptions(['optimizerModel']));
  assert.ok(session.module instanceof core.Module && session.optimizer instanceof core.Optimizer);
  await session.release();
  assert.throws(() => new TrainingSession({}), isError(TypeError, /use TrainingSession.create/));
});
