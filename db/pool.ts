import type { Socket } from 'node:net';
import pg from 'pg';
import { outageLog, throttledWarn } from '../services/logger.js';
import type { Logger } from '../services/logger.js';

/**
 * The only module that imports `pg`. Everything else talks to a `Queryable` (a pool, a transaction
 * client, or the embedded PGlite adapter) so queries can run inside or outside a transaction.
 */
export interface QueryResult<R> {
  rows: R[];
  rowCount: number | null;
}

export interface QueryOptions {
  /**
   * Run as a named prepared statement (node-postgres prepares it once per connection), on
   * connections that plan it once, generically, without the parameter values (makePgDb): only for
   * statements whose best plan does not depend on them (db/queries/search.ts says when). The name
   * must identify the text (a hash of it). Ignored in transactions and where statements are not
   * prepared by name (PGlite).
   */
  name?: string;
  /**
   * A search's statement (services/search/): makePgDb runs it on connections of its own, with
   * the search statement timeout. Ignored in transactions and by PGlite.
   */
  search?: boolean;
  /**
   * How long this statement may go without an answer before its connection is closed and it fails
   * as Postgres unavailable (0 = no bound), in place of the request bound (makePgDb's
   * requestTimeoutMs). Ignored by PGlite.
   */
  timeoutMs?: number;
}

export interface Queryable {
  query<R = Record<string, unknown>>(
    text: string,
    params?: unknown[],
    opts?: QueryOptions,
  ): Promise<QueryResult<R>>;
  /**
   * True when a Buffer parameter travels in Postgres's binary format (node-postgres). PGlite
   * serialises parameters by type itself and takes plain JS values instead.
   */
  readonly binaryParams?: boolean;
}

export interface Db extends Queryable {
  /** Runs fn in one transaction on one connection; commits on success, rolls back on throw. */
  transaction<T>(fn: (tx: Queryable) => Promise<T>): Promise<T>;
  close(): Promise<void>;
  readonly kind: 'postgres' | 'embedded';
  /**
   * The same database for HTTP requests: each statement gets makePgDb's `requestTimeoutMs` to
   * answer (background work keeps the unbounded Db). Absent = the Db itself (PGlite).
   */
  forRequests?(): Db;
}

/** `db` as HTTP requests use it (Db.forRequests). */
export const requestDb = (db: Db): Db => db.forRequests?.() ?? db;

// bigint (int8) as JS number would silently lose precision for unix-ns; keep it as string and
// convert at the call site. count(*) and seq fit in a double, so those are cast to int in SQL.
pg.types.setTypeParser(pg.types.builtins.INT8, (v: string) => v);

/**
 * pg reads a timestamptz from its text, in ISO format only: under another DateStyle (`SQL, DMY`
 * on a database) it read null, a revoked key's `revoked_at` included. Connections ask for ISO
 * (makePgDb); a text it still cannot read (behind a transaction pooler, a DateStyle changed on the
 * database since the start-up check) fails the statement instead of reading as no timestamp.
 */
const parseTimestamptz = pg.types.getTypeParser(pg.types.builtins.TIMESTAMPTZ, 'text');
pg.types.setTypeParser(pg.types.builtins.TIMESTAMPTZ, (v: string) => {
  const parsed: unknown = parseTimestamptz(v);
  if (parsed === null) throw new PgDateStyleError(v);
  return parsed;
});

/** A timestamp Postgres printed in another DateStyle than ISO (see parseTimestamptz). */
export class PgDateStyleError extends Error {
  constructor(readonly text: string) {
    super(`cannot read the timestamp "${text}": the connection's DateStyle must be ISO`);
  }
}

/**
 * Postgres gave no answer within a bound; the connection was closed. `during` says which bound:
 * a `statement`'s (a request's, PG_REQUEST_TIMEOUT_MS, or its own `timeoutMs`: a Postgres
 * outage, or a statement that runs long or waits on a lock), or a new connection's `setup`
 * (CONNECT_TIMEOUT_MS: connecting, its startup and settings; never the request's bound). The 503 names the
 * bound: told PG_REQUEST_TIMEOUT_MS for a setup that stalled, an operator turns the wrong dial.
 */
