/**
 * Just enough protobuf to read an ONNX model's metadata and to turn the eval model into an
 * inference model, without a protobuf library: messages are split into their fields, the
 * fields we change are re-encoded and every other field is copied byte for byte.
 *
 * Field numbers are onnx.proto's (ModelProto, GraphProto, NodeProto, ...).
 * @module
 */

import { ModelError } from './errors.js';
import { dtypeInfo } from './dtypes.js';
import { Reader } from './flatbuffers.js';

/** The metadata key holding the training/eval models' description (docs/artifacts.md). */
export const TRAINING_METADATA_KEY = 'onnxtrain.training';
/** The metadata key holding the optimizer model's description. */
export const OPTIMIZER_METADATA_KEY = 'onnxtrain.optimizer';

const MODEL = { graph: 7, metadataProps: 14 };
const GRAPH = { node: 1, initializer: 5, input: 11, output: 12, valueInfo: 13, metadataProps: 16 };
const NODE = { input: 1, output: 2, name: 3, opType: 4, attribute: 5 };
const ATTRIBUTE = { graph: 6, graphs: 11 };
const TENSOR = { dims: 1, dataType: 2, name: 8, rawData: 9 };
const NAMED = { name: 1 }; // ValueInfoProto.name, StringStringEntryProto.key
const ENTRY = { key: 1, value: 2 };
const WIRE = { varint: 0, fixed64: 1, bytes: 2, fixed32: 5 };
/** onnx TensorProto.DataType of each dtype name */
const ONNX_DATA_TYPE = {
  float32: 1, uint8: 2, int8: 3, uint16: 4, int16: 5, int32: 6, int64: 7, bool: 9,
  float16: 10, float64: 11, uint32: 12, uint64: 13,
};

/**
 * @typedef {object} Field
 * @property {number} number
 * @property {number} wire
 * @property {number} start  first byte of the tag
 * @property {number} end  one past the last byte of the field
 * @property {number} valueStart  first byte of the value (after the length for bytes fields)
 */

/**
 * @param {Uint8Array} bytes
 * @param {number} position
 * @returns {[number, number]} value and the position after it
 */
function readVarint(bytes, position) {
  let value = 0;
  let scale = 1;
  for (;;) {
    if (position >= bytes.length) throw new RangeError('truncated varint');
    const byte = bytes[position++];
    value += (byte & 0x7f) * scale;
    if (byte < 0x80) return [value, position];
    scale *= 128;
    if (scale > 2 ** 63) throw new RangeError('varint too long');
  }
}

/**
 * Split a message into its fields.
 * @param {Uint8Array} bytes
 * @returns {Field[]}
 */
function splitFields(bytes) {
  const fields = [];
  let position = 0;
  while (position < bytes.length) {
    const start = position;
    const [tag, afterTag] = readVarint(bytes, position);
    const number = Math.floor(tag / 8);
    const wire = tag & 7;
    let valueStart = afterTag;
    if (wire === WIRE.varint) {
      position = readVarint(bytes, afterTag)[1];
    } else if (wire === WIRE.fixed64) {
      position = afterTag + 8;
    } else if (wire === WIRE.fixed32) {
      position = afterTag + 4;
    } else if (wire === WIRE.bytes) {
      const [length, afterLength] = readVarint(bytes, afterTag);
      valueStart = afterLength;
      position = afterLength + length;
    } else {
      throw new RangeError(`unsupported wire type ${wire}`);
    }
    if (position > bytes.length || number === 0) throw new RangeError('truncated or malformed field');
    fields.push({ number, wire, start, end: position, valueStart });
  }
  return fields;
}

/** @param {Uint8Array} bytes @param {Field} field */
const valueOf = (bytes, field) => bytes.subarray(field.valueStart, field.end);
/** @param {Uint8Array} bytes @param {Field} field */
const stringOf = (bytes, field) => new TextDecoder().decode(valueOf(bytes, field));

/**
 * The first string field `number` of a message, or undefined.
 * @param {Uint8Array} message
 * @param {number} number
 */
function stringField(message, number) {
  const field = splitFields(message).find((f) => f.number === number && f.wire === WIRE.bytes);
  return field === undefined ? undefined : stringOf(message, field);
}

