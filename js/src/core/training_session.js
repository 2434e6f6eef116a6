/**
 * TrainingSession: the training API of upstream's `onnxruntime-web/training`
 * (`ort.TrainingSession`), as a thin layer over {@link CheckpointState}, {@link Module} and
 * {@link Optimizer}, so that an app written against it moves to onnxtrain's artifacts on stock
 * onnxruntime by changing its import. What each call does here is in docs/web.md
 * ("Upstream's TrainingSession").
 * @module
 */

import { CheckpointState } from './checkpoint_state.js';
import { InputMismatchError, ModelError, OnnxTrainError } from './errors.js';
import { formatShape } from './dtypes.js';
import { Module } from './module.js';
import { Optimizer } from './optimizer.js';
import { platformOf } from './platform.js';
import { isTensorLike } from './session.js';

/**
 * What {@link TrainingSession.create} loads; each one a path or URL, or the file's bytes.
 * @typedef {object} TrainingSessionCreateOptions
 * @property {string | URL | ArrayBuffer | ArrayBufferView} checkpointState  the checkpoint (onnxtrain's or onnxruntime-training's)
 * @property {string | URL | ArrayBuffer | ArrayBufferView} trainModel  training_model.onnx (or .ort)
 * @property {string | URL | ArrayBuffer | ArrayBufferView | null} [evalModel]  eval_model.onnx, for runEvalStep
 * @property {string | URL | ArrayBuffer | ArrayBufferView | null} [optimizerModel]  optimizer_model.onnx, for runOptimizerStep
 */

/**
 * The classes a TrainingSession builds on, bound to one platform (set by `bindPlatform`).
 * @typedef {{CheckpointState: typeof CheckpointState, Module: typeof Module, Optimizer: typeof Optimizer}} BoundClasses
 */

const CREATE_KEYS = ['checkpointState', 'trainModel', 'evalModel', 'optimizerModel'];

/** Absent as upstream reads it: undefined, null or the empty string. @param {unknown} value */
const absent = (value) => value === undefined || value === null || value === '';

/** @param {unknown} value */
function describe(value) {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'an array';
  if (isTensorLike(value)) return 'a Tensor';
  return typeof value === 'object' ? /** @type {object} */ (value).constructor?.name ?? 'object' : typeof value;
}

/** @param {unknown} value */
const isObject = (value) => value !== null && typeof value === 'object';

/**
 * Check a `trainableOnly` argument (upstream's default: true).
 * @param {unknown} trainableOnly
 * @param {string} what
 * @returns {boolean}
 */
function checkTrainableOnly(trainableOnly, what) {
  if (typeof trainableOnly !== 'boolean') {
    throw new TypeError(`${what}: trainableOnly must be true or false, got ${describe(trainableOnly)}`);
  }
  return trainableOnly;
}

/**
 * Check run options (accepted as upstream's `InferenceSession.RunOptions`; the steps run with
 * onnxruntime's default run options).
 * @param {unknown} options
 * @param {string} what
 */
function checkRunOptions(options, what) {
  if (options !== undefined && !(isObject(options) && !Array.isArray(options) && !isTensorLike(options))) {
    throw new TypeError(`${what}: options must be an object (run options), got ${describe(options)}`);
  }
}

/**
 * The feeds as one object by name (what {@link Module#trainStep} takes), without inherited names.
 * @param {unknown} feeds
 * @param {string} what
 * @returns {Record<string, any>}
 */
function feedsByName(feeds, what) {
  if (!isObject(feeds) || Array.isArray(feeds) || isTensorLike(feeds)) {
    throw new TypeError(`${what}: feeds must be an object with the input names as keys and Tensors as values, ` +
      `got ${describe(feeds)}`);
  }
  return Object.assign(Object.create(null), feeds);
}

/**
 * Read upstream's two call forms, `(feeds, options?)` and `(feeds, fetches, options?)`: `fetches`
 * is an array of output names, or an object whose keys include an output name with a null or
 * Tensor value (a Tensor to write that output into); any other object is the options.
 * @param {readonly string[]} outputNames
 * @param {unknown} fetchesOrOptions
 * @param {unknown} options
 * @param {string} what
 * @returns {Map<string, any>} output name -> null, or the Tensor to write it into
 */
