import type { RequestHandler } from 'express';
import type { CoreDeps } from './deps.js';
import { AppError } from './errors.js';

/**
 * Requests per API key per minute (RATE_LIMIT_PER_MIN; 0 = off), counted in Redis so every API
 * process shares the budget: one INCR per request on a per-key, per-minute counter. When Redis is
 * unreachable the limiter lets requests through (the write path answers 503 on its own); failing
 * closed would turn a Redis blip into a full outage for reads.
 */
export function rateLimit(deps: Pick<CoreDeps, 'config' | 'redis' | 'metrics'>): RequestHandler {
  const limit = deps.config.rateLimitPerMin;
  return async (_req, res, next) => {
    // Counted once per request, however many routers sharing the prefix it passes.
    if (limit <= 0 || res.locals.rateCounted === true) return next();
    res.locals.rateCounted = true;
    const keyId = res.locals.keyId as string | undefined;
    if (!keyId) return next();
    const now = Date.now();
    const minute = Math.floor(now / 60_000);
    const key = `${deps.config.prefix}:rl:${keyId}:${minute}`;
    let count: number;
    try {
      const r = await deps.redis.multi().incr(key).expire(key, 120).exec();
      count = Number(r?.[0]?.[1] ?? 0);
    } catch {
      return next();
    }
    res.setHeader('x-ratelimit-limit', String(limit));
    res.setHeader('x-ratelimit-remaining', String(Math.max(0, limit - count)));
    if (count > limit) {
      deps.metrics.rateLimited.inc();
      const retryAfter = Math.max(1, Math.ceil(((minute + 1) * 60_000 - now) / 1000));
      throw new AppError(
        429,
        'rate_limited',
        `more than ${limit} requests per minute for this API key`,
        { limit, retry_after_seconds: retryAfter },
        { 'retry-after': String(retryAfter) },
      );
    }
    next();
  };
}
