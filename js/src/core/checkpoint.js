/**
 * The onnxtrain checkpoint file (docs/artifacts.md), read and written exactly as the Python
 * side does (src/onnxtrain/checkpoint.py): one safetensors file with tensors
 * `param/<name>` and `optimizer/<param>/<state>`, and metadata `format` =
 * `onnxtrain.checkpoint`, `version` = `1` and `state`, a JSON object holding the parameter
 * list (name, requires_grad, dtype, shape), `nominal`, the optional `optimizer` section
 * (step, learning_rate, states) and the user `properties` (an inf or nan is null there, its
 * value in `nonfinite_properties`, as Python writes it). Checkpoints saved by
 * onnxruntime-training (`ODTC` flatbuffers) read into the same record
 * (upstream_checkpoint.js); saving always writes onnxtrain's format.
 * @module
 */

import { CheckpointError } from './errors.js';
import { dtypeInfo, exactInteger, formatShape } from './dtypes.js';
import { encodeSafetensors, parseSafetensors } from './safetensors.js';
import { isUpstreamCheckpoint, readUpstreamCheckpoint } from './upstream_checkpoint.js';

export const FORMAT = 'onnxtrain.checkpoint';
export const VERSION = 1;
export const PARAM_PREFIX = 'param/';
export const OPTIMIZER_PREFIX = 'optimizer/';

/**
 * A metadata entry for an error message: JSON, BigInts (integers beyond 2**53) as digits, cut short.
 * @param {unknown} entry
 */
function describe(entry) {
  const text = JSON.stringify(entry, (_, value) => (typeof value === 'bigint' ? value.toString() : value)) ?? String(entry);
  return text.length > 200 ? `${text.slice(0, 200)}...` : text;
}

/**
 * @typedef {object} ParameterRecord
 * @property {string} name
 * @property {boolean} requiresGrad
 * @property {string} dtype
 * @property {number[]} shape
 * @property {ArrayBufferView | null} value  null in a nominal checkpoint
 */

/**
 * @typedef {object} OptimizerRecord
 * @property {number} step  updates done so far
 * @property {number} learningRate
 * @property {string[]} states  e.g. ["momentum0", "momentum1"]
 * @property {Map<string, Map<string, ArrayBufferView>>} values  param -> state -> tensor
 */

/**
 * @typedef {object} CheckpointData
 * @property {Map<string, ParameterRecord>} parameters  in checkpoint order
 * @property {boolean} nominal
 * @property {OptimizerRecord | null} optimizer
 * @property {Record<string, number | string | bigint>} properties
 */

/**
 * Read and validate checkpoint bytes: onnxtrain's format, or onnxruntime-training's (`ODTC`
 * at bytes 4-8), whose tensors may be in a separate `<checkpoint>.data` file.
 * @param {Uint8Array} bytes
 * @param {string} [source]  a name for the messages (path or URL)
 * @param {{externalData?: Uint8Array | null}} [options]  onnxruntime-training's `<checkpoint>.data` bytes, where it has one
 * @returns {CheckpointData}
 */