/**
 * Whether `bytes` is an ORT-format (flatbuffers) model rather than an ONNX protobuf.
 * @param {Uint8Array} bytes
 */
export function isOrtFormat(bytes) {
  // ORT-format files carry the flatbuffers file identifier "ORTM" at bytes 4..8
  return bytes.length >= 8 && new TextDecoder().decode(bytes.subarray(4, 8)) === 'ORTM';
}

// Field slots (declaration order) of onnxruntime's ORT-format flatbuffer tables read here (ort.fbs)
const ORT_SESSION = { model: 1 };
const ORT_MODEL = { metadataProps: 9 };
const ORT_ENTRY = { key: 0, value: 1 };

/**
 * The model-level `metadata_props` of an ONNX or ORT-format model as a plain object (the
 * training metadata Module and Optimizer read: buffer updates, the loss scale, ...).
 * @param {Uint8Array} bytes
 * @param {string} what  e.g. "training model" (for messages)
 * @returns {Record<string, string>}
 */
export function readModelMetadata(bytes, what) {
  /** @type {Record<string, string>} */
  const metadata = {};
  if (isOrtFormat(bytes)) {
    const model = new Reader(bytes, `the ${what} (ORT format)`, ModelError).root().table(ORT_SESSION.model);
    for (const entry of model === null ? [] : model.tables(ORT_MODEL.metadataProps)) {
      const key = entry.string(ORT_ENTRY.key);
      if (key !== null) metadata[key] = entry.string(ORT_ENTRY.value) ?? '';
    }
    return metadata;
  }
  try {
    for (const field of splitFields(bytes)) {
      if (field.number !== MODEL.metadataProps || field.wire !== WIRE.bytes) continue;
      const entry = valueOf(bytes, field);
      const key = stringField(entry, ENTRY.key);
      if (key !== undefined) metadata[key] = stringField(entry, ENTRY.value) ?? '';
    }
    return metadata;
  } catch (error) {
    throw new ModelError(`the ${what} is not a readable ONNX model (${/** @type {Error} */ (error).message}); ` +
      'expected the bytes of an .onnx or .ort file');
  }
}

const VALUE_INFO = { name: 1, type: 2 };
const TYPE = { tensorType: 1 };
const TENSOR_TYPE = { shape: 2 };

/**
 * The names of the graph inputs an ONNX model declares as tensors without a shape (of any
 * rank): onnxruntime reports their shape as `[]`, a scalar's. Empty for ORT-format models.
 * @param {Uint8Array} bytes
 * @returns {Set<string>}
 */
export function inputsWithoutShape(bytes) {
  const names = new Set();
  if (isOrtFormat(bytes)) return names;
  for (const graphField of splitFields(bytes)) {
    if (graphField.number !== MODEL.graph || graphField.wire !== WIRE.bytes) continue;
    const graph = valueOf(bytes, graphField);
    for (const field of splitFields(graph)) {
      if (field.number !== GRAPH.input || field.wire !== WIRE.bytes) continue;
      const valueInfo = valueOf(graph, field);
      const typeField = splitFields(valueInfo).find((f) => f.number === VALUE_INFO.type && f.wire === WIRE.bytes);
      if (typeField === undefined) continue;
      const type = valueOf(valueInfo, typeField);
      const tensorField = splitFields(type).find((f) => f.number === TYPE.tensorType && f.wire === WIRE.bytes);
      if (tensorField === undefined) continue;
      const tensorType = valueOf(type, tensorField);
      if (!splitFields(tensorType).some((f) => f.number === TENSOR_TYPE.shape)) {
        names.add(stringField(valueInfo, VALUE_INFO.name) ?? '');
      }
    }
  }
  return names;
}

// ------------------------------------------------------------------------------ encoding

/** @param {number} value  a non-negative integer below 2**53 */
function varint(value) {
  const out = [];
  while (value >= 0x80) {
    out.push((value % 128) | 0x80);
    value = Math.floor(value / 128);
  }
  out.push(value);
  return Uint8Array.from(out);
}

