import { withTransaction } from '../../db/pool.js';
import { NO_SESSION_STATE, acceptLookup } from '../../db/queries/messages.js';
import { reviveSession } from '../../db/queries/lifecycle.js';
import { getSession, lockOrCreateSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { AppError, asDependencyError, unavailable } from '../errors.js';
import { syncRedisGeneration } from '../lifecycle/session-lifecycle.js';
import { settleImport } from '../lifecycle/lifecycle-redis.js';
import { enqueueFlush } from '../fair-priority.js';
import { throttledWarn } from '../logger.js';
import { acceptIntoInbox, defineInboxScripts, inboxKeys, seedInbox } from './inbox.js';
import type { AcceptedMessage } from './message-input.js';

export interface AcceptOutcome {
  session_id: string;
  accepted: number;
  messages: Array<{ id: string; seq: number }>;
}

export interface Accepted {
  /** The response body. */
  outcome: AcceptOutcome;
  /** Every message was found in the archive already (a re-post of archived ids): durable now. */
  archived: boolean;
}

const behindLogs = new WeakMap<CoreDeps['logger'], (fields: object) => void>();

/**
 * A session whose Redis counter was behind its archive: Redis lost writes it had acknowledged
 * (restored from a snapshot, a lagging replica promoted, an AOF's last second). The accept is safe
 * (seqs start after the archive's highest); the operator should know what else went back with it
 * (README "Durability semantics").
 */
function redisBehind(deps: CoreDeps, tenantId: string, sessionId: string): void {
  deps.metrics.redisBehind.inc();
  let warn = behindLogs.get(deps.logger);
  if (!warn) {
    warn = throttledWarn(
      deps.logger,
      "redis state is behind the archive (restored or failed over?): seqs continue after the archive's highest",
    );
    behindLogs.set(deps.logger, warn);
  }
  warn({ tenantId, sessionId });
}

/**
 * The accept was sent and no answer came: Redis may run it still (it was stalled, and runs what it
 * had queued when it resumes) or have run it already (the answer lay unread in a process that was
 * paused past the 5 s command timeout, or the connection broke on its way back). A tester saw 47
 * such 503s, all of whose messages were stored: a client that posts without ids and retries, as a
 * 503 invites, stores them twice. The answer says so; with ids the retry finds their seqs.
 */
function maybeStored(err: unknown): unknown {
  const msg = err instanceof Error ? err.message : '';
  if (!/Command timed out|Connection is closed/.test(msg)) return err;
  return Object.assign(
    new AppError(
      503,
      'unavailable',
      'redis did not answer the accept: the messages may be stored. Post them again with the same ids to find out (a re-post without ids may store them twice)',
      { dependency: 'redis', maybe_stored: true },
      { 'retry-after': '2' },
    ),
    { cause: err },
  );
}

function conflict(indexes: number[], messages: AcceptedMessage[]): AppError {
  return new AppError(
    409,
    'id_conflict',
    `messages[${indexes[0]}].id was already accepted in this session with different content`,
    { problems: indexes.map((i) => ({ path: `messages[${i}].id`, id: messages[i]?.id })) },
  );
}

/**
 * Accepts a validated batch: idempotency against the archive, then one atomic Lua step that takes
 * seq numbers and appends to the session inbox, then a flush request. All or nothing: a conflict
 * or a fault stores none of the batch.
 */
export async function acceptMessages(
  deps: CoreDeps,
  tenantId: string,
  sessionId: string,
  messages: AcceptedMessage[],
): Promise<Accepted> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  defineInboxScripts(deps.redis);
  const results: Array<{ id: string; seq: number } | null> = messages.map(() => null);
  try {
    // Ids already archived (their Redis idempotency entry may have expired or been lost), and
    // the archive's highest seq: the accept never hands out a seq at or below it, also when Redis
    // came back behind Postgres (an AOF that lost its last second, a failover to a lagging
    // replica), where its counter would hand out archived seqs again and the drain would skip
    // those messages as replays. A request without ids is accepted without that guard while
    // Postgres is down, as before the guard (its Redis state is then most likely current).
    const clientIds = messages.filter((m) => m.cid).map((m) => m.id);
    const lookup = await acceptLookup(deps.db, tenantId, sessionId, clientIds).catch((err: unknown) => {
      if (clientIds.length > 0) throw err;
      return { rows: [], session: NO_SESSION_STATE };
    });
    const state = lookup.session;
    const archived = new Map(lookup.rows.map((r) => [r.id, r] as const));
    const conflicts: number[] = [];
    const pending: number[] = [];
    messages.forEach((m, i) => {
      const row = m.cid ? archived.get(m.id) : undefined;
      if (!row) return void pending.push(i);
      if (row.fingerprint !== m.fp || (m.sent_at_given && row.sent_at_ns !== m.sent_at_ns)) conflicts.push(i);
      else results[i] = { id: m.id, seq: Number(row.seq) };
    });
    if (conflicts.length > 0) throw conflict(conflicts, messages);

    let newCount = 0;
    if (pending.length > 0) {
      const batch = pending.map((i) => messages[i]!);
      const given = batch.map((m) => (m.sent_at_given ? m.sent_at_ns : null));
      const accept = () =>
        acceptIntoInbox(deps.redis, keys, batch, given, state.archivedTop, state.generation).catch(
          (err: unknown) => {
            throw maybeStored(err);
          },
        );
      let outcome = await accept();
      const retry = (o: typeof outcome) => o.kind === 'seed' || o.kind === 'stale' || o.kind === 'importing';
      for (let attempt = 0; retry(outcome) && attempt < 3; attempt++) {
        if (outcome.kind === 'seed') await seedSession(deps, tenantId, sessionId);
        // Answered as a duplicate of an import that then proves aborted, the message was lost:
        // the import is settled first (its messages removed if it never committed).
        else if (outcome.kind === 'importing')
          await settleImport(deps.db, deps.redis, keys).catch((err: unknown) => {
            throw asDependencyError(err);
          });
        // A reset or delete whose Redis step has not run (Redis stalled past its timeout after
        // the commit, the process died) or that Redis lost (an AOF that lost its last second):
        // the cleared history's ids would take re-posts for duplicates of messages that are gone,
        // and the first message after a delete would not revive the session.
        else
          await syncRedisGeneration(
            deps,
            tenantId,
            sessionId,
            state.generation,
            state.clearedThrough,
            state.deleted,
          );
        outcome = await accept();
      }
      if (outcome.kind === 'importing') {
        const e = unavailable('postgres');
        e.message = 'an import into this session is still committing: retry in a moment';
        throw e;
      }
      if (outcome.kind === 'seed' || outcome.kind === 'stale') throw unavailable('redis');
      if (outcome.kind === 'conflict')
        throw conflict(
          outcome.indexes.map((j) => pending[j]!),
          messages,
        );
      outcome.results.forEach((r, j) => {
        const i = pending[j]!;
        results[i] = { id: messages[i]!.id, seq: r.seq };
        if (!r.duplicate) newCount++;
      });
      if (outcome.revive) {
        // The messages are accepted either way; if this fails, their drain revives the row.
        await reviveSession(deps.db, tenantId, sessionId, outcome.generation).catch((err: unknown) =>
          deps.logger.warn(
            { err: { message: (err as Error).message } },
            'could not revive a deleted session',
          ),
        );
      }
      // A retry some of whose messages wait in the inbox already: the request it retries may have
      // run but lost its answer (and with it the flush it would have asked for: the session is
      // armed, so this accept asks for none). One flush per session at a time for such retries,
      // so that a retry storm does not queue one per retry.
      // A Redis state behind the archive (restored from a snapshot, a lagging replica promoted)
      // can hold the session armed for a flush job that no worker runs any more: one flush per
      // session at a time for it too, as for retries.
      const retried =
        outcome.wake === null && (outcome.behind !== 'no' || outcome.results.some((r) => r.duplicate));
      if (outcome.behind === 'counter') redisBehind(deps, tenantId, sessionId);
      if (outcome.wake !== null || retried) {
        try {
          await enqueueFlush(
            deps,
            tenantId,
            sessionId,
            outcome.wake !== null ? { priority: outcome.wake } : { dedupe: 'retry' },
          );
        } catch (err) {
          // The messages are in the inbox and the session is armed: the ingest sweeper flushes it.
          deps.metrics.enqueueFailures.inc();
          deps.logger.warn(
            { err: { message: (err as Error).message } },
            'could not enqueue flush; sweeper will',
          );
        }
      }
    }
    deps.metrics.messagesAccepted.inc(newCount);
    deps.metrics.messagesDuplicate.inc(messages.length - newCount);
    return {
      outcome: { session_id: sessionId, accepted: newCount, messages: results.map((r) => r!) },
      archived: pending.length === 0,
    };
  } catch (err) {
    throw asDependencyError(err);
  }
}

