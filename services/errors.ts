import { PgDateStyleError, PgNoAnswerError, isPgUnavailable, isPoolWaitTimeout, pgCode } from '../db/pool.js';

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
 * failover, a failing snapshot, still loading, a busy script, a cluster in transition). A MULTI
 * one of whose commands Redis refused as it queued them (out of memory, read-only) fails as a
 * whole with EXECABORT, which node-redis reports without the refusal: error memory answered
 * 500 for a full Redis, and a purge it had done was told a server fault. mnemos's transactions
 * are fixed code, so a command they queue is never refused as malformed.
 */
export const REDIS_TRANSIENT_REPLY =
  /(?:^|: -)(?:LOADING|BUSY|OOM|MISCONF|READONLY|MASTERDOWN|TRYAGAIN|CLUSTERDOWN|EXECABORT)\b/;

/**
 * Redis 7 answers a script's refused call with the refusal itself (`OOM command not allowed ...
 * script: <sha>`); Redis 6.2 wraps it (`ERR Error running script (call to f_<sha>):
 * @user_script:3: -OOM command not allowed ...`), and both forms are matched.
 *
 * Of those, the replies that refuse a write while reads still go through: out of memory under
 * `noeviction` (which still allows what frees memory, DEL, ZREM, SREM, but not SET, SADD, HSET,
 * nor any command queued in a MULTI), a read-only replica, a failing snapshot; EXECABORT is a
 * MULTI refused so.
 */
export const REDIS_WRITE_REFUSED = /(?:^|: -)(?:OOM|READONLY|MISCONF|EXECABORT)\b/;

/**
 * An ACL refusal, plain or from within a script. A command a script calls is refused without the
 * NOPERM word: Redis 6.2 and 7.0 say `The user executing the script can't run this command or
 * subcommand` (or `can't access at least one of the keys mentioned in the command arguments`),
 * Redis 7.2+ `ACL failure in script: User x has no permissions to run the 'time' command`.
 */
const REDIS_NO_PERMISSION =
  /(?:^|: -)NOPERM\b|The user executing the script can't (?:run this command|access at least one of the keys|publish to the channel)|\bACL failure in script\b/;

/**
 * Postgres states that pass (a tester saw each as a 500): a read-only database or a standby after a
 * failover (25006), a statement or lock timeout set on the role or database (57014, 55P03),
 * insufficient resources (53xxx: disk full, out of memory, too many connections), serialisation
 * failures and deadlocks (40001, 40P01).
 */
const PG_TRANSIENT = /^(?:25006|57014|55P03|53\d{3}|40001|40P01)$/;

/**
 * Postgres states that are neither a bug nor an outage, with answers that say what is wrong: a
 * read-only database (25006: a hot standby after a failover, or `default_transaction_read_only`),
 * whose reads go on while every write fails; a database without mnemos's schema, relation
 * (42P01) or schema (3F000) missing, as when it was dropped and re-created under a running
 * service (migrations run at start, so a restart or `mnemos migrate` mends it; /readyz says
 * which are pending meanwhile); a database that is not there (3D000).
 */
const NO_SCHEMA: [string, string] = [
  'schema_not_migrated',
  'the postgres database has no mnemos schema (re-created under the service?): restart the service or run `npx mnemos migrate`, then retry',
];
const PG_STATES = new Map<string, [code: string, message: string]>([
  [
    '25006',
    [
      'read_only',
      'postgres refuses writes: the database is read-only (a standby, or default_transaction_read_only); retry later',
    ],
  ],
  ['42P01', NO_SCHEMA],
  ['3F000', NO_SCHEMA],
  ['3D000', ['unavailable', 'the postgres database does not exist; retry later']],
]);

/**
 * Redis and Postgres faults are 503s with retry-after, never 500s: `err` as that AppError when it
 * says a dependency cannot be reached, else unchanged. The error handler applies it to whatever
 * reaches it (services/http-errors.ts), so routes need not; services that other callers use too
 * (acceptMessages, importSession) apply it themselves.
 */