/** @param {Uint8Array[]} parts */
function concat(parts) {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let position = 0;
  for (const part of parts) {
    out.set(part, position);
    position += part.length;
  }
  return out;
}

/** @param {string} text */
const utf8 = (text) => new TextEncoder().encode(text);
/** A length-delimited field. @param {number} number @param {Uint8Array} value */
const bytesField = (number, value) => concat([varint(number * 8 + WIRE.bytes), varint(value.length), value]);
/** @param {number} number @param {number} value */
const varintField = (number, value) => concat([varint(number * 8 + WIRE.varint), varint(value)]);

/**
 * An initializer (TensorProto with raw little-endian data).
 * @param {string} name
 * @param {string} dtype
 * @param {readonly number[]} shape
 * @param {ArrayBufferView} data
 */
function tensorProto(name, dtype, shape, data) {
  dtypeInfo(dtype, `parameter ${JSON.stringify(name)}`);
  return concat([
    bytesField(TENSOR.dims, concat(shape.map(varint))),
    varintField(TENSOR.dataType, ONNX_DATA_TYPE[/** @type {keyof ONNX_DATA_TYPE} */ (dtype)]),
    bytesField(TENSOR.name, utf8(name)),
    bytesField(TENSOR.rawData, new Uint8Array(data.buffer, data.byteOffset, data.byteLength)),
  ]);
}

/**
 * Names a node reads, including the outer-scope names its subgraphs (If, Loop, Scan) read.
 * @param {Uint8Array} node  NodeProto bytes
 * @returns {{inputs: string[], outputs: string[]}}
 */
function nodeIo(node) {
  const inputs = [];
  const outputs = [];
  for (const field of splitFields(node)) {
    if (field.number === NODE.input) inputs.push(stringOf(node, field));
    else if (field.number === NODE.output) outputs.push(stringOf(node, field));
    else if (field.number === NODE.attribute) {
      const attribute = valueOf(node, field);
      for (const sub of splitFields(attribute)) {
        if (sub.number !== ATTRIBUTE.graph && sub.number !== ATTRIBUTE.graphs) continue;
        const graph = valueOf(attribute, sub);
        // conservative: everything a subgraph node reads may come from the outer scope
        for (const gf of splitFields(graph)) {
          if (gf.number === GRAPH.node) inputs.push(...nodeIo(valueOf(graph, gf)).inputs);
        }
      }
    }
  }
  return { inputs: inputs.filter((n) => n !== ''), outputs };
}

/**
 * Build an inference model from the eval model: keep the nodes that compute `outputNames`,
 * embed the parameters as initializers, drop inputs nothing uses any more (the loss inputs
 * among them) and the training metadata. The result runs in a plain InferenceSession.
 *
 * @param {Uint8Array} evalModel  ONNX bytes of eval_model.onnx
 * @param {string[]} outputNames
 * @param {Map<string, {dtype: string, shape: number[], value: ArrayBufferView}>} parameters
 * @param {string[]} lossInputs
 * @returns {Uint8Array}
 */
