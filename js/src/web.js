/**
 * onnxtrain-web for browsers (and other fetch-capable runtimes), on `onnxruntime-web`: models
 * and checkpoints load from URLs (or bytes); checkpoints and inference models are returned as
 * bytes to store or download. Choose the execution provider through the session options,
 * e.g. `{sessionOptions: {executionProviders: ['webgpu', 'wasm']}}`; the default is wasm.
 *
 * @example
 * import { CheckpointState, Module, Optimizer, ort } from 'onnxtrain-web';
 * import { TrainingSession } from 'onnxtrain-web'; // upstream's onnxruntime-web/training API
 * @module
 */

import * as ort from 'onnxruntime-web';
import { bindPlatform, CheckpointError, ModelError } from './core/index.js';

export * from './core/index.js';
export { ort };

/**
 * @param {string | URL} source
 * @param {string} what
 */
async function readBytes(source, what) {
  const url = source instanceof URL ? source.href : source;
  const ErrorClass = what === 'checkpoint' ? CheckpointError : ModelError;
  let response;
  try {
    response = await fetch(url);
  } catch (error) {
    throw new ErrorClass(`cannot fetch the ${what} ${JSON.stringify(url)}: ${/** @type {Error} */ (error).message}`);
  }
  if (!response.ok) throw new ErrorClass(`cannot fetch the ${what} ${JSON.stringify(url)}: HTTP ${response.status}`);
  return new Uint8Array(await response.arrayBuffer());
}

/** The web platform: onnxruntime-web and fetch; no file system (saves return bytes). */
export const platform = { name: 'web', ort, readBytes, writeBytes: null };

export const { CheckpointState, Module, Optimizer, TrainingSession } = bindPlatform(platform);