/**
 * Creates the session row if needed and seeds its Redis state from Postgres while holding the
 * row lock, so no drain can commit in between: the counter starts after everything archived
 * (invariant 3, also when Redis came back empty).
 */
export async function seedSession(deps: CoreDeps, tenantId: string, sessionId: string): Promise<void> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  await withTransaction(deps.db, async (tx) => {
    const row = await lockOrCreateSession(tx, tenantId, sessionId);
    await seedInbox(deps.redis, keys, Number(row.next_seq) - 1, row.generation, row.deleted);
  });
}

/**
 * Throws unless these messages are in the archive at these seqs; called before a `?wait=true`
 * answers 201. The archived mark in Redis says a seq was reached, not by which message, and two
 * things can reach it without them:
 * - a reset or delete that cleared them before their drain (their seqs are at or below the
 *   session's `cleared_through_seq`): 409 `session_cleared`, and posting them again would put
 *   them into the session after the reset, so the client must decide;
 * - Redis losing its data: a seq handed out for a message lost with it is handed out again, and
 *   the mark reaches it with another message (README "Durability semantics"): 503 with
 *   `details.lost`, post them again.
 */
export async function confirmArchived(
  deps: Pick<CoreDeps, 'db'>,
  tenantId: string,
  sessionId: string,
  messages: Array<{ id: string; seq: number }>,
): Promise<boolean> {
  if (messages.length === 0) return true;
  // Postgres gone right after the drain committed: the messages may well be stored, so this is
  // no 503 (which says nothing was, and brings a re-post without ids twice); false = the 202 of
  // a wait that could not confirm.
  const r = await deps.db
    .query<{ n: number; cleared: string | null }>(
      `SELECT (SELECT count(*)::int
                 FROM messages m
                 JOIN unnest($3::bigint[], $4::text[]) AS x(seq, id) ON m.seq = x.seq AND m.id = x.id
                WHERE m.tenant_id = $1 AND m.session_id = $2) AS n,
              (SELECT cleared_through_seq FROM sessions WHERE tenant_id = $1 AND id = $2) AS cleared`,
      [tenantId, sessionId, messages.map((m) => m.seq), messages.map((m) => m.id)],
    )
    .catch(() => null);
  if (!r) return false;
  const { n, cleared } = r.rows[0]!;
  if (n === new Set(messages.map((m) => m.seq)).size) return true;
  const through = Number(cleared ?? 0);
  // One request's seqs are handed out in one atomic step, so a reset clears all of them or none.
  if (messages.every((m) => m.seq <= through)) throw sessionCleared(through);
  throw new AppError(
    503,
    'unavailable',
    'the messages were lost before they were archived (Redis lost its data): post them again',
    { dependency: 'redis', lost: true },
    { 'retry-after': '1' },
  );
}