function readFetches(outputNames, fetchesOrOptions, options, what) {
  /** @type {Map<string, any>} */
  const fetches = new Map();
  if (fetchesOrOptions === undefined) {
    checkRunOptions(options, what);  // (feeds, undefined, options): every output
  } else if (Array.isArray(fetchesOrOptions)) {
    if (fetchesOrOptions.length === 0) throw new TypeError(`${what}: fetches is an empty array; name at least one output`);
    const unknown = fetchesOrOptions.filter((name) => typeof name !== 'string' || !outputNames.includes(name));
    if (unknown.length) {
      throw new InputMismatchError(`${what}: fetches names unknown outputs ${JSON.stringify(unknown)}; ` +
        `the outputs are ${JSON.stringify(outputNames)}`);
    }
    for (const name of fetchesOrOptions) fetches.set(name, null);
    checkRunOptions(options, what);
  } else if (isObject(fetchesOrOptions) && !isTensorLike(fetchesOrOptions)) {
    const given = /** @type {Record<string, unknown>} */ (fetchesOrOptions);
    for (const name of outputNames) {
      if (!Object.prototype.hasOwnProperty.call(given, name)) continue;
      const value = given[name];
      if (value === null || isTensorLike(value)) fetches.set(name, value);
    }
    if (fetches.size) checkRunOptions(options, what);
    else if (options !== undefined) {
      throw new InputMismatchError(`${what}: fetches names none of the outputs ${JSON.stringify(outputNames)} ` +
        `(keys ${JSON.stringify(Object.keys(given))}, each with null or a Tensor)`);
    } else {
      checkRunOptions(fetchesOrOptions, what);
    }
  } else {
    throw new TypeError(`${what}: the second argument must be fetches (an array of output names or an object by ` +
      `output name) or run options, got ${describe(fetchesOrOptions)}`);
  }
  if (!fetches.size) for (const name of outputNames) fetches.set(name, null);
  return fetches;
}

/**
 * The outputs asked for, in the order asked; an output with a Tensor in `fetches` is written into it.
 * @param {Record<string, any>} outputs
 * @param {Map<string, any>} fetches
 * @param {string} what
 * @returns {Record<string, any>}
 */
function pickOutputs(outputs, fetches, what) {
  /** @type {Record<string, any>} */
  const picked = {};
  for (const [name, target] of fetches) {
    const result = outputs[name];
    if (target === null) {
      picked[name] = result;
      continue;
    }
    if (target.location !== undefined && target.location !== 'cpu' && target.location !== 'cpu-pinned') {
      throw new InputMismatchError(`${what}: the Tensor given for output ${JSON.stringify(name)} is on "${target.location}"; ` +
        'a pre-allocated output must be a CPU tensor (or pass null to get a new one)');
    }
    const sameDims = target.dims.length === result.dims.length && target.dims.every((/** @type {number} */ d, /** @type {number} */ i) => d === result.dims[i]);
    if (target.type !== result.type || !sameDims) {
      throw new InputMismatchError(`${what}: the Tensor given for output ${JSON.stringify(name)} is ${target.type} ` +
        `${formatShape(target.dims)}; the output is ${result.type} ${formatShape(result.dims)}`);
    }
    target.data.set(result.data);
    picked[name] = target;
  }
  return picked;
}

/**
 * upstream's `onnxruntime-web/training` `TrainingSession` over onnxtrain's artifacts: the
 * checkpoint, the training model and, optionally, the eval and optimizer models, loaded
 * together. Create it with {@link TrainingSession.create}. Tensors are onnxruntime Tensors;
 * outputs come back as an object by output name, as from `InferenceSession.run`.
 *
 * @example
 * const session = await TrainingSession.create({
 *   checkpointState: 'out/checkpoint', trainModel: 'out/training_model.onnx',
 *   evalModel: 'out/eval_model.onnx', optimizerModel: 'out/optimizer_model.onnx',
 * });
 * const { loss } = await session.runTrainStep({ image: images, labels });
 * await session.runOptimizerStep();
 * await session.lazyResetGrad();
 */
