import type { CoreDeps } from './deps.js';
import { QUEUE_NAMES } from '../workers/queues.js';

const STATES = ['waiting', 'active', 'delayed', 'failed', 'prioritized'] as const;

/**
 * Queue depth and the age of the oldest waiting job, sampled on a timer rather than per scrape
 * (a scrape must stay cheap however many processes Prometheus polls).
 */
export async function sampleQueues(deps: Pick<CoreDeps, 'queues' | 'metrics'>): Promise<void> {
  const now = Date.now();
  for (const name of QUEUE_NAMES) {
    const q = deps.queues[name];
    const counts = await q.getJobCounts(...STATES);
    for (const s of STATES) deps.metrics.queueJobs.set({ queue: name, state: s }, counts[s] ?? 0);
    const [oldest] = await q.getJobs(['waiting', 'prioritized'], 0, 0, true);
    deps.metrics.queueOldestAge.set(
      { queue: name },
      oldest ? Math.max(0, (now - oldest.timestamp) / 1000) : 0,
    );
  }
}

export function startQueueSampler(deps: Pick<CoreDeps, 'queues' | 'metrics' | 'logger'>, everyMs = 15_000) {
  let running = false;
  const tick = () => {
    if (running) return;
    running = true;
    sampleQueues(deps)
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
