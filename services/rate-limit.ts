import type { RequestHandler } from 'express';
import type { CoreDeps } from './deps.js';
import { AppError } from './errors.js';

/**
 * Requests per API key per minute (RATE_LIMIT_PER_MIN; 0 = off), counted in Redis so every API
 * process shares the budget (fixed one-minute windows, one INCR per request).
 *
 * The INCR is not awaited on the request path: each process decides from the last count Redis
 * returned for the key plus its own increments still in flight, so a request pays no Redis round
 * trip. Within one process the count is exact; across processes a request can pass up to one
 * round trip after the budget is spent elsewhere. When Redis is unreachable the limiter lets
 * requests through (the write path answers 503 on its own); failing closed would turn a Redis
 * blip into a full outage for reads.
 */
export function rateLimit(
  deps: Pick<CoreDeps, 'config' | 'redis' | 'metrics'>,
  clock: () => number = Date.now,
): RequestHandler {
  const limit = deps.config.rateLimitPerMin;
  const windows = new Map<string, { minute: number; known: number; inFlight: number }>();
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
      w = { minute, known: 0, inFlight: 0 };
      windows.set(keyId, w);
    }
    const used = w.known + w.inFlight;
    if (used >= limit) {
      deps.metrics.rateLimited.inc();
      const retryAfter = Math.max(1, Math.ceil(((minute + 1) * 60_000 - now) / 1000));
      res.setHeader('x-ratelimit-limit', String(limit));
      res.setHeader('x-ratelimit-remaining', '0');
      throw new AppError(
        429,
        'rate_limited',
        `more than ${limit} requests per minute for this API key`,
        { limit, retry_after_seconds: retryAfter },
        { 'retry-after': String(retryAfter) },
      );
    }
    const window = w;
    window.inFlight++;
    const key = `${deps.config.prefix}:rl:${keyId}:${minute}`;
    deps.redis
      .multi()
      .incr(key)
      .expire(key, 120)
      .exec()
      .then(
        (r) => {
          window.known = Math.max(window.known, Number(r?.[0]?.[1] ?? 0));
        },
        () => undefined,
      )
      .finally(() => {
        window.inFlight--;
      });
    res.setHeader('x-ratelimit-limit', String(limit));
    res.setHeader('x-ratelimit-remaining', String(Math.max(0, limit - used - 1)));
    next();
  };
}
