import { RATE_LIMIT_ERROR, Worker } from 'bullmq';
import type { Job, Processor } from 'bullmq';
import { getTenantById } from '../db/queries/lifecycle.js';
import type { CoreDeps } from '../services/deps.js';
import type { Extension } from '../services/extension.js';
import { pgLogFields } from '../services/http-errors.js';
import { throttledKinds, throttledWarn } from '../services/logger.js';
import { makeRedis } from '../services/redis.js';
import type { Redis } from '../services/redis.js';
import { makeIngestProcessor } from './ingest.js';
import { exclusively, maintenanceLockKeys } from './maintenance-lock.js';
import { runIngestSweep } from './ingest-sweep.js';
import { REQUESTED, parsePayload, scheduleMaintenance } from './queues.js';
import { USAGE_RETENTION_EVERY_MS, makeUsageRetention } from './usage-retention.js';
import type { QueueName } from './queues.js';

export interface WorkerOptions {
  concurrency?: number;
  /** BullMQ lock duration; a killed worker's job is re-run after about this long. */
  lockDurationMs?: number;
  stalledIntervalMs?: number;
  /** How old an armed session must be before the sweeper re-requests its flush. */
  ingestSweepAfterMs?: number;
  ingestSweepEveryMs?: number;
}

/**
 * The tenant and session a job is for, read from its payload (`tenantId`, `sessionId`), so that an
 * operator can find the session a failure is about. Nothing else of the payload: no content. Read
 * as it is, not parsed: a job that failed for a payload of the wrong shape is named too.
 */
function jobSubject(data: unknown): { tenantId?: string; sessionId?: string } {
  const d = (typeof data === 'object' && data !== null ? data : {}) as Record<string, unknown>;
  const id = (v: unknown) => (typeof v === 'string' ? v.slice(0, 256) : undefined);
  const tenantId = id(d.tenantId);
  const sessionId = id(d.sessionId);
  return {
    ...(tenantId === undefined ? {} : { tenantId }),
    ...(sessionId === undefined ? {} : { sessionId }),
  };
}

/**
 * The summary queue's limiter never limits by itself (a million jobs a second): BullMQ applies a
 * queue's manual rate limit (`Queue.rateLimit`, set by a summarize job the LLM endpoint pushed
 * back on, workers/summarize.ts) only in workers that have one, and then in every process.
 */
const SUMMARY_LIMITER = { max: 1_000_000, duration: 1000 };

/** How long a maintenance pass asked for (requestMaintenance) waits for a pass on its tables. */
const REQUESTED_WAIT_MS = 10 * 60_000;

export interface RunningWorkers {
  workers: Worker[];
  close(timeoutMs: number): Promise<void>;
}

/**
 * Starts one BullMQ Worker per queue (each on its own retrying connection) and the repeatable
 * schedules. Processors are plain functions; this is only the wiring.
 */
