/**
 * Module: run the training and eval models of the artifacts against a CheckpointState.
 * Mirrors `onnxtrain.api.Module`. The graph contract is docs/artifacts.md: parameters are
 * graph inputs; each trainable parameter `p` has an input `p_grad.accumulation.buffer` and an
 * output `p_grad.accumulation.out`, which is `grad(p)` when `lazy_reset_grad` is true and
 * `buffer + grad(p)` otherwise.
 * @module
 */

import { CheckpointError, InputMismatchError, ModelError } from './errors.js';
import { copyOf, dtypeInfo, formatShape, zerosOf, elementCount } from './dtypes.js';
import * as names from './names.js';
import { CheckpointState } from './checkpoint_state.js';
import { buildInferenceModel, TRAINING_METADATA_KEY } from './onnx_proto.js';
import { platformOf } from './platform.js';
import { describeSpec, gatherInputs, isStaticDim, jsonMetadata, loadModel, runSession } from './session.js';

// torch.amp.GradScaler's initial scale, for a loss-scaled training model without metadata
const DEFAULT_LOSS_SCALE = 2 ** 16;

/**
 * fp16 artifacts' dynamic loss scale and its growth tracker, from the state's properties (where
 * the Module puts them and the Optimizer updates them), checked.
 * @param {CheckpointState} state
 * @returns {{scale: number, tracker: bigint}}
 */
export function lossScaleOf(state) {
  const scale = state.properties.get(names.LOSS_SCALE);
  const tracker = state.properties.get(names.LOSS_SCALE_GROWTH_TRACKER) ?? 0;
  if (typeof scale !== 'number' || !Number.isFinite(scale) || scale <= 0) {
    throw new CheckpointError(`property ${JSON.stringify(names.LOSS_SCALE)} is ${String(scale)}; fp16 artifacts keep ` +
      `their loss scale there, a positive finite number (the Module sets ${DEFAULT_LOSS_SCALE} when it is missing as it is created)`);
  }
  const integral = typeof tracker === 'bigint' || (typeof tracker === 'number' && Number.isInteger(tracker));
  if (!integral || tracker < 0) {
    throw new CheckpointError(`property ${JSON.stringify(names.LOSS_SCALE_GROWTH_TRACKER)} is ${String(tracker)}; ` +
      'expected a count of steps, an integer >= 0');
  }
  return { scale, tracker: BigInt(tracker) };
}

/**
 * How a training or eval model's inputs and outputs map onto the state.
 * @typedef {object} Signature
 * @property {string[]} params  parameter inputs, in the model's order
 * @property {string[]} trainable  parameters with a gradient (training model only)
 * @property {import('./session.js').IOSpec[]} userInputs
 * @property {string[]} userOutputs  the loss, then the additional outputs
 * @property {Map<string, string>} bufferUpdates  output name -> frozen parameter it replaces
 * @property {string[]} lossInputs
 * @property {boolean} lossScaled
 * @property {number} initialLossScale
 */

/**
 * @param {import('./session.js').LoadedModel} model
 * @param {CheckpointState} state
 * @param {boolean} training
 * @param {string} what
 * @returns {Signature}
 */
