/**
 * Session creation and the description of a session's inputs and outputs.
 * @module
 */

import { InputMismatchError, ModelError, RunError } from './errors.js';
import { DTYPES, formatShape } from './dtypes.js';
import { inputsWithoutShape, readModelMetadata } from './onnx_proto.js';
import { describeSource, readSource } from './platform.js';

/**
 * @typedef {object} IOSpec
 * @property {string} name
 * @property {string | null} type  tensor element type ("float32", "int64", ...) or null if unknown
 * @property {Array<number | string> | null} shape  dims (strings or -1 are symbolic) or null if unknown
 */

/**
 * @typedef {object} LoadedModel
 * @property {any} session  an onnxruntime InferenceSession
 * @property {Uint8Array} bytes
 * @property {Record<string, string>} metadata  the model's metadata_props
 * @property {IOSpec[]} inputs
 * @property {IOSpec[]} outputs
 */

/**
 * What a session is created with unless the caller's options say otherwise: no memory pattern
 * (onnxruntime's per-session block planned from the first runs, allocated beside what its arena
 * already holds; it applies to the wasm and Node CPU backends). GPT-style artifacts on
 * onnxruntime-node, 12 steps: peak RSS 555-569 -> 435-440 MB, steps 128 -> 130-134 ms.
 */
export const DEFAULT_SESSION_OPTIONS = Object.freeze({ enableMemPattern: false });

/**
 * Read a model (path, URL or bytes; ONNX or ORT format) and create its session.
 * @param {import('./platform.js').Platform} platform
 * @param {string | URL | ArrayBuffer | ArrayBufferView} source
 * @param {object | undefined} sessionOptions  onnxruntime InferenceSession options, over
 *   {@link DEFAULT_SESSION_OPTIONS}
 * @param {string} what  e.g. "training model"
 * @returns {Promise<LoadedModel>}
 */
export async function loadModel(platform, source, sessionOptions, what) {
  const bytes = await readSource(platform, source, what);
  const metadata = readModelMetadata(bytes, what);
  let session;
  try {
    session = await platform.ort.InferenceSession.create(bytes, { ...DEFAULT_SESSION_OPTIONS, ...sessionOptions });
  } catch (error) {
    throw new ModelError(`onnxruntime (${platform.name}) cannot load the ${what} ${JSON.stringify(describeSource(source))}: ` +
      `${/** @type {Error} */ (error).message}`);
  }
  const inputs = specs(session.inputNames, session.inputMetadata);
  if (inputs.some((spec) => spec.shape !== null && spec.shape.length === 0)) {
    // onnxruntime reports an input declared without a shape as [], a scalar's: the file tells
    const shapeless = inputsWithoutShape(bytes);
    for (const spec of inputs) if (shapeless.has(spec.name)) spec.shape = null;
  }
  return { session, bytes, metadata, inputs, outputs: specs(session.outputNames, session.outputMetadata) };
}

/**
 * @param {readonly string[]} names
 * @param {readonly any[] | undefined} metadata  onnxruntime's input/output metadata (absent in old versions)
 * @returns {IOSpec[]}
 */
function specs(names, metadata) {
  return names.map((name, i) => {
    const meta = metadata?.[i];
    const isTensor = meta && meta.isTensor;
    return { name, type: isTensor ? meta.type : null, shape: isTensor && Array.isArray(meta.shape) ? [...meta.shape] : null };
  });
}

/** @param {IOSpec} spec */
export function describeSpec(spec) {
  const shape = spec.shape ? `[${spec.shape.map((d) => (typeof d === 'string' ? JSON.stringify(d) : d)).join(', ')}]` : 'any shape';
  return `${spec.type ?? 'any type'} ${shape}`;
}

/** Whether a declared dim is a fixed size (not symbolic). @param {number | string} dim */
export const isStaticDim = (dim) => typeof dim === 'number' && dim >= 0;

/**
 * The metadata entry `key` as a JSON object ({} when absent).
 * @param {Record<string, string>} metadata
 * @param {string} key
 * @param {string} what
 * @returns {Record<string, any>}
 */
