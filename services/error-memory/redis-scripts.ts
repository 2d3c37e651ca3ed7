/**
 * Lua run by the error-memory store. Every step that must not interleave with a concurrent
 * write, renewal or delete is one script: a record is never resurrected by touching a key that
 * expired a moment ago (HSET/PEXPIRE only after EXISTS, inside the script), and a dedupe key is
 * only renewed or deleted while it still points at the record in hand. Scripts build a record's
 * dedupe key from its `dedupe` field (and READ_BY_DEDUPE_SCRIPT the record's key from the id a
 * dedupe key holds), so they assume a standalone Redis (not Cluster).
 */

/**
 * Merge a duplicate into an existing record: hits, time, keywords (the union, up to the maximum)
 * and session (when given) always. The attempt's action, outcome and cause replace the record's
 * together, a cause left out clearing the old one (an earlier attempt's cause is not this fix's),
 * with the error class and embedding computed from the record's symptom and that cause; except
 * that a failed or abandoned attempt never replaces a resolved fix (the fix is what a later
 * lookup needs; a newer fix does replace it).
 * KEYS: record, dedupe key. ARGV: id, ttl ms, now ms, action, outcome, has cause (0/1), cause,
 * keywords joined by \31, max keywords, session id ('' = keep), error class, embedding ('' =
 * keep).
 * Returns the merged record (HGETALL's list: its caller re-indexes it without reading it again),
 * or 0 when the record is gone.
 */
export const MERGE_SCRIPT = String.raw`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'hits', 1)
redis.call('HSET', KEYS[1], 'last_hit_ms', ARGV[3])
if redis.call('HGET', KEYS[1], 'outcome') ~= 'resolved' or ARGV[5] == 'resolved' then
  redis.call('HSET', KEYS[1], 'action', ARGV[4], 'outcome', ARGV[5], 'error_class', ARGV[11])
  if ARGV[6] == '1' then
    redis.call('HSET', KEYS[1], 'cause', ARGV[7])
  else
    redis.call('HDEL', KEYS[1], 'cause')
  end
  if ARGV[12] ~= '' then redis.call('HSET', KEYS[1], 'embedding', ARGV[12]) end
end
if ARGV[10] ~= '' then redis.call('HSET', KEYS[1], 'session_id', ARGV[10]) end
if ARGV[8] ~= '' then
  local max = tonumber(ARGV[9])
  local list, seen = {}, {}
  local function add(s)
    for k in string.gmatch(s, '[^\31]+') do
      if not seen[k] and #list < max then
        seen[k] = true
        list[#list + 1] = k
      end
    end
  end
  local current = redis.call('HGET', KEYS[1], 'keywords')
  if current then add(current) end
  add(ARGV[8])
  redis.call('HSET', KEYS[1], 'keywords', table.concat(list, '\31'))
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('PEXPIRE', KEYS[2], ARGV[2]) end
return redis.call('HGETALL', KEYS[1])
`;

/**
 * A write's first step: the id its dedupe key holds and that record as it is (HGETALL's list,
 * empty when the record is gone), in one round trip.
 * KEYS: dedupe key. ARGV: record key prefix (`T:rec:`). Returns nil when there is no such key.
 */
export const READ_BY_DEDUPE_SCRIPT = String.raw`
local id = redis.call('GET', KEYS[1])
if not id then return false end
return {id, redis.call('HGETALL', ARGV[1] .. id)}
`;

/**
 * A hit: renew the record and its dedupe key, stamp last_hit_ms, and move the record up to now
 * in the term keys given (those it is found through; never adding it to one it has left).
 * KEYS: record, term keys (none for a read by id). ARGV: id, ttl ms, now ms, dedupe key prefix.
 * Returns 1, or 0 when gone.
 */
