import { Worker } from 'bullmq';
import type { Job, Processor } from 'bullmq';
import type { CoreDeps } from '../services/deps.js';
import { makeRedis } from '../services/redis.js';
import type { Redis } from '../services/redis.js';
import { makeIngestProcessor } from './ingest.js';
import { runIngestSweep } from './ingest-sweep.js';
import { parsePayload } from './queues.js';
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

export interface RunningWorkers {
  workers: Worker[];
  close(timeoutMs: number): Promise<void>;
}

/**
 * Starts one BullMQ Worker per queue (each on its own retrying connection) and the repeatable
 * schedules. Processors are plain functions; this is only the wiring.
 */
export async function startWorkers(deps: CoreDeps, opts: WorkerOptions = {}): Promise<RunningWorkers> {
  const connection: Redis = makeRedis(deps.config.redisUrl, 'worker', deps.logger);
  const concurrency = opts.concurrency ?? deps.config.workerConcurrency;
  const common = {
    connection,
    prefix: deps.config.prefix,
    lockDuration: opts.lockDurationMs ?? 30_000,
    stalledInterval: opts.stalledIntervalMs ?? 30_000,
    maxStalledCount: 1000,
  };
  const ingest = makeIngestProcessor(deps);
  const processors: Partial<Record<QueueName, Processor>> = {
    ingest,
    maintenance: async (job: Job) => {
      const p = parsePayload('maintenance', job.data);
      if (p.kind === 'ingest-sweep') {
        return runIngestSweep(deps, opts.ingestSweepAfterMs ?? 60_000);
      }
      return { skipped: p.kind };
    },
  };
  const workers: Worker[] = [];
  for (const [name, processor] of Object.entries(processors) as Array<[QueueName, Processor]>) {
    const timedProcessor: Processor = async (job) => {
      const end = deps.metrics.jobDuration.startTimer({ queue: name });
      try {
        return await processor(job);
      } finally {
        end();
      }
    };
    const w = new Worker(name, timedProcessor, { ...common, concurrency });
    w.on('error', (err) => deps.logger.warn({ queue: name, err: { message: err.message } }, 'worker error'));
    w.on('failed', (job, err) => {
      const final = !job || job.attemptsMade >= (job.opts.attempts ?? 1);
      deps.metrics.jobFailures.inc({ queue: name, final: final ? 'true' : 'false' });
      deps.logger.warn(
        { queue: name, jobId: job?.id, attempts: job?.attemptsMade, final, err: { message: err.message } },
        'job failed',
      );
    });
    workers.push(w);
  }
  await deps.queues.maintenance.upsertJobScheduler(
    'ingest-sweep',
    { every: opts.ingestSweepEveryMs ?? 30_000 },
    { name: 'ingest-sweep', data: { v: 1, kind: 'ingest-sweep' } },
  );
  return {
    workers,
    async close(timeoutMs: number) {
      // Let in-flight jobs finish; past the deadline force-close (their locks expire and another
      // worker re-runs them: every processor is idempotent).
      const graceful = Promise.all(workers.map((w) => w.close()));
      const timer = new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), timeoutMs).unref());
      if ((await Promise.race([graceful, timer])) === 'timeout') {
        await Promise.allSettled(workers.map((w) => w.close(true)));
      }
      connection.disconnect();
    },
  };
}
