import { SESSION_STATE_TTL_SECONDS } from '../messages/inbox.js';
import type { InboxKeys } from '../messages/inbox.js';
import type { Redis } from '../redis.js';
import type { Queryable } from '../../db/pool.js';

/**
 * The Redis side of reset/delete and import, beside the inbox scripts of services/messages/inbox.ts
 * (same keys, same entry format "<seq> <gen> <json>").
 */

/** Dead-lettered (unreadable) inbox entries of a session; the name is the one inbox.ts writes. */
export const deadLetterKey = (prefix: string, tenantId: string, sessionId: string) =>
  `${prefix}:dead:${tenantId}:${sessionId}`;

/** How long a deleted session's Redis state outlives the delete (CLEAR_TO). */
export const DELETED_STATE_TTL_SECONDS = 24 * 3600;

// Moves a session's Redis state to a newer generation: drops the inbox entries of the cleared
// history (seq <= ARGV[3], the highest seq handed out when the reset/delete committed), their
// idempotency ids and the dead letters. Entries after that seq were accepted later and stay,
// armed for a flush (the drain keeps them whatever generation they carry), and so do their ids:
// a retry of such a message must get its seq, not a new one (and another body under its id a
// 409), also before its drain, when the archive cannot tell. A compare-and-set, so
// it is safe to repeat at any time (by a retried request or the reconciler): it never touches a
// state that already holds the target generation. Returns {cleared, top seq, entries left,
// entries removed, entries without a seq removed}; a state already there returns {0, '', inbox
// length}: what waits there was accepted after the clear (by a post that moved the state itself,
// STALE), and the caller asks for its flush, whose job a delete may have removed meanwhile.
// An entry without its "<seq> <gen> " (written by hand) is no message of any generation, and goes
// with the cleared history and the dead letters: one at the tail stopped the trim, outlived a
// delete, and was dead-lettered after it, for good (the delete had removed the dead letters).
// A delete also marks the state `deleted`: the first message accepted after it revives the session
// row at once (accept-messages.ts), so that the new session is visible before its first drain.
// A deleted session's state, once nothing is left in its inbox, expires after ARGV[5] seconds
// (the accept that revives the session persists it again): every deleted or reaped `temp-` session
// kept a hash in Redis for good. Losing it is losing nothing: the next accept seeds it from the
// session's row, `deleted` mark included, as after Redis came back empty.
// KEYS: sess, inbox, ids, armed, dead. ARGV: target generation, armed member, cleared-through seq,
// deleted ('1' for a delete), the deleted state's lifetime in seconds.
const CLEAR_TO = `
local cur = redis.call('HGET', KEYS[1], 'gen')
if cur and tonumber(cur) >= tonumber(ARGV[1]) then return {0, '', redis.call('LLEN', KEYS[2])} end
local top = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local tail = redis.call('LINDEX', KEYS[2], -1)
local last = tail and tonumber(string.match(tail, '^(%d+) '))
if last and last > top then top = last end
local through = tonumber(ARGV[3])
local removed = 0
if last and last <= through then
  -- Everything waiting goes (the usual case): no entry is copied into Lua, which for a backlog of
  -- megabyte entries held Redis for seconds.
  removed = redis.call('LLEN', KEYS[2])
  redis.call('DEL', KEYS[2])
end
local unreadable = 0
local step = 1
while true do
  local head = redis.call('LRANGE', KEYS[2], 0, step - 1)
  if #head == 0 then break end
  local k = 0
  local u = 0
  for _, e in ipairs(head) do
    local s = tonumber(string.match(e, '^(%d+) %d+ '))
    if not s then u = u + 1 end
    if not s or s <= through then k = k + 1 else break end
  end
  if k == 0 then break end
  redis.call('LTRIM', KEYS[2], k, -1)
  removed = removed + k - u
  unreadable = unreadable + u
  if k < #head then break end
  if step < 512 then step = step * 2 end
end
redis.call('DEL', KEYS[5])
if redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[3])
else
  -- Ids values are "<seq> <fp> <sent ns>"; a field whose seq is not above the cut goes.
  local cursor = '0'
  repeat
    local page = redis.call('HSCAN', KEYS[3], cursor, 'COUNT', 500)
    cursor = page[1]
    local kv = page[2]
    for i = 1, #kv, 2 do
      local s = tonumber(string.match(kv[i + 1], '^(%d+) '))
      if not s or s <= through then redis.call('HDEL', KEYS[3], kv[i]) end
    end
  until cursor == '0'
end
if cur then
  if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'deleted', '1') else redis.call('HDEL', KEYS[1], 'deleted') end
end
local left = redis.call('LLEN', KEYS[2])
if left > 0 then
  if cur then redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'armed', '1') end
  redis.call('ZADD', KEYS[4], 0, ARGV[2])
else
  if cur then redis.call('HSET', KEYS[1], 'gen', ARGV[1], 'armed', '0') end
  redis.call('ZREM', KEYS[4], ARGV[2])
end
if cur and ARGV[4] == '1' and left == 0 then
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[5]))
elseif cur then
  redis.call('EXPIRE', KEYS[1], ${SESSION_STATE_TTL_SECONDS})
end
return {1, tostring(top), left, removed, unreadable}
`;