export function readCheckpoint(bytes, source = '<bytes>', { externalData = null } = {}) {
  if (isUpstreamCheckpoint(bytes)) return readUpstreamCheckpoint(bytes, source, { externalData });
  const where = `checkpoint ${JSON.stringify(source)}`;
  const { metadata, tensors } = parseSafetensors(bytes, where);
  if (metadata.format !== FORMAT) {
    throw new CheckpointError(`${where} is a safetensors file but not an onnxtrain checkpoint ` +
      `(metadata format=${JSON.stringify(metadata.format ?? null)}, expected ${JSON.stringify(FORMAT)})`);
  }
  if (String(Number.parseInt(metadata.version, 10)) !== metadata.version || Number(metadata.version) !== VERSION) {
    throw new CheckpointError(`${where} has format version ${JSON.stringify(metadata.version ?? null)}; ` +
      `this onnxtrain-web reads version ${VERSION}`);
  }
  if (metadata.state === undefined) throw new CheckpointError(`${where} has no 'state' metadata`);
  let state;
  try {
    state = parseExactJson(metadata.state);
  } catch (error) {
    throw new CheckpointError(`${where}: the 'state' metadata is not valid JSON: ${/** @type {Error} */ (error).message}`);
  }
  if (state === null || typeof state !== 'object' || !Array.isArray(state.parameters)) {
    throw new CheckpointError(`${where}: the 'state' metadata has no parameter list`);
  }
  const nominal = Boolean(state.nominal);
  /** @type {Map<string, ParameterRecord>} */
  const parameters = new Map();
  for (const entry of state.parameters) {
    const { name, requires_grad: requiresGrad, dtype, shape } = entry ?? {};
    if (typeof name !== 'string' || typeof requiresGrad !== 'boolean' || typeof dtype !== 'string' ||
        !Array.isArray(shape) || !shape.every((d) => Number.isInteger(d) && d >= 0)) {
      throw new CheckpointError(`${where}: malformed parameter entry in the metadata: ${describe(entry)} ` +
        '(expected name, requires_grad, dtype and shape)');
    }
    dtypeInfo(dtype, `${where}: parameter ${JSON.stringify(name)}`);
    if (parameters.has(name)) throw new CheckpointError(`${where} lists parameter ${JSON.stringify(name)} twice`);
    parameters.set(name, { name, requiresGrad, dtype, shape: [...shape], value: null });
  }
  const used = new Set();
  if (!nominal) {
    for (const [name, record] of parameters) {
      const key = PARAM_PREFIX + name;
      const tensor = tensors.get(key);
      if (tensor === undefined) {
        throw new CheckpointError(`${where} lists parameter ${JSON.stringify(name)} but holds no tensor ${JSON.stringify(key)}`);
      }
      record.value = checked(where, key, tensor, record);
      used.add(key);
    }
  }
  let optimizer = null;
  if (state.optimizer !== undefined && state.optimizer !== null) {
    const { step, learning_rate: learningRate, states } = state.optimizer;
    if (!Number.isInteger(step) || step < 0 || typeof learningRate !== 'number' || !Number.isFinite(learningRate) ||
        learningRate < 0 || !Array.isArray(states) || !states.every((s) => typeof s === 'string') ||
        new Set(states).size !== states.length) {
      throw new CheckpointError(`${where}: malformed optimizer metadata ${describe(state.optimizer)} ` +
        '(expected an integer step >= 0, a finite learning_rate >= 0 and a list of distinct state names)');
    }
    optimizer = { step, learningRate, states: [...states], values: new Map() };
    for (const [key, tensor] of tensors) {
      if (!key.startsWith(OPTIMIZER_PREFIX)) continue;
      const rest = key.slice(OPTIMIZER_PREFIX.length);
      const cut = rest.lastIndexOf('/');
      const param = rest.slice(0, Math.max(cut, 0));
      const stateName = rest.slice(cut + 1);
      if (cut < 0 || !parameters.has(param) || !states.includes(stateName)) {
        throw new CheckpointError(`${where} holds optimizer tensor ${JSON.stringify(key)} for an unknown parameter or state`);
      }
      if (!optimizer.values.has(param)) optimizer.values.set(param, new Map());
      const record = /** @type {ParameterRecord} */ (parameters.get(param));
      /** @type {Map<string, ArrayBufferView>} */ (optimizer.values.get(param)).set(stateName, checked(where, key, tensor, record));
      used.add(key);
    }
    for (const [param, perState] of optimizer.values) {
      const missing = states.filter((s) => !perState.has(s));
      if (missing.length) {
        throw new CheckpointError(`${where}: optimizer state ${JSON.stringify(missing)} of parameter ${JSON.stringify(param)} is missing`);
      }
    }
    if (step > 0 && states.length && optimizer.values.size === 0) {
      throw new CheckpointError(`${where}: the optimizer took ${step} steps with states ${JSON.stringify(states)}, ` +
        'but the checkpoint holds none of their tensors');
    }
  }
  const extra = [...tensors.keys()].filter((k) => !used.has(k)).sort();
  if (extra.length) {
    throw new CheckpointError(`${where} holds tensors its metadata does not describe: ${JSON.stringify(extra.slice(0, 8))}`);
  }
  const properties = state.properties ?? {};
  const nonfinite = state.nonfinite_properties ?? {};
  for (const [key, value] of [['properties', properties], ['nonfinite_properties', nonfinite]]) {
    if (value === null || typeof value !== 'object' || Array.isArray(value)) {
      throw new CheckpointError(`${where}: '${key}' must be a JSON object`);
    }
  }
  const read = { ...properties };
  for (const [name, text] of Object.entries(nonfinite)) {
    if (properties[name] !== null || !Object.hasOwn(NONFINITE, text)) {
      throw new CheckpointError(`${where}: nonfinite property ${JSON.stringify(name)} = ${JSON.stringify(text)} is not ` +
        `one of ${JSON.stringify(Object.keys(NONFINITE))} with a null in 'properties'`);
    }
    Object.defineProperty(read, name, { value: NONFINITE[text], enumerable: true, writable: true, configurable: true });
  }
  for (const [name, value] of Object.entries(read)) {
    if (value === null) throw new CheckpointError(`${where}: property ${JSON.stringify(name)} is null without a nonfinite value`);
    checkProperty(name, value, CheckpointError);
  }
  return { parameters, nominal, optimizer, properties: read };
}

