/**
 * onnxtrain-web for Node.js, on `onnxruntime-node`: models and checkpoints load from paths
 * (or file:/http(s): URLs, or bytes) and save atomically to files.
 *
 * @example
 * import { CheckpointState, Module, Optimizer, ort } from 'onnxtrain-web/node';
 * import { TrainingSession } from 'onnxtrain-web/node'; // upstream's onnxruntime-web/training API
 * @module
 */

import { chmod, open, readFile, realpath, rename, stat, unlink } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import * as ort from 'onnxruntime-node';
import { bindPlatform, CheckpointError, ModelError, OnnxTrainError } from './core/index.js';

export * from './core/index.js';
export { ort };

/** @param {string} what */
const errorFor = (what) => (what === 'checkpoint' ? CheckpointError : ModelError);

/**
 * @param {string | URL} source
 * @param {string} what
 */
async function readBytes(source, what) {
  const text = source instanceof URL ? source.href : source;
  if (/^https?:\/\//.test(text)) {
    const response = await fetch(text);
    if (!response.ok) throw new (errorFor(what))(`cannot fetch the ${what} ${JSON.stringify(text)}: HTTP ${response.status}`);
    return new Uint8Array(await response.arrayBuffer());
  }
  const path = text.startsWith('file:') ? fileURLToPath(text) : text;
  try {
    const info = await stat(path);
    if (!info.isFile() && !info.isDirectory()) {  // a FIFO would block, a device read without end
      throw new (errorFor(what))(`the ${what} ${JSON.stringify(path)} is not a regular file, expected a file`);
    }
    return new Uint8Array(await readFile(path));
  } catch (error) {
    if (error instanceof OnnxTrainError) throw error;
    const code = /** @type {NodeJS.ErrnoException} */ (error).code;
    const reason = code === 'ENOENT' ? 'does not exist' : code === 'EISDIR' ? 'is a directory, expected a file'
      : `cannot be read (${/** @type {Error} */ (error).message})`;
    throw new (errorFor(what))(`the ${what} ${JSON.stringify(path)} ${reason}`);
  }
}

/**
 * Write `bytes` to a temporary file in the destination folder, fsync it and rename it over
 * the destination, so an interrupted write leaves the previous file intact (as the Python side).
 * @param {string | URL} target
 * @param {Uint8Array} bytes
 * @param {string} what
 */
async function writeBytes(target, bytes, what) {
  const given = target instanceof URL ? fileURLToPath(target) : target.startsWith('file:') ? fileURLToPath(target) : target;
  // through a symbolic link to the file it names (the rename would replace the link itself)
  const path = await realpath(given).catch(() => given);
  const temporary = join(dirname(path), `.${basename(path)}.${process.pid}.${Date.now()}.tmp`);
  let handle;
  try {
    handle = await open(temporary, 'w');
    await handle.writeFile(bytes);
    await handle.sync();
    await handle.close();
    handle = undefined;
    // a file written over keeps its mode (a new one gets 0666 less the umask, as open() gives)
    const existing = await stat(path).catch(() => undefined);
    if (existing) await chmod(temporary, existing.mode & 0o7777);
    await rename(temporary, path);
  } catch (error) {
    await handle?.close().catch(() => {});
    await unlink(temporary).catch(() => {});
    throw new (errorFor(what))(`cannot write the ${what} ${JSON.stringify(path)}: ${/** @type {Error} */ (error).message}`);
  }
}

/** The Node.js platform: onnxruntime-node and the file system. */
export const platform = { name: 'node', ort, readBytes, writeBytes };

export const { CheckpointState, Module, Optimizer, TrainingSession } = bindPlatform(platform);