export class PgNoAnswerError extends Error {
  readonly code = 'ETIMEDOUT';
  constructor(
    readonly ms: number,
    readonly during: 'statement' | 'setup' = 'statement',
    options?: ErrorOptions,
  ) {
    super(
      `Postgres gave no answer within ${ms} ms${during === 'setup' ? " to a new connection's setup" : ''} (connection closed)`,
      options,
    );
    this.name = 'PgNoAnswerError';
  }
}

/** Connecting (and the settings each new connection gets) may take this long. */
const CONNECT_TIMEOUT_MS = 5000;

/**
 * `pending` (a statement on `client`), or a PgNoAnswerError after `ms` (0 = never), and then the
 * connection is closed: on a connection that went silent without a reset (a partition, a VIP
 * failover, a stopped Postgres), node-postgres waits for ever, and a later statement queues behind
 * the lost one. pg's own `query_timeout` fails the statement but keeps the connection.
 */
function answerWithin<R>(
  client: pg.ClientBase,
  pending: Promise<R>,
  ms: number,
  during: PgNoAnswerError['during'],
  onCut?: (err: Error) => void,
): Promise<R> {
  if (!(ms > 0)) return pending;
  let timer: NodeJS.Timeout | undefined;
  return Promise.race([
    pending,
    new Promise<never>((_, reject) => {
      timer = setTimeout(() => {
        const err = new PgNoAnswerError(ms, during);
        onCut?.(err);
        reject(err);
        // The statement in flight then fails (Connection terminated), unobserved: the race has
        // settled. The client may report the end as an error, with no one else listening by then.
        client.on('error', () => undefined);
        (client as unknown as { connection?: { stream?: Socket } }).connection?.stream?.destroy();
      }, ms);
    }),
  ]).finally(() => clearTimeout(timer));
}

