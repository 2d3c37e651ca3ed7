import type { Redis } from '../redis.js';
import { cutUnits } from '../text/fts-text.js';
import { fairKey, fairLua } from '../fair-priority.js';
import { holdsUnstorable } from '../text/unstorable.js';
import type { AcceptedMessage } from './message-input.js';

/**
 * The per-session inbox in Redis: the ordering point of ingestion. One Lua call takes the next
 * seq numbers and appends the messages in the same atomic step, so list order is seq order for
 * any number of API processes; a worker holding the session's Postgres row lock drains the head
 * of the list into the archive in one transaction. See docs/ingestion.md.
 *
 * Keys (P = MNEMOS_PREFIX): P:sess:<tenant>:<sid> hash {seq, gen, armed, archived};
 * P:inbox:<tenant>:<sid> list of "<seq> <gen> <json>"; P:ids:<tenant>:<sid> hash message id
 * (the client's, or the one the server gave) → "<seq> <fp> <sent_ns>" (idempotency of
 * not-yet-archived or recent messages: pruned of ids archived over an hour ago, and gone 24 h
 * after the session's last accept); the sess hash
 * also holds the prune's mark and time (idsmark, idsat);
 * P:armed zset of "<tenant> <sid>" by the time a flush was requested or a drain last took entries
 * (the ingest sweeper's list).
 */

export interface InboxKeys {
  sess: string;
  inbox: string;
  ids: string;
  armed: string;
  member: string;
  prefix: string;
  tenantId: string;
}

export const inboxKeys = (prefix: string, tenantId: string, sessionId: string): InboxKeys => ({
  prefix,
  tenantId,
  sess: `${prefix}:sess:${tenantId}:${sessionId}`,
  inbox: `${prefix}:inbox:${tenantId}:${sessionId}`,
  ids: `${prefix}:ids:${tenantId}:${sessionId}`,
  armed: `${prefix}:armed`,
  member: `${tenantId} ${sessionId}`,
});

const IDS_TTL_SECONDS = 24 * 3600;
/**
 * A live session's state (the sess hash) expires this long after its last accept: every field of
 * it can be seeded again from Postgres and the inbox (SEED), as when Redis comes back empty, so
 * an idle session need not hold Redis memory for good (a soak test's mix made 0.15 new sessions
 * per request: at 100 requests/s, 6.5 GB of Redis after a month, never freed).
 */
export const SESSION_STATE_TTL_SECONDS = 7 * 24 * 3600;
/** How often a drain prunes the ids archived by the previous prune (FINISH). */
const IDS_PRUNE_MS = 3600 * 1000;

