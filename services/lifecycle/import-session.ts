import { randomBytes } from 'node:crypto';
import { withTransaction } from '../../db/pool.js';
import {
  recordRedisCaughtUp,
  reviveSession,
  sessionHasMessages,
  upsertImportedSummary,
} from '../../db/queries/lifecycle.js';
import { lockOrCreateSession } from '../../db/queries/sessions.js';
import type { CoreDeps } from '../deps.js';
import { AppError, asDependencyError, unavailable } from '../errors.js';
import { defineInboxScripts, inboxKeys, seedInbox } from '../messages/inbox.js';
import type { ImportCursor, ImportInput, ImportMessage } from './import-input.js';
import {
  clearToGeneration,
  deadLetterKey,
  importStatus,
  publishStagedImport,
  settleImport,
} from './lifecycle-redis.js';
import { enqueueFlush } from '../fair-priority.js';

/**
 * Import (SPEC §4 import, §5 `import jsonl|agenvoy`): past messages archived in timestamp order,
 * only into an empty session. The messages take the ordinary ingestion path: they are numbered
 * from the session's Redis counter and become its inbox, so the ingest worker archives them with
 * the same ordering, exactly-once and post-archive work (embedding, compaction) as posted ones.
 *
 * To keep a large import from blocking Redis in one call, the entries are first written to a
 * staging list (under the tenant's key namespace, with a TTL), then published by one Lua step that
 * renames the list into the inbox: only if the inbox is still empty, of the generation read, and
 * the counter has not moved. All of it happens under the session's Postgres row lock, which every
 * drain, reset and delete takes too, so "empty" cannot change underneath.
 *
 * "Empty" = no archived message and nothing waiting in the inbox: a session never written to, a
 * deleted one (its tombstone comes back to life) or a reset one (its kept summary is replaced only
 * if the import brings one).
 */

const IDS_TTL_SECONDS = 24 * 3600;
const STAGING_TTL_SECONDS = 3600;
const STAGE_CHUNK = 1000;

export interface ImportOutcome {
  session_id: string;
  imported: number;
  first_seq: number | null;
  last_seq: number | null;
  summary: { restored: true; version: number; cursor_seq: number | null } | null;
}

const notEmpty = (why: string) =>
  new AppError(409, 'session_not_empty', `import only goes into an empty session: ${why}`);

/** Stable sort by sent time (equal times keep their input order). */
export function sortForImport(messages: ImportMessage[]): ImportMessage[] {
  return messages
    .map((m, i) => ({ m, i, ns: BigInt(m.message.sent_at_ns) }))
    .sort((a, b) => (a.ns < b.ns ? -1 : a.ns > b.ns ? 1 : a.i - b.i))
    .map((x) => x.m);
}

/**
 * The cursor over the new numbering: the end of the longest prefix of the imported (time-ordered)
 * messages that the old cursor covers. Conservative when the old order differs: a message may be
 * summarised again, never skipped. `base` is the seq before the first imported message. A summary
 * without a cursor is taken to cover what was imported with it: the cursor is the newest imported
 * message (`base` when there is none), set here rather than by the next summary job, which would
 * set it to the newest message then and so skip whatever was posted since the import.
 */
export function mapCursor(cursor: ImportCursor, sorted: ImportMessage[], base: number): number {
  if (cursor.kind === 'none') return base + sorted.length;
  let covered = 0;
  for (const m of sorted) {
    let inside: boolean;
    if (cursor.kind === 'source_seq') {
      inside = m.sourceSeq !== null && m.sourceSeq <= cursor.seq;
    } else {
      const ns = BigInt(m.message.sent_at_ns);
      inside = cursor.wholeSeconds ? ns / 1_000_000_000n <= cursor.ns / 1_000_000_000n : ns <= cursor.ns;
    }
    if (!inside) break;
    covered++;
  }
  return base + covered;
}

