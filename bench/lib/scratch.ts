/**
 * Scratch resources of a bench run: Postgres databases named `mnemos_bench_<unix s>_<hex>_<label>`
 * (migrated with the real migrations) and Redis key prefixes `mb_<unix s>_<hex>`. Everything made
 * here is registered and removed by `cleanupScratch()`, which the benches call in `finally` and on
 * SIGINT/SIGTERM; databases a crashed run left behind for more than an hour are dropped at the
 * next run. The shared Postgres and Redis are never flushed.
 */
import { randomBytes } from 'node:crypto';
import { Redis } from 'ioredis';
import { migrate } from '../../db/migrate.js';
import { makePgDb } from '../../db/pool.js';

export const ADMIN_URL =
  process.env.BENCH_DATABASE_ADMIN_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
export const REDIS_URL = process.env.BENCH_REDIS_URL ?? 'redis://127.0.0.1:6379';

const runTag = `${Math.floor(Date.now() / 1000)}_${randomBytes(3).toString('hex')}`;
const databases = new Set<string>();
const prefixes = new Set<string>();
const closers: Array<() => Promise<void>> = [];

const urlFor = (name: string) => {
  const u = new URL(ADMIN_URL);
  u.pathname = `/${name}`;
  return u.toString();
};

export interface ScratchDatabase {
  name: string;
  url: string;
}

/** Creates and migrates a fresh database; `label` is [a-z0-9_]. */
export async function createScratchDatabase(label: string): Promise<ScratchDatabase> {
  const name = `mnemos_bench_${runTag}_${label}`;
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1, applicationName: 'mnemos-bench' });
  try {
    await admin.query(`CREATE DATABASE "${name}"`);
    databases.add(name);
  } finally {
    await admin.close();
  }
  const url = urlFor(name);
  const db = makePgDb({ connectionString: url, max: 1, applicationName: 'mnemos-bench' });
  try {
    await migrate(db);
  } finally {
    await db.close();
  }
  return { name, url };
}

export function scratchPrefix(): string {
  const p = `mb_${runTag}_${randomBytes(2).toString('hex')}`;
  prefixes.add(p);
  return p;
}

/** Runs `fn` during cleanup, before databases are dropped (stop services, end pools). */
export function onCleanup(fn: () => Promise<void>): void {
  closers.push(fn);
}

async function dropDatabase(name: string): Promise<void> {
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1, applicationName: 'mnemos-bench' });
  try {
    await admin.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`);
  } finally {
    await admin.close();
  }
}

async function deletePrefix(prefix: string): Promise<number> {
  const redis = new Redis(REDIS_URL, { maxRetriesPerRequest: 1 });
  let deleted = 0;
  try {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000);
      cursor = next;
      if (keys.length) deleted += await redis.unlink(...keys);
    } while (cursor !== '0');
  } finally {
    redis.disconnect();
  }
  return deleted;
}

let cleaning: Promise<string[]> | null = null;

/** Stops what registered itself, drops every scratch database and Redis prefix; returns what it removed. */
export function cleanupScratch(): Promise<string[]> {
  cleaning ??= (async () => {
    const done: string[] = [];
    for (const close of closers.splice(0).reverse()) await close().catch(() => undefined);
    for (const name of databases) {
      try {
        await dropDatabase(name);
        done.push(`database ${name}`);
      } catch (err) {
        done.push(`database ${name} NOT dropped: ${(err as Error).message}`);
      }
    }
    databases.clear();
    for (const p of prefixes) {
      try {
        const n = await deletePrefix(p);
        done.push(`redis prefix ${p}: (${n} keys)`);
      } catch (err) {
        done.push(`redis prefix ${p} NOT cleaned: ${(err as Error).message}`);
      }
    }
    prefixes.clear();
    return done;
  })();
  return cleaning;
}

/** Drops scratch databases of earlier runs older than an hour (a crashed run cannot clean up). */
export async function dropStaleScratchDatabases(): Promise<string[]> {
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1, applicationName: 'mnemos-bench' });
  try {
    const r = await admin.query<{ datname: string }>(
      `SELECT datname FROM pg_database WHERE datname LIKE 'mnemos\\_bench\\_%'`,
    );
    const cutoff = Date.now() / 1000 - 3600;
    const stale = r.rows
      .map((x) => x.datname)
      .filter((n) => {
        const ts = Number(/^mnemos_bench_(\d+)_/.exec(n)?.[1] ?? Number.NaN);
        return Number.isFinite(ts) && ts < cutoff;
      });
    for (const n of stale) await admin.query(`DROP DATABASE IF EXISTS "${n}" WITH (FORCE)`);
    return stale;
  } finally {
    await admin.close();
  }
}

/** SIGINT/SIGTERM: clean up, then exit (a second signal exits at once). */
export function cleanupOnSignals(): void {
  let signalled = false;
  const handler = (sig: NodeJS.Signals) => {
    if (signalled) process.exit(130);
    signalled = true;
    process.stderr.write(`[bench] ${sig}: cleaning up scratch databases and Redis keys\n`);
    // Work still in flight fails once its pools close; that must not end the process before the
    // scratch databases are dropped.
    const swallow = () => undefined;
    process.on('unhandledRejection', swallow);
    process.on('uncaughtException', swallow);
    cleanupScratch().then(
      () => process.exit(130),
      () => process.exit(130),
    );
  };
  process.on('SIGINT', handler);
  process.on('SIGTERM', handler);
}