export function makePgDb(opts: {
  connectionString: string;
  max?: number;
  logger?: Logger;
  applicationName?: string;
  /**
   * Postgres ends a session of ours that stays idle inside a transaction this long (0 = never):
   * a process that stalls or loses its network mid-transaction (a paused VM, a partition, where no
   * TCP reset comes for hours) would otherwise keep its row locks, and with them a session's
   * drains, until it came back. mnemos's own transactions never wait on anything slow between
   * statements (embedding and LLM calls happen outside them).
   */
  idleInTransactionTimeoutMs?: number;
  /**
   * Searches (QueryOptions.search) run on connections of their own (a quarter of `max`, opened
   * on first use) whose statements Postgres cancels after this long (0 = never): a search's cost
   * grows with what it reads, and neither a slow one nor many at once may hold the connections
   * that archive messages.
   */
  searchTimeoutMs?: number;
  /**
   * How long a statement made by an HTTP request (`forRequests()`) may go without an answer (0 = no
   * bound): then its connection is closed and the request answers 503 with retry-after, as when
   * Postgres is down. A search's statement gets at least `searchTimeoutMs` + 2 s, so that
   * Postgres's own cancellation answers first. Background work (drains, index builds, migrations,
   * erasure) is not bounded: its connections have TCP keepalive.
   */
  requestTimeoutMs?: number;
  /**
   * Postgres is reached through a pooler in transaction mode (PgBouncer `pool_mode = transaction`),
   * which hands each transaction whatever server connection is free: a setting made with SET
   * stays on that connection and reaches other clients' statements (a tester's psql sessions
   * through the same PgBouncer had their `pg_sleep(11)` cancelled by the search connections' 10 s
   * `statement_timeout`, and drains failed when SEARCH_TIMEOUT_MS was low). So nothing is SET on a
   * connection: a search runs in a transaction of its own with SET LOCAL (three round trips
   * instead of one), and Postgres's idle-in-transaction bound is left to the pooler's
   * `idle_transaction_timeout`. Named statements must not be used (`PG_PREPARED_STATEMENTS`).
   */
  transactionPooler?: boolean;
}): Db {
  const warn = (what: string) => (err: Error) =>
    opts.logger?.warn({ err: { message: err.message } }, `could not set ${what}`);
  // After statements failed for want of Postgres (a restart, a failover), one line when a new
  // connection goes through: the 503 and job-failure lines alone never say that it is over.
  const outage = outageLog(opts.logger, 'postgres connection restored');
  // One line per 5 s: Postgres ending idle sessions (idle_session_timeout, a restart) closes
  // every idle connection of every pool, each an error (56 lines in 40 s in a tester's run).
  const warnIdleError = throttledWarn(opts.logger, 'postgres idle client error');
  const failed = (err: unknown) => {
    if (isPgUnavailable(err) && !isPoolWaitTimeout(err)) outage.failed();
  };
  const newPool = (max: number, genericPlans: boolean, statementTimeoutMs = 0) => {
    const p = new pg.Pool({
      connectionString: opts.connectionString,
      max,
      application_name: opts.applicationName ?? 'mnemos',
      connectionTimeoutMillis: CONNECT_TIMEOUT_MS,
      idleTimeoutMillis: 30000,
      // A connection whose peer is gone without a word (a partition, a failover) is found by the
      // kernel's probes, after 10 s of silence, and fails: the only bound a background statement has.
      keepAlive: true,
      keepAliveInitialDelayMillis: 10_000,
      // For the per-session HNSW indexes of huge sessions (services/recent-index/ann-indexes.ts): a
      // wider search than pgvector's default 40, which lost whole clusters about once in 100–300
      // queries (bench/partial-hnsw.ts), and iterative scans so that a filter (seq >= start_seq)
      // cannot leave a k-NN short of k rows. Set on each new connection before the pool hands it
      // out (not as a startup option, which PgBouncer refuses); placeholders until pgvector loads.
      // A failure only costs recall or speed, so it is logged, never thrown; no answer at all is
      // thrown (pg-pool's connect timeout ends before this hook runs, and a connection left in it
      // would hold its place in the pool for ever).
      // eslint-disable-next-line @typescript-eslint/no-misused-promises -- pg-pool awaits onConnect (pg-pool 3.14 index.js); @types/pg says void
      onConnect: async (client: pg.ClientBase) => {
        if (opts.transactionPooler) return;
        const set = (sql: string, what: string) =>
          answerWithin(client, client.query(sql), CONNECT_TIMEOUT_MS, 'setup').then(
            () => undefined,
            (err: Error) => {
              if (err instanceof PgNoAnswerError) throw err;
              warn(what)(err);
            },
          );
        // Output formats, on which reading a value depends: timestamps in ISO (see parseTimestamptz),
        // floats printed exactly (Postgres's default; `extra_float_digits = -3` on a database cut a
        // search score's rank to 3 digits). A connection that cannot have them is not used.
        await answerWithin(
          client,
          client.query(`SET DateStyle = ISO; SET extra_float_digits = 1`),
          CONNECT_TIMEOUT_MS,
          'setup',
        );
        // mnemos's transactions are written for read committed (a drain's row locks serialise a
        // session's writers); a database or role defaulting to repeatable read or serializable
        // failed 1 in 40 posts with a 503 serialisation failure, and drains retried.
        await set(`SET default_transaction_isolation = 'read committed'`, 'default_transaction_isolation');
        if (opts.idleInTransactionTimeoutMs)
          await set(
            `SET idle_in_transaction_session_timeout = ${Math.round(opts.idleInTransactionTimeoutMs)}`,
            'idle_in_transaction_session_timeout',
          );
        await set(
          `SET hnsw.ef_search = 100; SET hnsw.iterative_scan = 'relaxed_order'`,
          'hnsw search options',
        );
        if (genericPlans) await set('SET plan_cache_mode = force_generic_plan', 'plan_cache_mode');
        if (statementTimeoutMs > 0)
          await set(`SET statement_timeout = ${Math.round(statementTimeoutMs)}`, 'statement_timeout');
      },
    });
    // An idle client losing its connection (Postgres restart) must not crash the process.
    p.on('error', (err) => {
      // Postgres ending an idle session on purpose (idle_session_timeout, 57P05) is no outage.
      if (pgCode(err) !== '57P05') failed(err);
      warnIdleError({ err: { message: err.message } });
    });
    p.on('connect', () => outage.restored());
    return p;
  };
  const max = opts.max ?? 10;
  const pool = newPool(max, false);
  // Named statements run on a few connections of their own, which plan them generically: left to
  // itself (plan_cache_mode auto), Postgres compared the generic plan's estimate with the custom
  // ones' and planned the search statement with its values on every run (pg_prepared_statements:
  // 0 generic, 1,300 custom), so preparing it saved the parsing but not the planning. The setting
  // cannot go on the main pool: it would also make every unnamed statement generic.
  // The named statements are searches (db/queries/search.ts): their pool has the search timeout.
  const searchTimeoutMs = opts.searchTimeoutMs ?? 0;
  const quarter = Math.max(1, Math.ceil(max / 4));
  let named: pg.Pool | null = null;
  const namedPool = () => (named ??= newPool(quarter, true, searchTimeoutMs));
  let searching: pg.Pool | null = null;
  const searchPool = () => (searching ??= newPool(quarter, false, searchTimeoutMs));
  const requestTimeoutMs = opts.requestTimeoutMs ?? 0;
  // The bound of a statement (0 = none): a request's, or background work's. (An AsyncLocalStorage
  // telling requests apart cost the ingest path half its throughput on Node 20: every promise of
  // the process pays for its hooks.)
  const boundOf = (forRequest: boolean, o?: QueryOptions) =>
    o?.timeoutMs ??
    (forRequest && requestTimeoutMs > 0
      ? o?.name || o?.search
        ? Math.max(requestTimeoutMs, searchTimeoutMs > 0 ? searchTimeoutMs + 2000 : 0)
        : requestTimeoutMs
      : 0);
  // Behind a transaction pooler, a search's settings last for its own transaction only.
  const searchSettings = [
    `BEGIN ISOLATION LEVEL READ COMMITTED`,
    `SET LOCAL hnsw.ef_search = 100`,
    `SET LOCAL hnsw.iterative_scan = 'relaxed_order'`,
    ...(searchTimeoutMs > 0 ? [`SET LOCAL statement_timeout = ${Math.round(searchTimeoutMs)}`] : []),
  ].join('; ');
  const background = facade(false);
  const forRequests = requestTimeoutMs > 0 ? facade(true) : background;
  return background;

  function facade(forRequest: boolean): Db {
    return {
      kind: 'postgres',
      binaryParams: true,
      query: (text, params, o) => {
        const statement = (client: pg.PoolClient) =>
          client.query({ name: o?.name, text, values: params as unknown[] });
        if (opts.transactionPooler && o?.search) {
          return inTransaction(searchPool(), boundOf(forRequest, o), searchSettings, failed, (run) =>
            run(statement),
          ) as never;
        }
        return checkedOut(
          o?.name ? namedPool() : o?.search ? searchPool() : pool,
          boundOf(forRequest, o),
          (ask) => ask(statement),
          (err) => err instanceof pg.DatabaseError && err.severity === 'ERROR',
          failed,
        ) as never;
      },
      transaction: (fn) =>
        // Read committed whatever the database's default: behind a transaction pooler no SET on
        // the connection says so.
        inTransaction(pool, boundOf(forRequest), 'BEGIN ISOLATION LEVEL READ COMMITTED', failed, (run) =>
          fn({
            binaryParams: true,
            query: (text, params) => run((client) => client.query(text, params as unknown[])) as never,
          }),
        ),
      close: async () => {
        await Promise.all([pool.end(), named?.end(), searching?.end()]);
      },
      forRequests: () => forRequests,
    };
  }
}

