// The Python-made fixtures (tests/js/fixtures.py): the directory named by
// $ONNXTRAIN_JS_FIXTURES (pytest's tests/js/test_js.py sets it), or, when the Node tests run on
// their own (`npm test`), a fresh one made by running that script with python3.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { delimiter, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const REPO = resolve(fileURLToPath(new URL('../..', import.meta.url)));
let cached;

/** @returns {string} the fixture directory */
export function fixtureDir() {
  if (process.env.ONNXTRAIN_JS_FIXTURES) return process.env.ONNXTRAIN_JS_FIXTURES;
  if (cached) return cached;
  const dir = mkdtempSync(join(tmpdir(), 'onnxtrain-js-'));
  process.on('exit', () => rmSync(dir, { recursive: true, force: true }));
  const python = process.env.PYTHON ?? 'python3';
  const env = { ...process.env, PYTHONPATH: [join(REPO, 'src'), REPO, process.env.PYTHONPATH].filter(Boolean).join(delimiter) };
  const run = spawnSync(python, [join(REPO, 'tests', 'js', 'fixtures.py'), dir], { env, encoding: 'utf8' });
  if (run.status !== 0) {
    throw new Error(`making the fixtures with ${python} tests/js/fixtures.py failed (set ONNXTRAIN_JS_FIXTURES to a ` +
      `directory it made instead):\n${run.stdout}\n${run.stderr}`);
  }
  cached = dir;
  return dir;
}

/** @param {string} name */
export const fixturePath = (name) => join(fixtureDir(), name);

/**
 * A file of tests/data/upstream (written by onnxruntime-training 1.19.2; in the repository).
 * @param {string} name
 */
export const upstreamData = (name) => join(REPO, 'tests', 'data', 'upstream', name);

/** The run's settings (batch size, learning rate, steps, tolerance). */
export const settings = () => JSON.parse(readFileSync(fixturePath('fixture.json'), 'utf8'));

/** The digits data as typed arrays. */
export async function digits() {
  const { decodeDigits } = await import('../../examples/web/digits_data.mjs');
  const bytes = readFileSync(fixturePath('digits.bin'));
  const index = JSON.parse(readFileSync(fixturePath('digits.json'), 'utf8'));
  return decodeDigits(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength), index);
}

/**
 * Largest absolute difference between two typed arrays of the same length.
 * @param {ArrayLike<number>} a
 * @param {ArrayLike<number>} b
 */
export function maxAbsDiff(a, b) {
  if (a.length !== b.length) throw new Error(`length ${a.length} != ${b.length}`);
  let worst = 0;
  for (let i = 0; i < a.length; i++) worst = Math.max(worst, Math.abs(a[i] - b[i]));
  return worst;
}
