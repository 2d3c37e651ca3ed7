import { createHash } from 'node:crypto';
import type { Job, JobsOptions } from 'bullmq';
import type { QueueRegistry } from '../../workers/queues.js';
import { MAX_FAIR_PRIORITY, nextFairPriority } from '../fair-priority.js';
import type { Redis } from '../redis.js';

/**
 * One summarize job per session at a time, for the sweep and the API alike: BullMQ's
 * deduplication keeps a single waiting/active job per session (adding another returns the
 * existing job's id) and releases the key when that job completes or fails, so a failed job
 * never blocks later ones. Session ids may contain ':' (not allowed in BullMQ ids), hence a hash.
 * The Postgres lease in the job (summary_leases) is the guarantee; this keeps the queue small.
 */
export function summaryDedupId(tenantId: string, sessionId: string): string {
  const h = createHash('sha256').update(`${tenantId}\u0000${sessionId}`).digest('hex');
  return `summarize-${h.slice(0, 40)}`;
}

export type SummarizeReason = 'sweep' | 'api';

/**
 * The sweep's jobs wait behind those an API request asked for (BullMQ takes the lowest number
 * first): in one first-come queue, a tenant's backlog (an import, thousands of new sessions) held
 * every other tenant's `summarize?wait=true` for minutes. Requests get their tenant's fair
 * priority (services/fair-priority.ts), 1 to MAX_FAIR_PRIORITY: a tenant that asked for
 * thousands of summaries held every other tenant's request behind them the same way.
 */
const SWEEP_PRIORITY = MAX_FAIR_PRIORITY + 1;
/** BullMQ's lowest priority (its highest number). */
const LAST_PRIORITY = 2_097_152;

function job(
  tenantId: string,
  sessionId: string,
  reason: SummarizeReason,
  priority: number,
  requestId?: string,
) {
  const data = {
    v: 1 as const,
    kind: 'summarize' as const,
    tenantId,
    sessionId,
    reason,
    ...(requestId ? { requestId } : {}),
  };
  const opts: JobsOptions = {
    // A request that finds the session's job running leaves one follow-up job (BullMQ keeps the
    // latest such add and queues it when the run ends): the run may have read the archive before
    // the request, and "summarize now" joined it and added nothing (its messages waited for the
    // next sweep). The sweep's adds need no follow-up: the next sweep looks again anyway.
    deduplication: {
      id: summaryDedupId(tenantId, sessionId),
      ...(reason === 'api' ? { keepLastIfActive: true } : {}),
    },
    priority,
    // A request's job is named by the request, not by BullMQ's counter: a Redis restored from a
    // snapshot (or a replica promoted behind its primary) counts from an older value and handed
    // out ids clients already held, so polling `GET /v1/jobs/summary.<id>` showed another
    // session's run. The sweep's jobs are never shown to a client.
    ...(requestId ? { jobId: requestId } : {}),
  };
  return { name: 'summarize', data, opts };
}

/**
 * Enqueues the session's summarize job, or joins the one already waiting or running (a request
 * joining a running one also leaves a follow-up that runs when it ends, see `job`); returns the
 * BullMQ job id, and for an API request the job as it found it (undefined when it is gone
 * already). `requestId`, stored in the payload, tells the caller which of the two happened. A
 * request that joins a job still waiting at a later priority (the sweep's, behind the backlog)
 * moves it up to the request's.
 */
export async function enqueueSummarize(
  deps: { queues: Pick<QueueRegistry, 'summary'>; redis: Redis; config: { prefix: string } },
  tenantId: string,
  sessionId: string,
  reason: SummarizeReason,
  requestId?: string,
): Promise<{ id: string; job?: Job | undefined }> {
  const { queues } = deps;
  const priority =
    reason === 'api'
      ? await nextFairPriority(deps.redis, deps.config.prefix, 'summarize', tenantId)
      : SWEEP_PRIORITY;
  const j = job(tenantId, sessionId, reason, priority, requestId);
  const added = await queues.summary.add(j.name, j.data, j.opts);
  const id = String(added.id);
  if (reason !== 'api') return { id };
  const existing = await queues.summary.getJob(id);
  if (existing && existing.priority > priority && (await existing.getState()) === 'prioritized') {
    // Taken by a worker meanwhile: it runs now anyway.
    await existing.changePriority({ priority }).catch(() => undefined);
  }
  return { id, job: existing };
}

/**
 * The sweep's jobs, behind every request's (SWEEP_PRIORITY), a session of `rank` (its place among
 * its tenant's sessions in this sweep, from 0) `rank` places further back: BullMQ takes every
 * tenant's first session, then every tenant's second, and so on, so a tenant with five changed
 * sessions is not behind another's 2,000 (with one priority for all, the sweep's tenant order
 * was the queue's: a tenant whose id sorted late waited behind every other tenant's backlog).
 */
export async function enqueueSummarizeMany(
  queues: Pick<QueueRegistry, 'summary'>,
  sessions: Array<{ tenantId: string; sessionId: string; rank?: number }>,
): Promise<void> {
  if (sessions.length === 0) return;
  await queues.summary.addBulk(
    sessions.map((s) =>
      job(s.tenantId, s.sessionId, 'sweep', Math.min(SWEEP_PRIORITY + (s.rank ?? 0), LAST_PRIORITY)),
    ),
  );
}
