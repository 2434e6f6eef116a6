/**
 * Checkpoints saved by onnxruntime-training (and read by upstream's onnxruntime-web training
 * API): one flatbuffer whose file identifier (bytes 4-8) is `ODTC` (schema
 * `ort_training_checkpoint.fbs`), read into the same record as onnxtrain's own checkpoints
 * (checkpoint.js), as the Python side does (src/onnxtrain/upstream_checkpoint.py, the spec of
 * this module: same field slots, checks and messages).
 *
 * Trainable parameters come first, then the frozen ones, each in the file's order; the
 * optimizer group (one allowed) gives the step and each parameter's `momentum0`/`momentum1`,
 * with the learning rate upstream resumes with (its default, 0.001: the file's initial learning
 * rate is its scheduler's, which upstream does not restore either); int, float
 * and string properties are kept (floats are float32 on disk: 0.1 reads back as 0.1). Past a
 * size threshold upstream keeps the tensors' bytes in `<checkpoint>.data` and their offsets in
 * the flatbuffer; those bytes are passed in as `externalData`. The flatbuffer is read with a
 * small reader whose every access is checked against the bytes' length: a truncated or
 * corrupt file is a CheckpointError, never a RangeError.
 * @module
 */

import { CheckpointError } from './errors.js';
import { DTYPES, exactInteger, formatShape } from './dtypes.js';
import { Reader } from './flatbuffers.js';

/** @typedef {import('./flatbuffers.js').Table} Table */

export const FILE_IDENTIFIER = 'ODTC';
export const EXTERNAL_DATA_SUFFIX = '.data';
// 1.19.2 writes 2; version 1 has the same tables, without the nominal and external-data flags.
export const SUPPORTED_VERSIONS = [1, 2];
/** The learning rate upstream's Optimizer resumes with, whatever the checkpoint holds. */
export const UPSTREAM_LEARNING_RATE = 1e-3;

/** ONNX TensorProto element type -> dtype name, the ones a checkpoint keeps. */
const ELEMENT_TYPES = new Map([
  [1, 'float32'], [2, 'uint8'], [3, 'int8'], [4, 'uint16'], [5, 'int16'], [6, 'int32'], [7, 'int64'],
  [9, 'bool'], [10, 'float16'], [11, 'float64'], [12, 'uint32'], [13, 'uint64'],
]);

// Field slots (declaration order) of the tables read here.
const CHECKPOINT = { version: 0, moduleState: 1, optimizerGroups: 2, propertyBag: 3 };
const MODULE_STATE = { requiresGradParams: 0, frozenParams: 1, isNominalState: 2, hasExternalData: 3 };
const TENSOR = { name: 0, dims: 2, dataType: 3, rawData: 4, externalDataOffset: 6 };
const OPTIMIZER_GROUP = { groupName: 0, step: 1, initialLearningRate: 2, optimizerStates: 3 };
const PARAMETER_OPTIMIZER_STATE = { paramName: 0, momentums: 1 };
const PROPERTY_BAG = { ints: 0, floats: 1, strings: 2 };
const PROPERTY = { name: 0, value: 1 };

/**
 * Whether `bytes` start like an onnxruntime-training checkpoint (`ODTC` at bytes 4-8).
 * @param {Uint8Array} bytes
 */
export function isUpstreamCheckpoint(bytes) {
  return bytes.byteLength >= 8 && bytes[4] === 0x4f && bytes[5] === 0x44 && bytes[6] === 0x54 && bytes[7] === 0x43;
}

/** @param {string} source */
const describe = (source) => `onnxruntime-training checkpoint ${JSON.stringify(source)}`;

/**
 * The name of the external data file of the checkpoint `source`, for messages and reading.
 * @param {string} source  a path or URL, or "<bytes>"
 */
export function externalDataName(source) {
  return source === '<bytes>' ? '<checkpoint>.data' : `${source}${EXTERNAL_DATA_SUFFIX}`;
}

/**
 * Whether the upstream checkpoint `bytes` keep their tensors in `<checkpoint>.data` (false for
 * any other bytes, and for a nominal checkpoint, which the reader refuses anyway).
 * @param {Uint8Array} bytes
 * @param {string} [source]
 */
export function needsExternalData(bytes, source = '<bytes>') {
  if (!isUpstreamCheckpoint(bytes)) return false;
  const module = new Reader(bytes, describe(source)).root().table(CHECKPOINT.moduleState);
  return module !== null && !module.bool(MODULE_STATE.isNominalState) && module.bool(MODULE_STATE.hasExternalData);
}