/**
 * How an inf or nan property is written in the metadata's `nonfinite_properties` (JSON has no
 * such numbers; the property itself is null in `properties`, which keeps the order), as Python's.
 * @type {Record<string, number>}
 */
const NONFINITE = { inf: Infinity, '-inf': -Infinity, nan: NaN };

/**
 * @param {string} where
 * @param {string} key
 * @param {import('./safetensors.js').SafetensorsTensor} tensor
 * @param {ParameterRecord} record
 */
function checked(where, key, tensor, record) {
  if (tensor.dtype !== record.dtype || formatShape(tensor.shape) !== formatShape(record.shape)) {
    throw new CheckpointError(`${where}: tensor ${JSON.stringify(key)} has shape ${formatShape(tensor.shape)} and dtype ` +
      `${tensor.dtype}, the metadata says ${formatShape(record.shape)} and ${record.dtype}`);
  }
  return tensor.data;
}

/**
 * Properties are numbers (int or float) or strings, as upstream's; an integer beyond 2**53
 * (Python's `time.time_ns()`, a 64-bit seed) is a BigInt, so it round-trips exactly, and a
 * BigInt within 2**53 becomes a number. Anything else is an error of class `ErrorClass`
 * naming the property.
 * @param {string} name
 * @param {unknown} value
 * @param {new (message: string) => Error} ErrorClass
 * @returns {number | string | bigint}
 */
export function checkProperty(name, value, ErrorClass) {
  if (typeof value === 'string' || typeof value === 'number') return value;
  if (typeof value === 'bigint') return exactInteger(value);
  const got = value === null ? 'null' : typeof value;
  throw new ErrorClass(`property ${JSON.stringify(name)} must be a number or a string, got ${got}`);
}

const BIG_INTEGER_MARK = '@onnxtrain-bigint';

/**
 * `JSON.parse`, but an integer literal beyond 2**53 is read as an exact BigInt (JSON.parse
 * would round it to the nearest double). Integer literals are found by a scan that skips
 * strings; each one too large is quoted with a mark no string of the text holds, and the
 * reviver turns it back into a BigInt.
 * @param {string} text
 */
export function parseExactJson(text) {
  let mark = BIG_INTEGER_MARK;
  while (text.includes(mark)) mark += '-';
  let quoted = '';
  let copied = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (c === '"') {  // skip the string, escapes included
      for (i += 1; i < text.length && text[i] !== '"'; i++) if (text[i] === '\\') i += 1;
      continue;
    }
    if (c !== '-' && (c < '0' || c > '9')) continue;
    let end = i + 1;
    while (end < text.length && /[-+0-9.eE]/.test(text[end])) end += 1;
    const token = text.slice(i, end);
    if (/^-?[0-9]+$/.test(token) && !Number.isSafeInteger(Number(token))) {
      quoted += `${text.slice(copied, i)}"${mark}${token}"`;
      copied = end;
    }
    i = end - 1;
  }
  if (copied === 0) return JSON.parse(text);
  return JSON.parse(quoted + text.slice(copied), (_key, value) =>
    (typeof value === 'string' && value.startsWith(mark) ? BigInt(value.slice(mark.length)) : value));
}