// Publishes a staged import as the session's inbox in one step, but only into an empty inbox of
// the expected generation whose counter has not moved since the entries were numbered: then the
// inbox is exactly the staged list, in seq order, and the counter continues after it.
// KEYS: sess, inbox, ids, armed, staged list, staged ids.
// ARGV: now ms, armed member, ids ttl s, expected gen, expected seq, count, new seq (the staged
// entries' last seq: the expected one plus count, or more when the archive was ahead of Redis).
const PUBLISH_IMPORT = `
if redis.call('EXISTS', KEYS[1]) == 0 then return {'SEED'} end
if redis.call('LLEN', KEYS[2]) > 0 then return {'BUSY'} end
if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[4] then return {'GEN'} end
if redis.call('HGET', KEYS[1], 'seq') ~= ARGV[5] then return {'MOVED'} end
local n = tonumber(ARGV[6])
if redis.call('LLEN', KEYS[5]) ~= n then return {'LOST'} end
redis.call('RENAME', KEYS[5], KEYS[2])
redis.call('PERSIST', KEYS[2])
if redis.call('EXISTS', KEYS[6]) == 1 then
  if redis.call('EXISTS', KEYS[3]) == 0 then
    redis.call('RENAME', KEYS[6], KEYS[3])
  else
    local kv = redis.call('HGETALL', KEYS[6])
    for i = 1, #kv, 2 do redis.call('HSET', KEYS[3], kv[i], kv[i + 1]) end
    redis.call('DEL', KEYS[6])
  end
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
end
redis.call('HSET', KEYS[1], 'seq', ARGV[7])
if ARGV[8] ~= nil and ARGV[8] ~= '' then
  redis.call('HSET', KEYS[1], 'impxid', ARGV[8], 'impfrom', tonumber(ARGV[7]) - n + 1, 'impto', ARGV[7])
  redis.call('HDEL', KEYS[1], 'impwake')
end
redis.call('EXPIRE', KEYS[1], ${SESSION_STATE_TTL_SECONDS})
local wake = 0
if redis.call('HGET', KEYS[1], 'armed') ~= '1' then
  redis.call('HSET', KEYS[1], 'armed', '1')
  redis.call('ZADD', KEYS[4], tonumber(ARGV[1]), ARGV[2])
  wake = 1
end
return {'OK', wake}
`;

