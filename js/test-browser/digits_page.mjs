// Drive headless Chromium (Debian's, through playwright-core: no browser download) on the
// digits page served on localhost: wait until it has trained, read the test accuracy it
// reports, save a screenshot.
//
//   node test-browser/digits_page.mjs URL SCREENSHOT.png [MIN_ACCURACY] [DOWNLOAD_DIR]
//
// Prints one JSON line {accuracy, status, backend, seconds, ...}; exits 1 when the page failed
// or its accuracy is below MIN_ACCURACY (default 0.9). With DOWNLOAD_DIR, also clicks the
// page's download buttons and saves `checkpoint` and `inference_model.onnx` there.
import { mkdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { chromium } from 'playwright-core';

const [url, screenshot, minimum = '0.9', downloadDir] = process.argv.slice(2);
if (!url || !screenshot) {
  console.error('usage: node test-browser/digits_page.mjs URL SCREENSHOT.png [MIN_ACCURACY]');
  process.exit(2);
}
const executablePath = process.env.CHROMIUM_PATH ?? '/usr/bin/chromium';
const TIMEOUT_MS = Number(process.env.PAGE_TIMEOUT_MS ?? 120_000);

const started = Date.now();
// extra flags, e.g. CHROMIUM_ARGS=--enable-unsafe-webgpu to try the page's ?ep=webgpu on a GPU-less machine
const extraArgs = (process.env.CHROMIUM_ARGS ?? '').split(' ').filter(Boolean);
const browser = await chromium.launch({ executablePath, args: ['--no-sandbox', ...extraArgs] });
let failed = true;
try {
  const page = await browser.newPage({ viewport: { width: 1000, height: 900 }, acceptDownloads: Boolean(downloadDir) });
  const problems = [];
  page.on('pageerror', (error) => problems.push(`page error: ${error.message}`));
  page.on('console', (message) => { if (message.type() === 'error') problems.push(`console: ${message.text()}`); });
  page.on('requestfailed', (request) => problems.push(`request failed: ${request.url()}`));
  await page.goto(url);
  await page.waitForSelector('#status[data-state="done"], #status[data-state="error"]', { timeout: TIMEOUT_MS });
  const result = await page.evaluate(() => ({
    state: document.getElementById('status').dataset.state,
    status: document.getElementById('status').textContent,
    accuracy: Number(document.getElementById('accuracy').dataset.accuracy),
    backend: document.getElementById('backend').textContent,
    epochs: document.querySelectorAll('#epochs tbody tr').length,
  }));
  mkdirSync(dirname(screenshot), { recursive: true });
  await page.screenshot({ path: screenshot, fullPage: true });
  const downloads = [];
  if (downloadDir && result.state === 'done') {
    for (const button of ['#download-checkpoint', '#download-model']) {
      const [download] = await Promise.all([page.waitForEvent('download'), page.click(button)]);
      const path = join(downloadDir, download.suggestedFilename());
      await download.saveAs(path);
      downloads.push(path);
    }
  }
  console.log(JSON.stringify({ ...result, seconds: (Date.now() - started) / 1000, problems, downloads }));
  failed = result.state !== 'done' || !(result.accuracy >= Number(minimum));
  if (failed) console.error(`the page reported ${result.state}: ${result.status} (accuracy ${result.accuracy}, need >= ${minimum})\n${problems.join('\n')}`);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
