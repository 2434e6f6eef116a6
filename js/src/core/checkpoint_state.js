/**
 * CheckpointState: parameters (with their accumulated gradients), optimizer state and user
 * properties, read from and written to the checkpoint format the Python side uses. Mirrors
 * `onnxtrain.api.CheckpointState` (and upstream's `onnxruntime.training.api.CheckpointState`).
 * @module
 */

import { CheckpointError, InputMismatchError, OnnxTrainError } from './errors.js';
import { copyOf, elementCount, formatShape, zerosOf, dtypeInfo } from './dtypes.js';
import { checkProperty, encodeCheckpoint, readCheckpoint } from './checkpoint.js';
import { describeSource, platformOf, readSource } from './platform.js';
import { EXTERNAL_DATA_SUFFIX, externalDataName, needsExternalData } from './upstream_checkpoint.js';

/**
 * A Uint8Array over `bytes` (no copy), or a TypeError naming `what`.
 * @param {unknown} bytes
 * @param {string} what
 */
function asBytes(bytes, what) {
  if (bytes instanceof ArrayBuffer) return new Uint8Array(bytes);
  if (ArrayBuffer.isView(bytes)) return new Uint8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  throw new TypeError(`${what}: expected bytes (Uint8Array or ArrayBuffer), got ${bytes === null ? 'null' : typeof bytes}`);
}

/** Upstream's learning rate when neither the checkpoint nor the user set one. */
export const DEFAULT_LEARNING_RATE = 1e-3;

/**
 * Storage of one parameter. Typed arrays are replaced, never written in place, so a tensor
 * handed to onnxruntime or to the user never changes under them.
 * @typedef {object} Slot
 * @property {string} name
 * @property {boolean} requiresGrad
 * @property {string} dtype
 * @property {number[]} shape
 * @property {ArrayBufferView} value
 * @property {ArrayBufferView | null} grad  the accumulated gradient (trainable parameters, once a Module adopts the state)
 * @property {boolean} hasValue  false for a parameter of a nominal checkpoint that was never set
 */

/**
 * @typedef {object} OptimizerState
 * @property {number} step
 * @property {number} learningRate
 * @property {string[]} states
 * @property {Map<string, Map<string, ArrayBufferView>>} values  param -> state -> tensor
 */

/** A model parameter held by a {@link CheckpointState} (a snapshot: arrays are copies). */
export class Parameter {
  /** @param {Slot} slot */
  constructor(slot) {
    /** @type {string} */ this.name = slot.name;
    /** @type {boolean} */ this.requiresGrad = slot.requiresGrad;
    /** @type {string} */ this.dtype = slot.dtype;
    /** @type {number[]} */ this.dims = [...slot.shape];
    /** The value (zeros for a nominal parameter that was never set). @type {ArrayBufferView} */
    this.data = copyOf(slot.dtype, /** @type {any} */ (slot.value));
    /**
     * The accumulated gradient: zeros from a Module's creation to its first training step (as
     * upstream), null for a frozen parameter or before any Module. @type {ArrayBufferView | null}
     */
    this.grad = slot.grad ? copyOf(slot.dtype, /** @type {any} */ (slot.grad)) : null;
  }
}

/**
 * The parameters by name, in checkpoint order: `get(name)` gives a {@link Parameter},
 * `set(name, data)` replaces a value (same dtype and element count), iteration yields
 * `[name, Parameter]` pairs.
 */
export class Parameters {
  /** @param {CheckpointState} state */
  constructor(state) {
    this._state = state;
  }

  /** @param {string} name */
  get(name) {
    return new Parameter(this._state._slot(name));
  }