export function buildInferenceModel(evalModel, outputNames, parameters, lossInputs) {
  if (isOrtFormat(evalModel)) {
    throw new ModelError('exporting an inference model needs the eval model as ONNX (.onnx), not ORT format (.ort)');
  }
  const modelFields = splitFields(evalModel);
  const graphField = modelFields.find((f) => f.number === MODEL.graph);
  if (graphField === undefined) throw new ModelError('the eval model has no graph');
  const graph = valueOf(evalModel, graphField);
  const graphFields = splitFields(graph);

  // every named value with its type: graph inputs, outputs and value_info
  /** @type {Map<string, Uint8Array>} */
  const typed = new Map();
  for (const f of graphFields) {
    if (f.number === GRAPH.input || f.number === GRAPH.output || f.number === GRAPH.valueInfo) {
      const info = valueOf(graph, f);
      const name = stringField(info, NAMED.name);
      if (name !== undefined && !typed.has(name)) typed.set(name, info);
    }
  }
  const missing = outputNames.filter((n) => !typed.has(n));
  if (missing.length) {
    const outputs = graphFields.filter((f) => f.number === GRAPH.output)
      .map((f) => stringField(valueOf(graph, f), NAMED.name));
    throw new ModelError(`graph outputs ${JSON.stringify(missing)} are not typed values of the eval model; ` +
      `its outputs are ${JSON.stringify(outputs)}. The eval model keeps only what the loss, the additional ` +
      'outputs and the base model\'s outputs compute (artifacts generated before eval models kept every output ' +
      'of the base model lack those the loss does not read: generate them again); to export another value, ' +
      'name it in generate_artifacts(..., additional_output_names=[...])');
  }

  const needed = new Set(outputNames);
  const keptNodes = new Set();
  const nodes = graphFields.filter((f) => f.number === GRAPH.node);
  for (let i = nodes.length - 1; i >= 0; i--) {
    const io = nodeIo(valueOf(graph, nodes[i]));
    if (io.outputs.some((o) => needed.has(o))) {
      keptNodes.add(nodes[i]);
      for (const name of io.inputs) needed.add(name);
    }
  }
  const usedLossInputs = lossInputs.filter((n) => needed.has(n));
  if (usedLossInputs.length) {
    throw new ModelError(`the requested outputs ${JSON.stringify(outputNames)} depend on the loss inputs ` +
      `${JSON.stringify(usedLossInputs)}; pick outputs computed before the loss`);
  }

  const parts = [];
  const initializers = [];
  for (const f of graphFields) {
    const value = valueOf(graph, f);
    const raw = graph.subarray(f.start, f.end);
    if (f.number === GRAPH.node) {
      if (keptNodes.has(f)) parts.push(raw);
    } else if (f.number === GRAPH.input) {
      const name = stringField(value, NAMED.name) ?? '';
      if (!needed.has(name)) continue;
      const parameter = parameters.get(name);
      if (parameter) initializers.push(bytesField(GRAPH.initializer, tensorProto(name, parameter.dtype, parameter.shape, parameter.value)));
      else parts.push(raw);
    } else if (f.number === GRAPH.initializer) {
      if (needed.has(stringField(value, TENSOR.name) ?? '')) parts.push(raw);
    } else if (f.number === GRAPH.valueInfo) {
      if (needed.has(stringField(value, NAMED.name) ?? '')) parts.push(raw);
    } else if (f.number === GRAPH.output || (f.number === GRAPH.metadataProps && isTrainingEntry(value))) {
      // outputs are written below; the training metadata does not describe an inference model
    } else {
      parts.push(raw);
    }
  }
  // a value is one graph output: a repeated one is an Identity of it named `<name>_alias_<k>`
  // (as the Python runtime writes it); an input requested as an output stays that input
  /** @type {Map<string, number>} */
  const repeats = new Map();
  for (const name of outputNames) {
    const info = /** @type {Uint8Array} */ (typed.get(name));
    const seen = repeats.get(name);
    repeats.set(name, seen === undefined ? 0 : seen + 1);
    if (seen === undefined) {
      parts.push(bytesField(GRAPH.output, info));
      continue;
    }
    const alias = `${name}_alias_${seen + 1}`;
    parts.push(bytesField(GRAPH.node, concat([bytesField(NODE.input, utf8(name)), bytesField(NODE.output, utf8(alias)),
      bytesField(NODE.name, utf8(alias)), bytesField(NODE.opType, utf8('Identity'))])));
    const rest = splitFields(info).filter((f) => f.number !== NAMED.name).map((f) => info.subarray(f.start, f.end));
    parts.push(bytesField(GRAPH.output, concat([bytesField(NAMED.name, utf8(alias)), ...rest])));
  }
  const newGraph = concat([...parts, ...initializers]);

  const modelParts = [];
  for (const f of modelFields) {
    if (f === graphField) modelParts.push(bytesField(MODEL.graph, newGraph));
    else if (f.number === MODEL.metadataProps && isTrainingEntry(valueOf(evalModel, f))) continue;
    else modelParts.push(evalModel.subarray(f.start, f.end));
  }
  return concat(modelParts);
}

/** @param {Uint8Array} entry  a StringStringEntryProto */
function isTrainingEntry(entry) {
  return stringField(entry, ENTRY.key) === TRAINING_METADATA_KEY;
}
