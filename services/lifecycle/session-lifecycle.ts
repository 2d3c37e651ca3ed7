import { withTransaction } from '../../db/pool.js';
import type { Queryable } from '../../db/pool.js';
import {
  clearSummaryFailures,
  deleteSessionMessages,
  deleteSessionSummary,
  deleteSessionSummaryLease,
  deleteSessionVectorRows,
  detachSessionUsage,
  hasWrittenSummary,
  markSessionCleared,
  recordRedisCaughtUp,
  sessionsBehindInRedis,
} from '../../db/queries/lifecycle.js';
import { lockSession } from '../../db/queries/sessions.js';
import type { SessionRow } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import type { Extension } from '../extension.js';
import { AppError, asDependencyError } from '../errors.js';
import { inboxKeys, topHandedOut } from '../messages/inbox.js';
import { clearToGeneration, deadLetterKey } from './lifecycle-redis.js';
import { FINISHED_STATES, PENDING_STATES, removeQueuedJobs, sessionJobs } from './queued-jobs.js';
import { enqueueFlush } from '../fair-priority.js';

/**
 * Reset and delete (SPEC §4, invariant 9). One Postgres transaction holds the session row lock
 * (the lock every ingest drain takes), bumps `generation` and removes the rows; after the commit
 * the session's Redis state moves to the new generation. A drain racing this either committed
 * before (its rows are deleted here) or runs after (its entries carry the old generation and are
 * dropped), so nothing of the old generation can come back. Every later step is idempotent and
 * repeated by the reconciler if the process dies in between.
 */

export type LifecycleDeps = Pick<CoreDeps, 'db' | 'redis' | 'config' | 'queues' | 'logger'> &
  Partial<Pick<CoreDeps, 'metrics'>>;
/** The process's extensions, read when needed (their purge hooks). */
export type ExtensionList = () => readonly Extension[];

export type ClearMode = { kind: 'reset'; keepSummary: boolean } | { kind: 'delete' };

export interface ClearOptions {
  /** Re-checked under the row lock; false = leave the session alone (the reaper's idle test). */
  guard?: (row: SessionRow, tx: Queryable) => Promise<boolean>;
  /** Upper bound of queued jobs scanned per queue state (0 = skip; they are harmless anyway). */
  jobScan?: number;
}

export type ClearOutcome =
  | { kind: 'done'; generation: number; summaryKept: boolean; messagesRemoved: number }
  | { kind: 'not_found' }
  | { kind: 'skipped' };

export const DEFAULT_JOB_SCAN = 500;