const sessionCleared = (through: number) =>
  new AppError(
    409,
    'session_cleared',
    'the session was reset or deleted after these messages were accepted and before they were ' +
      'archived: they were cleared with it and are not stored',
    { cleared_through_seq: through },
  );

/** Throws `session_cleared` when a reset or delete cleared the session through `seq`. */
async function assertNotCleared(
  deps: Pick<CoreDeps, 'db'>,
  tenantId: string,
  sessionId: string,
  seq: number,
) {
  // The messages are accepted: if Postgres cannot say, the answer stays what it would have been
  // (a 503 would claim that nothing was stored).
  const r = await deps.db
    .query<{ cleared: string }>(
      'SELECT cleared_through_seq AS cleared FROM sessions WHERE tenant_id = $1 AND id = $2',
      [tenantId, sessionId],
    )
    .catch(() => null);
  const through = Number(r?.rows[0]?.cleared ?? 0);
  if (seq <= through) throw sessionCleared(through);
}

const waits = new WeakMap<object, AbortController>();

/**
 * A signal for the wait of the request answered by `res`, fired by `endWaits` when the process
 * shuts down: the wait then answers its 202 before the shutdown deadline cuts the connection (a
 * drain held up by a lock, with SHUTDOWN_TIMEOUT_MS under the 10 s wait, left the client with a
 * cut connection for messages that were accepted).
 */
