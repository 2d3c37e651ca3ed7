import type { RequestHandler } from 'express';
import type { CoreDeps } from './deps.js';
import { AppError } from './errors.js';
import { monotonicNow } from './time.js';

/**
 * Requests per API key per minute (RATE_LIMIT_PER_MIN; 0 = off), counted in Redis so every API
 * process shares the budget (fixed one-minute windows of Redis's clock).
 *
 * Redis is not on the request path: each process decides from the last count Redis returned for
 * the key plus its own increments not yet acknowledged, and sends its increments as one script
 * call (COUNT) per key every FLUSH_MS. Within one process the count is exact; across processes a request can pass
 * up to FLUSH_MS plus a round trip after the budget is spent elsewhere, so a burst that reaches N
 * processes at once, before any has heard of the others, passes up to N × the budget (README). When Redis is unreachable
 * the limiter lets requests through (the write path answers 503 on its own): failing closed would
 * turn a Redis blip into a full outage for reads.
 */
export const FLUSH_MS = 50;

/**
 * Lua: adds ARGV[1] to the count of the current minute of the key whose counters are named
 * `KEYS[1]:<minute>` (2 min) and returns the count, the minute and Redis's time (ms). The minute
 * is Redis's (TIME), one clock for every process: named after each process's own minute, three API
 * processes with skewed clocks counted in three windows and allowed three times the budget.
 */
const COUNT = `
local tm = redis.call('TIME')
local ms = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local minute = math.floor(ms / 60000)
local key = KEYS[1] .. ':' .. minute
local n = redis.call('INCRBY', key, tonumber(ARGV[1]))
redis.call('EXPIRE', key, 120)
return {n, minute, ms}
`;

interface Window {
  /** Redis's minute this window counts (as far as this process knows). */
  minute: number;
  /** Count Redis last returned for this key and minute (all processes). */
  known: number;
  /** Local increments not yet sent. */
  pending: number;
  /** Local increments sent, reply not yet received. */
  sending: number;
}

/**
 * `clock` only measures time between Redis's answers, which say what time it is on Redis: the
 * window a request falls in is `clock()` plus the offset to Redis's clock the last answer gave
 * (before the first, the process's own minute). Monotonic by default, so a wall clock stepped
 * back or ahead does not move the window either.
 */
export function rateLimit(
  deps: Pick<CoreDeps, 'config' | 'redis' | 'metrics'>,
  clock: () => number = monotonicNow,
): RequestHandler {
  const limit = deps.config.rateLimitPerMin;
  const windows = new Map<string, Window>();
  /** Redis's time minus `clock()`, from the last answer. */
  let offset = 0;
  let timer: NodeJS.Timeout | null = null;
  const redisMinute = () => Math.floor((clock() + offset) / 60_000);

  const flush = () => {
    timer = null;
    for (const [keyId, w] of windows) {
      if (w.pending === 0) continue;
      const n = w.pending;
      w.pending = 0;
      w.sending += n;
      deps.redis
        .eval(COUNT, 1, `${deps.config.prefix}:rl:${keyId}`, n)
        .then(
          (r) => {
            const [count, minute, at] = (r as unknown[]).map(Number) as [number, number, number];
            offset = at - clock();
            const cur = windows.get(keyId);
            if (!cur) return;
            if (minute === cur.minute) cur.known = Math.max(cur.known, count);
            // Redis is in a later minute than this window (the clock or its offset was behind), or
            // this window is ahead of Redis's time as it now reads (a clock ahead, before the
            // first answer): the count is of Redis's minute, and so is the window from now on. An
            // answer of the minute before is a count sent just before the window turned: dropped.
            else if (minute > cur.minute || redisMinute() < cur.minute) {
              cur.minute = minute;
              cur.known = count;
            }
          },
          () => undefined,
        )
        .finally(() => {
          w.sending -= n;
        });
    }
  };

  return (_req, res, next) => {
    // Counted once per request, however many routers sharing the prefix it passes.
    if (limit <= 0 || res.locals.rateCounted === true) return next();
    res.locals.rateCounted = true;
    const keyId = res.locals.keyId as string | undefined;
    if (!keyId) return next();
    const now = clock() + offset;
    const minute = Math.floor(now / 60_000);
    let w = windows.get(keyId);
    // Forward only: a window an answer moved ahead of this estimate stays.
    if (!w || minute > w.minute) {
      if (windows.size > 50_000) windows.clear();
      w = { minute, known: 0, pending: 0, sending: 0 };
      windows.set(keyId, w);
    }
    const used = w.known + w.sending + w.pending;
    res.setHeader('x-ratelimit-limit', String(limit));
    if (used >= limit) {
      deps.metrics.rateLimited.inc();
      const retryAfter = Math.min(60, Math.max(1, Math.ceil(((w.minute + 1) * 60_000 - now) / 1000)));
      res.setHeader('x-ratelimit-remaining', '0');
      throw new AppError(
        429,
        'rate_limited',
        `more than ${limit} requests per minute for this API key`,
        { limit, retry_after_seconds: retryAfter },
        { 'retry-after': String(retryAfter) },
      );
    }
    w.pending++;
    timer ??= setTimeout(flush, FLUSH_MS);
    timer.unref?.();
    res.setHeader('x-ratelimit-remaining', String(Math.max(0, limit - used - 1)));
    next();
  };
}
