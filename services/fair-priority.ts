import { createHash } from 'node:crypto';
import type { JobsOptions } from 'bullmq';
import type { Redis } from './redis.js';

/**
 * Fair shares of a BullMQ queue among tenants. One queue serves every tenant, first come, first
 * served: a tenant that floods it (thousands of sessions posted to, or asked to summarise) held
 * every other tenant's jobs behind its own for minutes (a light tenant's messages took 95 s to be
 * archived behind another's two-minute flood). BullMQ has no queue per tenant, but it takes jobs
 * by priority (lowest number first; first come, first served among equals). So a job's priority
 * says how busy its tenant has been lately:
 *
 * - `v`, a count that every job adds 1 to and that decays by e every FAIR_DECAY_MS (a leaky
 *   bucket): 1 for a tenant's first job in a while; a flood of r jobs a second settles near r x 60;
 * - the priority is v's class on a scale of factors of FAIR_CLASS_STEP (1.5): class 0 for v near
 *   1, 11 near 95, 19 near 1,900, plus 1. A lighter tenant's jobs go ahead of a busier one's, and
 *   a busy tenant's jobs share one class, first come, first served, so they stay in order while its
 *   rate wobbles. The class goes up as soon as v passes its middle, but down only once v fell by
 *   1.5 classes (about 1.8 times): a class lower than the one the tenant's waiting jobs hold puts
 *   its new jobs ahead of them.
 *
 * Measured by re-testers: a count per minute that started again at 1 every minute let a flooding
 * tenant's new jobs pass its own older ones (its sessions waited up to 52 s, against 14 s first
 * come first served); the bare decaying count did so whenever the flood's rate dipped (24 s).
 * Nothing needs to be taken back when a job ends or is lost. The counts are Redis hashes
 * `<prefix>:fair:<kind>:<tenant>` {v, t, b}, which expire after ten decay periods without a job.
 */
export const FAIR_DECAY_MS = 60_000;
export const FAIR_CLASS_STEP = 1.5;

/** BullMQ's highest priority number is 2,097,152; the summary sweep's jobs come after these. */
export const MAX_FAIR_PRIORITY = 1_000_000;

export type FairKind = 'flush' | 'summarize';

/** The key of `tenantId`'s count of `kind` jobs. */
export const fairKey = (prefix: string, kind: FairKind, tenantId: string): string =>
  `${prefix}:fair:${kind}:${tenantId}`;

/**
 * Lua: adds one job to the decaying count in `key` and leaves the job's priority (1 to
 * MAX_FAIR_PRIORITY) in the local `fair`. Also part of the accept script
 * (services/messages/inbox.ts), which counts a flush in the step that arms its session. The time
 * is Redis's (TIME), one clock for every process: with each API's own, two APIs 10 minutes apart
 * dropped a flooding tenant to the lightest class (each call decayed the count by the skew), and
 * froze a light tenant's count (a `t` ahead of a process's clock decays nothing).
 */
export const fairLua = (key: string) => `
local fair
do
  local tm = redis.call('TIME')
  local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
  local f = redis.call('HMGET', ${key}, 'v', 't', 'b')
  local v = tonumber(f[1]) or 0
  local dt = now - (tonumber(f[2]) or now)
  if dt < 0 then dt = 0 end
  v = v * math.exp(-dt / ${FAIR_DECAY_MS}) + 1
  local class = math.log(v) / math.log(${FAIR_CLASS_STEP})
  local b = tonumber(f[3])
  if b == nil or class > b + 0.5 or class < b - 1.5 then b = math.floor(class + 0.5) end
  redis.call('HSET', ${key}, 'v', string.format('%.6f', v), 't', now, 'b', b)
  redis.call('PEXPIRE', ${key}, ${10 * FAIR_DECAY_MS})
  fair = math.min(b + 1, ${MAX_FAIR_PRIORITY})
end
`;

const FAIR = `${fairLua('KEYS[1]')}
return fair`;

/** Counts one more `kind` job of `tenantId` and returns its priority. */
export async function nextFairPriority(
  redis: Redis,
  prefix: string,
  kind: FairKind,
  tenantId: string,
): Promise<number> {
  // The script's priority is already within 1 to MAX_FAIR_PRIORITY.
  return Number(await redis.eval(FAIR, 1, fairKey(prefix, kind, tenantId)));
}

/**
 * Adds a session's flush job at its tenant's fair priority: `priority` when the accept step
 * counted it already (acceptIntoInbox), else counted here. `dedupe`: one such job per session at a
 * time for that reason (a client's retry, the ingest sweeper).
 */
export async function enqueueFlush(
  deps: { redis: Redis; config: { prefix: string }; queues: { ingest: FlushQueue } },
  tenantId: string,
  sessionId: string,
  o: { priority?: number; dedupe?: 'retry' | 'sweep' } = {},
): Promise<void> {
  const priority = o.priority ?? (await nextFairPriority(deps.redis, deps.config.prefix, 'flush', tenantId));
  await deps.queues.ingest.add(
    'flush',
    { v: 1, tenantId, sessionId },
    { priority, ...(o.dedupe ? { deduplication: { id: flushDedupId(o.dedupe, tenantId, sessionId) } } : {}) },
  );
}

/**
 * A hash, as the other per-session deduplication ids (sessionJobKey, summaryDedupId): BullMQ
 * writes the id into the queue's capped event stream, which outlives the session's delete and its
 * tenant's erasure, and session ids may be e-mail addresses (`retry:<tenant>:<sid>` kept them).
 */
export function flushDedupId(why: 'retry' | 'sweep', tenantId: string, sessionId: string): string {
  const h = createHash('sha256').update(`${tenantId}\u0000${sessionId}`).digest('hex');
  return `${why}-${h.slice(0, 40)}`;
}

interface FlushQueue {
  add(
    name: 'flush',
    data: { v: 1; tenantId: string; sessionId: string },
    opts: JobsOptions,
  ): Promise<unknown>;
}
