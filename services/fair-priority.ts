import type { JobsOptions } from 'bullmq';
import type { Redis } from './redis.js';

/**
 * Fair shares of a BullMQ queue among tenants. One queue serves every tenant, first come, first
 * served: a tenant that floods it (thousands of sessions posted to, or asked to summarise) held
 * every other tenant's jobs behind its own for minutes (a light tenant's messages took 95 s to be
 * archived behind another's two-minute flood). BullMQ has no queue per tenant, but it takes jobs
 * by priority (lowest number first; first come, first served among equals). So a job gets as its
 * priority the number of jobs of its kind its tenant asked for in the current window: the first
 * job of every tenant in a window is 1, a flooding tenant's thousandth is 1,000, and a light
 * tenant's job goes ahead of the flood's backlog, behind at most the few jobs each tenant queued
 * as its first of a window. Within a tenant, jobs stay in order except across a window's turn
 * (a new window's first jobs pass the previous window's later ones).
 *
 * The counts are Redis keys `<prefix>:fair:<kind>:<tenant>:<window>` that expire after two
 * windows, so nothing needs to be taken back when a job ends or is lost.
 */
export const FAIR_WINDOW_MS = 60_000;

/** BullMQ's highest priority number is 2,097,152; the summary sweep's jobs come after these. */
export const MAX_FAIR_PRIORITY = 1_000_000;

export type FairKind = 'flush' | 'summarize';

/** The count key of `tenantId`'s `kind` jobs in the window of `now`. */
export function fairKey(prefix: string, kind: FairKind, tenantId: string, now = Date.now()): string {
  return `${prefix}:fair:${kind}:${tenantId}:${Math.floor(now / FAIR_WINDOW_MS)}`;
}

/** The priority number of count `n` (1 = the tenant's first job of the window). */
export const fairPriorityOf = (n: number): number => Math.min(Math.max(1, Math.floor(n)), MAX_FAIR_PRIORITY);

/** Counts one more `kind` job of `tenantId` in this window and returns its priority. */
export async function nextFairPriority(
  redis: Redis,
  prefix: string,
  kind: FairKind,
  tenantId: string,
): Promise<number> {
  const key = fairKey(prefix, kind, tenantId);
  const replies = await redis
    .multi()
    .incr(key)
    .pexpire(key, 2 * FAIR_WINDOW_MS)
    .exec();
  const [err, n] = replies?.[0] ?? [new Error('no reply'), 0];
  if (err) throw err;
  return fairPriorityOf(Number(n));
}

/**
 * Adds a session's flush job at its tenant's fair priority: `priority` when the accept step
 * counted it already (acceptIntoInbox), else counted here. `dedupId`: one such job at a time.
 */
export async function enqueueFlush(
  deps: { redis: Redis; config: { prefix: string }; queues: { ingest: FlushQueue } },
  tenantId: string,
  sessionId: string,
  o: { priority?: number; dedupId?: string } = {},
): Promise<void> {
  const priority = o.priority ?? (await nextFairPriority(deps.redis, deps.config.prefix, 'flush', tenantId));
  await deps.queues.ingest.add(
    'flush',
    { v: 1, tenantId, sessionId },
    { priority, ...(o.dedupId ? { deduplication: { id: o.dedupId } } : {}) },
  );
}

interface FlushQueue {
  add(
    name: 'flush',
    data: { v: 1; tenantId: string; sessionId: string },
    opts: JobsOptions,
  ): Promise<unknown>;
}
