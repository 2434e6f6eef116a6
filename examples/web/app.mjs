// The page's script: load the data, train with onnxtrain-web on onnxruntime-web, show
// progress, the test accuracy and some predictions. `?epochs=N` and `?ep=webgpu` (WebGPU
// with wasm as fallback, where the browser has WebGPU) change the defaults.
import * as api from 'onnxtrain-web';
import { accuracy, decodeDigits, gather } from './digits_data.mjs';
import { trainDigits } from './digits_training.mjs';

const { ort } = api;
const params = new URLSearchParams(location.search);
const epochs = Number(params.get('epochs') ?? 8);
const wantWebGpu = params.get('ep') === 'webgpu';
const $ = (id) => document.getElementById(id);
const status = (text, state = 'running') => {
  $('status').textContent = text;
  $('status').dataset.state = state;
};

// single-threaded wasm unless the page is cross-origin isolated (serve.py --isolate)
ort.env.wasm.numThreads = globalThis.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency ?? 1) : 1;

async function chooseBackend() {
  if (wantWebGpu && navigator.gpu && await navigator.gpu.requestAdapter().catch(() => null)) {
    return { label: 'WebGPU (wasm fallback)', executionProviders: ['webgpu', 'wasm'] };
  }
  const threads = ort.env.wasm.numThreads;
  const note = wantWebGpu ? ', WebGPU unavailable' : '';
  return { label: `wasm, ${threads} thread${threads === 1 ? '' : 's'}${note}`, executionProviders: ['wasm'] };
}

function drawLoss(losses) {
  const canvas = $('chart');
  const g = canvas.getContext('2d');
  g.clearRect(0, 0, canvas.width, canvas.height);
  if (losses.length < 2) return;
  const top = Math.max(...losses);
  g.strokeStyle = '#36c';
  g.beginPath();
  losses.forEach((loss, i) => {
    const x = 30 + (i / (losses.length - 1)) * (canvas.width - 40);
    const y = 10 + (1 - loss / top) * (canvas.height - 30);
    i === 0 ? g.moveTo(x, y) : g.lineTo(x, y);
  });
  g.stroke();
  g.fillStyle = '#555';
  g.fillText(top.toFixed(2), 2, 14);
  g.fillText('0', 2, canvas.height - 20);
  g.fillText(`${losses.length} steps`, canvas.width - 60, canvas.height - 5);
}

function showDigits(test, logits) {
  const box = $('digits');
  box.replaceChildren();
  for (let i = 0; i < 16; i++) {
    const canvas = Object.assign(document.createElement('canvas'), { width: 48, height: 48 });
    const g = canvas.getContext('2d');
    for (let p = 0; p < 64; p++) {
      const v = 255 - Math.round(255 * test.images.data[i * 64 + p]);
      g.fillStyle = `rgb(${v},${v},${v})`;
      g.fillRect((p % 8) * 6, Math.floor(p / 8) * 6, 6, 6);
    }
    const row = logits.subarray(i * 10, i * 10 + 10);
    const predicted = row.indexOf(Math.max(...row));
    const figure = document.createElement('figure');
    const caption = document.createElement('figcaption');
    caption.textContent = String(predicted);
    if (predicted !== test.labels.data[i]) caption.className = 'wrong';
    figure.append(canvas, caption);
    box.append(figure);
  }
}

function offerDownload(button, bytes, name) {
  button.disabled = false;
  button.onclick = () => {
    const link = Object.assign(document.createElement('a'), {
      href: URL.createObjectURL(new Blob([bytes], { type: 'application/octet-stream' })), download: name,
    });
    link.click();
  };
}

async function main() {
  const backend = await chooseBackend();
  $('backend').textContent = backend.label;
  status('loading data and artifacts…');
  const [index, bytes] = await Promise.all([
    fetch('data/digits.json').then((r) => r.json()),
    fetch('data/digits.bin').then((r) => r.arrayBuffer()),
  ]);
  const data = decodeDigits(bytes, index);
  const losses = [];
  let lastDraw = 0;
  const train = (executionProviders) => trainDigits({
    api, data, epochs, artifact: (name) => `data/artifacts/${name}`,
    sessionOptions: { executionProviders },
    onProgress: ({ epoch, epochs: total, step, steps, loss, testAccuracy }) => {
      if (testAccuracy === undefined) {
        losses.push(loss);
        $('progress').value = ((epoch - 1) * steps + step) / (total * steps);
        if (performance.now() - lastDraw > 100) {
          status(`epoch ${epoch}/${total}, step ${step}/${steps}, loss ${loss.toFixed(4)}`);
          drawLoss(losses);
          lastDraw = performance.now();
        }
        return;
      }
      const row = document.createElement('tr');
      for (const text of [epoch, loss.toFixed(4), `${(100 * testAccuracy).toFixed(1)}%`]) {
        row.append(Object.assign(document.createElement('td'), { textContent: text }));
      }
      $('epochs').tBodies[0].append(row);
      $('accuracy').textContent = `${(100 * testAccuracy).toFixed(1)}%`;
    },
  });
  let result;
  try {
    result = await train(backend.executionProviders);
  } catch (error) {
    if (!backend.executionProviders.includes('webgpu')) throw error;
    // the digits CNN trains on WebGPU (its MaxPool gradient needs no Indices output); but a
    // WebGPU EP may take nodes it then fails to run (onnxruntime-web 1.30 does so with
    // training-mode BatchNormalization, see docs/web.md), or a real GPU may fail: train on wasm
    console.warn('WebGPU training failed, falling back to wasm:', error);
    $('backend').textContent = `wasm, 1 thread (WebGPU failed: ${error.message.slice(0, 160)})`;
    losses.length = 0;
    $('epochs').tBodies[0].replaceChildren();
    result = await train(['wasm']);
  }
  drawLoss(losses);
  const [images, labels] = gather(ort, data.test, Array.from({ length: data.test.count }, (_, i) => i));
  const { logits } = await result.module.evalStep(images, labels);
  const final = accuracy(logits.data, labels.data);
  showDigits(data.test, logits.data);
  $('accuracy').textContent = `${(100 * final).toFixed(1)}%`;
  $('accuracy').dataset.accuracy = String(final);
  $('progress').value = 1;
  offerDownload($('download-checkpoint'), await api.CheckpointState.save(result.state, null, { includeOptimizerState: true }), 'checkpoint');
  offerDownload($('download-model'), await result.module.exportModelForInferencing(['logits']), 'inference_model.onnx');
  status(`done: ${result.optimizer.stepCount} steps in ${result.seconds.toFixed(1)} s, test accuracy ${(100 * final).toFixed(1)}%`, 'done');
}

main().catch((error) => {
  console.error(error);
  status(`failed: ${error.name}: ${error.message}`, 'error');
});
