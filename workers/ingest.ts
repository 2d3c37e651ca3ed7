import type { Job } from 'bullmq';
import { pgCode, withTransaction } from '../db/pool.js';
import { archiveBatch, archivedFingerprints } from '../db/queries/messages.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { lockOrCreateSession, lockSession } from '../db/queries/sessions.js';
import type { CoreDeps } from '../services/deps.js';
import { throttledKinds, throttledLog } from '../services/logger.js';
import {
  clearInbox,
  moveToDeadLetters,
  defineInboxScripts,
  finishDrain,
  finishDrainCounted,
  inboxStillHolds,
  inboxKeys,
  readInbox,
} from '../services/messages/inbox.js';
import type { AcceptedMessage } from '../services/messages/message-input.js';
import { replaceBadChars } from '../services/messages/message-input.js';
import type { InboxEntry } from '../services/messages/inbox.js';
import { ftsDocument } from '../services/text/fts-text.js';
import { parsePayload } from './queues.js';
import { enqueueFlush } from '../services/fair-priority.js';
import { deadLetterKey, settleImport } from '../services/lifecycle/lifecycle-redis.js';

/** Entries per transaction: big enough to amortise the commit, small enough to keep locks short. */
export const DRAIN_BATCH = 500;
/**
 * Bytes of inbox entries per transaction (at least one entry): the batch goes to Postgres as one
 * jsonb parameter, which Postgres caps at 256 MB, and 500 messages of 1 MiB would pass it.
 */
export const DRAIN_MAX_BYTES = 16 * 1024 * 1024;
const MAX_ROUNDS_PER_JOB = 40;

export interface DrainResult {
  archived: number;
  dropped: number;
  /** Counters after the last committed batch (null when nothing was read). */
  hotBytes: number | null;
  generation: number | null;
}

/** Hook for what follows archival (embedding, compaction); the ingest path never waits on it. */
export type AfterArchive = (a: {
  tenantId: string;
  sessionId: string;
  generation: number;
  hotBytes: number;
  firstSeq: number;
  lastSeq: number;
}) => Promise<void>;

/** The text the archive's tsvector is derived from: name, content and tool-call names and arguments. */
export function searchableText(m: Pick<AcceptedMessage, 'name' | 'content' | 'tool_calls'>): string {
  const calls = (m.tool_calls ?? []) as Array<{ function?: { name?: string; arguments?: string } }>;
  const callText = calls
    .map((c) => `${c.function?.name ?? ''}\n${argumentsText(c.function?.arguments ?? '')}`)
    .join('\n');
  return [m.name ?? '', m.content ?? '', callText].filter(Boolean).join('\n');
}

/**
 * A tool call's arguments as words: the keys and values of its JSON, decoded, one per line. The
 * raw JSON glued escapes to the next word (`"cd /srv\nrestart"` indexed `nrestart`, `\u8a18` hex
 * fragments), so those words were never found. Arguments that are not JSON are taken as they are.
 *
 * Read from the text, not from JSON.parse's value: numbers keep the digits the model wrote (a
 * parsed `1234567890123456789` indexed as `1234567890123456800`, `1.10` as `1.1`, and an order id
 * searched as written was never found), and a key given twice keeps both values (the model saw
 * both).
 */
export function argumentsText(args: string): string {
  // Past 256 KiB the raw text, as before: decoding 8 MiB of deeply nested arguments held the event
  // loop for seconds, and only the first megabyte of a message's text is indexed anyway.
  if (args.length > ARGUMENTS_DECODE_MAX) return args;
  try {
    JSON.parse(args);
  } catch {
    return args;
  }
  // In valid JSON, scanning left to right, each string literal is matched whole before anything
  // inside it could be, and numbers and literals appear only outside strings.
  const out: string[] = [];
  for (const m of args.matchAll(JSON_TOKEN)) {
    const t = m[0];
    out.push(t.charCodeAt(0) === 0x22 ? (JSON.parse(t) as string) : t);
  }
  // Decoded, `\u0000` and a lone `\ud800` are real characters, which the archive row's JSON
  // parameter cannot carry (Postgres refused the row, and the session's drain failed for ever).
  return replaceBadChars(out.join('\n'));
}

const JSON_TOKEN = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false/g;

const ARGUMENTS_DECODE_MAX = 256 * 1024;