export function jsonMetadata(metadata, key, what) {
  const text = metadata[key];
  if (!text) return {};
  let value;
  try {
    value = JSON.parse(text);
  } catch (error) {
    throw new ModelError(`the ${what}'s metadata ${JSON.stringify(key)} is not valid JSON: ${/** @type {Error} */ (error).message}`);
  }
  return value !== null && typeof value === 'object' && !Array.isArray(value) ? value : {};
}

/**
 * Map user inputs (positional, or one object by name) onto `specs` and check each: an
 * onnxruntime Tensor of the declared type, rank and fixed dims. Integers of another integer
 * type are converted where every value fits (int64 class labels for an int32 labels input, as
 * the Python runtime and onnxruntime-training 1.19.2's artifacts take them).
 * @param {IOSpec[]} specs
 * @param {unknown[]} args
 * @param {string} what  e.g. "training step"
 * @param {new (type: any, data: any, dims: readonly number[]) => any} Tensor  onnxruntime's Tensor class
 * @returns {Record<string, any>} feeds by name
 */
export function gatherInputs(specs, args, what, Tensor) {
  const names = specs.map((s) => s.name);
  /** @type {Record<string, any>} */
  let byName;
  if (args.length === 1 && isPlainObject(args[0])) {
    byName = /** @type {Record<string, any>} */ (args[0]);
    const unknown = Object.keys(byName).filter((n) => !names.includes(n));
    if (unknown.length) {
      throw new InputMismatchError(`${what}: unknown inputs ${JSON.stringify(unknown)}; the model takes ${JSON.stringify(names)}`);
    }
  } else {
    if (args.length !== specs.length) {
      throw new InputMismatchError(`${what}: got ${args.length} inputs, expected ${specs.length} ` +
        `(${JSON.stringify(names)}), positionally or as one object by name`);
    }
    byName = Object.fromEntries(names.map((n, i) => [n, args[i]]));
  }
  /** @type {Record<string, any>} */
  const feeds = {};
  /** @type {Map<string, [number, string]>} a named symbolic dim's size, and the input that gave it */
  const symbols = new Map();
  for (const spec of specs) {
    const value = byName[spec.name];
    if (value === undefined) throw new InputMismatchError(`${what}: input ${JSON.stringify(spec.name)} is missing`);
    if (!isTensorLike(value)) {
      throw new InputMismatchError(`${what}: input ${JSON.stringify(spec.name)} must be an onnxruntime Tensor ` +
        `(${describeSpec(spec)}), got ${value === null ? 'null' : value.constructor?.name ?? typeof value}`);
    }
    const converted = integersConverted(spec, value, Tensor);
    const problem = (typeof converted === 'string' ? converted : mismatch(spec, converted)) ??
      symbolMismatch(spec, value, symbols);
    if (problem) {
      throw new InputMismatchError(`${what}: input ${JSON.stringify(spec.name)} is ${value.type} ` +
        `${formatShape(value.dims)}; expected ${describeSpec(spec)} (${problem})`);
    }
    feeds[spec.name] = converted;
  }
  return feeds;
}

/**
 * `tensor` as a Tensor of `spec`'s integer type where it holds integers of another integer type
 * and every value fits; `tensor` itself where no conversion applies (`mismatch` then judges it);
 * why not, where a value is out of the type's range.
 * @param {IOSpec} spec
 * @param {any} tensor
 * @param {new (type: any, data: any, dims: readonly number[]) => any} Tensor
 * @returns {any}
 */
function integersConverted(spec, tensor, Tensor) {
  const target = spec.type;
  if (target === null || target === tensor.type || !INTEGER_TYPES.has(target) || !INTEGER_TYPES.has(tensor.type) ||
      (tensor.location !== undefined && tensor.location !== 'cpu' && tensor.location !== 'cpu-pinned')) {
    return tensor;
  }
  const data = /** @type {ArrayLike<number | bigint>} */ (tensor.data);
  const bits = BigInt(8 * DTYPES[target].bytes);
  const signed = !target.startsWith('u');
  const [min, max] = signed ? [-(1n << (bits - 1n)), (1n << (bits - 1n)) - 1n] : [0n, (1n << bits) - 1n];
  let low = null, high = null;
  for (let i = 0; i < data.length; i++) {
    const v = BigInt(data[i]);
    if (low === null || v < low) low = v;
    if (high === null || v > high) high = v;
  }
  if (low !== null && high !== null && (low < min || high > max)) {
    return `element type ${tensor.type} with values in [${low}, ${high}], outside ${target}'s range`;
  }
  const wide = target.endsWith('64');
  const values = DTYPES[target].array.from(data, (/** @type {number | bigint} */ v) => (wide ? BigInt(v) : Number(v)));
  return new Tensor(target, values, tensor.dims);
}

