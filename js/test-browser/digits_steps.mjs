// Train the digits CNN of tests/js/fixtures.py in headless Chromium with onnxtrain-web on one
// execution provider, the way the fixture's Python run did (constant learning rate, batch k =
// training samples [k*B, (k+1)*B)), and report the largest parameter difference from the
// Python checkpoint after the same number of steps.
//
//   node test-browser/digits_steps.mjs PAGE_URL EXECUTION_PROVIDER FIXTURE_PATH
//
// FIXTURE_PATH is relative to PAGE_URL and holds the fixture's artifacts/, digits.bin,
// digits.json, fixture.json and python_step20. The page must serve digits_data.mjs next to it
// (the digits site does). Prints one JSON line {executionProvider, adapter, result: {maxAbsDiff,
// worstParameter, steps, expectedSteps, losses, seconds} | {error}}. With EXECUTION_PROVIDER
// webgpu, Chromium runs with --enable-unsafe-webgpu so that a machine without a GPU still offers
// its software adapter (SwiftShader). Exits 1 if the page could not run at all.
import { openPage } from './chromium.mjs';

const [url, executionProvider, fixturePath] = process.argv.slice(2);
if (!url || !executionProvider || !fixturePath) {
  console.error('usage: node test-browser/digits_steps.mjs PAGE_URL EXECUTION_PROVIDER FIXTURE_PATH');
  process.exit(2);
}
const { browser, page, adapter } = await openPage(url, executionProvider);
try {
  const result = await page.evaluate(async ({ executionProvider, fixturePath }) => {
    const api = await import('onnxtrain-web');
    const { batch, decodeDigits } = await import('./digits_data.mjs');
    const file = (name) => `${fixturePath}/${name}`;
    try {
      const started = performance.now();
      const settings = await (await fetch(file('fixture.json'))).json();
      const [index, bytes] = await Promise.all([
        fetch(file('digits.json')).then((r) => r.json()),
        fetch(file('digits.bin')).then((r) => r.arrayBuffer()),
      ]);
      const data = decodeDigits(bytes, index);
      const options = { sessionOptions: { executionProviders: [executionProvider] } };
      const artifact = (name) => file(`artifacts/${name}`);
      const state = await api.CheckpointState.load(artifact('checkpoint'));
      const module = await api.Module.create(artifact('training_model.onnx'), state, artifact('eval_model.onnx'), options);
      const optimizer = await api.Optimizer.create(artifact('optimizer_model.onnx'), module, options);
      optimizer.setLearningRate(settings.learning_rate);
      const losses = [];
      for (let k = 0; k < settings.steps; k++) {
        const { loss } = await module.trainStep(...batch(api.ort, data.train, k * settings.batch_size, settings.batch_size));
        await optimizer.step();
        module.lazyResetGrad();
        losses.push(loss.data[0]);
      }
      const expected = await api.CheckpointState.load(file('python_step20'));
      let maxAbsDiff = 0;
      let worstParameter = null;
      for (const [name, parameter] of expected.parameters) {
        const got = state.parameters.get(name).data;
        for (let i = 0; i < got.length; i++) {
          const diff = Math.abs(got[i] - parameter.data[i]);
          if (diff > maxAbsDiff) [maxAbsDiff, worstParameter] = [diff, name];
        }
      }
      return { maxAbsDiff, worstParameter, steps: optimizer.stepCount, expectedSteps: expected.optimizerState.step,
        losses, seconds: (performance.now() - started) / 1000 };
    } catch (error) {
      return { error: `${error.name}: ${error.message}`.slice(0, 800) };
    }
  }, { executionProvider, fixturePath });
  console.log(JSON.stringify({ executionProvider, adapter, result }));
} finally {
  await browser.close();
}
