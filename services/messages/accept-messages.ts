import { withTransaction } from '../../db/pool.js';
import { findByClientIds } from '../../db/queries/messages.js';
import { lockOrCreateSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { AppError, asDependencyError, unavailable } from '../errors.js';
import { acceptIntoInbox, archivedMark, defineInboxScripts, inboxKeys, seedInbox } from './inbox.js';
import type { AcceptedMessage } from './message-input.js';

export interface AcceptOutcome {
  session_id: string;
  accepted: number;
  messages: Array<{ id: string; seq: number }>;
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
): Promise<AcceptOutcome> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  defineInboxScripts(deps.redis);
  const results: Array<{ id: string; seq: number } | null> = messages.map(() => null);
  try {
    // Ids already archived (their Redis idempotency entry may have expired or been lost).
    const clientIds = messages.filter((m) => m.cid).map((m) => m.id);
    const archived = new Map(
      (await findByClientIds(deps.db, tenantId, sessionId, clientIds)).map((r) => [r.id, r] as const),
    );
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
      let outcome = await acceptIntoInbox(deps.redis, keys, batch, given);
      for (let attempt = 0; outcome.kind === 'seed' && attempt < 3; attempt++) {
        await seedSession(deps, tenantId, sessionId);
        outcome = await acceptIntoInbox(deps.redis, keys, batch, given);
      }
      if (outcome.kind === 'seed') throw unavailable('redis');
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
      if (outcome.wake) {
        try {
          await deps.queues.ingest.add('flush', { v: 1, tenantId, sessionId });
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
    return { session_id: sessionId, accepted: newCount, messages: results.map((r) => r!) };
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
    await seedInbox(deps.redis, keys, Number(row.next_seq) - 1, row.generation);
  });
}

/**
 * Whether these messages are in the archive at these seqs. The archived mark in Redis says a
 * seq was reached, not by which message: after Redis comes back empty, a seq handed out for a
 * message that was lost with it is handed out again, and the mark reaches it with another
 * message (see README "Durability semantics"). A 201 is only given after this check.
 */
export async function archivedAsAcknowledged(
  deps: Pick<CoreDeps, 'db'>,
  tenantId: string,
  sessionId: string,
  messages: Array<{ id: string; seq: number }>,
): Promise<boolean> {
  if (messages.length === 0) return true;
  const r = await deps.db.query<{ n: number }>(
    `SELECT count(*)::int AS n
       FROM messages m
       JOIN unnest($3::bigint[], $4::text[]) AS x(seq, id) ON m.seq = x.seq AND m.id = x.id
      WHERE m.tenant_id = $1 AND m.session_id = $2`,
    [tenantId, sessionId, messages.map((m) => m.seq), messages.map((m) => m.id)],
  );
  return r.rows[0]!.n === new Set(messages.map((m) => m.seq)).size;
}

/** A `?wait=true` whose messages were lost with Redis's data: post them again. */
export const lostWithRedis = () =>
  new AppError(
    503,
    'unavailable',
    'the messages were lost before they were archived (Redis lost its data): post them again',
    { dependency: 'redis', lost: true },
    { 'retry-after': '1' },
  );

/** Polls the archived mark until `seq` is durable in Postgres or the deadline passes. */
export async function waitArchived(
  deps: CoreDeps,
  tenantId: string,
  sessionId: string,
  seq: number,
  timeoutMs: number,
): Promise<boolean> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  const deadline = Date.now() + timeoutMs;
  let delay = 2;
  for (;;) {
    const mark = await archivedMark(deps.redis, keys).catch(() => null);
    if (mark !== null && mark >= seq) return true;
    if (Date.now() >= deadline) return false;
    await new Promise((r) => setTimeout(r, Math.min(delay, Math.max(1, deadline - Date.now()))));
    delay = Math.min(delay * 2, 50);
  }
}
