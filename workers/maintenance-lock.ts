import { randomUUID } from 'node:crypto';
import type { Redis } from '../services/redis.js';

/**
 * The big tables each maintenance task takes locks on (CREATE/DROP INDEX CONCURRENTLY, ANALYZE):
 * tasks that share a table run one at a time across the fleet. A pass whose index build waits out
 * an old snapshot can outlast its 10-minute interval, and the next one, on another worker, built
 * the same index at once or deadlocked with it (a tester saw both); `table-statistics` and
 * `search-indexes` once deadlocked each other.
 */
export const TASK_TABLES: Record<string, readonly string[]> = {
  'search-indexes': ['messages'],
  'search-indexes-gone': ['messages'],
  'ann-indexes': ['message_vectors'],
  'ann-indexes-gone': ['message_vectors'],
  'table-statistics': ['messages', 'message_vectors'],
  // Not a table: two passes erasing the same tenants at once only double the work.
  'tenant-erasures': ['tenant-erasures'],
};

/** The Redis keys of the table locks a maintenance task of `kind` holds; none: it runs unlocked. */
export function maintenanceLockKeys(prefix: string, kind: string): string[] {
  return (TASK_TABLES[kind] ?? []).map((t) => `${prefix}:maintenance:lock:${t}`);
}

/** How long a lock outlives a worker that died holding it; renewed every third of it. */
export const MAINTENANCE_LOCK_MS = 60_000;
const POLL_MS = 500;

const RENEW = `for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('PEXPIRE', key, ARGV[2]) end
end
return 0`;
const RELEASE = `for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 0`;
// All or none: a task never holds one of its tables while it waits for another.
const ACQUIRE = `for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then return 0 end
end
for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[1], 'PX', ARGV[2]) end
return 1`;

export type Skipped = { skipped: string };

/**
 * Runs `task` holding the Redis locks `keys` (set together with an expiry, renewed while it runs).
 * When another holder has one of them, waits up to `waitMs` for it (polling), then returns
 * `{skipped}`: a scheduled pass is skipped at once (the next comes on schedule); one asked for
 * after a delete waits, so that the index it is to drop goes now rather than at the next.
 */
export async function exclusively<T>(
  redis: Redis,
  keys: readonly string[],
  task: () => Promise<T>,
  opts: { waitMs?: number; lockMs?: number; signal?: AbortSignal } = {},
): Promise<T | Skipped> {
  const lockMs = opts.lockMs ?? MAINTENANCE_LOCK_MS;
  const token = randomUUID();
  const until = Date.now() + (opts.waitMs ?? 0);
  while ((await redis.eval(ACQUIRE, keys.length, ...keys, token, String(lockMs))) !== 1) {
    if (Date.now() >= until || opts.signal?.aborted)
      return { skipped: 'another maintenance task on the same tables is running' };
    await new Promise((r) => setTimeout(r, POLL_MS));
  }
  // A renewal that fails (Redis away for a moment) is retried on the next tick; a lock that
  // expired meanwhile lets another pass start, as before these locks existed.
  const renew = setInterval(
    () => void redis.eval(RENEW, keys.length, ...keys, token, String(lockMs)).catch(() => undefined),
    Math.max(10, Math.floor(lockMs / 3)),
  );
  try {
    return await task();
  } finally {
    clearInterval(renew);
    await redis.eval(RELEASE, keys.length, ...keys, token).catch(() => undefined);
  }
}