function readSignature(model, state, training, what) {
  const byName = new Map(model.inputs.map((s) => [s.name, s]));
  const outputNames = model.outputs.map((o) => o.name);
  const meta = jsonMetadata(model.metadata, TRAINING_METADATA_KEY, what);
  const slots = state._slots;
  const gradParams = outputNames.filter((o) => o.endsWith(names.ACCUMULATION_OUT_SUFFIX))
    .map((o) => o.slice(0, -names.ACCUMULATION_OUT_SUFFIX.length));
  const declared = new Set([...(meta.trainable ?? []), ...(meta.frozen ?? [])]);
  const params = model.inputs.map((s) => s.name).filter((n) => slots.has(n) || declared.has(n));
  const missing = params.filter((n) => !slots.has(n));
  missing.push(...gradParams.filter((p) => !slots.has(p) && !missing.includes(p)));
  if (missing.length) {
    throw new CheckpointError(`the ${what} takes parameters ${JSON.stringify(missing)} that the checkpoint does not hold`);
  }
  if (training) {
    const unused = [...slots.keys()].filter((n) => !byName.has(n));
    if (unused.length) {
      throw new CheckpointError(`the checkpoint holds parameters ${JSON.stringify(unused)} that the ${what} does not take`);
    }
  }
  for (const name of params) {
    checkParameter(state, name, /** @type {any} */ (byName.get(name)), gradParams.includes(name), training, what);
  }
  const trainable = training ? params.filter((n) => slots.get(n)?.requiresGrad) : [];
  if (training) {
    for (const p of trainable) {
      if (!byName.has(names.accumulationBufferName(p))) {
        throw new ModelError(`the ${what} has no input ${JSON.stringify(names.accumulationBufferName(p))} ` +
          `for trainable parameter ${JSON.stringify(p)}`);
      }
    }
    if (!byName.has(names.LAZY_RESET_GRAD)) throw new ModelError(`the ${what} has no ${JSON.stringify(names.LAZY_RESET_GRAD)} input`);
  }
  const lossScaled = training && byName.has(names.LOSS_SCALE);
  const internal = new Set([...params, ...trainable.map(names.accumulationBufferName)]);
  if (training) internal.add(names.LAZY_RESET_GRAD);
  if (lossScaled) internal.add(names.LOSS_SCALE);
  /** @type {Map<string, string>} */
  const bufferUpdates = new Map();
  if (training) {
    // training-mode BatchNormalization statistics: "s.updated" replaces frozen parameter s
    for (const [out, param] of Object.entries(meta.buffer_updates ?? {})) {
      if (outputNames.includes(out) && slots.has(param)) bufferUpdates.set(out, param);
    }
  }
  const gradOutputs = new Set(trainable.map(names.accumulationOutName));
  // the eval model's outputs of the base model, there for exportModelForInferencing only
  const inferenceOutputs = new Set(meta.inference_outputs ?? []);
  return {
    params, trainable, bufferUpdates,
    userInputs: model.inputs.filter((s) => !internal.has(s.name)),
    userOutputs: outputNames.filter((o) => !gradOutputs.has(o) && !bufferUpdates.has(o) && !inferenceOutputs.has(o)),
    lossInputs: [...(meta.loss_inputs ?? [])],
    lossScaled,
    initialLossScale: Number(meta.loss_scale ?? DEFAULT_LOSS_SCALE),
  };
}

/**
 * @param {CheckpointState} state
 * @param {string} name
 * @param {import('./session.js').IOSpec} spec
 * @param {boolean} hasGrad
 * @param {boolean} training
 * @param {string} what
 */
function checkParameter(state, name, spec, hasGrad, training, what) {
  const slot = /** @type {import('./checkpoint_state.js').Slot} */ (state._slots.get(name));
  if (training && hasGrad !== slot.requiresGrad) {
    throw new CheckpointError(`parameter ${JSON.stringify(name)} is ${hasGrad ? 'trainable' : 'frozen'} in the ${what} ` +
      `but ${slot.requiresGrad ? 'trainable' : 'frozen'} in the checkpoint`);
  }
  if (spec.type !== null && spec.type !== slot.dtype) {
    throw new CheckpointError(`parameter ${JSON.stringify(name)} is ${slot.dtype} in the checkpoint; the ${what} expects ${describeSpec(spec)}`);
  }
  if (spec.shape !== null && (spec.shape.length !== slot.shape.length ||
      spec.shape.some((d, i) => isStaticDim(d) && d !== slot.shape[i]))) {
    throw new CheckpointError(`parameter ${JSON.stringify(name)} has shape ${formatShape(slot.shape)} in the checkpoint; ` +
      `the ${what} expects ${describeSpec(spec)}`);
  }
}

/**
 * Runs training and evaluation steps of the training artifacts. Create it with
 * {@link Module.create}.
 *
 * @example
 * const state = await CheckpointState.load('out/checkpoint');
 * const module = await Module.create('out/training_model.onnx', state, 'out/eval_model.onnx');
 * const optimizer = await Optimizer.create('out/optimizer_model.onnx', module);
 * const { loss } = await module.trainStep(images, labels);  // onnxruntime Tensors
 * await optimizer.step();
 * module.lazyResetGrad();
 */
export class Module {
  /** The platform of this class (onnxruntime binding); set by the entry points. */
  static platform = /** @type {import('./platform.js').Platform | null} */ (null);