/** @param {unknown} value */
function isPlainObject(value) {
  return value !== null && typeof value === 'object' && !isTensorLike(value) &&
    (Object.getPrototypeOf(value) === Object.prototype || Object.getPrototypeOf(value) === null);
}

/** Whether `value` is an onnxruntime Tensor (of any binding). @param {any} value */
export function isTensorLike(value) {
  return value !== null && typeof value === 'object' && typeof value.type === 'string' && Array.isArray(value.dims);
}

/**
 * Why `tensor` does not fit `spec`, or null.
 * @param {IOSpec} spec
 * @param {{type: string, dims: readonly number[]}} tensor
 */
function mismatch(spec, tensor) {
  if (spec.type !== null && spec.type !== tensor.type) return `element type ${tensor.type} instead of ${spec.type}`;
  if (spec.shape === null) return null;
  if (spec.shape.length !== tensor.dims.length) return `rank ${tensor.dims.length} instead of ${spec.shape.length}`;
  const axis = spec.shape.findIndex((d, i) => isStaticDim(d) && d !== tensor.dims[i]);
  return axis < 0 ? null : `dim ${axis} is ${tensor.dims[axis]}, the model fixes it to ${spec.shape[axis]}`;
}

/**
 * Why `tensor` gives a named symbolic dim of `spec` another size than an earlier input gave it
 * (`symbols`, updated), or null: onnxruntime would broadcast or fail inside the graph instead.
 * @param {IOSpec} spec
 * @param {{dims: readonly number[]}} tensor
 * @param {Map<string, [number, string]>} symbols
 */
function symbolMismatch(spec, tensor, symbols) {
  if (spec.shape === null) return null;
  for (const [axis, dim] of spec.shape.entries()) {
    if (typeof dim !== 'string' || dim === '') continue;
    const seen = symbols.get(dim);
    if (seen === undefined) symbols.set(dim, [tensor.dims[axis], spec.name]);
    else if (seen[0] !== tensor.dims[axis]) {
      return `dim ${axis} (${JSON.stringify(dim)}) is ${tensor.dims[axis]} but input ${JSON.stringify(seen[1])} ` +
        `gave ${JSON.stringify(dim)} = ${seen[0]}`;
    }
  }
  return null;
}

/** What onnxruntime's Gather, GatherElements and friends say about an index out of range. */
const INDEX_OUT_OF_RANGE = /out of range|out of data bounds|out of bounds/i;
const INTEGER_TYPES = new Set(['int8', 'int16', 'int32', 'int64', 'uint8', 'uint16', 'uint32', 'uint64']);

/**
 * `session.run(feeds)`, a failure raised as a {@link RunError} that names `what` and, for an
 * index out of range, the integer inputs among `specs` it may have come from.
 * @param {any} session
 * @param {Record<string, any>} feeds
 * @param {string} what  e.g. "training step"
 * @param {IOSpec[]} specs  the user inputs
 * @param {string[]} [fetches]  the outputs to return (all when omitted)
 * @returns {Promise<Record<string, any>>}
 */
export async function runSession(session, feeds, what, specs, fetches) {
  try {
    return await (fetches === undefined ? session.run(feeds) : session.run(feeds, fetches));
  } catch (error) {
    const message = /** @type {Error} */ (error).message ?? String(error);
    const integers = specs.filter((s) => s.type !== null && INTEGER_TYPES.has(s.type)).map((s) => s.name);
    const hint = integers.length && INDEX_OUT_OF_RANGE.test(message)
      ? `\nAn index was out of range: check the integer inputs ${JSON.stringify(integers)} (class labels lie in ` +
        "[0, classes) or equal the loss's ignore_index, token ids in [0, vocabulary); negative ones are out of range too)"
      : '';
    throw new RunError(`${what}: onnxruntime failed the run: ${message}${hint}`);
  }
}
