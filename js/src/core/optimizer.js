/**
 * Optimizer: run the optimizer model of the artifacts to update the parameters. Mirrors
 * `onnxtrain.api.Optimizer`. The optimizer model takes `learning_rate` (float32 scalar),
 * `step` (int64 scalar: the number of this update, 1 for the first) and, per trainable
 * parameter `p` in the training model's order, `p`, `p_grad` and one input `p.<state>` per
 * optimizer state; it returns `p.updated` and `p.<state>.updated`.
 * @module
 */

import { CheckpointError, ModelError } from './errors.js';
import { copyOf, zerosOf } from './dtypes.js';
import * as names from './names.js';
import { DEFAULT_LEARNING_RATE } from './checkpoint_state.js';
import { Module, lossScaleOf } from './module.js';
import { OPTIMIZER_METADATA_KEY } from './onnx_proto.js';
import { jsonMetadata, loadModel, runSession } from './session.js';

/**
 * Updates the trainable parameters of a {@link Module} from its accumulated gradients.
 * Optimizer state (AdamW's `momentum0`/`momentum1`) starts at zero unless the checkpoint
 * holds it; the step count and learning rate also come from a checkpoint saved with
 * `includeOptimizerState`, so training resumes exactly.
 *
 * @example
 * const optimizer = await Optimizer.create('out/optimizer_model.onnx', module);
 * optimizer.setLearningRate(3e-3);
 * await module.trainStep(images, labels);
 * await optimizer.step();
 * module.lazyResetGrad();
 */
export class Optimizer {
  /**
   * @param {string | URL | ArrayBuffer | ArrayBufferView} optimizerModel  optimizer_model.onnx (or .ort): path, URL or bytes
   * @param {Module} module
   * @param {{sessionOptions?: object}} [options]  onnxruntime InferenceSession options
   * @returns {Promise<Optimizer>}
   */
  static async create(optimizerModel, module, options = {}) {
    if (!(module instanceof Module)) {
      throw new TypeError(`module must be an onnxtrain-web Module, got ${module === null ? 'null' : typeof module}`);
    }
    const model = await loadModel(module._platform, optimizerModel, options.sessionOptions, 'optimizer model');
    return new this({ module, model });
  }

  /**
   * Use {@link Optimizer.create}.
   * @param {any} parts
   */
  constructor(parts) {
    if (!parts || !(parts.module instanceof Module)) throw new TypeError('use Optimizer.create(...) to make an Optimizer');
    /** @type {Module} */
    this._module = parts.module;
    this._model = parts.model;
    this._released = false;
    this._state = this._module._state;
    this._params = [...this._module._trainSignature.trainable];
    this._states = this._readSignature();
    const state = this._state;
    let opt = state._optimizer;
    // the state the model needs and the checkpoint lacks
    const missing = opt === null ? [] : this._states.filter((s) => !(opt?.states ?? []).includes(s));
    if (opt === null) {
      opt = state._optimizer = { step: 0, learningRate: DEFAULT_LEARNING_RATE, states: [...this._states], values: new Map() };
    } else if (opt.step && missing.length) {
      // it would start from zero while the step count says otherwise (AdamW's bias correction
      // after a plain SGD's steps: updates of half their size)
      throw new CheckpointError(`the checkpoint holds optimizer state ${JSON.stringify(opt.states)} but the optimizer ` +
        `model uses ${JSON.stringify(this._states)}: its ${JSON.stringify(missing)} would start from zero after ` +
        `${opt.step} steps. To start this optimizer afresh, use a checkpoint saved without the optimizer state`);
    } else if (opt.values.size && JSON.stringify(opt.states) !== JSON.stringify(this._states)) {
      const unused = opt.states.filter((s) => !this._states.includes(s));
      if (unused.length !== opt.states.length || !allZero(opt.values, unused)) {
        throw new CheckpointError(`the checkpoint holds optimizer state ${JSON.stringify(opt.states)} but the optimizer ` +
          `model uses ${JSON.stringify(this._states)}`);
      }
      // state the model does not use and that holds nothing (onnxruntime-training's SGD saves an
      // all-zero momentum0 per parameter): dropped, the step count kept
      opt.values = new Map();
    }
    if (opt.values.size) {
      const missing = this._params.filter((p) => !opt?.values.has(p));
      if (missing.length) {
        throw new CheckpointError(`the checkpoint's optimizer state has no entry for parameters ${JSON.stringify(missing.slice(0, 8))}`);
      }
    }
    for (const p of this._params) { // the checkpoint's values, or zeros
      const slot = state._slot(p);
      const perState = opt.values.get(p) ?? new Map();
      for (const s of this._states) if (!perState.has(s)) perState.set(s, zerosOf(slot.dtype, slot.shape));
      opt.values.set(p, perState);
    }
    opt.states = [...this._states];
    this._opt = opt;
    /** Whether the last step was skipped because a gradient was inf/NaN (fp16 loss scaling). */
    this.lastStepSkipped = false;
  }

