// Type declarations of onnxtrain-web's shared core (hand-written; the sources are JSDoc-typed
// ESM JavaScript). The entry points 'onnxtrain-web' and 'onnxtrain-web/node' re-export all of
// this with the classes bound to onnxruntime-web / onnxruntime-node (see index.d.ts).

/** What a model or checkpoint can be given as: a path or URL, or the file's bytes. */
export type Source = string | URL | ArrayBuffer | ArrayBufferView;

/** Element types of parameters and tensors (numpy's names, which are also onnxruntime's). */
export type DType =
  | 'float32' | 'float64' | 'float16' | 'int8' | 'int16' | 'int32' | 'int64'
  | 'uint8' | 'uint16' | 'uint32' | 'uint64' | 'bool';

/** A typed array holding tensor data (BigInt64Array for int64, Uint8Array for bool, Uint16Array for float16). */
export type TypedArray =
  | Float32Array | Float64Array | Int8Array | Int16Array | Int32Array | BigInt64Array
  | Uint8Array | Uint16Array | Uint32Array | BigUint64Array;

/** The part of an onnxruntime Tensor that onnxtrain-web uses (onnxruntime-common's `Tensor`). */
export interface TensorLike {
  readonly type: string;
  readonly dims: readonly number[];
  readonly data: TypedArray | unknown;
}

/** The onnxruntime module and file access a set of classes is bound to. */
export interface Platform {
  /** For messages, e.g. "node" or "web". */
  name: string;
  /** The onnxruntime module (`InferenceSession`, `Tensor`), e.g. `import * as ort from 'onnxruntime-web'`. */
  ort: any;
  /** Read a path or URL. */
  readBytes(source: string | URL, what: string): Promise<Uint8Array>;
  /** Write a file atomically, or null where there is no file system (saves then only return bytes). */
  writeBytes: ((target: string | URL, bytes: Uint8Array, what: string) => Promise<void>) | null;
}

/** Base class of every error onnxtrain-web raises on purpose. */
export class OnnxTrainError extends Error {}
/** A checkpoint is unreadable or does not fit the models (missing parameter, bad bytes, ...). */
export class CheckpointError extends OnnxTrainError {}
/** A model does not follow the artifacts' input/output contract. */
export class ModelError extends OnnxTrainError {}
/** A user input or parameter value has the wrong name, dtype or shape. */
export class InputMismatchError extends OnnxTrainError {}
/** onnxruntime failed a step's run (an index input out of range, ...); the state is as before. */
export class RunError extends OnnxTrainError {}

/** A snapshot of one parameter (arrays are copies). */
export class Parameter {
  readonly name: string;
  readonly requiresGrad: boolean;
  readonly dtype: DType;
  readonly dims: number[];
  /** The value (zeros for a nominal parameter that was never set). */
  readonly data: TypedArray;
  /** The accumulated gradient: zeros from a Module's creation to its first training step, null for a frozen parameter or before any Module. */
  readonly grad: TypedArray | null;
}

/** The parameters by name, in checkpoint order. */
export class Parameters implements Iterable<[string, Parameter]> {
  get(name: string): Parameter;
  /** Replace a value by a copy of `data` (same dtype and element count, or a Tensor of the same shape). */
  set(name: string, data: TypedArray | TensorLike): void;
  has(name: string): boolean;
  keys(): string[];
  entries(): Array<[string, Parameter]>;
  readonly size: number;
  [Symbol.iterator](): Iterator<[string, Parameter]>;
}

/** User properties (numbers, inf and nan included, or strings), saved with the checkpoint. An
 * integer beyond 2**53 is a BigInt (exact); a BigInt within 2**53 is stored as a number. */
export class Properties implements Iterable<[string, number | string | bigint]> {
  get(name: string): number | string | bigint | undefined;
  set(name: string, value: number | string | bigint): void;
  has(name: string): boolean;
  delete(name: string): boolean;
  keys(): string[];
  entries(): Array<[string, number | string | bigint]>;
  readonly size: number;
  [Symbol.iterator](): Iterator<[string, number | string | bigint]>;
  toObject(): Record<string, number | string | bigint>;
}

export interface SaveOptions {
  /** Also save the optimizer's step count, learning rate and state tensors (default false). */
  includeOptimizerState?: boolean;
}

export interface LoadOptions {
  /** The bytes of `<checkpoint>.data`, for an onnxruntime-training checkpoint that keeps its
   * tensors there (loading from a path or URL reads that file itself). */
  externalData?: ArrayBuffer | ArrayBufferView | null;
}

