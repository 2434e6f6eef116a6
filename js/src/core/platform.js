/**
 * What the shared core needs from its surroundings: an onnxruntime binding (`onnxruntime-node`,
 * `onnxruntime-web`, or any package with the same `InferenceSession`/`Tensor` API) and a
 * way to read (and, where there is a file system, write) bytes. The entry points
 * (`onnxtrain-web`, `onnxtrain-web/node`) supply one; `bindPlatform` makes classes for another.
 * @module
 */

import { OnnxTrainError } from './errors.js';

/**
 * @typedef {object} Platform
 * @property {string} name  e.g. "node" or "web" (for messages)
 * @property {any} ort  the onnxruntime module: `InferenceSession`, `Tensor`
 * @property {(source: string | URL, what: string) => Promise<Uint8Array>} readBytes  read a path or URL
 * @property {((target: string | URL, bytes: Uint8Array, what: string) => Promise<void>) | null} writeBytes
 *   write a file atomically, or null where there is no file system (the bytes are returned instead)
 */

/**
 * @param {{platform?: Platform | null, name: string}} cls
 * @returns {Platform}
 */
export function platformOf(cls) {
  if (!cls.platform) {
    throw new OnnxTrainError(`${cls.name} from onnxtrain-web/core has no onnxruntime binding: import it from ` +
      "'onnxtrain-web' (onnxruntime-web) or 'onnxtrain-web/node' (onnxruntime-node), or use bindPlatform(...)");
  }
  return cls.platform;
}

/**
 * The bytes of a model or checkpoint given as bytes, a path or a URL.
 * @param {Platform} platform
 * @param {string | URL | ArrayBuffer | ArrayBufferView} source
 * @param {string} what  e.g. "training model"
 * @returns {Promise<Uint8Array>}
 */
export async function readSource(platform, source, what) {
  if (source instanceof Uint8Array) return source;
  if (source instanceof ArrayBuffer) return new Uint8Array(source);
  if (ArrayBuffer.isView(source)) return new Uint8Array(source.buffer, source.byteOffset, source.byteLength);
  if (typeof source === 'string' || source instanceof URL) return platform.readBytes(source, what);
  const got = source === null ? 'null' : typeof source;
  throw new TypeError(`${what}: expected a path or URL (string or URL) or the file's bytes ` +
    `(Uint8Array or ArrayBuffer), got ${got}`);
}

/**
 * A name for messages: the path or URL, or "<bytes>".
 * @param {unknown} source
 */
export function describeSource(source) {
  if (typeof source === 'string') return source;
  if (source instanceof URL) return source.href;
  return '<bytes>';
}