// The counter never hands out a seq at or below the archive's highest (ARGV[4], read from Postgres
// by the API): a Redis that came back behind Postgres (an AOF that lost its last second, a
// lagging replica) would otherwise give archived seqs to new messages, which the drain skips as
// replays of what it archived.
// A state whose generation is below the session's in Postgres (ARGV[5]: a reset or delete whose
// Redis step has not run yet, or that a lost second took back) answers STALE: the API moves it to
// that generation (clearToGeneration) before anything is accepted against the cleared history's ids.
// Every accepted id is recorded, the ids the server made up too: the answer hands them to the
// client, whose re-post of one under that id before its drain must find its seq (it was given a
// new one, which the archive's unique id then dropped, and a ?wait=true called the batch lost).
// Only a client's own ids are looked up: a fresh UUID cannot be in the hash.
// A request that arms the session (its flush job is to be added) counts one more flush of its
// tenant in KEYS[5], the tenant's decaying count (services/fair-priority.ts): the answer's second
// field is the flush job's priority (0 = no flush to add).
// Its fifth says whether this state is behind the archive (1: its archived mark, 2: its counter
// too): a Redis restored from a snapshot that holds the session armed, with the flush job active
// and no worker on it, asked for no flush, and new messages waited up to 90 s for BullMQ's stall
// check or the ingest sweeper.
// ARGV: now_ms, armed member, ids ttl, archive's highest seq, Postgres generation (0 = unknown),
// then 6 per message: id, cid (0/1), fp, given sent ns ('' when the client gave none), stored
// sent ns, payload json.
const ACCEPT = `
if redis.call('EXISTS', KEYS[1]) == 0 then return {'SEED'} end
local gen = redis.call('HGET', KEYS[1], 'gen')
if tonumber(gen) < tonumber(ARGV[5]) then return {'STALE'} end
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq'))
local floor = tonumber(ARGV[4])
local behind = 0
if floor > tonumber(redis.call('HGET', KEYS[1], 'archived') or '0') then behind = 1 end
if floor > seq then
  behind = 2
  seq = floor
  redis.call('HSET', KEYS[1], 'seq', seq)
end
if floor > tonumber(redis.call('HGET', KEYS[1], 'archived') or '0') then
  redis.call('HSET', KEYS[1], 'archived', floor)
end
local n = (#ARGV - 5) / 6
local known = {}
local conflicts = {'CONFLICT'}
local imp = nil
for i = 0, n - 1 do
  local b = 6 + i * 6
  if ARGV[b + 1] == '1' then
    local prev = redis.call('HGET', KEYS[3], ARGV[b])
    if prev then
      local pseq, pfp, psent = string.match(prev, '^(%d+) (%S+) (%d+)$')
      -- An id of an import not yet settled: stored only if its transaction committed.
      if imp == nil then imp = redis.call('HMGET', KEYS[1], 'impxid', 'impfrom', 'impto') end
      if imp[1] and tonumber(pseq) and tonumber(pseq) >= tonumber(imp[2]) and tonumber(pseq) <= tonumber(imp[3]) then
        return {'IMPORTING'}
      end
      if pfp ~= ARGV[b + 2] or (ARGV[b + 3] ~= '' and ARGV[b + 3] ~= psent) then
        conflicts[#conflicts + 1] = i
      else
        known[i] = pseq
      end
    end
  end
end
if #conflicts > 1 then return conflicts end
local out = {'OK', 0, gen, 0, behind}
local added = 0
for i = 0, n - 1 do
  local b = 6 + i * 6
  if known[i] then
    out[#out + 1] = known[i]
    out[#out + 1] = 1
  else
    seq = seq + 1
    added = added + 1
    redis.call('RPUSH', KEYS[2], seq .. ' ' .. gen .. ' ' .. ARGV[b + 5])
    redis.call('HSET', KEYS[3], ARGV[b], seq .. ' ' .. ARGV[b + 2] .. ' ' .. ARGV[b + 4])
    out[#out + 1] = seq
    out[#out + 1] = 0
  end
end
if added > 0 then
  redis.call('HSET', KEYS[1], 'seq', seq)
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
  local arm = redis.call('HGET', KEYS[1], 'armed') ~= '1'
  if arm then
    redis.call('HSET', KEYS[1], 'armed', '1')
    redis.call('ZADD', KEYS[4], tonumber(ARGV[1]), ARGV[2])
  end
  -- Armed by an import not settled yet, which asks for its flush only once committed: aborted,
  -- its settle removed its entries and left this message armed with no flush to come, for the
  -- ingest sweeper (60-90 s). One flush per import is asked here; it waits for the import's row
  -- lock, then settles it and drains.
  if arm or (redis.call('HEXISTS', KEYS[1], 'impxid') == 1 and redis.call('HSETNX', KEYS[1], 'impwake', '1') == 1) then
    ${fairLua('KEYS[5]')}
    out[2] = fair
  end
  if redis.call('HGET', KEYS[1], 'deleted') == '1' then
    redis.call('HDEL', KEYS[1], 'deleted')
    out[4] = 1
  end
  redis.call('EXPIRE', KEYS[1], ${SESSION_STATE_TTL_SECONDS})
end
return out
`;

// Seeds a session's Redis state from Postgres (first use, or Redis came back empty). Never moves
// the counter backwards: it starts after both the archive and whatever is still in the inbox.
// A deleted session (its row's deleted_at) is marked `deleted`, as the delete marks it, so that the
// first accept revives its row: the mark must survive Redis losing the session's state.
// It is seeded unarmed even when its inbox holds entries: the accept that follows arms it and asks
// for a flush (one more flush is harmless: drains take the session's lock). Seeded armed, it asked
// for none, and when the session had no member in the armed set either (nothing then looks at it,
// not the ingest sweeper) its messages waited in the inbox for good.
// ARGV: last archived seq (next_seq - 1), generation, deleted ('1' or '0').
const SEED = `
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local seq = tonumber(ARGV[1])
local tail = redis.call('LINDEX', KEYS[2], -1)
if tail then
  local t = tonumber(string.match(tail, '^(%d+) '))
  if t and t > seq then seq = t end
end
redis.call('HSET', KEYS[1], 'seq', seq, 'gen', ARGV[2], 'archived', ARGV[1])
if ARGV[3] == '1' then redis.call('HSET', KEYS[1], 'deleted', '1') end
redis.call('EXPIRE', KEYS[1], ${SESSION_STATE_TTL_SECONDS})
return 1
`;