  /**
   * Load the training (and optionally eval) model and check them against `state`.
   * @param {string | URL | ArrayBuffer | ArrayBufferView} trainingModel  training_model.onnx (or .ort): path, URL or bytes
   * @param {CheckpointState} state
   * @param {string | URL | ArrayBuffer | ArrayBufferView | null} [evalModel]  eval_model.onnx, for evalStep and export
   * @param {{sessionOptions?: object}} [options]  onnxruntime InferenceSession options (e.g. executionProviders),
   *   over the default `{enableMemPattern: false}`
   * @returns {Promise<Module>}
   */
  static async create(trainingModel, state, evalModel = null, options = {}) {
    const platform = platformOf(this);
    if (!(state instanceof CheckpointState)) {
      throw new TypeError(`state must be a CheckpointState, got ${state === null ? 'null' : typeof state}`);
    }
    const train = await loadModel(platform, trainingModel, options.sessionOptions, 'training model');
    const trainSignature = readSignature(train, state, true, 'training model');
    let evaluation = null;
    let evalSignature = null;
    if (evalModel !== null && evalModel !== undefined) {
      evaluation = await loadModel(platform, evalModel, options.sessionOptions, 'eval model');
      evalSignature = readSignature(evaluation, state, false, 'eval model');
    }
    return new this({ platform, state, train, trainSignature, evaluation, evalSignature });
  }

  /**
   * Use {@link Module.create}.
   * @param {any} parts
   */
  constructor(parts) {
    if (!parts || !(parts.state instanceof CheckpointState)) throw new TypeError('use Module.create(...) to make a Module');
    /** @type {import('./platform.js').Platform} */
    this._platform = parts.platform;
    /** @type {CheckpointState} */
    this._state = parts.state;
    this._train = parts.train;
    this._released = false;
    /** @type {Signature} */
    this._trainSignature = parts.trainSignature;
    this._eval = parts.evaluation;
    /** @type {Signature | null} */
    this._evalSignature = parts.evalSignature;
    const state = this._state;
    if (this._trainSignature.lossScaled) { // fp16 artifacts: the scale state lives in the properties
      if (!state.properties.has(names.LOSS_SCALE)) state.properties.set(names.LOSS_SCALE, this._trainSignature.initialLossScale);
      if (!state.properties.has(names.LOSS_SCALE_GROWTH_TRACKER)) state.properties.set(names.LOSS_SCALE_GROWTH_TRACKER, 0);
    }
    for (const p of this._trainSignature.trainable) {
      const slot = state._slot(p);
      if (!slot.grad) slot.grad = zerosOf(slot.dtype, slot.shape);
    }
    this._resetGrad = true; // the gradient buffers start empty: the first step must not add to them
  }

  /** The CheckpointState this module trains. */
  get state() {
    return this._state;
  }

  /**
   * Run one training step: forward, loss and gradients, accumulated into the state's
   * gradients until {@link Module.lazyResetGrad}. Inputs are onnxruntime Tensors, positional
   * in the order of `inputNames(true)` or one object by name. Returns the user outputs by
   * name (the loss first, then the additional outputs).
   * @param {...any} inputs
   * @returns {Promise<Record<string, any>>}
   */
  async trainStep(...inputs) {
    const sig = this._trainSignature;
    const feeds = gatherInputs(sig.userInputs, inputs, 'training step', this._platform.ort.Tensor);
    const state = this._state;
    this._checkValues();
    const { Tensor } = this._platform.ort;
    // reading the state, running and writing back happen as one exclusive section
    const outputs = await state._exclusive('a training step', async () => {
      for (const name of sig.params) feeds[name] = this._tensorOf(state._slot(name).value, name);
      for (const p of sig.trainable) {
        feeds[names.accumulationBufferName(p)] = this._tensorOf(/** @type {ArrayBufferView} */ (state._slot(p).grad), p);
      }
      feeds[names.LAZY_RESET_GRAD] = new Tensor('bool', Uint8Array.of(this._resetGrad ? 1 : 0), []);
      if (sig.lossScaled) {
        feeds[names.LOSS_SCALE] = new Tensor('float32', Float32Array.of(lossScaleOf(state).scale), []);
      }
      const results = await runSession(this._train.session, feeds, 'training step', sig.userInputs);
      // only after a successful run do the new gradients and statistics become current
      for (const p of sig.trainable) {
        const slot = state._slot(p);
        slot.grad = results[names.accumulationOutName(p)].data;
      }
      for (const [out, param] of sig.bufferUpdates) state._slot(param).value = results[out].data;
      this._resetGrad = false;
      return results;
    });
    return Object.fromEntries(sig.userOutputs.map((o) => [o, outputs[o]]));
  }