  /**
   * Replace the value of parameter `name` by a copy of `data` (a typed array of the
   * parameter's dtype, or an onnxruntime Tensor, with as many elements as the parameter).
   * @param {string} name
   * @param {ArrayBufferView | {type: string, data: ArrayBufferView, dims: readonly number[]}} data
   */
  set(name, data) {
    const slot = this._state._slot(name);
    let values = data;
    if (data && !ArrayBuffer.isView(data) && typeof data === 'object' && 'data' in data) {
      if (typeof data.type !== 'string' || !Array.isArray(data.dims)) {
        throw new InputMismatchError(`parameter ${JSON.stringify(name)} takes a typed array or an onnxruntime Tensor; ` +
          `got an object without a tensor's type and dims`);
      }
      if (data.type !== slot.dtype) {
        throw new InputMismatchError(`parameter ${JSON.stringify(name)} has dtype ${slot.dtype}; got a tensor of ${data.type}`);
      }
      if (formatShape(data.dims) !== formatShape(slot.shape)) {
        throw new InputMismatchError(`parameter ${JSON.stringify(name)} has shape ${formatShape(slot.shape)}; ` +
          `got a tensor of shape ${formatShape(data.dims)}`);
      }
      values = data.data;
    }
    const expected = dtypeInfo(slot.dtype, `parameter ${JSON.stringify(name)}`).array;
    if (!(values instanceof expected)) {
      const got = values?.constructor?.name ?? typeof values;
      throw new InputMismatchError(`parameter ${JSON.stringify(name)} has dtype ${slot.dtype}; expected a ` +
        `${expected.name}, got ${got}`);
    }
    const typed = /** @type {any} */ (values);
    if (typed.length !== elementCount(slot.shape)) {
      throw new InputMismatchError(`parameter ${JSON.stringify(name)} has shape ${formatShape(slot.shape)} ` +
        `(${elementCount(slot.shape)} elements); got ${typed.length} values`);
    }
    this._state._checkIdle(`set parameter ${JSON.stringify(name)}`);
    slot.value = copyOf(slot.dtype, typed);
    slot.hasValue = true;
  }

  /** @param {string} name */
  has(name) {
    return this._state._slots.has(name);
  }

  /** Parameter names in checkpoint order. */
  keys() {
    return [...this._state._slots.keys()];
  }

  /** `[name, Parameter]` pairs in checkpoint order. */
  entries() {
    return this.keys().map((name) => /** @type {[string, Parameter]} */ ([name, this.get(name)]));
  }

  get size() {
    return this._state._slots.size;
  }

  [Symbol.iterator]() {
    return this.entries()[Symbol.iterator]();
  }
}

/**
 * User properties (numbers, inf and nan included, or strings), saved with the checkpoint. Note: JSON does
 * not keep the difference between 3 and 3.0, so the Python side reads an integral float
 * written here as an int.
 */
export class Properties {
  /** @param {CheckpointState} state */
  constructor(state) {
    this._state = state;
  }

  /** @param {string} name @returns {number | string | bigint | undefined} */
  get(name) {
    return this.has(name) ? this._state._properties[name] : undefined;  // not an inherited name
  }

  /**
   * An integer beyond 2**53 may be given (and comes back) as a BigInt, kept exactly.
   * @param {string} name @param {number | string | bigint} value
   */
  set(name, value) {
    if (typeof name !== 'string') throw new TypeError(`property names are strings, got ${typeof name}`);
    const checked = checkProperty(name, value, TypeError);
    // an own property even for "__proto__", which plain assignment would take as the prototype
    Object.defineProperty(this._state._properties, name, { value: checked, enumerable: true, writable: true, configurable: true });
  }

  /** @param {string} name */
  has(name) {
    return Object.prototype.hasOwnProperty.call(this._state._properties, name);
  }

  /** @param {string} name */
  delete(name) {
    return delete this._state._properties[name];
  }

  keys() {
    return Object.keys(this._state._properties);
  }

  entries() {
    return Object.entries(this._state._properties);
  }

  get size() {
    return this.keys().length;
  }

  [Symbol.iterator]() {
    return this.entries()[Symbol.iterator]();
  }

  /** A plain-object copy. */
  toObject() {
    return { ...this._state._properties };
  }
}

/**
 * Zeros for a parameter of a nominal checkpoint, or a CheckpointError when its size cannot be allocated.
 * @param {{name: string, dtype: string, shape: number[]}} record
 */