// After a committed drain: drop the head entries up to the last seq the worker read, record the
// archived mark, and disarm when the inbox is empty (so the next accept requests a new flush);
// otherwise re-stamp the armed score, so that it says since when the session has waited without
// progress (archivingBehind, the ingest sweeper), not since when its inbox has been non-empty.
// The head is read 1, 2, 4, 8, then 16 entries at a time: entries can be megabytes, and only those
// read are trimmed (a drain of two 6 MiB entries read sixteen of them here, 96 MiB of copying that
// held Redis for seconds when a backlog of such messages waited).
// Once per IDS_PRUNE_MS per session it also prunes the id hash: the ids whose messages were
// archived by the previous prune (at least that long ago) are dropped, so the hash holds about one
// such period of a busy session instead of every id it ever took (its 24 h expiry is renewed by
// every accept). Dedupe of archived ids is the API's archive lookup; the Redis entry only covers
// the time between that lookup and the accept script, and a message not yet archived.
// ARGV: last seq read, armed member, now (ms), prune period (ms).
const FINISH = `
local last = tonumber(ARGV[1])
local k = 0
local more = true
local step = 1
while more do
  local part = redis.call('LRANGE', KEYS[2], k, k + step - 1)
  more = #part == step
  if step < 16 then step = step * 2 end
  for _, e in ipairs(part) do
    local s = tonumber(string.match(e, '^(%d+) '))
    if s and s <= last then k = k + 1 else more = false break end
  end
end
if k > 0 then redis.call('LTRIM', KEYS[2], k, -1) end
local prev = tonumber(redis.call('HGET', KEYS[1], 'archived') or '0')
if last > prev and redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'archived', last) end
local left = redis.call('LLEN', KEYS[2])
if left == 0 then
  if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'armed', '0') end
  redis.call('ZREM', KEYS[3], ARGV[2])
elseif k > 0 then
  redis.call('ZADD', KEYS[3], 'XX', tonumber(ARGV[3]), ARGV[2])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local now = tonumber(ARGV[3])
  local at = tonumber(redis.call('HGET', KEYS[1], 'idsat') or '0')
  if now - at >= tonumber(ARGV[4]) then
    local mark = tonumber(redis.call('HGET', KEYS[1], 'idsmark') or '0')
    if mark > 0 then
      local all = redis.call('HGETALL', KEYS[4])
      local drop = {}
      for j = 1, #all, 2 do
        local s = tonumber(string.match(all[j + 1], '^(%d+) '))
        if s and s <= mark then drop[#drop + 1] = all[j] end
        if #drop == 1000 then
          redis.call('HDEL', KEYS[4], unpack(drop))
          drop = {}
        end
      end
      if #drop > 0 then redis.call('HDEL', KEYS[4], unpack(drop)) end
    end
    redis.call('HSET', KEYS[1], 'idsmark', redis.call('HGET', KEYS[1], 'archived') or '0', 'idsat', now)
  end
end
return {left, k}
`;