export async function importSession(
  deps: Pick<CoreDeps, 'db' | 'redis' | 'config' | 'queues' | 'logger' | 'metrics'>,
  tenantId: string,
  sessionId: string,
  input: ImportInput,
): Promise<ImportOutcome> {
  if (input.messages.length === 0 && !input.summary) {
    throw new AppError(400, 'empty_import', 'nothing to import: give at least one message or a summary');
  }
  const sorted = sortForImport(input.messages);
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  const nonce = randomBytes(6).toString('hex');
  // Under the tenant's namespace (P:<kind>:<tenant>:<sid>:…): tenant erasure sweeps leftovers.
  const staged = {
    list: `${deps.config.prefix}:impstage:${tenantId}:${sessionId}:${nonce}`,
    ids: `${deps.config.prefix}:impids:${tenantId}:${sessionId}:${nonce}`,
  };
  defineInboxScripts(deps.redis);
  let wake = false;
  // Set once the messages are in the inbox: the transaction's id, and the answer it was to give.
  let published: { xid: string; outcome: ImportOutcome } | null = null;
  try {
    const outcome = await withTransaction(deps.db, async (tx) => {
      const row = await lockOrCreateSession(tx, tenantId, sessionId);
      // An earlier import whose transaction failed after publishing (its retry, most often).
      await settleImport(tx, deps.redis, keys);
      if (await sessionHasMessages(tx, tenantId, sessionId)) throw notEmpty('it already holds messages');
      await seedInbox(deps.redis, keys, Number(row.next_seq) - 1, row.generation, row.deleted);
      let [gen, seq] = await deps.redis.hmget(keys.sess, 'gen', 'seq');
      if (gen !== null && Number(gen) < row.generation) {
        // A reset/delete whose Redis step never ran: finish it (the lock makes this safe).
        const c = await clearToGeneration(
          deps.redis,
          keys,
          deadLetterKey(deps.config.prefix, tenantId, sessionId),
          row.generation,
          Number(row.cleared_through_seq),
          row.deleted,
        );
        await recordRedisCaughtUp(tx, {
          tenantId,
          sessionId,
          generation: row.generation,
          nextSeq: c.cleared && c.topSeq !== null ? Number(row.cleared_through_seq) + 1 : null,
        });
        [gen, seq] = await deps.redis.hmget(keys.sess, 'gen', 'seq');
      }
      if (gen == null || seq == null || Number(gen) !== row.generation) throw unavailable('redis');
      const counter = seq;
      if ((await deps.redis.llen(keys.inbox)) > 0) throw notEmpty('it has messages waiting to be archived');

      // Never at or below what the archive has numbered (cleared rows included: next_seq): a
      // Redis back behind Postgres (an AOF that lost its last second) would number the import with
      // seqs the drain skips as archived already.
      const base = Math.max(Number(counter), Number(row.next_seq) - 1);
      let summary: ImportOutcome['summary'] = null;
      if (input.summary) {
        const cursorSeq = mapCursor(input.summary.cursor, sorted, base);
        const version = await upsertImportedSummary(tx, {
          tenantId,
          sessionId,
          summary: input.summary.summary,
          cursorSeq,
        });
        summary = { restored: true, version, cursor_seq: cursorSeq };
      }
      await reviveSession(tx, tenantId, sessionId, row.generation);

      if (sorted.length > 0) {
        await deps.redis.del(staged.list, staged.ids);
        for (let i = 0; i < sorted.length; i += STAGE_CHUNK) {
          const chunk = sorted.slice(i, i + STAGE_CHUNK);
          const entries = chunk.map(
            (m, j) => `${base + i + j + 1} ${row.generation} ${JSON.stringify(m.message)}`,
          );
          const ids: string[] = [];
          chunk.forEach((m, j) => {
            if (m.message.cid)
              ids.push(m.message.id, `${base + i + j + 1} ${m.message.fp} ${m.message.sent_at_ns}`);
          });
          const p = deps.redis
            .multi()
            .rpush(staged.list, ...entries)
            .expire(staged.list, STAGING_TTL_SECONDS);
          if (ids.length > 0) p.hset(staged.ids, ...ids).expire(staged.ids, STAGING_TTL_SECONDS);
          await p.exec();
        }
      }
      const result: ImportOutcome = {
        session_id: sessionId,
        imported: sorted.length,
        first_seq: sorted.length > 0 ? base + 1 : null,
        last_seq: sorted.length > 0 ? base + sorted.length : null,
        summary,
      };
      if (sorted.length > 0) {
        const xid = (await tx.query<{ xid: string }>('SELECT txid_current()::text AS xid')).rows[0]!.xid;
        const publish = await publishStagedImport(deps.redis, keys, staged, {
          generation: row.generation,
          expectedSeq: counter,
          baseSeq: String(base),
          count: sorted.length,
          idsTtlSeconds: IDS_TTL_SECONDS,
          xid,
        });
        if (publish.kind === 'busy' || publish.kind === 'moved') {
          throw notEmpty('messages arrived while it was being imported');
        }
        if (publish.kind !== 'ok') throw unavailable('redis');
        wake = publish.wake;
        published = { xid, outcome: result };
      }
      return result;
    });
    if (wake) {
      await enqueueFlush(deps, tenantId, sessionId).catch((err: unknown) => {
        // The session is armed: the ingest sweeper requests the flush.
        deps.metrics.enqueueFailures.inc();
        deps.logger.warn(
          { err: { message: (err as Error).message } },
          'could not enqueue flush after import',
        );
      });
    }
    deps.metrics.messagesAccepted.inc(outcome.imported);
    return outcome;
  } catch (err) {
    await deps.redis.del(staged.list, staged.ids).catch(() => undefined);
    if (published) return afterFailedCommit(deps, tenantId, sessionId, published, err);
    throw asDependencyError(err);
  }
}

/**
 * The transaction failed after its messages went into the inbox: its COMMIT failed, or its answer
 * was lost (the connection broke). Postgres tells which. Committed, the import is done, and
 * answered so. Aborted, its messages are removed now (else by the next drain: settleImport), and
 * the error stands: nothing was stored. Unknown (Postgres cannot be asked), the 503 says the import
 * may be stored, for a retry to tell (a 409 `session_not_empty` then means it was).
 */
async function afterFailedCommit(
  deps: Pick<CoreDeps, 'db' | 'redis' | 'config' | 'queues' | 'logger' | 'metrics'>,
  tenantId: string,
  sessionId: string,
  published: { xid: string; outcome: ImportOutcome },
  err: unknown,
): Promise<ImportOutcome> {
  const status = await importStatus(deps.db, published.xid).catch(() => undefined);
  if (status === 'committed') {
    await enqueueFlush(deps, tenantId, sessionId).catch(() => deps.metrics.enqueueFailures.inc());
    deps.metrics.messagesAccepted.inc(published.outcome.imported);
    return published.outcome;
  }
  if (status === 'aborted') {
    const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
    await settleImport(deps.db, deps.redis, keys).catch(() => undefined);
    throw asDependencyError(err);
  }
  const e = asDependencyError(err);
  if (e instanceof AppError && e.status === 503) {
    throw new AppError(
      503,
      e.code,
      `${e.message} (the import may be stored: retry it; 409 session_not_empty then means it was)`,
      {
        ...(e.details ?? {}),
        maybe_stored: true,
      },
    );
  }
  throw e;
}