/**
 * The capped full-text inputs of an archive row (archiveBatch) from its searchable text.
 * Most messages are plain text without CJK: their full-text input is the content itself, sent
 * once instead of twice, and they need no CJK tsvector.
 */
export function ftsColumns(
  text: string,
  content: string | null,
): Pick<ArchiveInsertRow, 'fts_en' | 'fts_cjk'> {
  const fts = ftsDocument(text);
  return { fts_en: fts.en === content ? null : fts.en, fts_cjk: fts.cjk === '' ? null : fts.cjk };
}

/** The archive row of an accepted message at `seq`, with its capped full-text inputs. */
export function toArchiveRow(seq: number, m: AcceptedMessage): ArchiveInsertRow {
  return {
    seq,
    id: m.id,
    role: m.role,
    content: m.content,
    parts: m.parts,
    name: m.name,
    tool_call_id: m.tool_call_id,
    tool_calls: m.tool_calls,
    metadata: m.metadata,
    sent_at_ns: m.sent_at_ns,
    sent_at_given: m.sent_at_given,
    bytes: m.bytes,
    fingerprint: m.fp,
    ...ftsColumns(searchableText(m), m.content),
  };
}

/** A drain's inbox head is no longer what it read: its transaction is rolled back. */
class InboxMoved extends Error {
  constructor(readonly lastRead: number) {
    super('the inbox changed under a drain');
  }
}

const deadLetterLogs = new WeakMap<CoreDeps['logger'], ReturnType<typeof throttledKinds>>();

/**
 * At most one line per session per 5 s (throttledLog): a corrupt inbox that a drain kept
 * dead-lettering from wrote a level-50 line per pass, about 30 a second.
 */
function logDeadLetters(
  logger: CoreDeps['logger'],
  fields: { tenantId: string; sessionId: string; count: number; key: string },
): void {
  let throttleOf = deadLetterLogs.get(logger);
  if (!throttleOf) {
    throttleOf = throttledKinds(1000);
    deadLetterLogs.set(logger, throttleOf);
  }
  throttleOf(`${fields.tenantId} ${fields.sessionId}`, () =>
    throttledLog((obj, m) => logger.error(obj, m), 'unreadable inbox entries dead-lettered'),
  )({
    ...fields,
    hint: 'not messages, so no retry can archive them: inspect with redis-cli LRANGE <key> 0 -1; see docs/ingestion.md, "Seqs that are never archived do not stall anything"',
  });
}

/**
 * The batch read holds entries that are no message: not `<seq> <gen> <message>`
 * (InboxEntry.malformed), or unreadable ones the drain would archive.
 */
class DeadEntries extends Error {
  constructor(readonly raw: string[]) {
    super('inbox entries that are no message');
  }
}

/**
 * The entries of a read that break its seq order. The API never writes one (one Lua step takes
 * the seqs and appends, so list order is seq order): an entry pushed or set by hand with a seq
 * above the entries after it was never trimmed (the trim stops at the first seq above the last
 * one read), and the drain read it again 40 times a job, for good; archived, it also took a seq
 * the counter had still to hand out, and the real message later given that seq lost its insert
 * to it. Taking the highest seq read as the last one instead would pass real seqs still to
 * come. At each break the entry whose removal leaves the read in order goes: the higher one when
 * the entries before it are below the lower one (`7 5 6`, `5 7 6`), else the lower one (`5 6 3`,
 * a replay, a repeated seq). What is left is strictly increasing, as CHECK (inboxStillHolds) and
 * the trim take it to be.
 */
function outOfSeqOrder(entries: InboxEntry[], nextSeq: number): string[] {
  const inOrder: InboxEntry[] = [];
  const out: string[] = [];
  for (const e of entries) {
    const last = inOrder[inOrder.length - 1];
    if (!last || e.seq > last.seq) {
      inOrder.push(e);
      continue;
    }
    const before = inOrder[inOrder.length - 2];
    if (e.seq < last.seq && e.seq >= nextSeq && (!before || before.seq < e.seq)) {
      out.push(last.raw);
      inOrder[inOrder.length - 1] = e;
    } else {
      out.push(e.raw);
    }
  }
  return out;
}