// The head of the inbox for a drain: at most ARGV[1] entries and ARGV[2] bytes, but at least one
// entry when there is any. Read 1, 2, 4, 8, then 16 at a time, so that a backlog of large messages
// is never copied whole (one drain once read 266 entries of 1 MiB, and Postgres refused their
// 280 MB of JSON) nor far past the budget (16 entries of 6 MiB, JSON-escaped control characters,
// cost Redis 3 s of CPU per read, and every other client waited).
// KEYS[2] is the session's state: while it holds an import's mark (impxid, PUBLISH_IMPORT) the
// script returns that mark alone, and the drain settles the import first (settleImport). Asked in
// this same call, not by a separate HGET on every batch of the hot path. The reply's first
// element is the mark, or '' before the entries.
const READ = `
local xid = redis.call('HGET', KEYS[2], 'impxid')
if xid then return {xid} end
local maxn = tonumber(ARGV[1])
local maxb = tonumber(ARGV[2])
local out = {''}
local bytes = 0
local step = 1
while #out - 1 < maxn do
  local from = #out - 1
  local want = math.min(step, maxn - from)
  local part = redis.call('LRANGE', KEYS[1], from, from + want - 1)
  for _, e in ipairs(part) do
    if #out > 1 and bytes + #e > maxb then return out end
    out[#out + 1] = e
    bytes = bytes + #e
  end
  if #part < want then return out end
  if step < 16 then step = step * 2 end
end
return out
`;

// Before a drain commits: is the inbox head still what it read? KEYS[1] inbox; ARGV: the count of
// entries read, the start of the last entry read and of the first it archives ("<seq> <gen>
// {"id":…": which message at which seq), then the seqs of the replays read before that one
// (entries another drain archived and trims after its commit, which may come before this check).
// The inbox may start at any of those replays, or at the first entry this drain archives; that
// entry and the last one read must then be where they were, as many places earlier. 0 when Redis
// came back behind the drain (an AOF that lost its last second, a failover to a lagging replica)
// and may have handed the seqs it read to new messages.
const CHECK = `
local n = tonumber(ARGV[1])
local r = #ARGV - 3
local function holds(i, head)
  local e = redis.call('LINDEX', KEYS[1], i)
  return e and string.sub(e, 1, #head) == head
end
local first = redis.call('LINDEX', KEYS[1], 0)
if not first then return 0 end
local trimmed = r
if string.sub(first, 1, #ARGV[3]) ~= ARGV[3] then
  local s0 = tonumber(string.match(first, '^(%d+) '))
  trimmed = nil
  for i = 4, #ARGV do
    if tonumber(ARGV[i]) == s0 then trimmed = i - 4 break end
  end
  if trimmed == nil or not holds(r - trimmed, ARGV[3]) then return 0 end
end
if n - 1 > r and not holds(n - 1 - trimmed, ARGV[2]) then return 0 end
return 1
`;

// Reset/delete: pending message work goes, the generation moves on, the seq counter stays.
// ARGV: new generation, armed member.
const CLEAR = `
redis.call('DEL', KEYS[2], KEYS[3])
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'armed', '0')
end
redis.call('ZREM', KEYS[4], ARGV[2])
return 1
`;

export interface InboxEntry {
  seq: number;
  gen: number;
  /** Null when the entry cannot be read: moved to the dead letters (moveToDeadLetters), never dropped. */
  message: AcceptedMessage | null;
  raw: string;
  /**
   * The entry does not start `<seq> <gen> ` (written by hand into the inbox): no seq places it, so
   * no trim would ever remove it. The drain moves it to the dead letters (moveToDeadLetters).
   */
  malformed?: true;
}

export type AcceptResult =
  | { kind: 'seed' }
  | { kind: 'stale' }
  /** An id of the request is one of an import not settled yet (settleImport, then again). */
  | { kind: 'importing' }
  | { kind: 'conflict'; indexes: number[] }
  | {
      kind: 'ok';
      /** This request armed the session: the priority of the flush job to add; else null. */
      wake: number | null;
      generation: number;
      /** The first messages since the session was deleted: its row is to be revived. */
      revive: boolean;
      /**
       * The archive holds a drain this Redis state never saw finish: `drain` (its archived mark
       * is behind), or `counter` (its seq counter was too: Redis lost its last writes, as a
       * snapshot restore or a lagging replica's promotion does). `drain` is also, for the few
       * milliseconds between a drain's commit and its finish script, the normal case.
       */
      behind: Behind;
      results: Array<{ seq: number; duplicate: boolean }>;
    };

export type Behind = 'no' | 'drain' | 'counter';
const BEHIND: Behind[] = ['no', 'drain', 'counter'];

