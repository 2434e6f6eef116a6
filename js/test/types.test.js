// TypeScript: the hand-written declarations (types/) compile the documented usage and reject
// misuse, and the JSDoc types of the sources (src/) hold under tsc --strict --checkJs.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');

/** @param {string} config */
function typeCheck(config) {
  const project = fileURLToPath(new URL(`./types/${config}`, import.meta.url));
  const run = spawnSync(process.execPath, [tsc, '-p', project], { encoding: 'utf8' });
  assert.equal(run.status, 0, `tsc -p ${config} failed:\n${run.stdout}\n${run.stderr}`);
}

test('types/*.d.ts: tsc --strict accepts test/types/usage.ts and its marked misuse fails', () => typeCheck('tsconfig.json'));

test('src/: the JSDoc types hold under tsc --strict --checkJs', () => typeCheck('tsconfig.sources.json'));
