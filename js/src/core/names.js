/**
 * The graphs' input/output naming contract (docs/artifacts.md), as in the Python package's
 * `onnxtrain.names`, which follows upstream ONNX Runtime training artifacts.
 * @module
 */

export const GRAD_SUFFIX = '_grad';
export const ACCUMULATION_BUFFER_SUFFIX = '_grad.accumulation.buffer';
export const ACCUMULATION_OUT_SUFFIX = '_grad.accumulation.out';
export const LAZY_RESET_GRAD = 'lazy_reset_grad';
export const LEARNING_RATE = 'learning_rate';
export const STEP = 'step';
export const UPDATED_SUFFIX = '.updated';
// fp16 artifacts with dynamic loss scaling: the training model's scale input and the optimizer
// model's scale state, kept in the CheckpointState's properties under the same names
export const LOSS_SCALE = 'loss_scale';
export const LOSS_SCALE_GROWTH_TRACKER = 'loss_scale_growth_tracker';
export const ALL_FINITE = 'all_finite';

/** @param {string} param */
export const gradName = (param) => param + GRAD_SUFFIX;
/** @param {string} param */
export const accumulationBufferName = (param) => param + ACCUMULATION_BUFFER_SUFFIX;
/** @param {string} param */
export const accumulationOutName = (param) => param + ACCUMULATION_OUT_SUFFIX;
/** @param {string} param @param {string} state */
export const stateName = (param, state) => `${param}.${state}`;
/** @param {string} name */
export const updatedName = (name) => name + UPDATED_SUFFIX;