type Script = { name: string; body: string };
const scripts = {
  accept: { name: 'mnemosAccept', body: ACCEPT },
  seed: { name: 'mnemosSeed', body: SEED },
  finish: { name: 'mnemosFinish', body: FINISH },
  clear: { name: 'mnemosClear', body: CLEAR },
  read: { name: 'mnemosRead', body: READ },
  check: { name: 'mnemosCheck', body: CHECK },
} satisfies Record<string, Script>;

type ScriptedRedis = Redis & Record<string, (...args: unknown[]) => Promise<unknown>>;

/** Registers the Lua scripts on a connection (EVALSHA with automatic EVAL fallback). */
export function defineInboxScripts(redis: Redis): void {
  const r = redis as ScriptedRedis;
  if (typeof r.mnemosAccept === 'function') return;
  const numberOfKeys = { accept: 5, seed: 2, finish: 4, clear: 4, read: 2, check: 1 } as const;
  for (const [k, s] of Object.entries(scripts)) {
    redis.defineCommand(s.name, { numberOfKeys: numberOfKeys[k as keyof typeof numberOfKeys], lua: s.body });
  }
}

export async function acceptIntoInbox(
  redis: Redis,
  keys: InboxKeys,
  messages: AcceptedMessage[],
  givenSent: Array<string | null>,
  archivedTop = 0,
  generation = 0,
): Promise<AcceptResult> {
  const args: (string | number)[] = [Date.now(), keys.member, IDS_TTL_SECONDS, archivedTop, generation];
  messages.forEach((m, i) => {
    args.push(m.id, m.cid ? '1' : '0', m.fp, givenSent[i] ?? '', m.sent_at_ns, JSON.stringify(m));
  });
  const r = (await (redis as ScriptedRedis).mnemosAccept!(
    keys.sess,
    keys.inbox,
    keys.ids,
    keys.armed,
    fairKey(keys.prefix, 'flush', keys.tenantId),
    ...args,
  )) as (string | number)[];
  if (r[0] === 'SEED') return { kind: 'seed' };
  if (r[0] === 'STALE') return { kind: 'stale' };
  if (r[0] === 'IMPORTING') return { kind: 'importing' };
  if (r[0] === 'CONFLICT') return { kind: 'conflict', indexes: r.slice(1).map(Number) };
  const results: Array<{ seq: number; duplicate: boolean }> = [];
  for (let i = 5; i < r.length; i += 2)
    results.push({ seq: Number(r[i]), duplicate: Number(r[i + 1]) === 1 });
  return {
    kind: 'ok',
    wake: Number(r[1]) > 0 ? Number(r[1]) : null,
    generation: Number(r[2]),
    revive: Number(r[3]) === 1,
    behind: BEHIND[Number(r[4])] ?? 'no',
    results,
  };
}

export async function seedInbox(
  redis: Redis,
  keys: InboxKeys,
  lastArchivedSeq: number,
  generation: number,
  deleted: boolean,
) {
  await (redis as ScriptedRedis).mnemosSeed!(
    keys.sess,
    keys.inbox,
    lastArchivedSeq,
    generation,
    deleted ? '1' : '0',
  );
}

/**
 * Whether a parsed inbox entry has the fields the archive's insert needs, of their types. Only the
 * API writes entries, from validated messages; one made by hand with an id and a role and nothing
 * else passed a check of those two, then failed its insert on every drain for good (a NOT NULL
 * column), holding every later message of its session. Now it is unreadable: a dead letter.
 */
function isAcceptedShape(m: unknown): m is AcceptedMessage {
  if (!m || typeof m !== 'object') return false;
  const x = m as Record<string, unknown>;
  return (
    typeof x.id === 'string' &&
    typeof x.role === 'string' &&
    typeof x.fp === 'string' &&
    typeof x.sent_at_ns === 'string' &&
    /^\d{1,19}$/.test(x.sent_at_ns) &&
    (x.sent_at_ns.length < 19 || x.sent_at_ns <= INT8_MAX) &&
    typeof x.sent_at_given === 'boolean' &&
    Number.isInteger(x.bytes) &&
    (x.bytes as number) >= 0 &&
    (x.bytes as number) <= INT4_MAX &&
    (x.content === null || typeof x.content === 'string') &&
    (x.tool_calls == null ||
      (Array.isArray(x.tool_calls) && x.tool_calls.every((c) => c !== null && typeof c === 'object')))
  );
}