export class TrainingSession {
  /** The platform of this class (onnxruntime binding); set by the entry points. */
  static platform = /** @type {import('./platform.js').Platform | null} */ (null);

  /** The bound CheckpointState, Module and Optimizer classes it creates; set with the platform. */
  static classes = /** @type {BoundClasses | null} */ (null);

  /**
   * Load the checkpoint and the models, as upstream's `TrainingSession.create`.
   * @param {TrainingSessionCreateOptions} trainingOptions  `checkpointState` and `trainModel`
   *   (required), `evalModel` and `optimizerModel` (optional): paths or URLs, or the files' bytes
   * @param {object} [sessionOptions]  onnxruntime InferenceSession options (e.g. executionProviders)
   *   for every model, over the default `{enableMemPattern: false}`
   * @returns {Promise<TrainingSession>}
   */
  static async create(trainingOptions, sessionOptions = undefined) {
    platformOf(this);
    const classes = /** @type {BoundClasses} */ (this.classes);
    if (!isObject(trainingOptions) || Array.isArray(trainingOptions)) {
      throw new TypeError('TrainingSession.create: trainingOptions must be an object ' +
        `{checkpointState, trainModel, evalModel?, optimizerModel?}, got ${describe(trainingOptions)}`);
    }
    const unknown = Object.keys(trainingOptions).filter((key) => !CREATE_KEYS.includes(key));
    if (unknown.length) {
      throw new TypeError(`TrainingSession.create: unknown trainingOptions ${JSON.stringify(unknown)}; ` +
        `expected ${JSON.stringify(CREATE_KEYS)}`);
    }
    const { checkpointState, trainModel, evalModel, optimizerModel } = trainingOptions;
    for (const [key, value] of [['checkpointState', checkpointState], ['trainModel', trainModel]]) {
      if (absent(value)) {
        throw new TypeError(`TrainingSession.create: trainingOptions.${key} is required (a path or URL, or the file's bytes)`);
      }
    }
    if (sessionOptions !== undefined && sessionOptions !== null && (!isObject(sessionOptions) || Array.isArray(sessionOptions))) {
      throw new TypeError(`TrainingSession.create: sessionOptions must be an object, got ${describe(sessionOptions)}`);
    }
    const options = { sessionOptions: sessionOptions ?? undefined };
    const state = await classes.CheckpointState.load(checkpointState);
    const module = await classes.Module.create(trainModel, state, absent(evalModel) ? null : evalModel, options);
    let optimizer = null;
    try {
      if (!absent(optimizerModel)) optimizer = await classes.Optimizer.create(/** @type {any} */ (optimizerModel), module, options);
    } catch (error) {
      await module.release();
      throw error;
    }
    return new this({ state, module, optimizer });
  }

  /**
   * Use {@link TrainingSession.create}.
   * @param {any} parts
   */
  constructor(parts) {
    if (!parts || !(parts.module instanceof Module) || !(parts.state instanceof CheckpointState)) {
      throw new TypeError('use TrainingSession.create(...) to make a TrainingSession');
    }
    /** @type {CheckpointState} */
    this._state = parts.state;
    /** @type {Module} */
    this._module = parts.module;
    /** @type {Optimizer | null} */
    this._optimizer = parts.optimizer ?? null;
    this._released = false;
    this._trainingInputNames = Object.freeze(this._module.inputNames(true));
    this._trainingOutputNames = Object.freeze(this._module.outputNames(true));
    const hasEval = this._module._evalSignature !== null;
    this._evalInputNames = hasEval ? Object.freeze(this._module.inputNames(false)) : null;
    this._evalOutputNames = hasEval ? Object.freeze(this._module.outputNames(false)) : null;
  }

  /** The training model's user inputs (model inputs, then loss inputs), as runTrainStep's feeds take them. */
  get trainingInputNames() {
    return this._trainingInputNames;
  }