/**
 * Runs `fn` in a transaction opened by `begin` on a connection of `p` (checkedOut), committed if
 * `fn` resolves and rolled back if it throws.
 */
function inTransaction<T>(
  p: pg.Pool,
  boundMs: number,
  begin: string,
  failed: (err: unknown) => void,
  fn: (run: <R>(statement: (client: pg.PoolClient) => Promise<R>) => Promise<R>) => Promise<T>,
): Promise<T> {
  // After a ROLLBACK that went through, the connection is clean whatever fn threw.
  let rolledBack = true;
  return checkedOut(
    p,
    boundMs,
    async (ask) => {
      await ask((client) => client.query(begin));
      try {
        const result = await fn(ask);
        await ask((client) => client.query('COMMIT'));
        return result;
      } catch (err) {
        await ask((client) => client.query('ROLLBACK')).catch(() => {
          rolledBack = false;
        });
        throw err;
      }
    },
    () => rolledBack,
    failed,
  );
}

/**
 * Runs `fn` on a connection checked out of `p`, and gives it back. `fn` makes its statements
 * through `ask`, which bounds each by `boundMs` (answerWithin; 0 = no bound).
 *
 * - While checked out, a client whose connection drops (Postgres restarting, a terminated
 *   backend) emits `error`; pg-pool listens only to idle clients, and an `error` event without a
 *   listener ended the process. Here the query in flight fails instead, and the caller sees that
 *   error (a drain's job is retried, a request answers 503), and the connection is closed.
 * - A statement without an answer within `boundMs` fails with PgNoAnswerError, and its connection
 *   is closed, never given back to the pool (it would answer nothing either).
 * - After an error that `fn` throws, the connection is kept if `reusable(err)`: a statement that
 *   failed with severity ERROR leaves its session fine. `pool.query` closes the connection after
 *   any error; a search retried without its semantic list while the recent index has another
 *   dimension then cost a new connection, its settings and its prepared statements each time:
 *   8–10 ms instead of 2 (a probe on the search bench's corpus).
 * - A new connection whose setup (connect, startup, settings) gets no answer within CONNECT_TIMEOUT_MS
 *   fails with PgNoAnswerError too, `during: 'setup'`, which the 503 tells apart from a statement's.
 * - Every error, of the connect or of `fn`, is reported to `failed` (the outage log).
 */