/**
 * Read onnxruntime-training checkpoint bytes into a checkpoint record.
 * @param {Uint8Array} bytes
 * @param {string} [source]  a name for the messages (path or URL)
 * @param {{externalData?: Uint8Array | null}} [options]  the bytes of `<checkpoint>.data`, where it has one
 * @returns {import('./checkpoint.js').CheckpointData}
 */
export function readUpstreamCheckpoint(bytes, source = '<bytes>', { externalData = null } = {}) {
  const where = describe(source);
  if (!isUpstreamCheckpoint(bytes)) throw new CheckpointError(`${where} does not start with the file identifier ODTC`);
  const reader = new Reader(bytes, where);
  const root = reader.root();
  const version = root.int32(CHECKPOINT.version);
  if (!SUPPORTED_VERSIONS.includes(version)) {
    throw new CheckpointError(`${where} has checkpoint format version ${version}; onnxtrain-web reads versions ` +
      `${SUPPORTED_VERSIONS.join(', ')} (onnxruntime-training 1.19.2 writes 2)`);
  }
  const module = root.table(CHECKPOINT.moduleState);
  if (module === null) throw new CheckpointError(`${where} holds no module state (parameters)`);
  if (module.bool(MODULE_STATE.isNominalState)) {
    throw new CheckpointError(`${where} is a nominal checkpoint: upstream's store parameter names without ` +
      'shapes or values. Generate the artifacts with onnxtrain.artifacts.generate_artifacts (its checkpoint, or ' +
      'nominal_checkpoint with the shapes), or load a complete checkpoint');
  }
  /** @type {External | null} */
  let external = null;
  if (module.bool(MODULE_STATE.hasExternalData)) {
    const name = externalDataName(source);
    if (!externalData) {
      throw new CheckpointError(`${where} keeps its tensors in ${JSON.stringify(name)}, which was not given: load ` +
        'the checkpoint from its path or URL (the .data file next to it is read too), or pass that file\'s bytes ' +
        'as the externalData option');
    }
    external = { bytes: externalData, what: JSON.stringify(name) };
  }
  /** @type {Map<string, import('./checkpoint.js').ParameterRecord>} */
  const parameters = new Map();
  for (const [slot, requiresGrad] of [[MODULE_STATE.requiresGradParams, true], [MODULE_STATE.frozenParams, false]]) {
    for (const table of module.tables(/** @type {number} */ (slot))) {
      const { name, dtype, shape, value } = readTensor(table, external, where);
      if (parameters.has(name)) throw new CheckpointError(`${where} holds parameter ${JSON.stringify(name)} twice`);
      parameters.set(name, { name, requiresGrad: /** @type {boolean} */ (requiresGrad), dtype, shape, value });
    }
  }
  const optimizer = readOptimizer(root, parameters, external, where);
  const properties = readProperties(root.table(CHECKPOINT.propertyBag), where);
  return { parameters, nominal: false, optimizer, properties };
}

/**
 * @typedef {object} External  the bytes of `<checkpoint>.data`
 * @property {Uint8Array} bytes
 * @property {string} what  its quoted name, for messages
 */

/**
 * One tensor table: its name, dtype, shape and a fresh typed array of its values.
 * @param {Table} table
 * @param {External | null} external
 * @param {string} where
 */