// Settles the import an earlier PUBLISH_IMPORT marked in the session's state (impxid: its
// Postgres transaction), once that transaction is known to have ended (ARGV[2]). Committed: the
// mark goes. Aborted: its entries, at the inbox head (seqs impfrom … impto), are removed, at most
// ARGV[3] a call, with the idempotency ids that name them (a later post of such an id would have
// been answered as a duplicate of a message never archived); the mark goes with the last. Entries
// behind them were posted since and stay (the import's seqs are then a gap); when there are none,
// the counter goes back to before the import, and an inbox left empty is no longer armed.
// KEYS: sess, inbox, ids, armed. ARGV: xid, how it ended, chunk, removed before, armed member.
// Returns {removed, more}.
const SETTLE_IMPORT = `
if redis.call('HGET', KEYS[1], 'impxid') ~= ARGV[1] then return {0, 0} end
local removed = 0
if ARGV[2] == 'aborted' then
  local from = tonumber(redis.call('HGET', KEYS[1], 'impfrom'))
  local to = tonumber(redis.call('HGET', KEYS[1], 'impto'))
  local max = tonumber(ARGV[3])
  while from and to and removed < max do
    local e = redis.call('LINDEX', KEYS[2], 0)
    if not e then break end
    local sp = string.find(e, ' ', 1, true)
    local seq = sp and tonumber(string.sub(e, 1, sp - 1))
    if not seq or seq < from or seq > to then break end
    redis.call('LPOP', KEYS[2])
    removed = removed + 1
    local sp2 = string.find(e, ' ', sp + 1, true)
    local ok, m = pcall(cjson.decode, string.sub(e, (sp2 or sp) + 1))
    if ok and type(m) == 'table' and type(m.id) == 'string' then
      local v = redis.call('HGET', KEYS[3], m.id)
      if v and string.sub(v, 1, #tostring(seq) + 1) == tostring(seq) .. ' ' then
        redis.call('HDEL', KEYS[3], m.id)
      end
    end
  end
  if removed >= max then return {removed, 1} end
  -- Removed here, and nothing handed out after them: their seqs go back, for the retry (never
  -- below the archived mark: a reset, or an older worker, may have taken them first).
  if from and to and removed + tonumber(ARGV[4]) > 0 and tonumber(redis.call('HGET', KEYS[1], 'seq')) == to then
    redis.call('HSET', KEYS[1], 'seq', math.max(from - 1, tonumber(redis.call('HGET', KEYS[1], 'archived') or '0')))
  end
  -- Armed by the publish for entries that are gone: the next accept would ask for no flush.
  if redis.call('LLEN', KEYS[2]) == 0 then
    redis.call('HSET', KEYS[1], 'armed', '0')
    redis.call('ZREM', KEYS[4], ARGV[5])
  end
end
redis.call('HDEL', KEYS[1], 'impxid', 'impfrom', 'impto', 'impwake')
return {removed, 0}
`;

type Scripted = Redis & {
  mnemosLifecycleClear?: (
    ...args: Array<string | number>
  ) => Promise<[number, string, number, number?, number?]>;
  mnemosLifecyclePublish?: (...args: Array<string | number>) => Promise<Array<string | number>>;
  mnemosLifecycleSettle?: (...args: Array<string | number>) => Promise<[number, number]>;
};

type Scripts = Required<
  Pick<Scripted, 'mnemosLifecycleClear' | 'mnemosLifecyclePublish' | 'mnemosLifecycleSettle'>
>;

function scripted(redis: Redis): Scripts {
  const r = redis as Scripted;
  if (typeof r.mnemosLifecycleClear !== 'function') {
    redis.defineCommand('mnemosLifecycleClear', { numberOfKeys: 5, lua: CLEAR_TO });
    redis.defineCommand('mnemosLifecyclePublish', { numberOfKeys: 6, lua: PUBLISH_IMPORT });
    redis.defineCommand('mnemosLifecycleSettle', { numberOfKeys: 4, lua: SETTLE_IMPORT });
  }
  return r as Scripts;
}

export interface ClearResult {
  cleared: boolean;
  /** Highest seq handed out before the clear (null when nothing was cleared or nothing known). */
  topSeq: number | null;
  /** Inbox entries accepted after the cleared history (kept, armed for a flush): when nothing was
   * cleared (the state was there already), the whole inbox. */
  left: number;
  /** Inbox entries of the cleared history removed before they were archived. */
  removed: number;
  /** Inbox entries without a seq (no message: dead letters) removed with it. */
  unreadable: number;
}