async function checkedOut<T>(
  p: pg.Pool,
  boundMs: number,
  fn: (ask: <R>(statement: (client: pg.PoolClient) => Promise<R>) => Promise<R>) => Promise<T>,
  reusable: (err: unknown) => boolean,
  failed: (err: unknown) => void,
): Promise<T> {
  let client: pg.PoolClient;
  try {
    client = await p.connect();
  } catch (err) {
    failed(err);
    // pg-pool's connect timeout (no code of its own): the connect or Postgres's startup got no
    // answer. Thrown as settings left unanswered are, so that the 503 names the bound.
    if (err instanceof Error && /^Connection terminated due to connection timeout/.test(err.message))
      throw new PgNoAnswerError(CONNECT_TIMEOUT_MS, 'setup', { cause: err });
    throw err;
  }
  let broken: Error | undefined;
  const onError = (err: Error) => {
    broken ??= err;
  };
  client.on('error', onError);
  try {
    return await fn((statement) => answerWithin(client, statement(client), boundMs, 'statement', onError));
  } catch (err) {
    failed(err);
    if (!reusable(err)) broken ??= err instanceof Error ? err : new Error(String(err));
    throw err;
  } finally {
    client.removeListener('error', onError);
    client.release(broken);
  }
}

const FLOAT4_OID = 700;

/**
 * A `float4[]` parameter holding `rows` one after another (one flat array). Over node-postgres
 * it is a Buffer in the binary array format (Postgres's array_recv), so no float is printed in
 * JavaScript or parsed by Postgres: for embeddings, printing and parsing cost more than the
 * insert itself. Elsewhere it is the flat JS array.
 */
export function float4ArrayParam(q: Queryable, rows: ReadonlyArray<ArrayLike<number>>): unknown {
  let n = 0;
  for (const r of rows) n += r.length;
  if (!q.binaryParams) {
    const flat = new Array<number>(n);
    let i = 0;
    for (const r of rows) for (let j = 0; j < r.length; j++) flat[i++] = r[j]!;
    return flat;
  }
  // Header: ndim, has-nulls flag, element type, then (length, lower bound) per dimension; then
  // each element as its byte length and its big-endian IEEE float4.
  const buf = Buffer.allocUnsafe(20 + n * 8);
  // DataView (big-endian by default) is several times faster than Buffer's write* methods here.
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  view.setInt32(0, 1);
  view.setInt32(4, 0);
  view.setInt32(8, FLOAT4_OID);
  view.setInt32(12, n);
  view.setInt32(16, 1);
  let offset = 20;
  for (const r of rows) {
    for (let j = 0; j < r.length; j++) {
      view.setInt32(offset, 4);
      view.setFloat32(offset + 4, r[j]!);
      offset += 8;
    }
  }
  return buf;
}

