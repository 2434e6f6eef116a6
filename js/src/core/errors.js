/**
 * Typed errors of onnxtrain-web. Each names the thing that is wrong and what was expected,
 * mirroring the Python package's `onnxtrain.errors`.
 * @module
 */

/** Base class of every error onnxtrain-web raises on purpose. */
export class OnnxTrainError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = new.target.name;
  }
}

/** A checkpoint is unreadable or does not fit the models (missing parameter, bad bytes, ...). */
export class CheckpointError extends OnnxTrainError {}

/** A model does not follow the artifacts' input/output contract (docs/artifacts.md). */
export class ModelError extends OnnxTrainError {}

/** A user input or a parameter value has the wrong name, dtype or shape. */
export class InputMismatchError extends OnnxTrainError {}

/**
 * onnxruntime failed a run (a training or eval step, an optimizer step): an input value it
 * cannot take, such as a class label or token id out of range. The state is left as it was.
 */
export class RunError extends OnnxTrainError {}
