/**
 * The digits data written by examples/digits_for_js.py: `digits.json` (for each split, the
 * byte offset, dtype and dims of `images` and `labels`) indexing the little-endian `digits.bin`.
 * Shared by the Node example, the web page and the tests.
 */

const ARRAYS = { float32: Float32Array, int32: Int32Array };

/**
 * @param {ArrayBuffer} buffer  the bytes of digits.bin
 * @param {any} index  the parsed digits.json
 * @returns {{train: Split, test: Split}}
 */
export function decodeDigits(buffer, index) {
  const split = (name) => {
    const view = (entry) => {
      const Array_ = ARRAYS[entry.dtype];
      if (!Array_) throw new Error(`digits.json: unsupported dtype ${entry.dtype} (expected float32 or int32)`);
      const count = entry.dims.reduce((a, b) => a * b, 1);
      return { data: new Array_(buffer, entry.offset, count), dims: entry.dims, dtype: entry.dtype };
    };
    const images = view(index[name].images);
    const labels = view(index[name].labels);
    return { images, labels, count: labels.dims[0] };
  };
  return { train: split('train'), test: split('test') };
}

/**
 * @typedef {{images: {data: Float32Array, dims: number[]}, labels: {data: Int32Array, dims: number[]}, count: number}} Split
 */

/**
 * Samples [start, start + size) of a split as onnxruntime Tensors (image, label).
 * @param {any} ort  the onnxruntime module
 * @param {Split} split
 * @param {number} start
 * @param {number} size
 */
export function batch(ort, split, start, size) {
  const end = Math.min(start + size, split.count);
  const pixels = split.images.dims.slice(1).reduce((a, b) => a * b, 1);
  return [
    new ort.Tensor('float32', split.images.data.slice(start * pixels, end * pixels), [end - start, ...split.images.dims.slice(1)]),
    new ort.Tensor('int32', split.labels.data.slice(start, end), [end - start]),
  ];
}

/**
 * Fraction of rows of `logits` ([N, classes]) whose argmax equals the label.
 * @param {Float32Array} logits
 * @param {Int32Array} labels
 */
export function accuracy(logits, labels) {
  const classes = logits.length / labels.length;
  let correct = 0;
  for (let i = 0; i < labels.length; i++) {
    let best = 0;
    for (let c = 1; c < classes; c++) if (logits[i * classes + c] > logits[i * classes + best]) best = c;
    if (best === labels[i]) correct++;
  }
  return correct / labels.length;
}

/**
 * A permutation of 0..n-1 from a seeded generator (mulberry32), so runs are repeatable.
 * @param {number} n
 * @param {number} seed
 */
export function shuffled(n, seed) {
  let s = seed >>> 0;
  const random = () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const order = Array.from({ length: n }, (_, i) => i);
  for (let i = n - 1; i > 0; i--) {
    const j = Math.floor(random() * (i + 1));
    [order[i], order[j]] = [order[j], order[i]];
  }
  return order;
}

/**
 * Rows `indices` of a split as Tensors (for shuffled epochs).
 * @param {any} ort
 * @param {Split} split
 * @param {number[]} indices
 */
export function gather(ort, split, indices) {
  const pixels = split.images.dims.slice(1).reduce((a, b) => a * b, 1);
  const images = new Float32Array(indices.length * pixels);
  const labels = new Int32Array(indices.length);
  indices.forEach((row, i) => {
    images.set(split.images.data.subarray(row * pixels, (row + 1) * pixels), i * pixels);
    labels[i] = split.labels.data[row];
  });
  return [new ort.Tensor('float32', images, [indices.length, ...split.images.dims.slice(1)]),
    new ort.Tensor('int32', labels, [indices.length])];
}
