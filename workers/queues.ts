import { Queue, UnrecoverableError } from 'bullmq';
import type { ConnectionOptions, JobsOptions } from 'bullmq';
import { z } from 'zod';
import { throttledWarn } from '../services/logger.js';
import { isSessionId } from '../services/messages/message-input.js';

/**
 * The typed queue registry: the only place that constructs BullMQ `Queue`s. Every payload carries a
 * schema version `v` so a deploy never strands queued work: processors accept every version they
 * know and fail permanently (kept, visible) on one they do not.
 *
 * Redis layout (all under MNEMOS_PREFIX, default `mnemos`): BullMQ keys are
 * `<prefix>:<queue>:…`; see README "Redis key layout" for the rest.
 */

// A session id the API would refuse (a job added or edited by hand) fails the job at once: drained,
// it created a session row that was listed but could never be read or deleted (both answer 400).
const sessionRef = { tenantId: z.string().min(1), sessionId: z.string().refine(isSessionId) };

export const payloads = {
  ingest: z.object({ v: z.literal(1), ...sessionRef }),
  embed: z.object({ v: z.literal(1), ...sessionRef, generation: z.number().int() }),
  compact: z.object({ v: z.literal(1), ...sessionRef }),
  summary: z.union([
    z.object({ v: z.literal(1), kind: z.literal('sweep') }),
    z.object({
      v: z.literal(1),
      kind: z.literal('summarize'),
      ...sessionRef,
      reason: z.enum(['sweep', 'api']),
      // Set by the API so `?wait=true` can tell its own job from one it joined (deduplication).
      requestId: z.string().max(64).optional(),
      // The lease of another run this job waited for (makeSummaryProcessor, leaseWaitMs).
      leaseSeen: z.object({ holder: z.string().max(64), expiresAtMs: z.number() }).optional(),
    }),
  ]),
  // Periodic tasks; each extension registers the kinds it runs (see services/extension.ts).
  maintenance: z.object({ v: z.literal(1), kind: z.string().min(1).max(64) }),
} as const;

export type QueueName = keyof typeof payloads;
export type Payload<N extends QueueName> = z.infer<(typeof payloads)[N]>;
export const QUEUE_NAMES = Object.keys(payloads) as QueueName[];

// Exponential backoff; BullMQ adds jitter when `jitter` is set (0..1 of the delay).
const retrying = (attempts: number, delay: number): JobsOptions => ({
  attempts,
  backoff: { type: 'exponential', delay, jitter: 0.5 },
});

export const defaultJobOptions: Record<QueueName, JobsOptions> = {
  // Ingest jobs carry no message body (bodies live in the session inbox), but completed ones are
  // still removed at once; failed ones stay as the dead-letter set (Bull Board, metrics, retry).
  ingest: { ...retrying(12, 250), removeOnComplete: true, removeOnFail: false },
  embed: { ...retrying(20, 1000), removeOnComplete: true, removeOnFail: { count: 1000 } },
  compact: { ...retrying(8, 500), removeOnComplete: true, removeOnFail: { count: 1000 } },
  summary: {
    ...retrying(3, 2000),
    removeOnComplete: { age: 3600, count: 1000 },
    removeOnFail: { count: 1000 },
  },
  maintenance: { ...retrying(3, 1000), removeOnComplete: true, removeOnFail: { count: 100 } },
};

export type QueueRegistry = { [N in QueueName]: Queue<Payload<N>> } & { close(): Promise<void> };

/**
 * Runs the maintenance task `kind` every `everyMs` (a BullMQ job scheduler named after it; an
 * idempotent upsert, re-asserted by the workers in case Redis came back empty).
 */
export async function scheduleMaintenance(
  queues: Pick<QueueRegistry, 'maintenance'>,
  kind: string,
  everyMs: number,
): Promise<void> {
  // BullMQ sets a scheduler's next run by the clock of the process that runs or adds it, and an
  // upsert keeps a next run already set: one worker whose clock was an hour ahead put every
  // maintenance task of the fleet an hour away (no ingest sweep, no temp reaper), and it stayed
  // so after that worker was stopped or its clock corrected. A next run further than one interval
  // and a minute away is re-created from this process's time; the workers re-assert every minute.
  const existing = await queues.maintenance.getJobScheduler(kind);
  if (existing?.next !== undefined && existing.next > Date.now() + everyMs + FUTURE_SLACK_MS) {
    await queues.maintenance.removeJobScheduler(kind);
  }
  await queues.maintenance.upsertJobScheduler(kind, { every: everyMs }, { name: kind, data: { v: 1, kind } });
}
const FUTURE_SLACK_MS = 60_000;

/**
 * Asks for a run of the maintenance task `kind` now, beside its schedule: at most one waits, and
 * one asked for while another runs follows it (BullMQ deduplication with `keepLastIfActive`), so
 * a burst of deletes makes one or two passes, and the last of them sees every delete.
 */
export async function requestMaintenance(
  queues: Pick<QueueRegistry, 'maintenance'>,
  kind: string,
): Promise<void> {
  await queues.maintenance.add(
    REQUESTED,
    { v: 1, kind },
    { deduplication: { id: `requested-${kind}`, keepLastIfActive: true } },
  );
}
/** The name of a maintenance job asked for by requestMaintenance (scheduled ones bear their kind). */
export const REQUESTED = 'requested';

/**
 * Each queue is constructed at its first use: a BullMQ `Queue` writes its `<prefix>:<queue>:meta`
 * hash as soon as the connection is ready, and a process refused at start (another MNEMOS_PREFIX,
 * services/redis-namespace.ts) left those keys under the prefix it was refused for, as if a second
 * deployment used it. Nothing touches a queue before the start-up checks have passed.
 */
export function makeQueues(
  connection: ConnectionOptions,
  prefix: string,
  logger?: { warn(obj: object, msg: string): void },
): QueueRegistry {
  const made = new Map<QueueName, Queue>();
  let closed = false;
  const queue = (name: QueueName): Queue => {
    let q = made.get(name);
    if (q) return q;
    q = new Queue(name, { connection, prefix, defaultJobOptions: defaultJobOptions[name] });
    // One per reconnect attempt of the shared connection, whose own errors makeRedis logs: one
    // line per queue per 5 s, with the count left out.
    const warnError = throttledWarn(logger, 'queue error');
    q.on('error', (err: Error) => warnError({ queue: name, err: { message: err.message } }));
    // One first used after close() is a closed queue, as it would have been had it been made
    // earlier (closing at once also skips its meta write).
    if (closed) void q.close().catch(() => undefined);
    made.set(name, q);
    return q;
  };
  const registry = {
    async close() {
      closed = true;
      await Promise.allSettled([...made.values()].map((q) => q.close()));
    },
  };
  for (const name of QUEUE_NAMES)
    Object.defineProperty(registry, name, { enumerable: true, get: () => queue(name) });
  return registry as QueueRegistry;
}

/**
 * Parses a job payload as untrusted input (a deploy may meet jobs queued by an older version).
 * One that does not fit (a job added by hand, through Bull Board or by another build) is a
 * permanent fault: it fails at once (SPEC §6), into the failed set, rather than coming back for
 * every attempt. The reason names the fields, never their values.
 */
export function parsePayload<N extends QueueName>(name: N, data: unknown): Payload<N> {
  const r = payloads[name].safeParse(data);
  if (r.success) return r.data as Payload<N>;
  const fields = [...new Set(r.error.issues.map((i) => i.path.join('.') || '(payload)'))].slice(0, 8);
  throw new UnrecoverableError(`malformed ${name} job payload (${fields.join(', ')}): not retried`);
}
