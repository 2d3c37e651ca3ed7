import { existsSync } from 'node:fs';
import { rename, writeFile } from 'node:fs/promises';
import path from 'node:path';
import { openPgliteDb, PGDATA_SUBDIR } from '../db/embedded.js';
import { migrate } from '../db/migrate.js';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { insertUsage } from '../db/queries/usage.js';
import { makeQueues } from '../workers/queues.js';
import { pgConnectionOptions } from './config.js';
import type { Config } from './config.js';
import type { CoreDeps } from './deps.js';
import { makeLlmClient } from './llm/llm-client.js';
import type { Logger } from './logger.js';
import { makeMetrics } from './metrics.js';
import { makeRedis } from './redis.js';
import { createTenant, tenantList } from './tenants.js';

/**
 * Opens every connection a process needs. Called only by entry points (main files, CLI, tests);
 * the caller owns shutdown through `closeDeps`.
 */
export async function openDeps(
  config: Config,
  logger: Logger,
  opts: { db?: Db; defaultMetrics?: boolean; poolSize?: number; quietQueueErrors?: boolean } = {},
): Promise<CoreDeps> {
  const db =
    opts.db ??
    (config.databaseUrl
      ? makePgDb({
          ...pgConnectionOptions(config, config.databaseUrl),
          logger,
          max: opts.poolSize ?? config.pgPoolSize,
          searchTimeoutMs: config.searchTimeoutMs,
          requestTimeoutMs: config.pgRequestTimeoutMs,
        })
      : await openEmbedded(config, logger));
  const redis = makeRedis(config.redisUrl, 'producer', logger);
  // Queues share the fail-fast producer connection: enqueueing during an outage is a 503, not a hang.
  // `quietQueueErrors` (CLI commands): makeRedis logs that connection's errors (at most one per
  // 5 s) and the command ends with "cannot reach Redis", but each queue repeated every reconnect
  // attempt's error too (36 lines on the stderr of an `export` before the one saying so). Those
  // go to debug there.
  const queues = makeQueues(
    redis,
    config.prefix,
    opts.quietQueueErrors ? { warn: (obj: object, msg: string) => logger.debug(obj, msg) } : logger,
  );
  const metrics = makeMetrics({ defaultMetrics: opts.defaultMetrics ?? false });
  const llm = config.llm.configured
    ? makeLlmClient({
        ...(config.llm.apiKey ? { apiKey: config.llm.apiKey } : {}),
        ...(config.llm.baseURL ? { baseURL: config.llm.baseURL } : {}),
        timeoutMs: config.llmTimeoutMs,
        logger,
        onUsage: async (u) => {
          metrics.llmTokens.inc({ purpose: u.purpose, model: u.model, direction: 'input' }, u.inputTokens);
          metrics.llmTokens.inc({ purpose: u.purpose, model: u.model, direction: 'output' }, u.outputTokens);
          await insertUsage(db, u);
        },
        onCall: (e) =>
          metrics.llmCalls.inc({
            purpose: e.purpose,
            model: e.model,
            outcome: e.outcome === 'ok' ? 'ok' : (e.kind ?? 'error'),
          }),
      })
    : null;
  return { config, db, redis, queues, logger, metrics, llm };
}

/**
 * No DATABASE_URL: the embedded Postgres (PGlite + pgvector) under `config.dataDir`, migrated,
 * and, on the first start of a database (never again, even once every tenant is erased), a tenant
 * "default" whose API key goes to a 0600 file (never to the log or stdout).
 */
async function openEmbedded(config: Config, logger: Logger): Promise<Db> {
  const db = await openPgliteDb(config.dataDir);
  try {
    await migrate(db);
    const created = await ensureFirstTenant(db, db.dataDir);
    if (created)
      logger.info({ file: created }, 'created tenant "default"; its API key is in this file (mode 0600)');
  } catch (err) {
    await db.close();
    throw err;
  }
  logger.info({ dataDir: db.dataDir }, 'embedded Postgres (PGlite) opened; single-process mode');
  return db;
}

export const FIRST_KEY_FILE = 'first-api-key.txt';
/** maintenance_state row recording that this database has had a tenant (bootstrapped or not). */
const FIRST_TENANT_MARK = 'first-tenant';

/**
 * Creates tenant "default" on the first start of a database only; returns the key file's path
 * then. A database that has ever had a tenant is marked (maintenance_state 'first-tenant'), so
 * erasing every tenant does not bring "default" back with a new live key on the next start.
 * Databases from before the mark get it on the first start that finds a tenant.
 */
export async function ensureFirstTenant(db: Db, dataDir: string): Promise<string | null> {
  const mark = await db.query<{ done: boolean }>(
    `SELECT done_at IS NOT NULL AS done FROM maintenance_state WHERE name = $1`,
    [FIRST_TENANT_MARK],
  );
  if (mark.rows[0]?.done) return null;
  const hadTenant = (await tenantList(db, { limit: 1 })).items.length > 0;
  let file: string | null = null;
  if (!hadTenant) {
    const t = await createTenant(db, 'default');
    file = path.join(dataDir, FIRST_KEY_FILE);
    const tmp = `${file}.${process.pid}.tmp`;
    await writeFile(tmp, `${t.api_key}\n`, { mode: 0o600 });
    await rename(tmp, file);
  }
  // After the key file: a start that dies before this sees the tenant next time and only marks.
  await db.query(
    `INSERT INTO maintenance_state (name, done_at) VALUES ($1, now())
     ON CONFLICT (name) DO UPDATE SET done_at = coalesce(maintenance_state.done_at, now())`,
    [FIRST_TENANT_MARK],
  );
  return file;
}

/** `p` as one word for a POSIX shell, to paste as printed (a checkout under "My Projects"). */
export const shellQuoted = (p: string): string =>
  /^[\w/.,:@%+=-]+$/.test(p) ? p : `'${p.replace(/'/g, `'\\''`)}'`;

/** Start-up banner lines about the embedded database and how to get an API key. */
export function embeddedBannerLines(config: Config, url: string): string[] {
  const dir = path.resolve(config.dataDir);
  const keyFile = path.join(dir, FIRST_KEY_FILE);
  return [
    `  Database:   embedded PGlite in ${path.join(dir, PGDATA_SUBDIR)} (single process; set DATABASE_URL for Postgres)`,
    existsSync(keyFile)
      ? `  API key:    export MNEMOS_API_KEY="$(cat ${shellQuoted(keyFile)})"   (tenant "default"; delete the file once stored)`
      : config.adminToken
        ? adminKeyLine(url)
        : '  API keys:   stop the server and run `npx mnemos tenant create <name>`, or set MNEMOS_ADMIN_TOKEN for the admin API',
  ];
}

/** The banner line of a service with an admin token: a tenant and its first key over the admin API. */
export const adminKeyLine = (url: string) =>
  `  API keys:   curl -X POST ${url}/v1/admin/tenants -H "authorization: Bearer $MNEMOS_ADMIN_TOKEN" -H 'content-type: application/json' -d '{"name":"me"}'`;

export async function closeDeps(deps: CoreDeps): Promise<void> {
  await deps.queues.close();
  deps.redis.disconnect();
  await deps.db.close();
}