  /** @returns {string[]} the optimizer state names */
  _readSignature() {
    /** @type {string[]} */
    const inputs = this._model.inputs.map((/** @type {{name: string}} */ s) => s.name);
    /** @type {Set<string>} */
    const outputs = new Set(this._model.outputs.map((/** @type {{name: string}} */ s) => s.name));
    if (inputs[0] !== names.LEARNING_RATE || inputs[1] !== names.STEP) {
      throw new ModelError(`the optimizer model's first inputs must be ${JSON.stringify([names.LEARNING_RATE, names.STEP])}, ` +
        `got ${JSON.stringify(inputs.slice(0, 2))}`);
    }
    const meta = jsonMetadata(this._model.metadata, OPTIMIZER_METADATA_KEY, 'optimizer model');
    /** @type {string[]} */
    let states;
    if (Array.isArray(meta.states)) {
      states = [...meta.states];
    } else { // no metadata (e.g. an .ort file): the first parameter's inputs are p, p_grad, p.<state>...
      const first = this._params[0] ?? '';
      states = inputs.filter((n) => n.startsWith(`${first}.`)).map((n) => n.slice(first.length + 1));
    }
    this._lossScaled = inputs.includes(names.LOSS_SCALE);
    const expected = [names.LEARNING_RATE, names.STEP];
    if (this._lossScaled) expected.push(names.LOSS_SCALE, names.LOSS_SCALE_GROWTH_TRACKER);
    for (const p of this._params) expected.push(p, names.gradName(p), ...states.map((s) => names.stateName(p, s)));
    const missing = expected.filter((n) => !inputs.includes(n));
    const extra = inputs.filter((n) => !expected.includes(n));
    if (missing.length || extra.length) {
      throw new ModelError("the optimizer model does not match the training model's trainable parameters: " +
        `missing inputs ${JSON.stringify(missing.slice(0, 8))}, unexpected inputs ${JSON.stringify(extra.slice(0, 8))}`);
    }
    const wanted = this._params.flatMap((p) => [names.updatedName(p), ...states.map((s) => names.updatedName(names.stateName(p, s)))]);
    if (this._lossScaled) {
      wanted.push(names.updatedName(names.LOSS_SCALE), names.updatedName(names.LOSS_SCALE_GROWTH_TRACKER), names.ALL_FINITE);
    }
    const lacking = wanted.filter((n) => !outputs.has(n));
    if (lacking.length) throw new ModelError(`the optimizer model lacks outputs ${JSON.stringify(lacking.slice(0, 8))}`);
    return states;
  }