export async function startWorkers(
  deps: CoreDeps,
  extensions: Extension[] = [],
  opts: WorkerOptions = {},
): Promise<RunningWorkers> {
  const connection: Redis = makeRedis(deps.config.redisUrl, 'worker', deps.logger);
  const concurrency = opts.concurrency ?? deps.config.workerConcurrency;
  const common = {
    connection,
    prefix: deps.config.prefix,
    lockDuration: opts.lockDurationMs ?? 30_000,
    stalledInterval: opts.stalledIntervalMs ?? 30_000,
    maxStalledCount: 1000,
  };
  const hooks = extensions.flatMap((e) => (e.afterArchive ? [e.afterArchive] : []));
  const ingest = makeIngestProcessor(deps, async (a) => {
    for (const h of hooks) await h(a);
  });
  const tasks: Record<string, () => Promise<unknown>> = {
    'ingest-sweep': () => runIngestSweep(deps, opts.ingestSweepAfterMs ?? 60_000),
    'usage-retention': makeUsageRetention(deps),
  };
  for (const e of extensions) Object.assign(tasks, e.maintenance ?? {});
  const unknownKinds = new Set<string>();
  const processors: Partial<Record<QueueName, Processor>> = {
    ingest,
    maintenance: async (job: Job, _token?: string, signal?: AbortSignal) => {
      const p = parsePayload('maintenance', job.data);
      const task = tasks[p.kind];
      if (!task) {
        // A newer build's task (a rolling upgrade, or its schedulers left after a rollback):
        // failing it filled the failed set and counted a final failure every time its scheduler
        // fired, for good. Its next pass on a worker of that build does the work.
        if (!unknownKinds.has(p.kind)) {
          unknownKinds.add(p.kind);
          deps.logger.warn(
            { kind: p.kind },
            "maintenance task unknown to this build (a newer build's?): skipped",
          );
        }
        return { skipped: 'unknown maintenance task in this build' };
      }
      const keys = maintenanceLockKeys(deps.config.prefix, p.kind);
      if (keys.length === 0) return task();
      return exclusively(deps.redis, keys, task, {
        waitMs: job.name === REQUESTED ? REQUESTED_WAIT_MS : 0,
        ...(signal ? { signal } : {}),
      });
    },
  };
  for (const e of extensions) Object.assign(processors, e.processors ?? {});
  const workers: Worker[] = [];
  const stopping = new AbortController();
  for (const [name, processor] of Object.entries(processors) as Array<[QueueName, Processor]>) {
    const timedProcessor: Processor = async (job, token, signal) => {
      const end = deps.metrics.jobDuration.startTimer({ queue: name });
      let deferred = false;
      try {
        // The signal also tells a processor that the worker is shutting down (a summarize job
        // stops between chunks).
        const stop = signal ? AbortSignal.any([signal, stopping.signal]) : stopping.signal;
        return await processor(job, token, stop);
      } catch (err) {
        deferred = isDeferral(err);
        // A job of a tenant erased meanwhile ends as done, not failed: a failed job's record
        // (its tenant and session ids) is kept by count alone, for ever, and the erasure has
        // already swept (a summary whose LLM answered, unusable, after the erasure; re-tester r4).
        const tenantId = (job.data as { tenantId?: unknown } | undefined)?.tenantId;
        if (
          typeof tenantId === 'string' &&
          (await getTenantById(deps.db, tenantId).catch(() => 'unknown')) === null
        ) {
          deps.logger.info({ queue: name, jobId: job.id }, 'dropped a failed job of an erased tenant');
          return undefined;
        }
        throw err;
      } finally {
        // A run that put its job back (delayed, rate-limited) did not end it: observing it counted
        // one summary job as many short ones, each deferral a "job" of its own.
        if (!deferred) end();
      }
    };
    // The recent index is derived and catches up in bigger batches; archiving gets the rest.
    // Summaries are bound by the LLM endpoint's limits (SUMMARY_CONCURRENCY calls in flight).
    const queueConcurrency =
      name === 'embed'
        ? Math.min(concurrency, deps.config.embedConcurrency)
        : name === 'summary'
          ? Math.min(concurrency, deps.config.summaryConcurrency)
          : concurrency;
    const w = new Worker(name, timedProcessor, {
      ...common,
      concurrency: queueConcurrency,
      ...(name === 'summary' ? { limiter: SUMMARY_LIMITER } : {}),
    });
    // While Redis refuses commands (out of memory, say) BullMQ emits an error per poll: one line
    // per queue per 5 s, with the count left out.
    const warnError = throttledWarn(deps.logger, 'worker error');
    w.on('error', (err) => warnError({ queue: name, err: { message: err.message } }));
    // Attempts that will be retried: one line per error message per 5 s on this queue (a
    // Postgres outage failed every queued drain's attempts at once: 3,202 lines in 30 s, 694 a
    // second, for 400 sessions). A final failure, which needs an operator, is always logged.
    const retriedOf = throttledKinds(100);
    w.on('failed', (job, err) => {
      // Final: no attempt left, or a permanent fault (UnrecoverableError skips the rest).
      const final = !job || job.attemptsMade >= (job.opts.attempts ?? 1) || err.name === 'UnrecoverableError';
      deps.metrics.jobFailures.inc({ queue: name, final: final ? 'true' : 'false' });
      // A Postgres refusal as the request lines log it: its SQLSTATE and its main message, bounded
      // (it can quote a value: `invalid input syntax for type integer: "…"`).
      const pg = pgLogFields(err);
      const fields = {
        queue: name,
        jobId: job?.id,
        ...jobSubject(job?.data),
        attempts: job?.attemptsMade,
        final,
        err: { message: pg.pg_message ?? err.message },
        ...pg,
      };
      if (final) {
        deps.logger.warn(fields, 'job failed');
        return;
      }
      retriedOf(err.message.slice(0, 200), () => throttledWarn(deps.logger, 'job failed'))(fields);
    });
    workers.push(w);
  }
  // Job schedulers live in Redis: if Redis comes back empty they are gone, so re-assert them
  // periodically (upserts are idempotent).
  const ensureSchedules = async () => {
    await scheduleMaintenance(deps.queues, 'ingest-sweep', opts.ingestSweepEveryMs ?? 30_000);
    await scheduleMaintenance(deps.queues, 'usage-retention', USAGE_RETENTION_EVERY_MS);
    for (const e of extensions) await e.schedule?.();
  };
  await ensureSchedules();
  const scheduleTimer = setInterval(() => {
    ensureSchedules().catch((err: unknown) =>
      deps.logger.warn({ err: { message: (err as Error).message } }, 'could not re-assert job schedulers'),
    );
  }, 60_000);
  scheduleTimer.unref();
  return {
    workers,
    async close(timeoutMs: number) {
      clearInterval(scheduleTimer);
      stopping.abort();
      const after = (ms: number) => new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), ms).unref());
      // Redis unreachable: a graceful close never resolves (BullMQ waits for Redis), and no job
      // can record its end anyway. Their locks expire and they are retried, as past a deadline.
      if (connection.status !== 'ready') {
        deps.logger.warn('Redis is unreachable at shutdown: not waiting for jobs (they are retried)');
        await Promise.race([Promise.allSettled(workers.map((w) => w.close(true))), after(1000)]);
        connection.disconnect();
        return;
      }
      // Let in-flight jobs finish; past the deadline force-close (their locks expire and another
      // worker re-runs them: every processor is idempotent).
      const graceful = Promise.all(workers.map((w) => w.close()));
      if ((await Promise.race([graceful, after(timeoutMs)])) === 'timeout') {
        deps.logger.warn(
          'jobs still running at the shutdown deadline: left to be retried (their locks expire)',
        );
        // A forced close still waits for the running processors (an LLM call of 30 s kept the
        // process past its deadline until the backstop exited 1): give it a moment, then go.
        await Promise.race([Promise.allSettled(workers.map((w) => w.close(true))), after(1000)]);
      }
      connection.disconnect();
    },
  };
}

/**
 * Whether a processor's error puts its job back rather than ending the run: as BullMQ's worker
 * tells them apart (by class or name, and a manual rate limit by its message).
 */
function isDeferral(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  return (
    err.message === RATE_LIMIT_ERROR ||
    err.name === 'DelayedError' ||
    err.name === 'WaitingError' ||
    err.name === 'WaitingChildrenError'
  );
}