// The archive's bigint sent_at_ns and integer bytes: an entry past them failed its insert for good
// (as did a missing sent_at_given, NOT NULL, and tool_calls that were no list of calls, which the
// index text reads as one).
const INT8_MAX = '9223372036854775807';
const INT4_MAX = 2 ** 31 - 1;

/**
 * The head of the inbox: at most `maxEntries` entries and `maxBytes` bytes (but at least one); or,
 * while the session's state holds an unsettled import's mark, that mark (the transaction id) and
 * no entries: the import's messages may not be read before it is settled (settleImport).
 */
export async function readInbox(
  redis: Redis,
  keys: InboxKeys,
  maxEntries: number,
  maxBytes: number,
): Promise<{ importXid: string | null; entries: InboxEntry[] }> {
  const [xid, ...raw] = (await (redis as ScriptedRedis).mnemosRead!(
    keys.inbox,
    keys.sess,
    maxEntries,
    maxBytes,
  )) as string[];
  if (xid) return { importXid: xid, entries: [] };
  const entries = raw.map((e): InboxEntry => {
    const a = e.indexOf(' ');
    const b = e.indexOf(' ', a + 1);
    let message: AcceptedMessage | null = null;
    try {
      const m = JSON.parse(e.slice(b + 1)) as AcceptedMessage;
      if (isAcceptedShape(m) && !(UNSTORABLE_ESCAPE.test(e) && holdsUnstorable(m))) message = m;
    } catch {
      message = null;
    }
    if (!ENTRY_PREFIX.test(e)) return { seq: NaN, gen: NaN, message: null, raw: e, malformed: true as const };
    return { seq: Number(e.slice(0, a)), gen: Number(e.slice(a + 1, b)), message, raw: e };
  });
  return { importXid: null, entries };
}

const ENTRY_PREFIX = /^\d+ \d+ /;

/**
 * Every string of an entry reaches Postgres (text columns, and the batch's one jsonb parameter),
 * which refuses NUL and lone surrogates (UNSTORABLE): an entry holding one (made by hand; the API
 * refuses them) failed its drain's insert every time, for good, and held the session. In the
 * entry's text such a character can only be a `\u` escape (JSON allows no raw NUL in a string,
 * and text decoded from Redis's UTF-8 holds no lone surrogate), so the parsed message is walked
 * only when the text has one of these escapes, or what looks like one (`\\u0000` is a backslash
 * and `u0000`, which Postgres stores): one regex over the entry on the drain's path, no walk.
 */
const UNSTORABLE_ESCAPE = /\\u(?:0000|d[89a-f])/i;

/**
 * Moves entries that are no message (malformed, or unreadable: InboxEntry) from the inbox to the
 * session's dead letters, in one step each, and only while the inbox still holds them. Left in
 * place, one at the head held the session for ever: the drain's check found no seq to place it
 * and rolled back, 230 times a second (a re-tester's hand-made entry); an unreadable one with a
 * seq above the last entry read was never trimmed and was dead-lettered again by every drain. A
 * plain push after the drain put back the dead letters of a session whose delete (its Redis step
 * removes the inbox entries and the dead letters) came in between, message content and all.
 */
export async function moveToDeadLetters(
  redis: Redis,
  keys: InboxKeys,
  dead: string,
  raw: string[],
): Promise<number> {
  let moved = 0;
  for (const e of raw) moved += Number(await redis.eval(MOVE_DEAD, 2, keys.inbox, dead, e));
  return moved;
}

// KEYS[1] inbox, KEYS[2] dead letters; ARGV[1] the entry. One entry moved, never lost or doubled.
const MOVE_DEAD = `
if redis.call('LREM', KEYS[1], 1, ARGV[1]) > 0 then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  return 1
end
return 0
`;

/** How much of an entry names it: seq, generation and the message id (cut never mid-pair). */
const ENTRY_HEAD_UNITS = 256;
/**
 * Whether the inbox still starts with the entries a drain read (compared by their heads): false
 * when Redis lost them meanwhile and the drain must not commit (see CHECK). `replays`: how many
 * of the first entries read were already archived (seq below the session's next_seq, at most all
 * but one): the drain that archived them trims them after its commit, which may fall between
 * this drain's read and this check, and is no loss.
 */
