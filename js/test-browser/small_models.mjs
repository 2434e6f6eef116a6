// Train the small MLPs of tests/js/fixtures.py (served under data/small/ next to
// contract_page.html) in headless Chromium with onnxtrain-web, on one execution provider, and
// report the largest parameter difference from the Python run.
//
//   node test-browser/small_models.mjs PAGE_URL EXECUTION_PROVIDER MODEL...
//
// Prints one JSON line {adapter, results: {MODEL: {maxAbsDiff, steps, losses} | {error}}}.
// With EXECUTION_PROVIDER webgpu, Chromium runs with --enable-unsafe-webgpu so that a machine
// without a GPU still offers its software adapter (SwiftShader). Exits 1 if the page could
// not run at all; per-model errors are reported, not thrown.
import { openPage } from './chromium.mjs';

const [url, executionProvider, ...models] = process.argv.slice(2);
if (!url || !executionProvider || models.length === 0) {
  console.error('usage: node test-browser/small_models.mjs PAGE_URL EXECUTION_PROVIDER MODEL...');
  process.exit(2);
}
const { browser, page, adapter } = await openPage(url, executionProvider);
try {
  const results = {};
  for (const model of models) {
    results[model] = await page.evaluate(async ({ model, executionProvider }) => {
      const api = await import('onnxtrain-web');
      const small = await (await fetch('data/small/data.json')).json();
      const artifact = (file) => `data/small/${model}/${file}`;
      const options = { sessionOptions: { executionProviders: [executionProvider] } };
      try {
        const state = await api.CheckpointState.load(artifact('checkpoint'));
        const module = await api.Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'), options);
        const optimizer = await api.Optimizer.create(artifact('optimizer_model.onnx'), module, options);
        optimizer.setLearningRate(small.learning_rate);
        const x = Float32Array.from(small.x);
        const y = Int32Array.from(small.y);
        const [count, features] = small.x_dims;
        const losses = [];
        for (let k = 0; k < small.steps; k++) {
          if (model === 'fp16' && k === small.overflow_step) state.properties.set('loss_scale', small.overflow_scale);
          const start = (k * small.rows) % count;
          const { loss } = await module.trainStep(
            new api.ort.Tensor('float32', x.slice(start * features, (start + small.rows) * features), [small.rows, features]),
            new api.ort.Tensor('int32', y.slice(start, start + small.rows), [small.rows]));
          await optimizer.step();
          module.lazyResetGrad();
          losses.push(loss.data[0]);
        }
        const expected = await api.CheckpointState.load(artifact('python_steps'));
        let maxAbsDiff = 0;
        for (const [name, parameter] of expected.parameters) {
          const got = state.parameters.get(name).data;
          for (let i = 0; i < got.length; i++) maxAbsDiff = Math.max(maxAbsDiff, Math.abs(got[i] - parameter.data[i]));
        }
        return { maxAbsDiff, steps: optimizer.stepCount, expectedSteps: expected.optimizerState.step, losses };
      } catch (error) {
        return { error: `${error.name}: ${error.message}`.slice(0, 500) };
      }
    }, { model, executionProvider });
  }
  console.log(JSON.stringify({ executionProvider, adapter, results }));
} finally {
  await browser.close();
}