/**
 * `JSON.stringify`, BigInts written as integer literals (JSON.stringify refuses them): each is
 * first written as a marked string, with a mark that no other string of the text holds.
 * @param {unknown} value
 */
export function stringifyExactJson(value) {
  for (let mark = BIG_INTEGER_MARK; ; mark += '-') {
    /** @type {string[]} */
    const digits = [];
    const text = JSON.stringify(value, (_key, v) => {
      // a whole Number beyond 2**53 is written with its exact digits (JSON.stringify's shortest
      // decimal, 1152921504606847000 for 2**60, is another integer to a reader that keeps them exact)
      const whole = typeof v === 'number' && Number.isInteger(v) && !Number.isSafeInteger(v);
      if (typeof v !== 'bigint' && !whole) return v;
      digits.push(BigInt(v).toString());
      return `${mark}${digits.length - 1}`;
    });
    if (digits.length === 0) return text;
    const pattern = new RegExp(`"${mark}([0-9]+)"`, 'g');
    if ((text.match(pattern) ?? []).length !== digits.length) continue;  // a user string looks like a mark
    return text.replace(pattern, (_whole, index) => digits[Number(index)]);
  }
}

/**
 * Serialize a checkpoint record to safetensors bytes (what the Python side reads back).
 * @param {CheckpointData} data
 * @returns {Uint8Array}
 */
export function encodeCheckpoint(data) {
  /** @type {Array<[string, import('./safetensors.js').SafetensorsTensor]>} */
  const tensors = [];
  const parameterList = [];
  for (const [name, record] of data.parameters) {
    const info = dtypeInfo(record.dtype, `parameter ${JSON.stringify(name)}`);
    parameterList.push({ name, requires_grad: record.requiresGrad, dtype: record.dtype, shape: record.shape });
    if (data.nominal) continue;
    if (record.value === null) {
      throw new CheckpointError(`parameter ${JSON.stringify(name)} has no value; save a nominal checkpoint instead`);
    }
    if (!(record.value instanceof info.array)) {
      throw new CheckpointError(`parameter ${JSON.stringify(name)}: value is a ${record.value.constructor.name}, ` +
        `expected a ${info.array.name} for ${record.dtype}`);
    }
    tensors.push([PARAM_PREFIX + name, { dtype: record.dtype, shape: record.shape, data: record.value }]);
  }
  /** @type {Record<string, unknown>} */
  const state = { parameters: parameterList, nominal: data.nominal };
  if (data.optimizer) {
    const { step, learningRate, states, values } = data.optimizer;
    state.optimizer = { step, learning_rate: learningRate, states };
    for (const [param, perState] of values) {
      const record = data.parameters.get(param);
      if (!record) throw new CheckpointError(`optimizer state for ${JSON.stringify(param)}, which is not a parameter of the checkpoint`);
      for (const [stateName, value] of perState) {
        tensors.push([`${OPTIMIZER_PREFIX}${param}/${stateName}`, { dtype: record.dtype, shape: record.shape, data: value }]);
      }
    }
  }
  /** @type {Array<[string, number | string | bigint | null]>} */
  const properties = [];
  /** @type {Array<[string, string]>} */
  const nonfinite = [];
  for (const [name, given] of Object.entries(data.properties)) {
    const value = checkProperty(name, given, CheckpointError);
    if (typeof value === 'number' && !Number.isFinite(value)) {
      nonfinite.push([name, Number.isNaN(value) ? 'nan' : value > 0 ? 'inf' : '-inf']);
      properties.push([name, null]);
    } else {
      properties.push([name, value]);
    }
  }
  state.properties = Object.fromEntries(properties); // own keys, "__proto__" included
  if (nonfinite.length) state.nonfinite_properties = Object.fromEntries(nonfinite);
  return encodeSafetensors(tensors, { format: FORMAT, version: String(VERSION), state: stringifyExactJson(state) });
}