/**
 * Drains one session's inbox into the archive, in seq order, batch by batch. Each batch is one
 * transaction that holds the session's row lock, so any number of workers may run this for the
 * same session: they serialise on Postgres, never on an in-process lock. The inbox head is trimmed
 * only after the commit, and a replay skips what is already archived (seq < next_seq), so a worker
 * killed at any point loses and duplicates nothing.
 */
export async function drainSession(
  deps: Pick<CoreDeps, 'db' | 'redis' | 'config' | 'metrics' | 'logger'>,
  tenantId: string,
  sessionId: string,
  afterArchive?: AfterArchive,
): Promise<DrainResult & { more: boolean }> {
  const keys = inboxKeys(deps.config.prefix, tenantId, sessionId);
  defineInboxScripts(deps.redis);
  const total: DrainResult = { archived: 0, dropped: 0, hotBytes: null, generation: null };
  for (let round = 0; round < MAX_ROUNDS_PER_JOB; round++) {
    let batch: {
      lastRead: number;
      archived: number;
      dropped: number;
      /** Messages whose id the archive holds at another seq already (countDrops). */
      idTaken: number;
      /** Messages below next_seq that the archive does not hold (countDrops). */
      seqTaken: number;
      /** Inbox entries read (trimmed after the commit). */
      read: number;
      hotBytes: number;
      generation: number;
      firstSeq: number;
    } | null;
    try {
      batch = await withTransaction(deps.db, async (tx) => {
        let session = await lockSession(tx, tenantId, sessionId);
        let head = await readInbox(deps.redis, keys, DRAIN_BATCH, DRAIN_MAX_BYTES);
        if (!session) {
          // A flush with nothing to drain (a job added by hand for a session never posted to)
          // created a live, empty session. Created only for entries (a session's first drain),
          // then read again under the row lock, as every other drain reads.
          if (head.entries.length === 0 && head.importXid === null) return null;
          // An import's row is not visible until it commits: the insert waits for it to end. One
          // that failed left only its own entries, which its settle removes, and the row made here
          // is taken back (it was committed: a live, empty session for a failed import).
          const importing = head.importXid;
          if (importing !== null) await tx.query('SAVEPOINT before_row');
          session = await lockOrCreateSession(tx, tenantId, sessionId);
          if (importing !== null) await settleImport(tx, deps.redis, keys, importing);
          head = await readInbox(deps.redis, keys, DRAIN_BATCH, DRAIN_MAX_BYTES);
          if (importing !== null && head.entries.length === 0 && head.importXid === null) {
            await tx.query('ROLLBACK TO SAVEPOINT before_row');
            return null;
          }
        }
        if (head.importXid !== null) {
          // An import's messages wait here until its transaction is known to have committed.
          await settleImport(tx, deps.redis, keys, head.importXid);
          head = await readInbox(deps.redis, keys, DRAIN_BATCH, DRAIN_MAX_BYTES);
        }
        // Still marked: an import that has not ended (it cannot hold this row lock and run). Its
        // entries wait; the session stays armed, and the sweeper asks again.
        const entries = head.entries;
        if (entries.length === 0) return null;
        const malformed = entries.filter((e) => e.malformed).map((e) => e.raw);
        if (malformed.length > 0) throw new DeadEntries(malformed);
        const nextSeq = Number(session.next_seq);
        const disordered = outOfSeqOrder(entries, nextSeq);
        if (disordered.length > 0) throw new DeadEntries(disordered);
        // Entries of the current generation, and entries accepted after the last reset/delete
        // committed (its Redis step may not have re-stamped the inbox generation yet: a crash in
        // between must not drop them). Older generations' entries are the cleared history.
        const clearedThrough = Number(session.cleared_through_seq);
        const isCurrent = (e: InboxEntry) => e.gen === session.generation || e.seq > clearedThrough;
        const current = entries.filter((e) => isCurrent(e) && e.seq >= nextSeq);
        const keep = current.filter(
          (e): e is InboxEntry & { message: AcceptedMessage } => e.message !== null,
        );
        // Moved aside before anything is written, as malformed entries are, and only while the
        // inbox still holds them (moveToDeadLetters). Pushed after the commit, they came back as
        // dead letters of a session whose delete fell in between, and one whose seq was above the
        // last entry read (a corrupt inbox) was never trimmed: dead-lettered again every pass.
        const unreadable = current.filter((e) => e.message === null).map((e) => e.raw);
        if (unreadable.length > 0) throw new DeadEntries(unreadable);
        const stale = entries.filter((e) => !isCurrent(e)).length;
        // Below next_seq: a replay (its drain committed, then stopped before the trim) has its id
        // and fingerprint archived. One that has not was given a seq the archive holds another
        // message at: Redis handed it out while another namespace (MNEMOS_PREFIX, Redis
        // database) numbered this session from the archive, or Redis went back behind it.
        const below = entries.filter(
          (e): e is InboxEntry & { message: AcceptedMessage } =>
            isCurrent(e) && e.seq < nextSeq && e.message !== null,
        );
        const archivedFps =
          below.length === 0
            ? null
            : await archivedFingerprints(
                tx,
                tenantId,
                sessionId,
                below.map((e) => e.message.id),
              );
        const seqTaken = below.filter((e) => archivedFps?.get(e.message.id) !== e.message.fp).length;
        const rows = keep.map((e) => toArchiveRow(e.seq, e.message));
        const lastRead = entries[entries.length - 1]!.seq;
        const counters = await archiveBatch(tx, { tenantId, sessionId, nextSeq: lastRead + 1, rows });
        // Redis may have come back behind this drain (an AOF without its last second) while it
        // waited on Postgres, and handed the seqs it read to new messages: committing would
        // archive lost messages at those seqs, and drop the new ones as replays. The lost ones go
        // (they were in the lost second); the new ones are drained next round.
        // (Only replays read, archived by another drain: nothing of this read is committed.)
        const replays = entries.findIndex((e) => e.seq >= nextSeq);
        if (replays !== -1 && !(await inboxStillHolds(deps.redis, keys, entries, replays))) {
          throw new InboxMoved(lastRead);
        }
        return {
          lastRead,
          archived: counters.archived,
          dropped: stale,
          // Replays (seq < next_seq) were left out above: a row not inserted is an id conflict.
          idTaken: rows.length - counters.archived,
          seqTaken,
          read: entries.length,
          hotBytes: Number(counters.hot_bytes),
          generation: session.generation,
          firstSeq: entries[0]!.seq,
        };
      });
    } catch (err) {
      if (err instanceof DeadEntries) {
        // Nothing was written: moved aside, the batch is read again. None moved: another drain
        // moved them, or a reset or delete removed them (and the dead letters) meanwhile.
        const key = deadLetterKey(deps.config.prefix, tenantId, sessionId);
        const moved = await moveToDeadLetters(deps.redis, keys, key, err.raw);
        deps.metrics.ingestDeadLetter.inc(moved);
        if (moved > 0) logDeadLetters(deps.logger, { tenantId, sessionId, count: moved, key });
        continue;
      }
      if (err instanceof InboxMoved) {
        // A drain that stalled (a paused process, past PG_IDLE_IN_TRANSACTION_TIMEOUT_MS) finds
        // what it read archived and trimmed by another drain: the archived mark, which only a
        // committed drain or the archive's own highest seq moves, has passed its read. That is no
        // sign of Redis going back, and was counted and logged as one.
        const mark = Number((await deps.redis.hget(keys.sess, 'archived').catch(() => null)) ?? 0);
        if (mark >= err.lastRead) {
          deps.logger.info(
            { tenantId },
            'another drain archived what a stalled drain read: reading it again',
          );
          continue;
        }
        deps.metrics.ingestInboxMoved.inc();
        deps.logger.warn(
          { tenantId },
          'the inbox changed under a drain (Redis restarted behind it?): rolled back, reading it again',
        );
        continue;
      }
      // The tenant was erased while work was queued: its inbox has nowhere to go. (Or another
      // deployment, with another database, shares this MNEMOS_PREFIX: say so, and count it.)
      if (pgCode(err) === '23503') {
        const waiting = await deps.redis.llen(keys.inbox);
        await clearInbox(deps.redis, keys, 0);
        deps.metrics.messagesDropped.inc(waiting);
        deps.logger.warn(
          { tenantId, dropped: waiting },
          'dropped the inbox of a tenant this database does not know: erased meanwhile, or another ' +
            'deployment (another database) shares this MNEMOS_PREFIX on the same Redis',
        );
        return { ...total, more: false };
      }
      throw err;
    }
    if (!batch) {
      await finishDrain(deps.redis, keys, 0);
      return { ...total, more: false };
    }
    // The hook (enqueueing the batch's embed job) does not wait for the trim: the batch is
    // committed, and the two round trips overlap instead of holding the worker slot one after the
    // other.
    const hooked =
      batch.archived > 0 && afterArchive
        ? afterArchive({
            tenantId,
            sessionId,
            generation: batch.generation,
            hotBytes: batch.hotBytes,
            firstSeq: batch.firstSeq,
            lastSeq: batch.lastRead,
          }).catch((err: unknown) =>
            deps.logger.warn({ err: { message: (err as Error).message } }, 'post-archive hook failed'),
          )
        : undefined;
    const { left, trimmed } = await finishDrainCounted(deps.redis, keys, batch.lastRead);
    // Stale entries a reset's Redis step removed before this trim were counted by the reset
    // (syncRedisGeneration): the entries this drain read but did not trim are those.
    if (Number.isFinite(trimmed)) batch.dropped = Math.max(0, batch.dropped - (batch.read - trimmed));
    total.archived += batch.archived;
    total.dropped += batch.dropped + batch.idTaken + batch.seqTaken;
    total.hotBytes = batch.hotBytes;
    total.generation = batch.generation;
    deps.metrics.messagesArchived.inc(batch.archived);
    if (batch.dropped > 0) deps.metrics.messagesDropped.inc(batch.dropped);
    if (batch.idTaken > 0) countDrops(deps, tenantId, sessionId, batch.idTaken, 'idTaken');
    if (batch.seqTaken > 0) countDrops(deps, tenantId, sessionId, batch.seqTaken, 'seqTaken');
    await hooked;
    if (left === 0) return { ...total, more: false };
  }
  return { ...total, more: true };
}

