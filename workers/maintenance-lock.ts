import { randomUUID } from 'node:crypto';
import type { Redis } from '../services/redis.js';

/**
 * Maintenance tasks that take locks on the big tables (CREATE/DROP INDEX CONCURRENTLY, ANALYZE)
 * run one at a time across the fleet. A pass whose index build waits out an old snapshot can
 * outlast its 10-minute interval, and the next one, on another worker, built the same index at
 * once or deadlocked with it (a tester saw both); `table-statistics` and `search-indexes` once
 * deadlocked each other. A pass that finds another running is skipped: the next one comes on
 * schedule.
 */
export const TABLE_LOCKING_TASKS = new Set(['search-indexes', 'ann-indexes', 'table-statistics']);

/** How long the lock outlives a worker that died holding it; renewed every third of it. */
export const MAINTENANCE_LOCK_MS = 60_000;

const RENEW = `if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0`;
const RELEASE = `if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1]) end
return 0`;

export type Skipped = { skipped: string };

/**
 * Runs `task` holding the Redis lock `key` (SET NX with an expiry, renewed while it runs), or
 * returns `{skipped}` naming the reason when another holder has it.
 */
export async function exclusively<T>(
  redis: Redis,
  key: string,
  task: () => Promise<T>,
  lockMs = MAINTENANCE_LOCK_MS,
): Promise<T | Skipped> {
  const token = randomUUID();
  if ((await redis.set(key, token, 'PX', lockMs, 'NX')) !== 'OK') {
    return { skipped: 'another table-locking maintenance task is running' };
  }
  // A renewal that fails (Redis away for a moment) is retried on the next tick; a lock that
  // expired meanwhile lets another pass start, as before this lock existed.
  const renew = setInterval(
    () => void redis.eval(RENEW, 1, key, token, String(lockMs)).catch(() => undefined),
    Math.max(10, Math.floor(lockMs / 3)),
  );
  try {
    return await task();
  } finally {
    clearInterval(renew);
    await redis.eval(RELEASE, 1, key, token).catch(() => undefined);
  }
}