function nominalValue(record) {
  try {
    return zerosOf(record.dtype, record.shape);
  } catch (error) {
    if (!(error instanceof RangeError)) throw error;
    throw new CheckpointError(`nominal parameter ${JSON.stringify(record.name)} of shape ${formatShape(record.shape)} ` +
      `${record.dtype} could not be allocated: ${error.message}`);
  }
}

/**
 * The training state. Create it with {@link CheckpointState.load}; a `Module` and an
 * `Optimizer` then read and update it.
 *
 * @example
 * const state = await CheckpointState.load('artifacts/checkpoint');
 * state.properties.set('epoch', 3);
 * await CheckpointState.save(state, 'artifacts/checkpoint', { includeOptimizerState: true });
 */
export class CheckpointState {
  /** The platform (onnxruntime binding, file access) of this class; set by the entry points. */
  static platform = /** @type {import('./platform.js').Platform | null} */ (null);

  /**
   * @param {import('./checkpoint.js').CheckpointData} data  use `load` or `fromBytes` instead
   */
  constructor(data) {
    if (!data || !(data.parameters instanceof Map)) {
      throw new TypeError('use CheckpointState.load(source) or CheckpointState.fromBytes(bytes) to make a CheckpointState');
    }
    /** @type {Map<string, Slot>} */
    this._slots = new Map();
    for (const [name, record] of data.parameters) {
      this._slots.set(name, {
        name, requiresGrad: record.requiresGrad, dtype: record.dtype, shape: [...record.shape],
        value: record.value ?? nominalValue(record), grad: null,
        hasValue: record.value !== null,
      });
    }
    /** @type {Record<string, number | string | bigint>} */
    this._properties = { ...data.properties };
    /** @type {OptimizerState | null} */
    this._optimizer = data.optimizer ? { ...data.optimizer, states: [...data.optimizer.states] } : null;
    /** the step (Module or Optimizer run) now in flight, if any */
    this._busy = /** @type {string | null} */ (null);
    this._parameters = new Parameters(this);
    this._propertyView = new Properties(this);
  }

  /**
   * Load a checkpoint (complete or nominal) from a path, a URL or its bytes: onnxtrain's
   * format or onnxruntime-training's (`ODTC`). An onnxruntime-training checkpoint that keeps
   * its tensors in `<checkpoint>.data` reads that file too (from a path or URL; given bytes,
   * pass the file's bytes as `externalData`).
   * @param {string | URL | ArrayBuffer | ArrayBufferView} source
   * @param {{externalData?: ArrayBuffer | ArrayBufferView | null}} [options]
   * @returns {Promise<CheckpointState>}
   */
  static async load(source, { externalData = null } = {}) {
    const platform = platformOf(this);
    const bytes = await readSource(platform, source, 'checkpoint');
    const name = describeSource(source);
    if (externalData === null && (typeof source === 'string' || source instanceof URL) && needsExternalData(bytes, name)) {
      // next to the checkpoint: "<path>.data", or the URL's path plus ".data" (its query kept)
      let dataSource;
      if (source instanceof URL || /^(https?|file):/i.test(source)) {
        dataSource = new URL(source instanceof URL ? source.href : source);
        dataSource.pathname += EXTERNAL_DATA_SUFFIX;
      } else {
        dataSource = externalDataName(source);
      }
      try {
        externalData = await platform.readBytes(dataSource, 'checkpoint');
      } catch (error) {
        throw new CheckpointError(`onnxruntime-training checkpoint ${JSON.stringify(name)} keeps its tensors in ` +
          `${JSON.stringify(describeSource(dataSource))}, which cannot be read: ${/** @type {Error} */ (error).message}`);
      }
    }
    return this.fromBytes(bytes, name, { externalData });
  }

  /**
   * Read a checkpoint from its bytes (synchronous; needs no platform).
   * @param {ArrayBuffer | ArrayBufferView} bytes
   * @param {string} [source]  a name for error messages
   * @param {{externalData?: ArrayBuffer | ArrayBufferView | null}} [options]  the bytes of
   *   `<checkpoint>.data`, for an onnxruntime-training checkpoint that has one
   */
  static fromBytes(bytes, source = '<bytes>', { externalData = null } = {}) {
    return new this(readCheckpoint(asBytes(bytes, 'checkpoint'), source,
      { externalData: externalData === null ? null : asBytes(externalData, 'externalData') }));
  }