  /**
   * Run one evaluation step (the eval model: no gradients, Dropout off, BatchNorm on running
   * statistics). Inputs as for {@link Module.trainStep}; returns the user outputs by name.
   * @param {...any} inputs
   * @returns {Promise<Record<string, any>>}
   */
  async evalStep(...inputs) {
    const sig = this._evalSignatureOrThrow('an eval step');
    const feeds = gatherInputs(sig.userInputs, inputs, 'eval step', this._platform.ort.Tensor);
    this._checkValues();
    const evaluation = /** @type {any} */ (this._eval);
    const outputs = await this._state._exclusive('an eval step', () => {
      for (const name of sig.params) feeds[name] = this._tensorOf(this._state._slot(name).value, name);
      // not the base model's outputs the eval model keeps for export (inference_outputs)
      return runSession(evaluation.session, feeds, 'eval step', sig.userInputs, sig.userOutputs);
    });
    return Object.fromEntries(sig.userOutputs.map((o) => [o, outputs[o]]));
  }

  /** Make the next training step overwrite the gradients instead of adding to them. */
  lazyResetGrad() {
    this._state._checkIdle('reset the gradients');
    this._resetGrad = true;
  }

  /**
   * User input names: of the training model (model inputs, then loss inputs) or the eval model.
   * @param {boolean} [training]
   */
  inputNames(training = true) {
    return (training ? this._trainSignature : this._evalSignatureOrThrow('eval input names')).userInputs.map((s) => s.name);
  }

  /**
   * User output names: the loss, then the additional outputs.
   * @param {boolean} [training]
   */
  outputNames(training = true) {
    return [...(training ? this._trainSignature : this._evalSignatureOrThrow('eval output names')).userOutputs];
  }

  /**
   * Number of elements in all (or only the trainable) parameters.
   * @param {boolean} [trainableOnly]
   */
  getParametersSize(trainableOnly = true) {
    return this._selected(trainableOnly).reduce((n, slot) => n + elementCount(slot.shape), 0);
  }

  /**
   * All (or the trainable) parameters flattened into one 1-D Tensor, in the training model's
   * parameter order (trainable first, then frozen).
   * @param {boolean} [trainableOnly]
   */
  getContiguousParameters(trainableOnly = false) {
    const slots = this._selected(trainableOnly);
    const dtype = commonDtype(slots);
    this._checkValues();
    const flat = zerosOf(dtype, [this.getParametersSize(trainableOnly)]);
    let offset = 0;
    for (const slot of slots) {
      /** @type {any} */ (flat).set(slot.value, offset);
      offset += elementCount(slot.shape);
    }
    return new this._platform.ort.Tensor(dtype, flat, [flat.length]);
  }

  /**
   * Copy a flat buffer (a Tensor or typed array, as from {@link Module.getContiguousParameters})
   * into the parameters, in the same order.
   * @param {any} buffer
   * @param {boolean} [trainableOnly]
   */
  copyBufferToParameters(buffer, trainableOnly = true) {
    const slots = this._selected(trainableOnly);
    const dtype = commonDtype(slots);
    const flat = ArrayBuffer.isView(buffer) ? buffer : buffer?.data;
    const expected = this.getParametersSize(trainableOnly);
    const kind = trainableOnly ? 'trainable' : 'all';
    if (!(flat instanceof dtypeInfo(dtype, 'parameter buffer').array)) {
      const got = buffer === null ? 'null' : ArrayBuffer.isView(buffer) || flat === undefined
        ? (buffer?.constructor?.name ?? typeof buffer) : `a tensor of ${flat?.constructor?.name ?? typeof flat}`;
      throw new InputMismatchError(`parameter buffer must hold ${dtype} values (${kind} parameters), got ${got}; ` +
        'pass a typed array or a 1-D tensor');
    }
    this._state._checkIdle('copy a buffer into the parameters');
    if (buffer?.dims && buffer.dims.length !== 1) {
      throw new InputMismatchError(`parameter buffer has shape ${formatShape(buffer.dims)}; expected a 1-D buffer`);
    }
    if (/** @type {any} */ (flat).length !== expected) {
      throw new InputMismatchError(`parameter buffer has ${/** @type {any} */ (flat).length} elements; expected ${expected} (${kind} parameters)`);
    }
    let offset = 0;
    for (const slot of slots) {
      const size = elementCount(slot.shape);
      slot.value = copyOf(dtype, /** @type {any} */ (flat).subarray(offset, offset + size));
      slot.hasValue = true;
      offset += size;
    }
  }

