import { Router } from 'express';
import { healthAnswer, jobAnswer, openapiDocument, readyAnswer } from '../openapi-responses.js';
import { pendingMigrations } from '../../db/migrate.js';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound } from '../errors.js';
import type { RouteMeta } from '../openapi.js';
import { redisWriteState } from '../redis.js';
import { noQuery, parseInput } from '../validate.js';
import { QUEUE_NAMES } from '../../workers/queues.js';
import type { QueueName } from '../../workers/queues.js';

async function timed<T>(p: Promise<T>, ms: number): Promise<T> {
  let t: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      p,
      new Promise<never>((_, rej) => {
        t = setTimeout(() => rej(new Error('timeout')), ms);
      }),
    ]);
  } finally {
    clearTimeout(t);
  }
}

/**
 * `ok`, or `read_only` for a database that takes no writes: a hot standby (after a failover, the
 * old primary's address may lead to one) or `default_transaction_read_only` on the database or
 * role. Reads go on there, so `SELECT 1` said ok while every write and every drain failed.
 * Bounded in the pool too, which closes a connection that gave no answer: left waiting, each
 * probe during an outage held one of the pool's connections for good.
 */
async function postgresState(deps: Pick<CoreDeps, 'db'>): Promise<'ok' | 'read_only'> {
  const r = await deps.db.query<{ standby: boolean; read_only: string }>(
    `SELECT pg_is_in_recovery() AS standby, current_setting('transaction_read_only') AS read_only`,
    [],
    { timeoutMs: 2000 },
  );
  const row = r.rows[0];
  return row && (row.standby || row.read_only === 'on') ? 'read_only' : 'ok';
}

export const opsRoutesMeta: Record<string, RouteMeta> = {
  'GET /healthz': { summary: 'Liveness: the process is up', auth: 'none', responses: { 200: healthAnswer } },
  'GET /readyz': {
    summary: 'Readiness with per-dependency status (503 when not ready)',
    auth: 'none',
    responses: { 200: readyAnswer, 503: readyAnswer },
  },
  'GET /metrics': { summary: 'Prometheus metrics', auth: 'none', produces: 'text/plain; version=0.0.4' },
  'GET /openapi.json': {
    summary: 'This document',
    auth: 'none',
    responses: { 200: openapiDocument },
  },
};

export function makeOpsRoutes(deps: CoreDeps, openapi: () => unknown): Router {
  const router = Router();
  router.get('/healthz', (_req, res) => {
    res.json({ status: 'ok' });
  });
  router.get('/readyz', async (_req, res) => {
    const checks: Record<string, string> = {};
    await Promise.all([
      timed(postgresState(deps), 2000).then(
        (state) => (checks.postgres = state),
        () => (checks.postgres = 'down'),
      ),
      timed(redisWriteState(deps.redis, deps.config.prefix), 2000).then(
        (state) => (checks.redis = state),
        () => (checks.redis = 'down'),
      ),
    ]);
    // A read-only database still answers reads: its migrations are worth reporting.
    if (checks.postgres !== 'down') {
      const pending = await pendingMigrations(deps.db).catch(() => ['unknown']);
      checks.migrations = pending.length === 0 ? 'ok' : `pending: ${pending.join(', ')}`;
    } else {
      checks.migrations = 'unknown';
    }
    checks.llm = deps.llm ? 'configured' : 'disabled';
    const ready = checks.postgres === 'ok' && checks.redis === 'ok' && checks.migrations === 'ok';
    if (!ready) res.setHeader('retry-after', '5');
    res.status(ready ? 200 : 503).json({ status: ready ? 'ready' : 'not_ready', checks });
  });
  router.get('/metrics', async (_req, res) => {
    res.setHeader('content-type', deps.metrics.registry.contentType);
    res.send(await deps.metrics.registry.metrics());
  });
  router.get('/openapi.json', (_req, res) => {
    res.json(openapi());
  });
  return router;
}

export const jobRoutesMeta: Record<string, RouteMeta> = {
  'GET /:id': {
    summary: "State of one of the tenant's jobs (id as returned, e.g. summary.<uuid>)",
    responses: { 200: jobAnswer },
  },
};

/** Job ids given to clients are `<queue>.<bullmq id>`; only the owning tenant can read them. */
export function makeJobRoutes(deps: CoreDeps): Router {
  const router = Router();
  router.get('/:id', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const m = /^([a-z]+)\.([A-Za-z0-9_-]{1,200})$/.exec(req.params.id!);
    if (!m || !QUEUE_NAMES.includes(m[1] as QueueName)) throw notFound('job');
    const queue = deps.queues[m[1] as QueueName];
    const job = await queue.getJob(m[2]!).catch(() => {
      throw new AppError(503, 'unavailable', 'redis is unavailable, retry later', undefined, {
        'retry-after': '2',
      });
    });
    const data = job?.data as { tenantId?: string } | undefined;
    if (!job || data?.tenantId !== res.locals.tenantId) throw notFound('job');
    const state = await job.getState();
    res.json({
      id: req.params.id,
      queue: m[1],
      name: job.name,
      state,
      attempts: job.attemptsMade,
      failed_reason: job.failedReason ?? null,
      created_at: new Date(job.timestamp).toISOString(),
      finished_at: job.finishedOn ? new Date(job.finishedOn).toISOString() : null,
      result: state === 'completed' ? (job.returnvalue ?? null) : null,
    });
  });
  return router;
}