export async function clearToGeneration(
  redis: Redis,
  keys: InboxKeys,
  deadKey: string,
  generation: number,
  clearedThroughSeq: number,
  deleted: boolean,
): Promise<ClearResult> {
  const [cleared, top, left, removed, unreadable] = await scripted(redis).mnemosLifecycleClear(
    keys.sess,
    keys.inbox,
    keys.ids,
    keys.armed,
    deadKey,
    generation,
    keys.member,
    clearedThroughSeq,
    deleted ? '1' : '0',
    DELETED_STATE_TTL_SECONDS,
  );
  const topSeq = top === '' ? null : Number(top);
  return {
    cleared: Number(cleared) === 1,
    left: Number(left),
    removed: Number(removed ?? 0),
    unreadable: Number(unreadable ?? 0),
    topSeq: topSeq !== null && Number.isFinite(topSeq) && topSeq > 0 ? topSeq : null,
  };
}

export type PublishResult =
  { kind: 'ok'; wake: boolean } | { kind: 'seed' | 'busy' | 'gen' | 'moved' | 'lost' };

export async function publishStagedImport(
  redis: Redis,
  keys: InboxKeys,
  staged: { list: string; ids: string },
  a: {
    generation: number;
    /** The counter as read when the entries were numbered; publishing fails if it moved. */
    expectedSeq: string;
    /** The entries' seqs are baseSeq + 1 … baseSeq + count (baseSeq ≥ expectedSeq). */
    baseSeq: string;
    count: number;
    idsTtlSeconds: number;
    /** The import's Postgres transaction (txid_current), marked in the state until settled. */
    xid: string;
  },
): Promise<PublishResult> {
  const r = await scripted(redis).mnemosLifecyclePublish(
    keys.sess,
    keys.inbox,
    keys.ids,
    keys.armed,
    staged.list,
    staged.ids,
    Date.now(),
    keys.member,
    a.idsTtlSeconds,
    String(a.generation),
    a.expectedSeq,
    a.count,
    String(BigInt(a.baseSeq) + BigInt(a.count)),
    a.xid,
  );
  if (r[0] === 'OK') return { kind: 'ok', wake: Number(r[1]) === 1 };
  return { kind: String(r[0]).toLowerCase() as 'seed' | 'busy' | 'gen' | 'moved' | 'lost' };
}

const SETTLE_CHUNK = 1000;

/**
 * An import publishes its messages into the inbox from inside its Postgres transaction (under the
 * session's row lock, so that no drain, reset or delete interleaves), and marks the session's
 * state with that transaction's id. Whoever next holds the row lock (a drain, a reset's or
 * another import's) settles it before reading the inbox: the transaction has ended by then, and
 * Postgres tells how (txid_status). Committed, the messages are the session's; aborted (its COMMIT
 * failed, its connection or its API process died first), they are removed, so that a failed
 * import stores nothing, as its 503 says, and its retry finds the session empty. Before, the
 * drain archived them anyway, without the summary and the session row the transaction had
 * written (its summary was lost and made again by the LLM from seq 0), and the retry answered 409
 * `session_not_empty`. Returns the entries removed (0 when there was nothing to settle, or the
 * transaction still runs).
 */
export async function settleImport(
  q: Queryable,
  redis: Redis,
  keys: InboxKeys,
  /** The mark, when the caller has just read it (the drain's inbox read). */
  known?: string,
): Promise<number> {
  const xid = known ?? (await redis.hget(keys.sess, 'impxid'));
  if (xid === null) return 0;
  const status = await importStatus(q, xid);
  if (status === 'in progress') return 0;
  let removed = 0;
  for (;;) {
    // Null: a transaction too old for Postgres to remember is long over; keep what it published.
    const [n, more] = await scripted(redis).mnemosLifecycleSettle(
      keys.sess,
      keys.inbox,
      keys.ids,
      keys.armed,
      xid,
      status === 'aborted' ? 'aborted' : 'committed',
      SETTLE_CHUNK,
      removed,
      keys.member,
    );
    removed += Number(n);
    if (Number(more) !== 1) return removed;
  }
}

/** How the import transaction `xid` ended ('committed', 'aborted'), 'in progress', or null (forgotten). */
export async function importStatus(q: Queryable, xid: string): Promise<string | null> {
  const r = await q.query<{ s: string | null }>('SELECT txid_status($1::bigint) AS s', [xid]);
  return r.rows[0]?.s ?? null;
}