export const RENEW_SCRIPT = String.raw`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'last_hit_ms', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
local d = redis.call('HGET', KEYS[1], 'dedupe')
if d then
  local dk = ARGV[4] .. d
  local v = redis.call('GET', dk)
  if v == ARGV[1] then
    redis.call('PEXPIRE', dk, ARGV[2])
  elseif not v then
    redis.call('SET', dk, ARGV[1], 'PX', ARGV[2])
  end
end
for i = 2, #KEYS do redis.call('ZADD', KEYS[i], 'XX', 'GT', ARGV[3], ARGV[1]) end
return 1
`;

/**
 * Delete a record, its dedupe key and its index entries, in one step: the term keys are named by
 * words of the record (`term:<word>`, `tterm:<tool>:<word>`), which must not outlive it until the
 * sweep; an index key left empty is forgotten in the registry (Redis drops an empty set itself).
 * The caller computed the index keys from the record at a merge count (`hits`): a merge since may
 * have indexed it under other terms, so then nothing is done and -1 says to read it again.
 * KEYS: record, registry of index keys, the record's index keys (tool, resolved, terms; none
 * when unknown). ARGV: id, dedupe key prefix, hits ('' = whatever the record holds now).
 * Returns the record's tool name, nil when it did not exist, or -1.
 */
export const DELETE_SCRIPT = String.raw`
local f = redis.call('HMGET', KEYS[1], 'tool_name', 'dedupe', 'hits')
if ARGV[3] ~= '' and f[3] and f[3] ~= ARGV[3] then return -1 end
if redis.call('DEL', KEYS[1]) == 0 then return false end
if f[2] then
  local dk = ARGV[2] .. f[2]
  if redis.call('GET', dk) == ARGV[1] then redis.call('DEL', dk) end
end
for i = 3, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[2], KEYS[i]) end
end
return f[1] or ''
`;

/** Delete KEYS[1] only while it holds ARGV[1] (a dedupe key whose record vanished). */
export const COMPARE_AND_DELETE_SCRIPT = String.raw`
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
`;

/**
 * After a merge: take a live record out of the term keys it is no longer indexed under, and
 * forget a key in the registry once it is empty. Only while the record is still at the merge
 * count the caller computed the stale keys from: a later merge may have put a term back, and
 * its own writer cleans up after it.
 * KEYS: record, registry of index keys, stale term keys. ARGV: id, hits.
 * Returns 1, or 0 when the record is gone or has moved on.
 */
export const DROP_STALE_TERMS_SCRIPT = String.raw`
if redis.call('HGET', KEYS[1], 'hits') ~= ARGV[2] then return 0 end
for i = 3, #KEYS do
  redis.call('ZREM', KEYS[i], ARGV[1])
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[2], KEYS[i]) end
end
return 1
`;

/**
 * Remove dead ids from one index key; forget the key in the registry once it is empty.
 * KEYS: index key, registry set. ARGV: ids.
 */
export const SWEEP_KEY_SCRIPT = String.raw`
for i = 1, #ARGV, 500 do
  redis.call('ZREM', KEYS[1], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], KEYS[1]) end
return 1
`;

/**
 * Forget a tenant in the tenant registry (and its layout mark) once it has no index left.
 * KEYS: all index, registry of index keys, dead set, pending set, tenant registry, layout mark.
 * ARGV: tenant id.
 */
export const FORGET_TENANT_SCRIPT = String.raw`
if redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4]) == 0 then
  redis.call('SREM', KEYS[5], ARGV[1])
  redis.call('DEL', KEYS[6])
  return 1
end
return 0
`;

/**
 * A new record is about to be saved: register it as pending and its tenant in the registry; a
 * tenant with no record yet starts on the current layout (its layout mark is set).
 * KEYS: pending set, tenant registry, all index, layout mark. ARGV: now ms, id, tenant id, layout.
 */
export const PENDING_SCRIPT = String.raw`
if redis.call('EXISTS', KEYS[3]) == 0 then redis.call('SET', KEYS[4], ARGV[4]) end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 1
`;
