import type { ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { Redis } from 'ioredis';
import { migrate } from '../../db/migrate.js';
import { makePgDb } from '../../db/pool.js';
import { getRedisNamespace } from '../../db/queries/redis-namespace.js';
import { loadConfig } from '../../services/config.js';
import type { Config } from '../../services/config.js';
import { defaultExtensions } from '../../services/extensions.js';
import { makeLogger } from '../../services/logger.js';
import type { Logger } from '../../services/logger.js';
import { startService } from '../../services/main.js';
import type { Mode, RunningService } from '../../services/main.js';
import { createTenant } from '../../services/tenants.js';
import type { WorkerOptions } from '../../workers/main.js';
import { waitExit, waitReady } from './child-service.js';
import './open-handles.js';

export const ADMIN_URL = process.env.TEST_DATABASE_ADMIN_URL ?? 'postgres://postgres@127.0.0.1:5432/postgres';
export const REDIS_URL = process.env.TEST_REDIS_URL ?? 'redis://127.0.0.1:6379';
export const ADMIN_TOKEN = 'test-admin-token-0123456789';
const runId =
  process.env.MNEMOS_TEST_RUN ?? `${Math.floor(Date.now() / 1000)}_${randomBytes(3).toString('hex')}`;

const urlFor = (name: string) => {
  const u = new URL(ADMIN_URL);
  u.pathname = `/${name}`;
  return u.toString();
};

/** A fresh database for one test file: a clone of the run's migrated template (or migrated here). */
export async function createTestDatabase(): Promise<string> {
  const name = `mnemos_t_${runId}_${randomBytes(4).toString('hex')}`;
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  try {
    const template = process.env.MNEMOS_TEST_TEMPLATE;
    await admin.query(`CREATE DATABASE "${name}"${template ? ` TEMPLATE "${template}"` : ''}`);
  } finally {
    await admin.close();
  }
  const url = urlFor(name);
  if (!process.env.MNEMOS_TEST_TEMPLATE) {
    const db = makePgDb({ connectionString: url, max: 1 });
    await migrate(db);
    await db.close();
  }
  return url;
}

export async function dropTestDatabase(url: string): Promise<void> {
  const name = new URL(url).pathname.slice(1);
  const admin = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  await admin.query(`DROP DATABASE IF EXISTS "${name}" WITH (FORCE)`).catch(() => undefined);
  await admin.close();
}

export const testPrefix = () => `mt_${runId}_${randomBytes(4).toString('hex')}`;

export async function deleteRedisPrefix(prefix: string, redisUrl = REDIS_URL): Promise<void> {
  const redis = new Redis(redisUrl);
  try {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', 1000);
      cursor = next;
      if (keys.length) await redis.unlink(...keys);
    } while (cursor !== '0');
  } finally {
    redis.disconnect();
  }
}

export function testConfig(env: Record<string, string | undefined>): Config {
  return loadConfig({
    PORT: '0',
    LOG_LEVEL: process.env.TEST_LOG_LEVEL ?? 'silent',
    MNEMOS_ADMIN_TOKEN: ADMIN_TOKEN,
    REDIS_URL,
    ...env,
  });
}

export interface TestService extends RunningService {
  base: string;
  config: Config;
  newTenant(name?: string): Promise<{ tenantId: string; apiKey: string; api: Api }>;
}

/**
 * The prefix a database records (redis_namespace), or null. A database is used with one prefix
 * (services/redis-namespace.ts): a service started again on it without a prefix takes that one,
 * as a restart of the same deployment would.
 */
async function recordedPrefix(databaseUrl: string): Promise<string | null> {
  // No session settings: through a transaction pooler they would reach other clients' statements.
  const db = makePgDb({ connectionString: databaseUrl, max: 1, transactionPooler: true });
  try {
    return (await getRedisNamespace(db))?.prefix ?? null;
  } catch {
    return null;
  } finally {
    await db.close().catch(() => undefined);
  }
}

/**
 * Starts mnemos in this process against a test database and a unique Redis prefix (the one the
 * database records, when given one that a service started on before).
 */
export async function startTestService(
  opts: {
    mode?: Mode;
    env?: Record<string, string | undefined>;
    worker?: WorkerOptions;
    databaseUrl?: string;
    prefix?: string;
    /** Instead of one at LOG_LEVEL (silent in tests): for tests that read what was logged. */
    logger?: Logger;
  } = {},
): Promise<TestService> {
  const config = testConfig({
    DATABASE_URL: opts.databaseUrl ?? (await createTestDatabase()),
    MNEMOS_PREFIX:
      opts.prefix ?? (opts.databaseUrl && (await recordedPrefix(opts.databaseUrl))) ?? testPrefix(),
    ...opts.env,
  });
  const svc = await startService(opts.mode ?? 'serve', config, {
    logger: opts.logger ?? makeLogger(config.logLevel),
    extensions: defaultExtensions,
    worker: {
      lockDurationMs: 5000,
      stalledIntervalMs: 2000,
      ingestSweepAfterMs: 2000,
      ingestSweepEveryMs: 1000,
      ...opts.worker,
    },
  });
  return {
    ...svc,
    base: svc.url ?? '',
    config,
    async newTenant(name = `tenant-${randomBytes(4).toString('hex')}`) {
      const t = await createTenant(svc.deps.db, name);
      return { tenantId: t.tenant_id, apiKey: t.api_key, api: api(svc.url ?? '', t.api_key) };
    },
  };
}

export interface Res<T = any> {
  status: number;
  body: T;
  headers: Headers;
  text: string;
}

