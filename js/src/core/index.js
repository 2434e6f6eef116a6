/**
 * The shared core of onnxtrain-web, independent of the onnxruntime binding. The entry points
 * `onnxtrain-web` (onnxruntime-web) and `onnxtrain-web/node` (onnxruntime-node) bind it;
 * {@link bindPlatform} binds it to any other package with the same API.
 * @module
 */

import { CheckpointState } from './checkpoint_state.js';
import { Module } from './module.js';
import { Optimizer } from './optimizer.js';
import { TrainingSession } from './training_session.js';

export { CheckpointState, Parameter, Parameters, Properties, DEFAULT_LEARNING_RATE } from './checkpoint_state.js';
export { Module } from './module.js';
export { Optimizer } from './optimizer.js';
export { LinearLRScheduler } from './lr_scheduler.js';
export { TrainingSession } from './training_session.js';
export { OnnxTrainError, CheckpointError, ModelError, InputMismatchError, RunError } from './errors.js';
export { readCheckpoint, encodeCheckpoint } from './checkpoint.js';
export * as names from './names.js';

/**
 * Classes bound to `platform`: `CheckpointState.load` reads through it, `Module.create`
 * creates its sessions with `platform.ort`, `TrainingSession.create` does both. Instances are also instances of the core classes.
 * @param {import('./platform.js').Platform} platform
 */
export function bindPlatform(platform) {
  if (!platform || !platform.ort || typeof platform.ort.InferenceSession?.create !== 'function' ||
      typeof platform.ort.Tensor !== 'function') {
    throw new TypeError('bindPlatform: platform.ort must be an onnxruntime module (InferenceSession, Tensor)');
  }
  if (typeof platform.readBytes !== 'function') throw new TypeError('bindPlatform: platform.readBytes must be a function');
  const classes = {
    CheckpointState: class extends CheckpointState { static platform = platform; },
    Module: class extends Module { static platform = platform; },
    Optimizer: class extends Optimizer {},
  };
  const bound = {
    ...classes,
    // upstream's onnxruntime-web/training API over the three classes above
    TrainingSession: class extends TrainingSession { static platform = platform; static classes = classes; },
  };
  for (const [name, cls] of Object.entries(bound)) Object.defineProperty(cls, 'name', { value: name });
  return bound;
}
