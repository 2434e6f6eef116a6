// Types of the entry points 'onnxtrain-web' (onnxruntime-web) and 'onnxtrain-web/node'
// (onnxruntime-node): the core's API with the classes bound to that binding, plus `ort`, the
// binding itself, for making Tensors.
export * from './core.js';
import type { Platform } from './core.js';

/** The onnxruntime module this entry point uses (onnxruntime-web or onnxruntime-node). */
export const ort: typeof import('onnxruntime-common') & Record<string, any>;
/** This entry point's platform (for bindPlatform-style reuse). */
export const platform: Platform;