export async function inboxStillHolds(
  redis: Redis,
  keys: InboxKeys,
  read: InboxEntry[],
  replays = 0,
): Promise<boolean> {
  if (read.length === 0) return true;
  const r = Math.min(replays, read.length - 1);
  const res = await (redis as ScriptedRedis).mnemosCheck!(
    keys.inbox,
    read.length,
    cutUnits(read[read.length - 1]!.raw, ENTRY_HEAD_UNITS),
    cutUnits(read[r]!.raw, ENTRY_HEAD_UNITS),
    ...read.slice(0, r).map((e) => e.seq),
  );
  return Number(res) === 1;
}

/** Returns how many entries are still waiting after the trim. */
export async function finishDrain(redis: Redis, keys: InboxKeys, lastSeqRead: number): Promise<number> {
  return (await finishDrainCounted(redis, keys, lastSeqRead)).left;
}

/**
 * finishDrain, also saying how many entries this trim removed: fewer than the drain read when a
 * reset's Redis step (or another drain's trim) removed some first, and counted them itself.
 */
export async function finishDrainCounted(
  redis: Redis,
  keys: InboxKeys,
  lastSeqRead: number,
): Promise<{ left: number; trimmed: number }> {
  const r = (await (redis as ScriptedRedis).mnemosFinish!(
    keys.sess,
    keys.inbox,
    keys.armed,
    keys.ids,
    lastSeqRead,
    keys.member,
    Date.now(),
    IDS_PRUNE_MS,
  )) as unknown;
  // A script of an older version (a rolling upgrade) answers the count left alone.
  return Array.isArray(r)
    ? { left: Number(r[0]), trimmed: Number(r[1]) }
    : { left: Number(r), trimmed: Number.NaN };
}

export async function clearInbox(redis: Redis, keys: InboxKeys, newGeneration: number): Promise<void> {
  await (redis as ScriptedRedis).mnemosClear!(
    keys.sess,
    keys.inbox,
    keys.ids,
    keys.armed,
    newGeneration,
    keys.member,
  );
}

/** Sessions that asked for a flush before `olderThanMs` and still hold work (crash recovery). */
export async function staleArmedSessions(redis: Redis, prefix: string, olderThanMs: number, limit = 500) {
  const members = await redis.zrangebyscore(
    `${prefix}:armed`,
    '-inf',
    Date.now() - olderThanMs,
    'LIMIT',
    0,
    limit,
  );
  return members.map((m) => {
    const i = m.indexOf(' ');
    return { tenantId: m.slice(0, i), sessionId: m.slice(i + 1), member: m };
  });
}

/**
 * Whether archiving is behind: some session's accepted messages have waited for more than
 * `olderThanMs` without a drain making progress (its armed score: when its inbox stopped being
 * empty, or when a drain last took entries from it).
 */
export async function archivingBehind(redis: Redis, prefix: string, olderThanMs: number): Promise<boolean> {
  return (await redis.zcount(`${prefix}:armed`, '-inf', Date.now() - olderThanMs)) > 0;
}

/**
 * Since when (ms) the longest-waiting session's accepted messages have waited without a drain
 * taking any (the lowest armed score), or null when none waits. A score of 0 marks a session a
 * reset left armed for an immediate flush (lifecycle-redis.ts): no waiting time, left out.
 */
export async function oldestArmedAt(redis: Redis, prefix: string): Promise<number | null> {
  const [, score] = await redis.zrangebyscore(`${prefix}:armed`, '(0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1);
  return score === undefined ? null : Number(score);
}

export async function touchArmed(redis: Redis, prefix: string, member: string): Promise<void> {
  await redis.zadd(`${prefix}:armed`, 'XX', Date.now(), member);
}

/** The highest seq handed out for the session so far (counter or inbox tail), 0 when unknown. */
export async function topHandedOut(redis: Redis, keys: InboxKeys): Promise<number> {
  const [counter, tail] = await Promise.all([redis.hget(keys.sess, 'seq'), redis.lindex(keys.inbox, -1)]);
  const tailSeq = tail ? Number(tail.slice(0, tail.indexOf(' '))) : 0;
  return Math.max(Number(counter ?? 0), Number.isFinite(tailSeq) ? tailSeq : 0);
}
