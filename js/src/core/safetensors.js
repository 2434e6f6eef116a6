/**
 * The safetensors container: an 8-byte little-endian header length, a JSON header (tensor
 * dtype tag, shape and byte range relative to the data area, plus `__metadata__` strings),
 * then the raw little-endian tensor bytes, back to back.
 * @module
 */

import { CheckpointError } from './errors.js';
import { DTYPES, dtypeInfo, dtypeOfTag, elementCount } from './dtypes.js';

// safetensors refuses headers above 100 MB; so do we, before allocating anything for them.
const MAX_HEADER_BYTES = 100_000_000;

/**
 * @typedef {object} SafetensorsTensor
 * @property {string} dtype  dtype name (float32, int64, ...)
 * @property {number[]} shape
 * @property {ArrayBufferView} data  a fresh typed array of `dtype`'s kind
 */

/**
 * Parse safetensors bytes; every problem is a CheckpointError naming `where`.
 * @param {Uint8Array} bytes
 * @param {string} where  e.g. "checkpoint 'out/checkpoint'"
 * @returns {{metadata: Record<string, string>, tensors: Map<string, SafetensorsTensor>}}
 */
export function parseSafetensors(bytes, where) {
  if (bytes.byteLength < 8) {
    throw new CheckpointError(`${where} is not a safetensors file: ${bytes.byteLength} bytes, ` +
      'expected at least an 8-byte header length');
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerLength = Number(view.getBigUint64(0, true));
  if (headerLength > MAX_HEADER_BYTES || 8 + headerLength > bytes.byteLength) {
    throw new CheckpointError(`${where} is corrupt or not a safetensors file: header length ${headerLength} ` +
      `does not fit in the file's ${bytes.byteLength} bytes`);
  }
  let header;
  try {
    header = JSON.parse(new TextDecoder('utf-8', { fatal: true }).decode(bytes.subarray(8, 8 + headerLength)));
  } catch (error) {
    throw new CheckpointError(`${where} is corrupt or not a safetensors file: its header is not JSON ` +
      `(${/** @type {Error} */ (error).message})`);
  }
  if (header === null || typeof header !== 'object' || Array.isArray(header)) {
    throw new CheckpointError(`${where} is corrupt: the safetensors header is not a JSON object`);
  }
  const dataStart = 8 + headerLength;
  const dataLength = bytes.byteLength - dataStart;
  const metadata = header.__metadata__ ?? {};
  const tensors = new Map();
  const ranges = [];
  for (const [key, entry] of Object.entries(header)) {
    if (key === '__metadata__') continue;
    const dtype = dtypeOfTag(entry?.dtype);
    if (dtype === undefined) {
      throw new CheckpointError(`${where}: tensor ${JSON.stringify(key)} has dtype ${JSON.stringify(entry?.dtype)}; ` +
        `expected one of ${Object.values(DTYPES).map((d) => d.tag).join(', ')}`);
    }
    const shape = entry.shape;
    const offsets = entry.data_offsets;
    if (!Array.isArray(shape) || !shape.every((d) => Number.isInteger(d) && d >= 0) ||
        !Array.isArray(offsets) || offsets.length !== 2 || !offsets.every((o) => Number.isInteger(o) && o >= 0)) {
      throw new CheckpointError(`${where}: tensor ${JSON.stringify(key)} has a malformed shape or data_offsets`);
    }
    const [begin, end] = offsets;
    const expectedBytes = elementCount(shape) * DTYPES[dtype].bytes;
    if (end - begin !== expectedBytes || end > dataLength) {
      throw new CheckpointError(`${where} is corrupt: tensor ${JSON.stringify(key)} (${dtype} ${JSON.stringify(shape)}) ` +
        `needs ${expectedBytes} bytes at [${begin}, ${end}) but the data area holds ${dataLength} bytes`);
    }
    ranges.push([begin, end, key]);
    // slice() copies into a fresh, aligned buffer that the typed array can view
    const raw = bytes.slice(dataStart + begin, dataStart + end);
    tensors.set(key, { dtype, shape: [...shape], data: new DTYPES[dtype].array(raw.buffer) });
  }
  ranges.sort((a, b) => a[0] - b[0]);
  let cursor = 0;
  for (const [begin, end, key] of ranges) {
    if (begin !== cursor) {
      throw new CheckpointError(`${where} is corrupt: tensor ${JSON.stringify(key)} starts at byte ${begin}, ` +
        `expected ${cursor} (tensors must tile the data area)`);
    }
    cursor = end;
  }
  if (cursor !== dataLength) {
    throw new CheckpointError(`${where} is corrupt: its tensors cover ${cursor} bytes of a ${dataLength}-byte data area`);
  }
  if (typeof metadata !== 'object' || Array.isArray(metadata) ||
      !Object.values(metadata).every((v) => typeof v === 'string')) {
    throw new CheckpointError(`${where}: the safetensors __metadata__ must map names to strings`);
  }
  return { metadata, tensors };
}

/**
 * Serialize tensors (in the given order) and string metadata to safetensors bytes.
 * @param {Array<[string, SafetensorsTensor]>} tensors
 * @param {Record<string, string>} metadata
 * @returns {Uint8Array}
 */
export function encodeSafetensors(tensors, metadata) {
  /** @type {Record<string, unknown>} */
  const header = { __metadata__: metadata };
  let offset = 0;
  for (const [key, tensor] of tensors) {
    const info = dtypeInfo(tensor.dtype, `tensor ${JSON.stringify(key)}`);
    const nbytes = elementCount(tensor.shape) * info.bytes;
    if (tensor.data.byteLength !== nbytes) {
      throw new CheckpointError(`tensor ${JSON.stringify(key)}: ${tensor.data.byteLength} bytes of data for ` +
        `${tensor.dtype} ${JSON.stringify(tensor.shape)}, expected ${nbytes}`);
    }
    header[key] = { dtype: info.tag, shape: tensor.shape, data_offsets: [offset, offset + nbytes] };
    offset += nbytes;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padding = (8 - (json.byteLength % 8)) % 8; // the format pads the header with spaces to 8 bytes
  const out = new Uint8Array(8 + json.byteLength + padding + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(json.byteLength + padding), true);
  out.set(json, 8);
  out.fill(0x20, 8 + json.byteLength, 8 + json.byteLength + padding);
  let position = 8 + json.byteLength + padding;
  for (const [, tensor] of tensors) {
    out.set(new Uint8Array(tensor.data.buffer, tensor.data.byteOffset, tensor.data.byteLength), position);
    position += tensor.data.byteLength;
  }
  return out;
}