export async function clearSession(
  deps: LifecycleDeps,
  extensions: ExtensionList,
  tenantId: string,
  sessionId: string,
  mode: ClearMode,
  opts: ClearOptions = {},
): Promise<ClearOutcome> {
  const dropSummary = mode.kind === 'delete' || !mode.keepSummary;
  const r = await withTransaction(deps.db, async (tx) => {
    const row = await lockSession(tx, tenantId, sessionId);
    if (!row) return { kind: 'not_found' as const };
    // A tombstone is gone for the client: its Redis step is only re-run below (a retried DELETE
    // finishes what a failed one left), as the delete's, whatever was asked: run as a reset's by a
    // reset sent to a half-deleted session, it dropped the `deleted` mark, and the next post did
    // not revive the session (404, unlisted, until archived). Unless messages posted since wait in
    // its inbox: they would bring it back, so it is cleared like a live session.
    if (
      row.deleted &&
      (await deps.redis.llen(inboxKeys(deps.config.prefix, tenantId, sessionId).inbox)) === 0
    ) {
      return {
        kind: 'tombstone' as const,
        generation: row.generation,
        clearedThroughSeq: Number(row.cleared_through_seq),
        deleted: true,
      };
    }
    if (opts.guard && !(await opts.guard(row, tx))) return { kind: 'skipped' as const };
    const generation = row.generation + 1;
    // Everything handed out until now is the cleared history; later accepts survive the clear.
    const clearedThroughSeq = Math.max(
      Number(row.next_seq) - 1,
      await topHandedOut(deps.redis, inboxKeys(deps.config.prefix, tenantId, sessionId)),
    );
    const messagesRemoved = await deleteSessionMessages(tx, tenantId, sessionId);
    await deleteSessionVectorRows(tx, tenantId, sessionId);
    if (dropSummary) await deleteSessionSummary(tx, tenantId, sessionId);
    else await clearSummaryFailures(tx, tenantId, sessionId);
    if (mode.kind === 'delete') {
      await deleteSessionSummaryLease(tx, tenantId, sessionId);
      await detachSessionUsage(tx, tenantId, sessionId);
    }
    const summaryKept = !dropSummary && (await hasWrittenSummary(tx, tenantId, sessionId));
    await markSessionCleared(tx, {
      tenantId,
      sessionId,
      generation,
      deleted: mode.kind === 'delete',
      clearedThroughSeq,
    });
    return {
      kind: 'done' as const,
      generation,
      summaryKept,
      messagesRemoved,
      clearedThroughSeq,
      deleted: mode.kind === 'delete',
    };
  });
  if (r.kind === 'not_found' || r.kind === 'skipped') return r;

  const scan = opts.jobScan ?? (mode.kind === 'delete' ? DEFAULT_JOB_SCAN : 0);
  const warn = (err: unknown) =>
    deps.logger.warn(
      { err: { message: (err as Error).message } },
      'could not remove queued jobs of a deleted session',
    );
  const match = sessionJobs(tenantId, sessionId);
  // The deleted session's queued jobs go before the Redis step, not after: that step asks for a
  // flush of what was accepted after the cut (kept), and removed afterwards, with the flush job
  // of such a message still queued behind a busy worker, they left it in the inbox until the
  // ingest sweeper came round (every 30 s). Jobs carry no generation: a post between the commit
  // and this scan (which moved the Redis state itself) loses its flush job here too, and the
  // Redis step, then a no-op, still asks for a flush of what waits in the inbox.
  if (scan > 0) await removeQueuedJobs(deps.redis, deps.queues, match, scan, PENDING_STATES).catch(warn);
  const finish = async () => {
    await syncRedisGeneration(deps, tenantId, sessionId, r.generation, r.clearedThroughSeq, r.deleted);
    if (mode.kind === 'delete' || dropSummary || r.kind === 'tombstone') {
      await purgeSessionEverywhere(deps, extensions, tenantId, sessionId);
    }
  };
  try {
    await finish();
  } catch (err) {
    // The clear committed: the session is reset or deleted whatever happens next. A 503 here
    // (Redis stalled past its command timeout) said it was not, and a retried reset wiped what
    // was accepted in between. Until the Redis step runs, the drain drops the cleared history
    // (cleared_through_seq) and an accept moves the Redis state on first (STALE); the step itself
    // is retried here, and by the reconciler if this process dies.
    const e = asDependencyError(err);
    if (!(e instanceof AppError && e.status === 503)) throw err;
    deps.logger.warn(
      { tenantId, sessionId, err: { message: (err as Error).message } },
      'reset/delete committed, its Redis step did not finish: retrying it in the background',
    );
    finishLater(deps, finish);
  }
  if (scan > 0) {
    // Jobs that ran (ids only, never run again for the old generation) go behind the answer: up
    // to `scan` per state of each queue, read whole then, they made a delete take seconds (p50
    // 2.9 s under a tester's load, with the summary queue's hour of completed jobs).
    void removeQueuedJobs(deps.redis, deps.queues, match, scan, FINISHED_STATES).catch(warn);
  }
  if (r.kind === 'tombstone') return { kind: 'not_found' };
  return {
    kind: 'done',
    generation: r.generation,
    summaryKept: r.summaryKept,
    messagesRemoved: r.messagesRemoved,
  };
}

/** Pauses between the background retries of a committed clear's Redis step (then the reconciler's). */
const FINISH_RETRY_MS = [1000, 2000, 5000, 10_000, 20_000, 30_000];