  /**
   * Serialize `state` (with `includeOptimizerState`, also the optimizer's step count, learning
   * rate and state tensors); write it to `target` when given (atomically, where the platform
   * has a file system) and return the bytes.
   * @param {CheckpointState} state
   * @param {string | URL | null} [target]
   * @param {{includeOptimizerState?: boolean}} [options]
   * @returns {Promise<Uint8Array>}
   */
  static async save(state, target = null, { includeOptimizerState = false } = {}) {
    if (!(state instanceof CheckpointState)) {
      throw new TypeError(`expected a CheckpointState, got ${state === null ? 'null' : typeof state}`);
    }
    const bytes = state.toBytes({ includeOptimizerState });
    if (target !== null && target !== undefined) {
      const platform = platformOf(this);
      if (!platform.writeBytes) {
        throw new OnnxTrainError(`the ${platform.name} platform cannot write files; call CheckpointState.save(state) ` +
          'without a target (or state.toBytes()) and store the returned bytes');
      }
      await platform.writeBytes(target, bytes, 'checkpoint');
    }
    return bytes;
  }

  /**
   * The checkpoint bytes of this state.
   * @param {{includeOptimizerState?: boolean}} [options]
   * @returns {Uint8Array}
   */
  toBytes({ includeOptimizerState = false } = {}) {
    const missing = this._missingValues();
    const nominal = missing.length > 0 && missing.length === this._slots.size;
    if (missing.length && !nominal) {
      throw new CheckpointError(`cannot save: parameters ${JSON.stringify(missing.slice(0, 8))} have no value ` +
        '(they came from a nominal checkpoint and were never set)');
    }
    const parameters = new Map();
    for (const [name, slot] of this._slots) {
      parameters.set(name, { name, requiresGrad: slot.requiresGrad, dtype: slot.dtype, shape: slot.shape,
        value: nominal ? null : slot.value });
    }
    const optimizer = includeOptimizerState && this._optimizer ? this._optimizer : null;
    return encodeCheckpoint({ parameters, nominal, optimizer, properties: this._properties });
  }

  /** The parameters, by name. */
  get parameters() {
    return this._parameters;
  }

  /** User properties (numbers and strings), saved with the checkpoint. */
  get properties() {
    return this._propertyView;
  }

  /** True while some parameter has no value (loaded from a nominal checkpoint). */
  get nominal() {
    return this._missingValues().length > 0;
  }

  /** Optimizer step count and learning rate, or null when the state holds no optimizer state. */
  get optimizerState() {
    return this._optimizer ? { step: this._optimizer.step, learningRate: this._optimizer.learningRate,
      states: [...this._optimizer.states] } : null;
  }

  /** @param {string} name */
  _slot(name) {
    const slot = this._slots.get(name);
    if (!slot) {
      throw new CheckpointError(`parameter ${JSON.stringify(name)} is not in the checkpoint; it holds ` +
        `${JSON.stringify([...this._slots.keys()].slice(0, 8))}`);
    }
    return slot;
  }

  _missingValues() {
    return [...this._slots.values()].filter((s) => !s.hasValue).map((s) => s.name);
  }

  /**
   * Refuse a change of the state while a step on it is running: the step writes its results
   * back when it ends, over the change.
   * @param {string} what
   */
  _checkIdle(what) {
    if (this._busy) {
      throw new OnnxTrainError(`cannot ${what}: ${this._busy} on the same state is still running; await it first`);
    }
  }

  /**
   * Mark the state busy for the duration of `run`: two steps on one state must not overlap.
   * @template T
   * @param {string} what
   * @param {() => Promise<T>} run
   * @returns {Promise<T>}
   */
  async _exclusive(what, run) {
    if (this._busy) {
      throw new OnnxTrainError(`cannot start ${what}: ${this._busy} on the same state is still running; ` +
        'await it before starting the next step');
    }
    this._busy = what;
    try {
      return await run();
    } finally {
      this._busy = null;
    }
  }
}