/**
 * A pgvector `vector[]` parameter holding `rows`, for node-postgres (binaryParams) only: a Buffer
 * in the binary array format whose elements are in pgvector's binary format (vector_recv), so
 * each row reaches Postgres as one vector. Cut out of a flat float4ArrayParam in SQL instead,
 * every float was received by a call of its own and every row sliced and cast: 25 → 16 µs of
 * Postgres CPU per 384-d row, with half the bytes. `vectorOid` is the `vector` type's OID in the
 * database (vectorTypeOid in db/queries/vectors.ts): array_recv refuses elements of another type.
 */
export function vectorArrayParam(rows: ReadonlyArray<ArrayLike<number>>, vectorOid: number): Buffer {
  let size = 20;
  for (const r of rows) size += 8 + r.length * 4;
  const buf = Buffer.allocUnsafe(size);
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  view.setInt32(0, 1);
  view.setInt32(4, 0);
  view.setUint32(8, vectorOid);
  view.setInt32(12, rows.length);
  view.setInt32(16, 1);
  let offset = 20;
  for (const r of rows) {
    // Each element: its byte length, then vector_recv's dimensions and a zero as int16, then the floats.
    view.setInt32(offset, 4 + r.length * 4);
    view.setInt16(offset + 4, r.length);
    view.setInt16(offset + 6, 0);
    offset += 8;
    for (let j = 0; j < r.length; j++) {
      view.setFloat32(offset, r[j]!);
      offset += 4;
    }
  }
  return buf;
}

/**
 * A pgvector `vector` parameter. Over node-postgres it is a Buffer in pgvector's binary format
 * (vector_recv: dimensions and a zero as int16, then each element as a big-endian float4), so the
 * query embedding is neither printed by JavaScript nor parsed by Postgres: at 1,536 dimensions
 * its text form is about 30 kB of digits. Elsewhere it is the text literal.
 */
export function vectorParam(q: Queryable, v: readonly number[]): unknown {
  if (!q.binaryParams) return `[${v.join(',')}]`;
  const buf = Buffer.allocUnsafe(4 + v.length * 4);
  const view = new DataView(buf.buffer, buf.byteOffset, buf.byteLength);
  view.setInt16(0, v.length);
  view.setInt16(2, 0);
  for (let i = 0; i < v.length; i++) view.setFloat32(4 + i * 4, v[i]!);
  return buf;
}

/** Shorthand used by query modules: `withTransaction(db, async (tx) => …)`. */
export function withTransaction<T>(db: Db, fn: (tx: Queryable) => Promise<T>): Promise<T> {
  return db.transaction(fn);
}

/** SQLSTATEs we branch on (never on message text). */
export const PG = {
  uniqueViolation: '23505',
  serializationFailure: '40001',
  deadlock: '40P01',
  undefinedTable: '42P01',
  invalidTextRepresentation: '22P02',
  readOnlyTransaction: '25006',
} as const;

export function pgCode(err: unknown): string | undefined {
  return typeof err === 'object' && err !== null && 'code' in err && typeof err.code === 'string'
    ? err.code
    : undefined;
}

/**
 * pg-pool's error when no connection of the pool came free within `connectionTimeoutMillis`: the
 * pool is busy (or Postgres does not answer a connect; isPgUnavailable counts it as down).
 */
export const isPoolWaitTimeout = (err: unknown): boolean =>
  err instanceof Error && /timeout exceeded when trying to connect/.test(err.message);

/** True for errors that mean "Postgres is not reachable right now" (connection refused, shutdown, timeout). */
export function isPgUnavailable(err: unknown): boolean {
  const code = pgCode(err);
  if (code && /^(08|57P0[1-3]|53300)/.test(code)) return true;
  const msg = err instanceof Error ? err.message : '';
  return (
    code === 'ECONNREFUSED' ||
    code === 'ECONNRESET' ||
    code === 'ETIMEDOUT' ||
    code === 'EPIPE' ||
    // Out of file descriptors (the process's `ulimit -n`, or the system's): no connection can be
    // opened now. A 503 to retry, not a 500.
    code === 'EMFILE' ||
    code === 'ENFILE' ||
    isPoolWaitTimeout(err) ||
    /Connection terminated|Client has encountered a connection error/.test(msg)
  );
}