/** Parameters, gradients, optimizer state and user properties (the Python side's checkpoint format). */
export class CheckpointState {
  static platform: Platform | null;
  /** Load a checkpoint (complete or nominal) from a path, URL or bytes: onnxtrain's format or onnxruntime-training's (`ODTC`). */
  static load(source: Source, options?: LoadOptions): Promise<CheckpointState>;
  /** Read a checkpoint from its bytes (either format). */
  static fromBytes(bytes: ArrayBuffer | ArrayBufferView, source?: string, options?: LoadOptions): CheckpointState;
  /** Serialize `state`, write it to `target` when given (atomically, Node only), return the bytes. */
  static save(state: CheckpointState, target?: string | URL | null, options?: SaveOptions): Promise<Uint8Array>;
  toBytes(options?: SaveOptions): Uint8Array;
  readonly parameters: Parameters;
  readonly properties: Properties;
  /** True while some parameter has no value (from a nominal checkpoint). */
  readonly nominal: boolean;
  readonly optimizerState: { step: number; learningRate: number; states: string[] } | null;
}

export interface CreateOptions {
  /** onnxruntime InferenceSession options, e.g. `{executionProviders: ['webgpu', 'wasm']}`; over
   * the default `{enableMemPattern: false}` (less peak memory on the wasm and Node backends). */
  sessionOptions?: Record<string, unknown>;
}

/** User inputs: positional Tensors in the order of `inputNames()`, or one object by name. */
export type StepInputs = TensorLike[] | [Record<string, TensorLike>];

/** Runs the training and eval models of the artifacts against a CheckpointState. */
export class Module {
  static platform: Platform | null;
  static create(trainingModel: Source, state: CheckpointState, evalModel?: Source | null, options?: CreateOptions): Promise<Module>;
  readonly state: CheckpointState;
  /** Forward, loss and gradients (accumulated until lazyResetGrad); returns the loss and additional outputs by name. */
  trainStep(...inputs: StepInputs): Promise<Record<string, any>>;
  /** The eval model (no gradients); returns the loss and additional outputs by name. */
  evalStep(...inputs: StepInputs): Promise<Record<string, any>>;
  /** Make the next training step overwrite the gradients instead of adding to them. */
  lazyResetGrad(): void;
  inputNames(training?: boolean): string[];
  outputNames(training?: boolean): string[];
  getParametersSize(trainableOnly?: boolean): number;
  /** All (default) or the trainable parameters as one 1-D Tensor, in the training model's order. */
  getContiguousParameters(trainableOnly?: boolean): any;
  copyBufferToParameters(buffer: TypedArray | TensorLike, trainableOnly?: boolean): void;
  /** The current parameter values as onnxruntime Tensors by name (copies). */
  exportParameters(): Record<string, any>;
  /** The eval model pruned to `outputNames` with the parameters embedded; written to `target` when given (Node). */
  exportModelForInferencing(outputNames: string[], target?: string | URL | null): Promise<Uint8Array>;
  release(): Promise<void>;
}

/** Runs the optimizer model to update the trainable parameters of a Module. */
export class Optimizer {
  static create(optimizerModel: Source, module: Module, options?: CreateOptions): Promise<Optimizer>;
  /** Update every trainable parameter once from its accumulated gradient. */
  step(): Promise<void>;
  readonly stepCount: number;
  /** fp16 artifacts: whether the last step was skipped (a gradient was inf/NaN). */
  readonly lastStepSkipped: boolean;
  setLearningRate(learningRate: number): void;
  getLearningRate(): number;
  /** The optimizer state tensors of a parameter by state name (copies). */
  getState(param: string): Record<string, TypedArray>;
  release(): Promise<void>;
}

/** Linear warmup to `initialLr` over `warmupStepCount` steps, then linear decay to 0 at `totalStepCount`. */
export class LinearLRScheduler {
  constructor(optimizer: { stepCount: number; setLearningRate(lr: number): void },
    warmupStepCount: number, totalStepCount: number, initialLr: number);
  readonly warmupStepCount: number;
  readonly totalStepCount: number;
  readonly initialLr: number;
  factor(step: number): number;
  /** Set the learning rate for the next update (call after `optimizer.step()`). */
  step(): void;
}

/** What `TrainingSession.create` loads (upstream's `TrainingSessionCreateOptions`): paths or URLs, or the files' bytes. */
export interface TrainingSessionCreateOptions {
  /** The checkpoint: onnxtrain's or onnxruntime-training's (`ODTC`). */
  checkpointState: Source;
  /** training_model.onnx (or .ort). */
  trainModel: Source;
  /** eval_model.onnx, for runEvalStep (absent, null or '' for none). */
  evalModel?: Source | null;
  /** optimizer_model.onnx, for runOptimizerStep (absent, null or '' for none). */
  optimizerModel?: Source | null;
}

/** Feeds of a step: a Tensor for every input name. */
export type TrainingFeeds = Record<string, TensorLike>;
/** The outputs to return: names, or an object by output name with null or a CPU Tensor to write the output into. */
export type TrainingFetches = readonly string[] | Record<string, TensorLike | null>;
/** onnxruntime's run options (accepted as upstream's; the steps run with onnxruntime's defaults). */
export type TrainingRunOptions = Record<string, unknown>;