  /**
   * The current parameter values as onnxruntime Tensors by name (copies): what an inference
   * model built from the eval model needs as its weights.
   * @returns {Record<string, any>}
   */
  exportParameters() {
    this._checkValues();
    const { Tensor } = this._platform.ort;
    return Object.fromEntries([...this._state._slots.values()].map((slot) =>
      [slot.name, new Tensor(slot.dtype, copyOf(slot.dtype, /** @type {any} */ (slot.value)), [...slot.shape])]));
  }

  /**
   * Build an inference model: the eval model pruned to the nodes that compute `outputNames`,
   * without loss inputs, with the current parameters embedded as initializers. Writes it to
   * `target` when given (where the platform has a file system) and returns its bytes.
   * @param {string[]} outputNames
   * @param {string | URL | null} [target]
   * @returns {Promise<Uint8Array>}
   */
  async exportModelForInferencing(outputNames, target = null) {
    const sig = this._evalSignatureOrThrow('exporting an inference model');
    if (!Array.isArray(outputNames) || outputNames.length === 0 || !outputNames.every((n) => typeof n === 'string')) {
      throw new TypeError('outputNames must be a non-empty array of output names');
    }
    this._checkValues();
    const parameters = new Map([...this._state._slots.values()].map((s) => [s.name, { dtype: s.dtype, shape: s.shape, value: s.value }]));
    const bytes = buildInferenceModel(/** @type {any} */ (this._eval).bytes, outputNames, parameters, sig.lossInputs);
    if (target !== null && target !== undefined) {
      if (!this._platform.writeBytes) {
        throw new ModelError(`the ${this._platform.name} platform cannot write files; call exportModelForInferencing(outputNames) and keep the returned bytes`);
      }
      await this._platform.writeBytes(target, bytes, 'inference model');
    }
    return bytes;
  }

  /** Release the sessions. */
  async release() {
    if (this._released) return;
    this._released = true;
    await this._train.session.release?.();
    await this._eval?.session.release?.();
  }

  /** @param {string} what */
  _evalSignatureOrThrow(what) {
    if (!this._evalSignature) throw new ModelError(`${what} needs the eval model: pass it to Module.create(trainingModel, state, evalModel)`);
    return this._evalSignature;
  }

  /** @param {boolean} trainableOnly */
  _selected(trainableOnly) {
    return this._trainSignature.params.map((n) => this._state._slot(n)).filter((s) => !trainableOnly || s.requiresGrad);
  }

  _checkValues() {
    const missing = this._state._missingValues();
    if (missing.length) {
      throw new CheckpointError(`parameters ${JSON.stringify(missing.slice(0, 8))} have no value (nominal checkpoint): ` +
        'set them with copyBufferToParameters or state.parameters.set(name, data) first');
    }
  }

  /** @param {ArrayBufferView} data @param {string} name */
  _tensorOf(data, name) {
    const slot = this._state._slot(name);
    return new this._platform.ort.Tensor(slot.dtype, data, slot.shape);
  }
}

/** @param {import('./checkpoint_state.js').Slot[]} slots */
function commonDtype(slots) {
  const dtypes = [...new Set(slots.map((s) => s.dtype))];
  if (dtypes.length > 1) {
    throw new ModelError(`parameters have different dtypes ${JSON.stringify(dtypes.sort())}; a contiguous buffer needs one dtype`);
  }
  return dtypes[0] ?? 'float32';
}