export interface Api {
  get<T = any>(path: string): Promise<Res<T>>;
  post<T = any>(path: string, body?: unknown, headers?: Record<string, string>): Promise<Res<T>>;
  del<T = any>(path: string): Promise<Res<T>>;
  raw(path: string, init: RequestInit): Promise<Res>;
}

export function api(base: string, token?: string): Api {
  const call = async (path: string, init: RequestInit): Promise<Res> => {
    const headers = new Headers(init.headers);
    if (token && !headers.has('authorization')) headers.set('authorization', `Bearer ${token}`);
    const r = await fetch(base + path, { ...init, headers });
    const text = await r.text();
    let body: unknown = text;
    try {
      body = text ? JSON.parse(text) : null;
    } catch {
      /* not JSON */
    }
    return { status: r.status, body, headers: r.headers, text };
  };
  return {
    get: (path) => call(path, { method: 'GET' }),
    post: (path, body, headers) =>
      call(path, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...headers },
        body: body === undefined ? undefined : typeof body === 'string' ? body : JSON.stringify(body),
      }),
    del: (path) => call(path, { method: 'DELETE' }),
    raw: call,
  } as Api;
}

/** Polls until `check` returns a truthy value or the deadline passes (tests await events, never sleep). */
/**
 * A transaction holding an old snapshot open on its own connection, which every CREATE INDEX
 * CONCURRENTLY of the database waits out. Resolves once the snapshot is taken; `release` ends it.
 */
export async function holdOldSnapshot(databaseUrl: string): Promise<{ release(): Promise<void> }> {
  return holdTransaction(databaseUrl, ['SET TRANSACTION ISOLATION LEVEL REPEATABLE READ', 'SELECT 1']);
}

/**
 * A transaction of its own connection that has run `statements` (taking locks, a snapshot) and
 * stays open until release(), as another process's long transaction would.
 */
export async function holdTransaction(
  databaseUrl: string,
  statements: string[],
): Promise<{ release(): Promise<void> }> {
  const db = makePgDb({ connectionString: databaseUrl, max: 1 });
  let release!: () => void;
  const released = new Promise<void>((resolve) => (release = resolve));
  let taken!: () => void;
  const snapshotTaken = new Promise<void>((resolve) => (taken = resolve));
  const holding = db.transaction(async (tx) => {
    for (const sql of statements) await tx.query(sql);
    taken();
    await released;
  });
  await Promise.race([snapshotTaken, holding]);
  let ended: Promise<void> | null = null;
  return {
    release: () =>
      (ended ??= (async () => {
        release();
        await holding.catch(() => undefined);
        await db.close();
      })()),
  };
}

/** Waits until a CREATE INDEX CONCURRENTLY of the index `name` waits on a lock (an old snapshot). */
export async function indexBuildWaiting(
  db: { query: (sql: string, params: unknown[]) => Promise<{ rowCount: number | null }> },
  name: string,
): Promise<void> {
  await eventually(
    async () =>
      (
        await db.query(
          `SELECT 1 FROM pg_stat_activity
           WHERE datname = current_database() AND wait_event_type = 'Lock'
             AND query LIKE 'CREATE INDEX CONCURRENTLY%' AND strpos(query, $1) > 0`,
          [name],
        )
      ).rowCount === 1,
    20_000,
    'the index build to wait for the old snapshot',
  );
}

/**
 * An LLM endpoint's call that never answers of itself: it ends when its signal aborts (and says so
 * in `state.aborted`), else fails after 10 s as an endpoint that answered before any abort.
 */
export function heldCall(): {
  state: { called: boolean; aborted: boolean };
  call: (signal?: AbortSignal) => Promise<never>;
} {
  const state = { called: false, aborted: false };
  const call = (signal?: AbortSignal) =>
    new Promise<never>((_resolve, reject) => {
      state.called = true;
      const answer = setTimeout(() => reject(new Error('the endpoint answered before any abort')), 10_000);
      signal?.addEventListener('abort', () => {
        state.aborted = true;
        clearTimeout(answer);
        reject(new Error('aborted'));
      });
    });
  return { state, call };
}

export async function eventually<T>(
  check: () => Promise<T | undefined | null | false>,
  timeoutMs = 15000,
  what = 'condition',
): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let delay = 10;
  for (;;) {
    const v = await check();
    if (v) return v;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, delay));
    delay = Math.min(delay * 2, 200);
  }
}

export interface ChildService {
  url: string | null;
  pid: number;
  child: ChildProcess;
  stop(): Promise<void>;
  kill(): Promise<void>;
}

/** Runs mnemos api/worker in a separate OS process (for multi-process and SIGKILL tests). */
export async function spawnService(
  mode: 'api' | 'worker' | 'serve',
  env: Record<string, string>,
): Promise<ChildService> {
  const { spawn } = await import('node:child_process');
  const child = spawn(process.execPath, ['--import', 'tsx', 'test/support/service-process.ts', mode], {
    env: {
      ...process.env,
      LOG_LEVEL: process.env.TEST_LOG_LEVEL ?? 'silent',
      MNEMOS_ADMIN_TOKEN: ADMIN_TOKEN,
      PORT: '0',
      ...env,
    },
    stdio: ['ignore', 'pipe', 'inherit'],
  });
  const ready = await waitReady(child, mode);
  return {
    url: ready.url,
    pid: child.pid!,
    child,
    async stop() {
      child.kill('SIGTERM');
      await waitExit(child);
    },
    async kill() {
      child.kill('SIGKILL');
      await waitExit(child);
    },
  };
}