/** Retries `finish` (repeatable) behind the answer; the timers never hold the process open. */
function finishLater(deps: Pick<LifecycleDeps, 'logger'>, finish: () => Promise<void>, attempt = 0): void {
  const pause = FINISH_RETRY_MS[attempt];
  if (pause === undefined) {
    deps.logger.warn("a reset/delete's Redis step still fails: left to the reconciler");
    return;
  }
  setTimeout(() => {
    finish().catch(() => finishLater(deps, finish, attempt + 1));
  }, pause).unref();
}

/**
 * Moves the session's Redis state to `generation` (compare-and-set: repeatable), keeps the seq
 * numbers it had handed out from ever being reused, and records that Redis caught up. Messages
 * waiting in the inbox afterwards are flushed, also when the state was there already.
 */
export async function syncRedisGeneration(
  deps: Pick<LifecycleDeps, 'db' | 'redis' | 'config' | 'queues' | 'metrics'>,
  tenantId: string,
  sessionId: string,
  generation: number,
  clearedThroughSeq: number,
  deleted: boolean,
): Promise<boolean> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  const dead = deadLetterKey(deps.config.prefix, tenantId, sessionId);
  const c = await clearToGeneration(deps.redis, keys, dead, generation, clearedThroughSeq, deleted);
  // Accepted, never archived, now never will be: counted as the drain counts the stale entries it drops.
  if (c.removed > 0) deps.metrics?.messagesDropped.inc(c.removed);
  // Not messages: dead letters, removed as the session's other dead letters are.
  if (c.unreadable > 0) deps.metrics?.ingestDeadLetter.inc(c.unreadable);
  // next_seq already moved past the cleared history in the reset/delete transaction.
  await recordRedisCaughtUp(deps.db, { tenantId, sessionId, generation, nextSeq: null });
  if (c.left > 0) {
    // Messages accepted after the clear wait in the inbox: flush them now (the sweeper would too).
    await enqueueFlush(deps, tenantId, sessionId);
  }
  return c.cleared;
}

/** Every module's per-session state (caches, indexes): after delete, or when the summary went. */
export async function purgeSessionEverywhere(
  deps: Pick<LifecycleDeps, 'logger'>,
  extensions: ExtensionList,
  tenantId: string,
  sessionId: string,
): Promise<void> {
  const failures: string[] = [];
  const errors: unknown[] = [];
  for (const e of extensions()) {
    if (!e.purgeSession) continue;
    try {
      await e.purgeSession(tenantId, sessionId);
    } catch (err) {
      failures.push(e.name);
      errors.push(err);
      deps.logger.warn({ module: e.name, err: { message: (err as Error).message } }, 'purgeSession failed');
    }
  }
  if (failures.length > 0) throw purgeFailure(`purge failed in: ${failures.join(', ')}`, errors);
}

/**
 * The error of a purge that some modules could not finish: a dependency being down (Redis,
 * Postgres) is a 503 with `retry-after`, which the caller retries (purges are repeatable); anything
 * else is a server fault.
 */
export function purgeFailure(message: string, errors: unknown[]): Error {
  const down = errors.map(asDependencyError).find((e) => e instanceof AppError && e.status === 503);
  return down instanceof AppError ? down : new Error(message);
}

/**
 * Finishes resets and deletes whose Redis step did not happen (crash, Redis outage): without this
 * the session's new messages would be stamped with the old generation and dropped.
 */
export async function reconcileGenerations(
  deps: LifecycleDeps,
  extensions: ExtensionList,
  limit = 500,
): Promise<{ reconciled: number }> {
  let reconciled = 0;
  for (const s of await sessionsBehindInRedis(deps.db, limit)) {
    try {
      // Only when this run did the clear: otherwise the session may already hold new data.
      const cleared = await syncRedisGeneration(
        deps,
        s.tenant_id,
        s.id,
        s.generation,
        Number(s.cleared_through_seq),
        s.deleted,
      );
      if (cleared) {
        await purgeSessionEverywhere(deps, extensions, s.tenant_id, s.id);
      }
      reconciled++;
    } catch (err) {
      deps.logger.warn(
        { err: { message: (err as Error).message } },
        'could not reconcile a session generation',
      );
    }
  }
  return { reconciled };
}
