import type { RequestHandler } from 'express';
import type { CoreDeps } from './deps.js';
import { AppError } from './errors.js';

/**
 * Requests per API key per minute (RATE_LIMIT_PER_MIN; 0 = off), counted in Redis so every API
 * process shares the budget (fixed one-minute windows).
 *
 * Redis is not on the request path: each process decides from the last count Redis returned for
 * the key plus its own increments not yet acknowledged, and sends its increments as one INCRBY per
 * key every FLUSH_MS. Within one process the count is exact; across processes a request can pass
 * up to FLUSH_MS plus a round trip after the budget is spent elsewhere, so a burst that reaches N
 * processes at once, before any has heard of the others, passes up to N × the budget (README). When Redis is unreachable
 * the limiter lets requests through (the write path answers 503 on its own): failing closed would
 * turn a Redis blip into a full outage for reads.
 */
export const FLUSH_MS = 50;

interface Window {
  minute: number;
  /** Count Redis last returned for this key and minute (all processes). */
  known: number;
  /** Local increments not yet sent. */
  pending: number;
  /** Local increments sent, reply not yet received. */
  sending: number;
}

export function rateLimit(
  deps: Pick<CoreDeps, 'config' | 'redis' | 'metrics'>,
  clock: () => number = Date.now,
): RequestHandler {
  const limit = deps.config.rateLimitPerMin;
  const windows = new Map<string, Window>();
  let timer: NodeJS.Timeout | null = null;

  const flush = () => {
    timer = null;
    for (const [keyId, w] of windows) {
      if (w.pending === 0) continue;
      const n = w.pending;
      w.pending = 0;
      w.sending += n;
      const key = `${deps.config.prefix}:rl:${keyId}:${w.minute}`;
      deps.redis
        .multi()
        .incrby(key, n)
        .expire(key, 120)
        .exec()
        .then(
          (r) => {
            w.known = Math.max(w.known, Number(r?.[0]?.[1] ?? 0));
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
    const now = clock();
    const minute = Math.floor(now / 60_000);
    let w = windows.get(keyId);
    if (!w || w.minute !== minute) {
      if (windows.size > 50_000) windows.clear();
      w = { minute, known: 0, pending: 0, sending: 0 };
      windows.set(keyId, w);
    }
    const used = w.known + w.sending + w.pending;
    res.setHeader('x-ratelimit-limit', String(limit));
    if (used >= limit) {
      deps.metrics.rateLimited.inc();
      const retryAfter = Math.max(1, Math.ceil(((minute + 1) * 60_000 - now) / 1000));
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
