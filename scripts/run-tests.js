#!/usr/bin/env node
// `npm test`: makes sure Postgres (with pgvector) and Redis are up, migrates a template database
// once, runs every test file in parallel (each clones its own database from the template and uses
// its own Redis prefix), then drops this run's databases and any a crashed earlier run left behind.
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { randomBytes } from 'node:crypto';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const run = (cmd, args, opts = {}) => {
  const r = spawnSync(cmd, args, { stdio: 'inherit', cwd: root, ...opts });
  if (r.status !== 0) {
    console.error(`[test] ${cmd} ${args.join(' ')} failed (exit ${r.status})`);
    process.exit(r.status ?? 1);
  }
};

// `npm test` on a fresh clone: install dependencies first if they are missing.
if (!existsSync(path.join(root, 'node_modules', '.package-lock.json'))) {
  console.log('[test] installing dependencies (npm ci)');
  run('npm', ['ci', '--no-audit', '--no-fund']);
}

const adminUrl = process.env.TEST_DATABASE_ADMIN_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
if (!process.env.TEST_SKIP_SETUP) {
  run('bash', ['scripts/ensure-services.sh']);
  run('bash', ['scripts/install-pgvector.sh']);
  run('bash', ['scripts/install-pgbouncer.sh']);
}

const runId = `${Math.floor(Date.now() / 1000)}_${randomBytes(3).toString('hex')}`;
const template = `mnemos_tpl_${runId}`;
// Every JSON answer any test receives is checked against the schema /openapi.json documents for
// it (services/response-check.ts); mismatches land in this file and fail the run below.
const contractFile = path.join(tmpdir(), `mnemos-contract-${runId}.jsonl`);
const env = {
  ...process.env,
  TEST_DATABASE_ADMIN_URL: adminUrl,
  MNEMOS_TEST_TEMPLATE: template,
  MNEMOS_TEST_RUN: runId,
  MNEMOS_CHECK_RESPONSES: contractFile,
};

run(process.execPath, ['--import', 'tsx', 'test/support/global-setup.ts', 'setup'], { env });

const only = process.argv.slice(2);
const files = only.length
  ? only
  : readdirSync(path.join(root, 'test'))
      .filter((f) => f.endsWith('.test.ts'))
      .sort()
      .map((f) => `test/${f}`);
const concurrency = process.env.TEST_CONCURRENCY ?? '4';
// The timeout bounds each file as a whole, not only each test: the embedded file (PGlite in WASM,
// a CLI process per step) took 300 s on a machine loaded by other work, 1–2 min when quiet.
// --test-force-exit: a file whose tests have all ended exits even if a cleanup left a socket or a
// timer open (one such file, all 28 tests passed, waited out the 600 s and failed CI). What was
// left open is reported on stderr (test/support/open-handles.ts), not hidden.
const result = spawnSync(
  process.execPath,
  [
    '--import',
    'tsx',
    '--test',
    '--test-force-exit',
    `--test-concurrency=${concurrency}`,
    '--test-timeout=600000',
    ...files,
  ],
  { stdio: 'inherit', cwd: root, env },
);

spawnSync(process.execPath, ['--import', 'tsx', 'test/support/global-setup.ts', 'teardown'], {
  stdio: 'inherit',
  cwd: root,
  env,
});
let status = result.status ?? 1;
if (existsSync(contractFile)) {
  const lines = readFileSync(contractFile, 'utf8').trim().split('\n').filter(Boolean);
  rmSync(contractFile, { force: true });
  if (lines.length > 0) {
    const distinct = [...new Set(lines)];
    console.error(`[test] ${lines.length} answers did not match their documented schema (/openapi.json):`);
    for (const l of distinct.slice(0, 30)) console.error(`  ${l}`);
    if (distinct.length > 30) console.error(`  … and ${distinct.length - 30} more distinct ones`);
    if (status === 0) status = 1;
  }
}
process.exit(status);
