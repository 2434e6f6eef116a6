/**
 * Element types: the checkpoint's dtype names (numpy's, as the Python side writes them), the
 * safetensors tags on disk and the typed arrays that hold the values. The dtype names are also
 * onnxruntime's JavaScript tensor type names.
 * @module
 */

import { CheckpointError } from './errors.js';

/** @type {Record<string, {tag: string, bytes: number, array: any}>} */
export const DTYPES = {
  float32: { tag: 'F32', bytes: 4, array: Float32Array },
  float64: { tag: 'F64', bytes: 8, array: Float64Array },
  // onnxruntime's JavaScript API carries float16 as raw 16-bit patterns in a Uint16Array
  float16: { tag: 'F16', bytes: 2, array: Uint16Array },
  int8: { tag: 'I8', bytes: 1, array: Int8Array },
  int16: { tag: 'I16', bytes: 2, array: Int16Array },
  int32: { tag: 'I32', bytes: 4, array: Int32Array },
  int64: { tag: 'I64', bytes: 8, array: BigInt64Array },
  uint8: { tag: 'U8', bytes: 1, array: Uint8Array },
  uint16: { tag: 'U16', bytes: 2, array: Uint16Array },
  uint32: { tag: 'U32', bytes: 4, array: Uint32Array },
  uint64: { tag: 'U64', bytes: 8, array: BigUint64Array },
  bool: { tag: 'BOOL', bytes: 1, array: Uint8Array },
};

const BY_TAG = Object.fromEntries(Object.entries(DTYPES).map(([name, d]) => [d.tag, name]));

/**
 * The dtype record of `name`, or a CheckpointError naming `what`.
 * @param {string} name
 * @param {string} what
 */
export function dtypeInfo(name, what) {
  const info = Object.prototype.hasOwnProperty.call(DTYPES, name) ? DTYPES[name] : undefined;
  if (!info) {
    throw new CheckpointError(`${what}: dtype ${JSON.stringify(name)} is not supported ` +
      `(supported: ${Object.keys(DTYPES).join(', ')})`);
  }
  return info;
}

/**
 * The dtype name of a safetensors tag, or undefined.
 * @param {string} tag
 */
export function dtypeOfTag(tag) {
  return BY_TAG[tag];
}

/**
 * Number of elements of a shape.
 * @param {readonly number[]} shape
 */
export function elementCount(shape) {
  return shape.reduce((n, d) => n * d, 1);
}

/**
 * A zero-filled typed array for `dtype` and `shape`.
 * @param {string} dtype
 * @param {readonly number[]} shape
 */
export function zerosOf(dtype, shape) {
  const info = dtypeInfo(dtype, 'zeros');
  return new info.array(elementCount(shape));
}

/**
 * A copy of `data` (a typed array) as a fresh typed array of `dtype`'s type.
 * @param {string} dtype
 * @param {ArrayLike<any>} data
 */
export function copyOf(dtype, data) {
  const info = dtypeInfo(dtype, 'copy');
  return new info.array(/** @type {any} */ (data));
}

/**
 * Whether `data` is a typed array of the kind `dtype` uses.
 * @param {string} dtype
 * @param {unknown} data
 */
export function isArrayOf(dtype, data) {
  return data instanceof dtypeInfo(dtype, 'check').array;
}

/** @param {readonly number[]} shape */
export function formatShape(shape) {
  return `[${shape.join(', ')}]`;
}

/**
 * `value` as a number where that is exact, else as the BigInt itself.
 * @param {bigint} value
 * @returns {number | bigint}
 */
export function exactInteger(value) {
  const number = Number(value);
  return Number.isSafeInteger(number) ? number : value;
}