function readTensor(table, external, where) {
  const name = table.string(TENSOR.name);
  if (!name) throw new CheckpointError(`${where} holds a tensor without a name`);
  const code = table.int32(TENSOR.dataType);
  const dtype = ELEMENT_TYPES.get(code);
  if (dtype === undefined) {
    throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} has element type ${code} (ONNX TensorProto ` +
      'code), which an onnxtrain checkpoint cannot hold');
  }
  const info = DTYPES[dtype];
  const dims = table.int64s(TENSOR.dims);
  if (dims.some((d) => d < 0n)) {
    throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} has a negative dimension [${dims.join(', ')}]`);
  }
  if (dims.some((d) => d > BigInt(Number.MAX_SAFE_INTEGER))) {
    throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} has a dimension above 2**53 [${dims.join(', ')}]`);
  }
  // BigInt: a corrupt shape cannot overflow into a small size
  const count = dims.reduce((n, d) => n * d, 1n);
  const nbytes = count * BigInt(info.bytes);
  let offset = table.int64(TENSOR.externalDataOffset, -1n);
  let source = table.reader.bytes;
  let what = 'the checkpoint';
  if (offset >= 0n) {
    if (external === null) {
      throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} refers to external data but the checkpoint ` +
        'says it has none');
    }
    source = external.bytes;
    what = external.what;
  } else {
    const [start, length] = table.vector(TENSOR.rawData, 1);
    if (BigInt(length) !== nbytes) {
      throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} of shape [${dims.join(', ')}] and type ` +
        `${dtype} needs ${nbytes} bytes, the file holds ${length}`);
    }
    offset = BigInt(start);
  }
  if (offset + nbytes > BigInt(source.byteLength)) {
    throw new CheckpointError(`${where}: tensor ${JSON.stringify(name)} needs bytes ${offset}-${offset + nbytes} of ` +
      `${what}, which has ${source.byteLength}`);
  }
  const shape = dims.map(Number);
  // slice() copies into a fresh, aligned buffer that the typed array can view (little-endian
  // on disk, like every host onnxruntime-web runs on; safetensors.js assumes the same)
  const raw = source.slice(Number(offset), Number(offset + nbytes));
  return { name, dtype, shape, value: new info.array(raw.buffer) };
}

/**
 * @param {Table} root
 * @param {Map<string, import('./checkpoint.js').ParameterRecord>} parameters
 * @param {External | null} external
 * @param {string} where
 * @returns {import('./checkpoint.js').OptimizerRecord | null}
 */
function readOptimizer(root, parameters, external, where) {
  const groups = root.tables(CHECKPOINT.optimizerGroups);
  if (groups.length === 0) return null;
  if (groups.length > 1) {
    const names = groups.map((g) => g.string(OPTIMIZER_GROUP.groupName));
    throw new CheckpointError(`${where} holds ${groups.length} optimizer groups ${JSON.stringify(names)}; onnxtrain ` +
      'keeps one (upstream\'s Optimizer writes group0 only)');
  }
  const group = groups[0];
  /** @type {Map<string, Map<string, ArrayBufferView>>} */
  const values = new Map();
  for (const entry of group.tables(OPTIMIZER_GROUP.optimizerStates)) {
    const param = entry.string(PARAMETER_OPTIMIZER_STATE.paramName);
    const record = param === null ? undefined : parameters.get(param);
    if (param === null || record === undefined) {
      throw new CheckpointError(`${where} holds optimizer state for ${JSON.stringify(param)}, which is not a parameter`);
    }
    if (!record.requiresGrad) {
      throw new CheckpointError(`${where} holds optimizer state for the frozen parameter ${JSON.stringify(param)}`);
    }
    if (values.has(param)) throw new CheckpointError(`${where} holds optimizer state for ${JSON.stringify(param)} twice`);
    /** @type {Map<string, ArrayBufferView>} */
    const states = new Map();
    for (const table of entry.tables(PARAMETER_OPTIMIZER_STATE.momentums)) {
      const repeated = table.string(TENSOR.name);
      if (repeated !== null && states.has(repeated)) {  // before reading its bytes again
        throw new CheckpointError(`${where} holds optimizer state ${JSON.stringify(repeated)} of ${JSON.stringify(param)} twice`);
      }
      const { name: stateName, dtype, shape, value } = readTensor(table, external, where);
      if (formatShape(shape) !== formatShape(record.shape) || dtype !== record.dtype) {
        throw new CheckpointError(`${where}: optimizer state ${JSON.stringify(stateName)} of ${JSON.stringify(param)} ` +
          `has shape ${formatShape(shape)} and type ${dtype}, the parameter ${formatShape(record.shape)} and ${record.dtype}`);
      }
      states.set(stateName, value);
    }
    values.set(param, states);
  }
  const names = [...new Set([...values.values()].flatMap((states) => [...states.keys()]))].sort();
  for (const [param, states] of values) {
    const own = [...states.keys()].sort();
    if (own.join('\u0000') !== names.join('\u0000')) {
      throw new CheckpointError(`${where}: parameter ${JSON.stringify(param)} has optimizer states ` +
        `${JSON.stringify(own)}, others have ${JSON.stringify(names)}`);
    }
  }
  return {
    step: Number(group.int64(OPTIMIZER_GROUP.step, 0n)),
    // upstream keeps its scheduler's initial learning rate in the file and resumes at its
    // default learning rate whatever the file says: so does this state
    learningRate: UPSTREAM_LEARNING_RATE,
    states: names,
    values,
  };
}

/**
 * @param {Table | null} bag
 * @param {string} where
 * @returns {Record<string, number | string | bigint>}
 */
function readProperties(bag, where) {
  /** @type {Record<string, number | string | bigint>} */
  const properties = {};
  if (bag === null) return properties;
  /** @type {Array<[number, (t: Table) => number | string | bigint]>} */
  const kinds = [
    // int64 -> a number, or a BigInt beyond 2**53, as CheckpointState keeps int properties
    [PROPERTY_BAG.ints, (t) => exactInteger(t.int64(PROPERTY.value, 0n))],
    [PROPERTY_BAG.floats, (t) => shortestFloat32(t.float32(PROPERTY.value))],
    [PROPERTY_BAG.strings, (t) => t.string(PROPERTY.value) ?? ''],
  ];
  for (const [slot, read] of kinds) {
    for (const table of bag.tables(slot)) {
      const name = table.string(PROPERTY.name);
      if (!name) throw new CheckpointError(`${where} holds a property without a name`);
      if (Object.prototype.hasOwnProperty.call(properties, name)) {
        throw new CheckpointError(`${where} holds property ${JSON.stringify(name)} twice`);
      }
      const value = read(table);
      // an own property even for "__proto__"
      Object.defineProperty(properties, name, { value, enumerable: true, writable: true, configurable: true });
    }
  }
  return properties;
}

/**
 * The shortest decimal that reads back as the same float32 (what Python's
 * `float(str(np.float32(value)))` gives): upstream stores learning rates and float properties
 * as float32, so a saved 0.1 reads back as 0.1 (not 0.10000000149011612). The digits are
 * found with exact BigInt arithmetic, as numpy's Dragon4 does: `toPrecision` rounds a halfway
 * digit up where numpy takes the even one (343126.125 is 343126.12 in Python).
 * @param {number} value
 * @returns {number}
 */
export function shortestFloat32(value) {
  const f = Math.fround(value);
  if (!Number.isFinite(f) || f === 0) return f;
  const view = new DataView(new ArrayBuffer(4));
  view.setFloat32(0, Math.abs(f));
  const bits = view.getUint32(0);
  const biased = bits >>> 23;
  const fraction = bits & 0x7fffff;
  // |f| = mantissa * 2**exponent; the values that round to it lie between (4 * mantissa -
  // lowGap) and (4 * mantissa + 2), in units of 2**(exponent - 2): the bounds included when the
  // mantissa is even (round half to even), as numpy's shortest repr has it
  const mantissa = BigInt(biased ? fraction | 0x800000 : fraction);
  const bound = mantissa % 2n === 0n ? 0 : 1;
  const exponent = (biased || 1) - 150;
  const lowGap = fraction === 0 && biased > 1 ? 1n : 2n;
  const unitShift = exponent - 2;
  /**
   * Compare D * 10**q with X * 2**unitShift (sign of the difference), exactly.
   * @param {bigint} digits @param {number} q @param {bigint} units
   */
  const compare = (digits, q, units) => {
    const left = digits * (q >= 0 ? 10n ** BigInt(q) : 1n) * (unitShift < 0 ? 2n ** BigInt(-unitShift) : 1n);
    const right = units * (unitShift >= 0 ? 2n ** BigInt(unitShift) : 1n) * (q < 0 ? 10n ** BigInt(-q) : 1n);
    return left < right ? -1 : left > right ? 1 : 0;
  };
  const center = 4n * mantissa;
  // the decimal exponent k: 10**k <= |f| < 10**(k + 1)
  let k = Math.floor(Math.log10(Math.abs(f)));
  while (compare(1n, k, center) > 0) k -= 1;
  while (compare(1n, k + 1, center) <= 0) k += 1;
  for (let precision = 1; precision <= 9; precision += 1) {
    const q = k - precision + 1;
    // floor(|f| / 10**q), exactly
    const numerator = center * (unitShift >= 0 ? 2n ** BigInt(unitShift) : 1n) * (q < 0 ? 10n ** BigInt(-q) : 1n);
    const denominator = (unitShift < 0 ? 2n ** BigInt(-unitShift) : 1n) * (q >= 0 ? 10n ** BigInt(q) : 1n);
    const below = numerator / denominator;
    const inside = [below, below + 1n].filter((d) => compare(d, q, center - lowGap) >= bound &&
      compare(d, q, center + 2n) <= -bound);
    if (inside.length === 0) continue;
    let digits = inside[0];
    if (inside.length === 2) {
      // the nearer one; halfway: the even one
      const side = compare(2n * below + 1n, q, 2n * center);
      digits = side > 0 ? below : side < 0 ? below + 1n : (below % 2n === 0n ? below : below + 1n);
    }
    return Math.sign(f) * Number(`${digits}e${q}`);
  }
  return f;
}