/**
 * Why the drain drops accepted messages, each counted in `mnemos_messages_dropped_total` and said
 * in one warn line per batch (both were once lost without a count or a line):
 * - `idTaken`: the archive's `on conflict do nothing` left them out, as their id is archived at an
 *   earlier seq. The accept answers a re-posted id from the session's id hash (or, once archived,
 *   from the archive), so this is a Redis that lost that hash while the first message still waited
 *   in the inbox (evicted under a volatile-* maxmemory-policy, restored from an older snapshot) and
 *   gave the re-post a seq of its own. The archive keeps the first message of an id (SPEC).
 * - `seqTaken`: below the session's next_seq and not in the archive, so not replays but messages
 *   whose seq the archive gave to another message meanwhile: a process started with another
 *   MNEMOS_PREFIX numbered the session afresh from the archive while they waited in the old
 *   prefix's inbox, and the drain of the old prefix, back in use, came to them.
 */
const DROP_REASONS = {
  idTaken:
    'dropped accepted messages whose id this session had archived already: Redis lost the ' +
    "session's id state (a maxmemory-policy other than noeviction evicted it, or a restore), " +
    'so their re-posts were given new seqs; the archive keeps the first message of each id',
  seqTaken:
    'dropped accepted messages whose seqs the archive holds other messages at: this database was ' +
    'used with another Redis namespace (MNEMOS_PREFIX or Redis database) while they waited, or Redis ' +
    'went back behind the archive; the archive keeps the messages it holds',
} as const;

function countDrops(
  deps: Pick<CoreDeps, 'metrics' | 'logger'>,
  tenantId: string,
  sessionId: string,
  dropped: number,
  why: keyof typeof DROP_REASONS,
): void {
  deps.metrics.messagesDropped.inc(dropped);
  deps.logger.warn({ tenantId, sessionId, dropped }, DROP_REASONS[why]);
}

export function makeIngestProcessor(
  deps: Pick<CoreDeps, 'db' | 'redis' | 'config' | 'metrics' | 'logger' | 'queues'>,
  afterArchive?: AfterArchive,
) {
  return async (job: Job): Promise<{ archived: number }> => {
    const p = parsePayload('ingest', job.data);
    const r = await drainSession(deps, p.tenantId, p.sessionId, afterArchive);
    // A very busy session: hand the rest to a fresh job so other sessions get a turn.
    // At the tenant's fair priority (services/fair-priority.ts), as every flush job.
    if (r.more) await enqueueFlush(deps, p.tenantId, p.sessionId);
    return { archived: r.archived };
  };
}