export function waitSignal(res: object): AbortSignal {
  let c = waits.get(res);
  if (!c) waits.set(res, (c = new AbortController()));
  return c.signal;
}

export function endWaits(responses: Iterable<object>): void {
  for (const res of responses) waits.get(res)?.abort();
}

/**
 * Polls the archived mark until `seq` is durable in Postgres or the deadline passes. A reset or
 * delete that clears the messages meanwhile moves the session's generation on: then, and once
 * more at the deadline (for one that came before the first poll), the archive's clear mark is
 * checked, and messages it cleared are a 409 `session_cleared` at once, not a 202 after the wait
 * for an archive they will never reach.
 */
export async function waitArchived(
  deps: CoreDeps,
  tenantId: string,
  sessionId: string,
  seq: number,
  timeoutMs: number,
  signal?: AbortSignal,
): Promise<boolean> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  // Monotonic: the wall clock stepping back an hour (NTP, a VM resumed) held a ?wait=true past 60 s.
  const deadline = performance.now() + timeoutMs;
  let delay = 2;
  let seenGen: string | null | undefined;
  let askedArchive = -Infinity;
  for (;;) {
    const polledAt = performance.now();
    const [mark, gen] = await deps.redis
      .hmget(keys.sess, 'archived', 'gen')
      .catch((): Array<string | null> => [null, null]);
    if (mark != null && Number(mark) >= seq) return true;
    const timedOut = performance.now() >= deadline;
    // The session's state is gone (expired or evicted; a drain does not make it again): its
    // archived mark will not move, so the archive itself is asked, at most every 250 ms.
    if (mark == null && gen == null && (timedOut || performance.now() - askedArchive >= 250)) {
      askedArchive = performance.now();
      const row = await getSession(deps.db, tenantId, sessionId).catch(() => null);
      if (row && Number(row.next_seq) > seq) return true;
    }
    if (timedOut || (seenGen !== undefined && gen !== seenGen)) {
      await assertNotCleared(deps, tenantId, sessionId, seq);
    }
    seenGen = gen ?? null;
    if (timedOut || signal?.aborted) return false;
    // The next poll starts `delay` after this one started: on a slow link its own round trip is
    // part of the pause, not added to it (at 25 ms each way a poll every 100 ms, not every 50).
    const now = performance.now();
    await new Promise((r) => setTimeout(r, Math.max(1, Math.min(delay - (now - polledAt), deadline - now))));
    delay = Math.min(delay * 2, 50);
  }
}
