import type { Queue } from 'bullmq';
import type { QueueRegistry } from '../../workers/queues.js';
import { QUEUE_NAMES } from '../../workers/queues.js';
import type { Redis } from '../redis.js';

/**
 * Removing queued jobs of a deleted session or an erased tenant. Job payloads carry ids only
 * (message bodies live in the session inbox), and every processor re-checks the session's
 * generation, so a job that escapes this is harmless; removing them keeps Redis free of the ids.
 * Active (locked) jobs cannot be removed: they finish against the new state and are dropped.
 */

// (A paused queue keeps its jobs in the wait list.)
/** Jobs that would still run. */
export const PENDING_STATES = ['waiting', 'prioritized', 'delayed', 'waiting-children'] as const;
/** Jobs that ran: kept for Bull Board (failed ones until retried or removed, completed ones an hour). */
export const FINISHED_STATES = ['failed', 'completed'] as const;
type State = (typeof PENDING_STATES)[number] | (typeof FINISHED_STATES)[number];
const STATES: readonly State[] = [...PENDING_STATES, ...FINISHED_STATES];
const PAGE = 1000;

type Match = (data: Record<string, unknown>) => boolean;

async function matchingIds(
  redis: Redis,
  queue: Queue,
  match: Match,
  maxPerState: number,
  states: readonly State[],
): Promise<string[]> {
  const ids: string[] = [];
  for (const state of states) {
    for (let start = 0; start < maxPerState; start += PAGE) {
      const end = Math.min(start + PAGE, maxPerState) - 1;
      const page = await queue.getRanges([state], start, end, true);
      // Only each job's payload: reading whole jobs (getJobs: every field, twice, parsed into Job
      // objects) made one tenant erasure read the summary queue's 1,000 kept jobs four times over,
      // and 50 concurrent erasures stalled the API process's event loop for seconds.
      const payloads = page.length > 0 ? await payloadsOf(redis, queue, page) : [];
      page.forEach((id, i) => {
        const data = payloads[i];
        if (data && typeof data === 'object' && match(data as Record<string, unknown>)) ids.push(id);
      });
      if (page.length < end - start + 1) break;
    }
  }
  return ids;
}

/** The parsed `data` field of each job (null for a job removed meanwhile, or not JSON). */
async function payloadsOf(redis: Redis, queue: Queue, ids: readonly string[]): Promise<unknown[]> {
  const pipeline = redis.pipeline();
  for (const id of ids) pipeline.hget(queue.toKey(id), 'data');
  return ((await pipeline.exec()) ?? []).map(([err, raw]) => {
    if (err || typeof raw !== 'string') return null;
    try {
      return JSON.parse(raw) as unknown;
    } catch {
      return null;
    }
  });
}

/** Returns how many jobs were removed. `maxPerState` bounds the scan of each queue state. */
export async function removeQueuedJobs(
  redis: Redis,
  queues: QueueRegistry,
  match: Match,
  maxPerState: number,
  states: readonly State[] = STATES,
): Promise<number> {
  let removed = 0;
  for (const name of QUEUE_NAMES) {
    const queue = queues[name] as unknown as Queue;
    // Collect first, remove after: removing while paging would shift the pages.
    for (const id of await matchingIds(redis, queue, match, maxPerState, states)) {
      removed += (await queue.remove(id).catch(() => 0)) === 1 ? 1 : 0;
    }
  }
  return removed;
}

export const sessionJobs =
  (tenantId: string, sessionId: string): Match =>
  (d) =>
    d.tenantId === tenantId && d.sessionId === sessionId;

export const tenantJobs =
  (tenantId: string): Match =>
  (d) =>
    d.tenantId === tenantId;