  /**
   * Update every trainable parameter once from its accumulated gradient. With fp16 artifacts
   * the step is skipped when a gradient is inf or NaN ({@link Optimizer#lastStepSkipped}) and
   * the loss scale in `state.properties` is updated as torch's GradScaler does.
   * @returns {Promise<void>}
   */
  async step() {
    const { Tensor } = this._module._platform.ort;
    const state = this._state;
    const opt = this._opt;
    // reading the state, running and writing back happen as one exclusive section
    await state._exclusive('an optimizer step', async () => {
      this._module._checkValues(); // an update of a nominal state's placeholders would count a step
      /** @type {Record<string, any>} */
      const feeds = {
        [names.LEARNING_RATE]: new Tensor('float32', Float32Array.of(opt.learningRate), []),
        // the number of this update (1 for the first): AdamW's bias corrections use it as a power
        [names.STEP]: new Tensor('int64', BigInt64Array.of(BigInt(opt.step + 1)), []),
      };
      if (this._lossScaled) {
        const { scale, tracker } = lossScaleOf(state);
        feeds[names.LOSS_SCALE] = new Tensor('float32', Float32Array.of(scale), []);
        feeds[names.LOSS_SCALE_GROWTH_TRACKER] = new Tensor('int64', BigInt64Array.of(tracker), []);
      }
      for (const p of this._params) {
        const slot = state._slot(p);
        feeds[p] = new Tensor(slot.dtype, slot.value, slot.shape);
        feeds[names.gradName(p)] = new Tensor(slot.dtype, slot.grad ?? zerosOf(slot.dtype, slot.shape), slot.shape);
        const perState = /** @type {Map<string, ArrayBufferView>} */ (opt.values.get(p));
        for (const s of this._states) feeds[names.stateName(p, s)] = new Tensor(slot.dtype, perState.get(s), slot.shape);
      }
      const outputs = await runSession(this._model.session, feeds, 'optimizer step', []);
      for (const p of this._params) {
        state._slot(p).value = outputs[names.updatedName(p)].data;
        const perState = /** @type {Map<string, ArrayBufferView>} */ (opt.values.get(p));
        for (const s of this._states) perState.set(s, outputs[names.updatedName(names.stateName(p, s))].data);
      }
      if (this._lossScaled) {
        state.properties.set(names.LOSS_SCALE, Number(outputs[names.updatedName(names.LOSS_SCALE)].data[0]));
        state.properties.set(names.LOSS_SCALE_GROWTH_TRACKER, Number(outputs[names.updatedName(names.LOSS_SCALE_GROWTH_TRACKER)].data[0]));
        // a skipped step leaves the step count as it was, as GradScaler.step skips optimizer.step()
        this.lastStepSkipped = !outputs[names.ALL_FINITE].data[0];
        if (this.lastStepSkipped) return;
      }
      opt.step += 1;
    });
  }

  /** Number of updates done so far (restored from a checkpoint with optimizer state). */
  get stepCount() {
    return this._opt.step;
  }

  /**
   * Set the learning rate used by the following steps.
   * @param {number} learningRate
   */
  setLearningRate(learningRate) {
    if (typeof learningRate !== 'number' || !Number.isFinite(learningRate)) {
      throw new TypeError(`learning rate must be a finite number, got ${learningRate}`);
    }
    if (learningRate < 0) throw new RangeError(`learning rate must be >= 0, got ${learningRate}`);
    this._opt.learningRate = learningRate;
  }

  /** The learning rate the next step will use. */
  getLearningRate() {
    return this._opt.learningRate;
  }

  /** The optimizer state tensors of parameter `param` by state name (copies). @param {string} param */
  getState(param) {
    const perState = this._opt.values.get(param);
    if (!perState) throw new CheckpointError(`parameter ${JSON.stringify(param)} is not trained by this optimizer; it trains ${JSON.stringify(this._params)}`);
    const slot = this._state._slot(param);
    return Object.fromEntries([...perState].map(([s, v]) => [s, copyOf(slot.dtype, /** @type {any} */ (v))]));
  }

  /** Release the session. */
  async release() {
    if (this._released) return;
    this._released = true;
    await this._model.session.release?.();
  }
}

/**
 * Whether every tensor of `states` in `values` (param -> state -> typed array or Tensor) is all zeros.
 * @param {Map<string, Map<string, any>>} values
 * @param {string[]} states
 */
function allZero(values, states) {
  for (const perState of values.values()) {
    for (const name of states) {
      const value = perState.get(name);
      if (value === undefined) continue;
      const data = ArrayBuffer.isView(value) ? value : value.data;
      for (let i = 0; i < data.length; i++) if (Number(data[i]) !== 0) return false;
    }
  }
  return true;
}