export function asDependencyError(err: unknown): unknown {
  if (err instanceof AppError) return err;
  // The Postgres error stays as the cause: the error handler logs its SQLSTATE and message.
  const state = PG_STATES.get(pgCode(err) ?? '');
  if (state) {
    const [code, message] = state;
    return Object.assign(
      new AppError(503, code, message, { dependency: 'postgres' }, { 'retry-after': '5' }),
      { cause: err },
    );
  }
  // A DateStyle changed on the role or database behind a transaction pooler after the start:
  // a configuration fault, not a server one (it answered 500 internal, beside a ready /readyz).
  if (err instanceof PgDateStyleError) {
    const e = unavailable('postgres');
    e.message =
      "Postgres printed a timestamp in another DateStyle than ISO, which mnemos cannot read: set the role's " +
      "DateStyle to ISO (ALTER ROLE <role> SET DateStyle = 'ISO, MDY') and reconnect the pooler; retry later";
    return Object.assign(e, { cause: err });
  }
  // No connection came free, or none could be opened (out of file descriptors): Postgres may be
  // fine. Told "postgres is unavailable", an operator looked at a healthy database.
  if (isPoolWaitTimeout(err) || /^E[MN]FILE$/.test(pgCode(err) ?? '')) {
    const e = unavailable('postgres');
    e.message =
      "no Postgres connection came free in time (this process's connections are all busy, or Postgres " +
      'does not accept new ones): retry later';
    return Object.assign(e, { cause: err });
  }
  // A request's statement cut at its bound: a reset or delete of a huge session runs that long on
  // a healthy Postgres, and told "postgres is unavailable" beside a /readyz saying ok, operators
  // looked for an outage. (A search's bound may be longer: the message gives the one applied.)
  // A new connection's setup has a fixed bound of its own: named PG_REQUEST_TIMEOUT_MS, with
  // another number, it sent operators to a setting that does not bound it.
  if (err instanceof PgNoAnswerError) {
    const e = unavailable('postgres');
    e.message =
      err.during === 'setup'
        ? `Postgres gave no answer within ${err.ms} ms to a new connection's setup (connecting, its ` +
          'startup and settings: a fixed bound, not PG_REQUEST_TIMEOUT_MS): the connection was closed; ' +
          'Postgres, or something before it, is unreachable or takes connections without serving them; ' +
          'retry later'
        : `Postgres gave no answer within ${err.ms} ms (PG_REQUEST_TIMEOUT_MS): the statement was given up ` +
          'and its connection closed, which a long statement or a lock wait does with Postgres up; retry later';
    return Object.assign(e, { cause: err });
  }
  if (isPgUnavailable(err) || PG_TRANSIENT.test(pgCode(err) ?? '')) {
    return Object.assign(unavailable('postgres'), { cause: err });
  }
  const msg = err instanceof Error ? err.message : '';
  // The cause gives the log line its `redis_error` (the client's answer says only "unavailable").
  // A Redis user refused a command or key (mnemos checks only EVAL and EVALSHA at start) is the
  // dependency refusing, as an ACL changed under the service does: it answered 500 internal. The
  // log names the command; the client is not told Redis's commands or users.
  if (REDIS_NO_PERMISSION.test(msg) || REDIS_TRANSIENT_REPLY.test(msg)) {
    return Object.assign(unavailable('redis'), { cause: err });
  }
  // ioredis's MaxRetriesPerRequestError says "Reached the max retries per request limit": matched
  // by its name too, since its message does not carry it.
  if (
    (err instanceof Error && err.name === 'MaxRetriesPerRequestError') ||
    /Stream isn't writeable|Connection is closed|ECONNREFUSED|Command timed out|max retries per request|ETIMEDOUT|ECONNRESET/i.test(
      msg,
    )
  ) {
    return Object.assign(unavailable('redis'), { cause: err });
  }
  return err;
}
