import { isPgUnavailable, pgCode } from '../db/pool.js';

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
 * Redis replies that refuse a command for now (out of memory under `noeviction`, a replica after a
 * failover, a failing snapshot, still loading, a busy script, a cluster in transition).
 */
export const REDIS_TRANSIENT_REPLY =
  /^(?:LOADING|BUSY|OOM|MISCONF|READONLY|MASTERDOWN|TRYAGAIN|CLUSTERDOWN)\b/;

/**
 * Postgres states that pass (a tester saw each as a 500): a read-only database or a standby after a
 * failover (25006), a statement or lock timeout set on the role or database (57014, 55P03),
 * insufficient resources (53xxx: disk full, out of memory, too many connections), serialisation
 * failures and deadlocks (40001, 40P01).
 */
const PG_TRANSIENT = /^(?:25006|57014|55P03|53\d{3}|40001|40P01)$/;

/**
 * Redis and Postgres faults are 503s with retry-after, never 500s: `err` as that AppError when it
 * says a dependency cannot be reached, else unchanged. The error handler applies it to whatever
 * reaches it (services/http-errors.ts), so routes need not; services that other callers use too
 * (acceptMessages, importSession) apply it themselves.
 */
export function asDependencyError(err: unknown): unknown {
  if (err instanceof AppError) return err;
  // The Postgres error stays as the cause: the error handler logs its SQLSTATE and message, and
  // answers a read-only database as such.
  if (isPgUnavailable(err) || PG_TRANSIENT.test(pgCode(err) ?? '')) {
    return Object.assign(unavailable('postgres'), { cause: err });
  }
  const msg = err instanceof Error ? err.message : '';
  if (REDIS_TRANSIENT_REPLY.test(msg)) return unavailable('redis');
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
