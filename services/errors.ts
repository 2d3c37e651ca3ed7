import { isPgUnavailable } from '../db/pool.js';

/**
 * The one application error class. Every 4xx/5xx the API sends is an AppError rendered as
 * `{"error":{"code","message","details"}}`; anything else becomes a generic 500.
 */
export class AppError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly details?: unknown,
    readonly headers?: Record<string, string>,
  ) {
    super(message);
    this.name = 'AppError';
  }
}

export const notFound = (what = 'resource') => new AppError(404, 'not_found', `${what} not found`);

/** A dependency (Postgres, Redis) cannot take the request right now; clients should retry. */
export const unavailable = (dependency: string, retryAfterSeconds = 2) =>
  new AppError(
    503,
    'unavailable',
    `${dependency} is unavailable, retry later`,
    { dependency },
    { 'retry-after': String(retryAfterSeconds) },
  );

/**
 * Redis and Postgres faults are 503s with retry-after, never 500s: `err` as that AppError when it
 * says a dependency cannot be reached, else unchanged. The error handler applies it to whatever
 * reaches it (services/http-errors.ts), so routes need not; services that other callers use too
 * (acceptMessages, importSession) apply it themselves.
 */
export function asDependencyError(err: unknown): unknown {
  if (err instanceof AppError) return err;
  if (isPgUnavailable(err)) return unavailable('postgres');
  const msg = err instanceof Error ? err.message : '';
  // ioredis's MaxRetriesPerRequestError says "Reached the max retries per request limit": matched
  // by its name too, since its message does not carry it.
  if (
    (err instanceof Error && err.name === 'MaxRetriesPerRequestError') ||
    /Stream isn't writeable|Connection is closed|ECONNREFUSED|Command timed out|max retries per request|ETIMEDOUT|ECONNRESET/i.test(
      msg,
    )
  ) {
    return unavailable('redis');
  }
  return err;
}