  /** The training model's user outputs: the loss, then the additional outputs. */
  get trainingOutputNames() {
    return this._trainingOutputNames;
  }

  /** The eval model's user inputs; throws a ModelError without an eval model (as upstream throws). */
  get evalInputNames() {
    return this._evalNames(this._evalInputNames, 'evalInputNames');
  }

  /** The eval model's user outputs; throws a ModelError without an eval model (as upstream throws). */
  get evalOutputNames() {
    return this._evalNames(this._evalOutputNames, 'evalOutputNames');
  }

  /** The CheckpointState trained (onnxtrain: save it with `CheckpointState.save`). */
  get state() {
    return this._state;
  }

  /** The underlying {@link Module} (onnxtrain: `exportModelForInferencing`, ...). */
  get module() {
    return this._module;
  }

  /** The underlying {@link Optimizer} (onnxtrain: `setLearningRate`, `stepCount`, ...), or null without an optimizer model. */
  get optimizer() {
    return this._optimizer;
  }

  /**
   * Make the next training step overwrite the gradients instead of adding to them
   * ({@link Module#lazyResetGrad}).
   * @returns {Promise<void>}
   */
  async lazyResetGrad() {
    this._checkOpen('lazyResetGrad');
    this._module.lazyResetGrad();
  }

  /**
   * One training step ({@link Module#trainStep}): forward, loss and gradients, added to the
   * accumulated ones until {@link TrainingSession#lazyResetGrad}. Called as
   * `(feeds, options?)` or `(feeds, fetches, options?)`.
   * @param {Record<string, any>} feeds  a Tensor for every name of `trainingInputNames`
   * @param {readonly string[] | Record<string, any> | object} [fetchesOrOptions]  the outputs to return
   *   (names, or an object by name with null or a Tensor to write into), or the run options
   * @param {object} [options]  run options (accepted; the step runs with onnxruntime's defaults)
   * @returns {Promise<Record<string, any>>} the outputs by name (all of `trainingOutputNames` unless fetched)
   */
  async runTrainStep(feeds, fetchesOrOptions = undefined, options = undefined) {
    this._checkOpen('runTrainStep');
    const byName = feedsByName(feeds, 'runTrainStep');
    const fetches = readFetches(this._trainingOutputNames, fetchesOrOptions, options, 'runTrainStep');
    return pickOutputs(await this._module.trainStep(byName), fetches, 'runTrainStep');
  }

  /**
   * One optimizer step ({@link Optimizer#step}): every trainable parameter updated from its
   * accumulated gradient. Needs the optimizer model.
   * @param {object} [options]  run options (accepted; the step runs with onnxruntime's defaults)
   * @returns {Promise<void>}
   */
  async runOptimizerStep(options = undefined) {
    this._checkOpen('runOptimizerStep');
    checkRunOptions(options, 'runOptimizerStep');
    if (!this._optimizer) {
      throw new ModelError('runOptimizerStep needs the optimizer model: pass optimizerModel to TrainingSession.create');
    }
    await this._optimizer.step();
  }

  /**
   * One evaluation step on the eval model ({@link Module#evalStep}): no gradients. Needs the
   * eval model. Called as `(feeds, options?)` or `(feeds, fetches, options?)`.
   * @param {Record<string, any>} feeds  a Tensor for every name of `evalInputNames`
   * @param {readonly string[] | Record<string, any> | object} [fetchesOrOptions]  as for runTrainStep
   * @param {object} [options]  run options (accepted; the step runs with onnxruntime's defaults)
   * @returns {Promise<Record<string, any>>} the outputs by name (all of `evalOutputNames` unless fetched)
   */
  async runEvalStep(feeds, fetchesOrOptions = undefined, options = undefined) {
    this._checkOpen('runEvalStep');
    const outputNames = this._evalNames(this._evalOutputNames, 'runEvalStep');
    const byName = feedsByName(feeds, 'runEvalStep');
    const fetches = readFetches(outputNames, fetchesOrOptions, options, 'runEvalStep');
    return pickOutputs(await this._module.evalStep(byName), fetches, 'runEvalStep');
  }

