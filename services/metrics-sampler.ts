import type { CoreDeps } from './deps.js';
import { oldestUnsummarisedAgeSeconds } from '../db/queries/summaries.js';
import { QUEUE_NAMES } from '../workers/queues.js';
import { oldestArmedAt } from './messages/inbox.js';

const STATES = ['waiting', 'active', 'delayed', 'failed', 'prioritized'] as const;
/** Active jobs read per queue per sample (the oldest first). */
const ACTIVE_SAMPLE = 200;

/**
 * Queue depth and the age of the oldest waiting job, sampled on a timer rather than per scrape
 * (a scrape must stay cheap however many processes Prometheus polls). For `ingest` the age is
 * also that of the session that has waited longest without its drain taking anything (the oldest
 * score of the armed set, inbox.ts): a drain that keeps failing retries from BullMQ's delayed set,
 * where no waiting job shows it, and accepted messages then wait with no job at all in sight.
 */
export async function sampleQueues(
  deps: Pick<CoreDeps, 'queues' | 'metrics'> & Partial<Pick<CoreDeps, 'redis' | 'config'>>,
): Promise<void> {
  const now = Date.now();
  for (const name of QUEUE_NAMES) {
    const q = deps.queues[name];
    const counts = await q.getJobCounts(...STATES);
    for (const s of STATES) deps.metrics.queueJobs.set({ queue: name, state: s }, counts[s] ?? 0);
    // A queue paused by hand and forgotten holds its jobs with no error anywhere (an ingest queue
    // paused shows only as the age below climbing).
    deps.metrics.queuePaused.set({ queue: name }, (await q.isPaused()) ? 1 : 0);
    const [oldest] = await q.getJobs(['waiting', 'prioritized'], 0, 0, true);
    let since = oldest?.timestamp ?? now;
    if (name === 'ingest' && deps.redis && deps.config) {
      const armedAt = await oldestArmedAt(deps.redis, deps.config.prefix);
      if (armedAt !== null) since = Math.min(since, armedAt);
    }
    deps.metrics.queueOldestAge.set({ queue: name }, Math.max(0, (now - since) / 1000));
    // A drain whose statement waits on a connection that went silent (behind a proxy that keeps
    // acknowledging) stays active for good, holding a worker slot, while nothing waits: the age
    // above stayed 0 for a tester's five such jobs. Active jobs are at most the workers' slots.
    let started = now;
    for (const job of await q.getJobs(['active'], 0, ACTIVE_SAMPLE - 1, true)) {
      started = Math.min(started, job.processedOn ?? job.timestamp);
    }
    deps.metrics.queueLongestActive.set({ queue: name }, Math.max(0, (now - started) / 1000));
  }
}

/** One process of the fleet computes the summary lag in such a period (the others read it). */
const SUMMARY_LAG_PERIOD_MS = 50_000;

/**
 * Summary lag: only meaningful when summaries run (an LLM is configured). Its query joins every
 * session with its summary (1.75 s of Postgres at a million sessions), so one process of the
 * fleet runs it in each period, whichever asks first, and shares the value: every
 * API process exports it, and the query runs about once a minute however many there are (until
 * 2026-12-02 each API process ran it every minute). A shared value is up to a minute old.
 */
export async function sampleSummaryLag(
  deps: Pick<CoreDeps, 'db' | 'llm' | 'metrics' | 'redis' | 'config'>,
): Promise<void> {
  if (!deps.llm) {
    deps.metrics.summaryLag.set(0);
    return;
  }
  const valueKey = `${deps.config.prefix}:metrics:summary-lag`;
  const turn = await deps.redis.set(
    `${valueKey}:turn`,
    String(process.pid),
    'PX',
    SUMMARY_LAG_PERIOD_MS,
    'NX',
  );
  if (turn !== 'OK') {
    const shared = await deps.redis.get(valueKey);
    if (shared !== null && Number.isFinite(Number(shared))) deps.metrics.summaryLag.set(Number(shared));
    return;
  }
  const age = await oldestUnsummarisedAgeSeconds(deps.db);
  deps.metrics.summaryLag.set(age);
  await deps.redis.set(valueKey, String(age), 'PX', 3 * SUMMARY_LAG_PERIOD_MS);
}

export function startQueueSampler(
  deps: Pick<CoreDeps, 'queues' | 'metrics' | 'logger' | 'db' | 'llm' | 'redis' | 'config'>,
  everyMs = 15_000,
) {
  let running = false;
  let ticks = 0;
  const tick = () => {
    if (running) return;
    running = true;
    const lagDue = ticks++ % 4 === 0;
    Promise.all([sampleQueues(deps), lagDue ? sampleSummaryLag(deps) : null])
      .catch((err: unknown) =>
        deps.logger.debug({ err: { message: (err as Error).message } }, 'queue sampling failed'),
      )
      .finally(() => {
        running = false;
      });
  };
  tick();
  const timer = setInterval(tick, everyMs);
  timer.unref();
  return () => clearInterval(timer);
}
