/**
 * Peer systems for side-by-side baselines live in an isolated npm project, bench/peers/ (its own
 * package.json and lock; its node_modules is git-ignored), so LangChain and friends never enter
 * mnemos's dependency tree. `ensurePeers()` installs it on demand with `npm ci`; `requirePeer()`
 * loads a module resolved from there (the CommonJS build: the same code as the ESM one).
 */
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';
import { note } from './format.js';

export const PEERS_DIR = fileURLToPath(new URL('../peers/', import.meta.url));

/** The dependencies bench/peers/package.json names that its node_modules lacks. */
function missingPeers(): string[] {
  const pkg = JSON.parse(readFileSync(`${PEERS_DIR}package.json`, 'utf8')) as {
    dependencies?: Record<string, string>;
  };
  return Object.keys(pkg.dependencies ?? {}).filter(
    (name) => !existsSync(`${PEERS_DIR}node_modules/${name}/package.json`),
  );
}

/**
 * Installs bench/peers (npm ci, from its lock) when any dependency it names is missing, so an
 * install made before a peer was added gets it too; returns an error text or null.
 */
export function ensurePeers(): string | null {
  const missing = missingPeers();
  if (missing.length === 0) return null;
  note(
    `bench/peers/node_modules lacks ${missing.join(', ')}: running "npm --prefix bench/peers ci" (isolated peer install, ~200 MB, ~30 s)`,
  );
  const r = spawnSync('npm', ['--prefix', PEERS_DIR, 'ci', '--no-audit', '--no-fund'], {
    stdio: ['ignore', 'inherit', 'inherit'],
    timeout: 300_000,
  });
  if (r.status !== 0)
    return `npm --prefix bench/peers ci failed (exit ${r.status ?? r.signal ?? r.error?.message})`;
  const still = missingPeers();
  return still.length === 0 ? null : `npm --prefix bench/peers ci did not install ${still.join(', ')}`;
}

/** Loads a module as bench/peers resolves it (throws when it cannot). */
export function requirePeer<T = any>(specifier: string): T {
  const require = createRequire(`${PEERS_DIR}package.json`);
  return require(specifier) as T;
}

/** The installed version of a peer package, or null. */
export function peerVersion(name: string): string | null {
  try {
    const pkg = JSON.parse(readFileSync(`${PEERS_DIR}node_modules/${name}/package.json`, 'utf8')) as {
      version: string;
    };
    return pkg.version;
  } catch {
    return null;
  }
}