  /**
   * The number of elements of the trainable (default) or of all parameters.
   * @param {boolean} [trainableOnly]
   * @returns {Promise<number>}
   */
  async getParametersSize(trainableOnly = true) {
    this._checkOpen('getParametersSize');
    return this._module.getParametersSize(checkTrainableOnly(trainableOnly, 'getParametersSize'));
  }

  /**
   * Set the trainable (default) or all parameters from one buffer: the bytes of their float32
   * values, in the order of {@link TrainingSession#getContiguousParameters}, so
   * `4 * getParametersSize(trainableOnly)` bytes (the platform's byte order, little-endian
   * everywhere onnxruntime-web runs).
   * @param {Uint8Array} buffer  e.g. `new Uint8Array(floats.buffer, floats.byteOffset, floats.byteLength)`
   * @param {boolean} [trainableOnly]
   * @returns {Promise<void>}
   */
  async loadParametersBuffer(buffer, trainableOnly = true) {
    this._checkOpen('loadParametersBuffer');
    const selected = checkTrainableOnly(trainableOnly, 'loadParametersBuffer');
    this._checkFloat32(selected, 'loadParametersBuffer');
    if (!(buffer instanceof Uint8Array)) {
      throw new InputMismatchError(`loadParametersBuffer: buffer must be a Uint8Array holding the float32 values' bytes, ` +
        `got ${describe(buffer)}; e.g. new Uint8Array(floats.buffer, floats.byteOffset, floats.byteLength)`);
    }
    const size = this._module.getParametersSize(selected);
    if (buffer.byteLength !== 4 * size) {
      throw new InputMismatchError(`loadParametersBuffer: buffer has ${buffer.byteLength} bytes; expected ${4 * size} ` +
        `(${size} float32 values, ${selected ? 'the trainable' : 'all'} parameters; see getParametersSize(${selected}))`);
    }
    const values = new Float32Array(size);  // a copy: the buffer may start at any byte offset
    new Uint8Array(values.buffer).set(buffer);
    this._module.copyBufferToParameters(values, selected);
  }

  /**
   * The trainable (default) or all parameters as one 1-D float32 Tensor, in the training
   * model's parameter order (a copy).
   * @param {boolean} [trainableOnly]
   * @returns {Promise<any>}
   */
  async getContiguousParameters(trainableOnly = true) {
    this._checkOpen('getContiguousParameters');
    const selected = checkTrainableOnly(trainableOnly, 'getContiguousParameters');
    this._checkFloat32(selected, 'getContiguousParameters');
    return this._module.getContiguousParameters(selected);
  }

  /**
   * Release the sessions of every model. The session cannot be used afterwards; the state
   * ({@link TrainingSession#state}) stays readable and savable.
   * @returns {Promise<void>}
   */
  async release() {
    if (this._released) return;
    this._state._checkIdle('release the TrainingSession');
    this._released = true;
    await this._module.release();
    await this._optimizer?.release();
  }

  /** @param {string} what */
  _checkOpen(what) {
    if (this._released) throw new OnnxTrainError(`${what}: this TrainingSession was released; create a new one`);
  }

  /**
   * @param {readonly string[] | null} names
   * @param {string} what
   */
  _evalNames(names, what) {
    if (!names) throw new ModelError(`${what} needs the eval model: pass evalModel to TrainingSession.create`);
    return names;
  }

  /**
   * upstream's parameter buffers are float32 only.
   * @param {boolean} trainableOnly
   * @param {string} what
   */
  _checkFloat32(trainableOnly, what) {
    const dtypes = [...new Set(this._module._selected(trainableOnly).map((slot) => slot.dtype))].filter((d) => d !== 'float32');
    if (dtypes.length) {
      throw new ModelError(`${what}: ${trainableOnly ? 'the trainable' : 'all'} parameters include ${JSON.stringify(dtypes.sort())} ` +
        "ones; a parameters buffer holds float32 values only (as upstream's); session.module's getContiguousParameters " +
        'and copyBufferToParameters take other dtypes');
    }
  }
}