/**
 * upstream's `onnxruntime-web/training` TrainingSession over onnxtrain's artifacts: a thin layer
 * over CheckpointState, Module and Optimizer (docs/web.md, "Upstream's TrainingSession").
 */
export class TrainingSession {
  static platform: Platform | null;
  /** Load the checkpoint and the models; `sessionOptions` (e.g. executionProviders) apply to every model. */
  static create(trainingOptions: TrainingSessionCreateOptions, sessionOptions?: Record<string, unknown> | null): Promise<TrainingSession>;
  /** The training model's user inputs (model inputs, then loss inputs). */
  readonly trainingInputNames: readonly string[];
  /** The training model's user outputs: the loss, then the additional outputs. */
  readonly trainingOutputNames: readonly string[];
  /** The eval model's user inputs; throws a ModelError without an eval model (as upstream throws). */
  readonly evalInputNames: readonly string[];
  /** The eval model's user outputs; throws a ModelError without an eval model (as upstream throws). */
  readonly evalOutputNames: readonly string[];
  /** onnxtrain: the state trained (save it with `CheckpointState.save`). */
  readonly state: CheckpointState;
  /** onnxtrain: the underlying Module. */
  readonly module: Module;
  /** onnxtrain: the underlying Optimizer (`setLearningRate`, `stepCount`, ...), null without an optimizer model. */
  readonly optimizer: Optimizer | null;
  /** Make the next training step overwrite the gradients instead of adding to them. */
  lazyResetGrad(): Promise<void>;
  /** Forward, loss and gradients (accumulated until lazyResetGrad); the outputs by name. */
  runTrainStep(feeds: TrainingFeeds, options?: TrainingRunOptions): Promise<Record<string, any>>;
  runTrainStep(feeds: TrainingFeeds, fetches: TrainingFetches | undefined, options?: TrainingRunOptions): Promise<Record<string, any>>;
  /** Update the trainable parameters from their gradients (needs the optimizer model). */
  runOptimizerStep(options?: TrainingRunOptions): Promise<void>;
  /** The eval model (needs it); the outputs by name. */
  runEvalStep(feeds: TrainingFeeds, options?: TrainingRunOptions): Promise<Record<string, any>>;
  runEvalStep(feeds: TrainingFeeds, fetches: TrainingFetches | undefined, options?: TrainingRunOptions): Promise<Record<string, any>>;
  /** Elements of the trainable (default) or all parameters. */
  getParametersSize(trainableOnly?: boolean): Promise<number>;
  /** Set the trainable (default) or all parameters from the bytes of their float32 values (`4 * getParametersSize(trainableOnly)` bytes). */
  loadParametersBuffer(buffer: Uint8Array, trainableOnly?: boolean): Promise<void>;
  /** The trainable (default) or all parameters as one 1-D float32 Tensor, in the training model's order. */
  getContiguousParameters(trainableOnly?: boolean): Promise<any>;
  /** Release the sessions; later calls are refused (OnnxTrainError). */
  release(): Promise<void>;
}

export const DEFAULT_LEARNING_RATE: number;

export interface ParameterRecord {
  name: string; requiresGrad: boolean; dtype: DType; shape: number[]; value: TypedArray | null;
}
export interface CheckpointData {
  parameters: Map<string, ParameterRecord>;
  nominal: boolean;
  optimizer: { step: number; learningRate: number; states: string[]; values: Map<string, Map<string, TypedArray>> } | null;
  properties: Record<string, number | string | bigint>;
}
/** Parse and validate checkpoint bytes (the format of src/onnxtrain/checkpoint.py, or onnxruntime-training's `ODTC`). */
export function readCheckpoint(bytes: Uint8Array, source?: string, options?: { externalData?: Uint8Array | null }): CheckpointData;
/** Serialize a checkpoint record. */
export function encodeCheckpoint(data: CheckpointData): Uint8Array;

/** The graphs' naming contract. */
export const names: {
  GRAD_SUFFIX: string; ACCUMULATION_BUFFER_SUFFIX: string; ACCUMULATION_OUT_SUFFIX: string;
  LAZY_RESET_GRAD: string; LEARNING_RATE: string; STEP: string; UPDATED_SUFFIX: string;
  LOSS_SCALE: string; LOSS_SCALE_GROWTH_TRACKER: string; ALL_FINITE: string;
  gradName(param: string): string; accumulationBufferName(param: string): string;
  accumulationOutName(param: string): string; stateName(param: string, state: string): string;
  updatedName(name: string): string;
};

/** Classes bound to another onnxruntime package (same API as onnxruntime-web/-node). */
export function bindPlatform(platform: Platform): {
  CheckpointState: typeof CheckpointState;
  Module: typeof Module;
  Optimizer: typeof Optimizer;
  TrainingSession: typeof TrainingSession;
};
