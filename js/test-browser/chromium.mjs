// Shared by the browser test scripts: headless Debian Chromium through playwright-core (no
// browser download), on one onnxruntime-web execution provider.
import { chromium } from 'playwright-core';

/**
 * Launch Chromium, open `url` and report the WebGPU adapter the page sees (null without one).
 * With `executionProvider` 'webgpu', Chromium runs with --enable-unsafe-webgpu so that a
 * machine without a GPU still offers its software adapter (SwiftShader).
 * @param {string} url
 * @param {string} executionProvider
 * @returns {Promise<{browser: import('playwright-core').Browser, page: import('playwright-core').Page, adapter: string | null}>}
 */
export async function openPage(url, executionProvider) {
  const args = ['--no-sandbox', ...(executionProvider === 'webgpu' ? ['--enable-unsafe-webgpu'] : [])];
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM_PATH ?? '/usr/bin/chromium', args });
  try {
    const page = await browser.newPage();
    await page.goto(url);
    const adapter = await page.evaluate(async () => {
      const found = await globalThis.navigator.gpu?.requestAdapter().catch(() => null);
      return found ? `${found.info?.vendor ?? ''} ${found.info?.architecture ?? ''}`.trim() || 'unnamed adapter' : null;
    });
    return { browser, page, adapter };
  } catch (error) {
    await browser.close();
    throw error;
  }
}
