import { STATUS_CODES, createServer } from 'node:http';
import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import type { Socket } from 'node:net';
import { migrate, newerSchemaWarning, unknownMigrations } from '../db/migrate.js';
import { startWorkers } from '../workers/main.js';
import type { RunningWorkers, WorkerOptions } from '../workers/main.js';
import { makeApp, makeOpsApp } from './app.js';
import { startQueueSampler } from './metrics-sampler.js';
import { timeAnswer } from './metrics.js';
import { endWaits } from './messages/accept-messages.js';
import { loadConfig, shownUrl } from './config.js';
import type { Config } from './config.js';
import type { Db } from '../db/pool.js';
import type { CoreDeps } from './deps.js';
import type { Extension, ExtensionFactory } from './extension.js';
import { makeLogger } from './logger.js';
import type { Logger } from './logger.js';
import { refuseOtherNamespace } from './redis-namespace.js';
import { redisDurabilityWarnings, refuseMissingScripting, waitForRedis } from './redis.js';
import { adminKeyLine, closeDeps, embeddedBannerLines, openDeps } from './runtime.js';
import { AppError } from './errors.js';
import { errorBody } from './http-errors.js';

export type Mode = 'api' | 'worker' | 'serve';

/**
 * How long an answer may have bytes waiting for its client, none of them taken, before the
 * connection is cut. A client that stops reading otherwise keeps what was written for it in
 * memory for as long as it keeps the connection open: 80 paused keep-alive sockets, each asking
 * for a 22 MB export, held 1 GB. Only stalled writes count: a long-poll writing nothing waits.
 */
export const WRITE_STALL_MS = 60_000;

export interface RunningService {
  deps: CoreDeps;
  extensions: Extension[];
  server: Server | null;
  workers: RunningWorkers | null;
  url: string | null;
  stop(): Promise<void>;
}

/**
 * Starts the API, the workers, or both, in this process. Used by the CLI and by tests (which pass
 * a config directly instead of the environment).
 */
export async function startService(
  mode: Mode,
  config: Config,
  opts: {
    logger?: Logger;
    worker?: WorkerOptions;
    extensions?: ExtensionFactory[];
    /** WRITE_STALL_MS unless given (tests). */
    writeStallMs?: number;
  } = {},
): Promise<RunningService> {
  const logger = opts.logger ?? makeLogger(config.logLevel);
  if (!config.databaseUrl && mode !== 'serve') {
    throw new Error(
      `mnemos ${mode} needs DATABASE_URL: the embedded Postgres is single-process, so only "mnemos serve" can run without it.`,
    );
  }
  const deps = await openDeps(config, logger, { defaultMetrics: true });
  const extensions: Extension[] = [];
  let server: Server | null = null;
  let workers: RunningWorkers | null = null;
  let stopping: Promise<void> | null = null;
  const inFlight = new Set<ServerResponse>();
  let stopSampler: (() => void) | null = null;
  let stopStallWatch: (() => void) | null = null;

  const stop = () =>
    (stopping ??= (async () => {
      // Ordered: stop intake, finish in-flight work, then close queues, Redis and the pool. One
      // deadline for all of it: requests first (jobs keep running meanwhile, so that a ?wait=true
      // still sees its drain), then jobs with what is left of it. (Each phase once had the whole
      // grace period: twice SHUTDOWN_TIMEOUT_MS, past compose's stop_grace_period.)
      // Monotonic, as every deadline here: a wall clock stepped back would keep the process past it.
      const until = performance.now() + config.shutdownTimeoutMs;
      const left = () => Math.max(0, Math.floor(until - performance.now()));
      // A ?wait=true still waiting a second before the deadline answers its 202 then, rather
      // than have its connection cut with it.
      const waits = setTimeout(() => endWaits(inFlight), Math.max(0, left() - 1000));
      waits.unref();
      stopSampler?.();
      stopStallWatch?.();
      if (server) {
        const s = server;
        // Answers still being prepared close their connection too.
        for (const res of inFlight) if (!res.headersSent) res.setHeader('connection', 'close');
        // Connections whose last answer went out before the flag was seen close as they idle.
        const idle = setInterval(() => s.closeIdleConnections(), 100);
        idle.unref();
        await new Promise<void>((resolve) => {
          s.close(() => resolve());
          s.closeIdleConnections();
          setTimeout(() => {
            s.closeAllConnections();
            resolve();
          }, left()).unref();
        }).finally(() => clearInterval(idle));
      }
      if (workers) await workers.close(left());
      for (const e of extensions) await e.close?.().catch(() => undefined);
      // A job left running at the deadline may hold a pool connection (a drain waiting on a lock):
      // ending the pool waits for it, and the backstop then exited 1 five seconds later. Exiting
      // closes the socket and Postgres rolls that transaction back; the job is retried elsewhere.
      await Promise.race([
        closeDeps(deps).catch(() => undefined),
        new Promise((r) => setTimeout(r, Math.max(1000, left())).unref()),
      ]);
    })());

  try {
    await migrate(deps.db, undefined, { logger });
    await refuseNonIsoDateStyle(deps.db, config);
    const newer = await unknownMigrations(deps.db);
    if (newer.length > 0) logger.warn(newerSchemaWarning(newer));
    if (!(await waitForRedis(deps.redis, 5000))) {
      throw new Error(`cannot reach Redis at ${shownUrl(config.redisUrl)} (is it running?)`);
    }
    await refuseMissingScripting(deps.redis);
    // Once Redis answers in the configured database: a first start refused for its REDIS_URL
    // records nothing that the corrected one would be refused for.
    await refuseOtherNamespace(deps.db, config);
    // Each queue is made at its first use (workers/queues.ts), so that a refused start writes
    // nothing under its prefix; a service makes them all now, as before, rather than first in the
    // middle of a job, where a Queue made while Redis is away waits for it without a limit.
    void Object.values(deps.queues);
    for (const w of [
      ...config.warnings,
      ...(await redisDurabilityWarnings(deps.redis)),
      ...(await poolerIsolationWarnings(deps.db, config)),
    ])
      logger.warn(w);
    for (const f of opts.extensions ?? []) extensions.push(await f(deps, extensions));
    if (mode !== 'api') workers = await startWorkers(deps, extensions, opts.worker);
    let url: string | null = null;
    {
      // Worker processes serve only /healthz, /readyz and /metrics (their job metrics live there).
      const app =
        mode === 'worker'
          ? makeOpsApp(deps)
          : makeApp(deps, {
              extraRoutes: extensions.flatMap((e) => e.routes ?? []),
              // Tenant erasure is offered by the lifecycle module (services/lifecycle/).
              eraseTenant: extensions.find((e) => e.provides?.eraseTenant)?.provides?.eraseTenant as
                ((tenantId: string) => Promise<boolean>) | undefined,
            });
      if (mode !== 'worker') stopSampler = startQueueSampler(deps);
      // A worker samples nothing, so it does not export the sampled summary lag as a constant 0
      // (an alert on one process's series, or an average, would read "no lag").
      else deps.metrics.registry.removeSingleMetric('mnemos_summary_lag_seconds');
      // Not `app.listen`: Express 5 hands its callback the server's 'error' too, so a port in
      // use or a bad HOST would be reported as listening while nothing listens.
      // Once stopping, every answer closes its connection: a keep-alive client would otherwise go
      // on sending requests over it until the shutdown deadline cut one off midway.
      // Node's own refusals of a missing Host and of an unknown `Expect` have empty bodies: both are
      // answered here instead, in the JSON error shape.
      // Every answer under way, for the stall watch (inFlight leaves out those begun while stopping).
      const answering = new Set<ServerResponse>();
      // What is answered here, before the app, is timed as the app times its answers, with the
      // route "unmatched" (no route ran): the request metric counts every answer, and these were
      // missing from it. The method is the one Node parsed, from its fixed list.
      const refuse = (
        req: IncomingMessage,
        res: ServerResponse,
        status: number,
        code: string,
        message: string,
      ) => {
        timeAnswer(deps.metrics, res, () => ({ method: req.method ?? 'unknown', route: 'unmatched' }));
        rawError(res, status, code, message);
      };
      const handle = (req: IncomingMessage, res: ServerResponse) => {
        if (stopping) res.setHeader('connection', 'close');
        if (req.headers.host === undefined && req.httpVersion !== '1.0') {
          refuse(req, res, 400, 'missing_host', 'an HTTP/1.1 request must carry a Host header');
          return;
        }
        if ((req.headersDistinct.host?.length ?? 0) > 1) {
          refuse(req, res, 400, 'duplicate_host', 'a request carries one Host header (RFC 9112 §3.2)');
          return;
        }
        const codings = unsupportedTransferCoding(req);
        if (codings !== null) {
          refuse(
            req,
            res,
            501,
            'unsupported_transfer_coding',
            `transfer coding ${codings} is not supported: send chunked or a content-length`,
          );
          return;
        }
        app(req, res);
      };
      const serve = oneAtATimePerConnection(handle, (err, res) => {
        logger.error({ err }, 'unhandled error');
        res.destroy();
      });
      const track = (req: IncomingMessage, res: ServerResponse) => {
        answering.add(res);
        res.once('close', () => answering.delete(res));
        if (!stopping) {
          inFlight.add(res);
          res.once('close', () => inFlight.delete(res));
        }
        serve(req, res);
      };
      stopStallWatch = cutStalledWrites(answering, opts.writeStallMs ?? WRITE_STALL_MS, (res) =>
        logger.warn(
          { pending: res.socket?.writableLength },
          'cut a connection whose client stopped reading its answer',
        ),
      );
      const s = createServer({ requireHostHeader: false }, track);
      // Node keeps the first 2000 header fields and drops the rest without a word: 1,000 filler
      // headers hid a second Authorization (or Host) behind them. The 16 KB header size limit
      // bounds the count.
      s.maxHeadersCount = 0;
      // `Expect: 100-continue` is answered by the app once the caller is authenticated (app.ts),
      // not by Node before any route runs: a caller without a valid key is not invited to upload.
      s.on('checkContinue', track);
      s.on('checkExpectation', (req: IncomingMessage, res: ServerResponse) =>
        refuse(req, res, 417, 'expectation_failed', 'the only supported expectation is Expect: 100-continue'),
      );
      // What Node refuses before a request exists (headers over its 16 KB limit, a malformed
      // request line) gets the same JSON error body as every other error, not an empty one.
      s.on('clientError', (err: NodeJS.ErrnoException, socket) => {
        // As Node's own handler: no answer into a response already under way on this connection
        // (a pipelined request after a streaming export), only the close.
        const current = (socket as { _httpMessage?: { headersSent?: boolean } })._httpMessage;
        if (!socket.writable || err.code === 'ECONNRESET' || current?.headersSent) {
          socket.destroy();
          return;
        }
        // Timed from the refusal to the answer's last byte written (when the request began is not
        // known here). No request exists to tell its method: "unknown", which keeps the label to
        // Node's list of methods and this one.
        // A request the app has (a body that stopped coming: a 408) is timed by the app already,
        // when its response closes: timed here too, it counted twice (r1).
        const { status, raw } = clientErrorResponse(err.code);
        if (current) {
          socket.end(raw);
          return;
        }
        const end = deps.metrics.httpDuration.startTimer({ method: 'unknown', route: 'unmatched' });
        let timed = false;
        const record = (sent: boolean) => {
          if (timed) return;
          timed = true;
          end({ status: sent ? String(status) : '499' });
        };
        socket.once('close', () => record(socket.writableFinished));
        socket.end(raw, () => record(socket.writableFinished));
      });
      server = s;
      await new Promise<void>((resolve, reject) => {
        const failed = (err: NodeJS.ErrnoException) => {
          s.off('listening', listening);
          const where = `${config.host}:${config.port}`;
          reject(
            new Error(
              err.code === 'EADDRINUSE'
                ? `cannot listen on ${where}: the port is in use (PORT)`
                : err.code === 'ENOTFOUND' || err.code === 'EAI_AGAIN' || err.code === 'EADDRNOTAVAIL'
                  ? `cannot listen on ${where}: HOST is not an address of this machine (${err.code})`
                  : `cannot listen on ${where}: ${err.message}`,
            ),
          );
        };
        const listening = () => {
          s.off('error', failed);
          resolve();
        };
        s.once('error', failed);
        s.once('listening', listening);
        s.listen(config.port, config.host);
      });
      server.keepAliveTimeout = 65_000;
      // A request must arrive whole within 2 minutes (Node's default, 5, let a key's slow or
      // stalled bodies hold up to 8 MiB each per connection that long: a tester held 800 MB).
      server.requestTimeout = 120_000;
      const addr = server.address();
      const port = typeof addr === 'object' && addr ? addr.port : config.port;
      url = `http://${config.host.includes(':') ? `[${config.host}]` : config.host}:${port}`;
    }
    return { deps, extensions, server, workers, url, stop };
  } catch (err) {
    await stop();
    throw err;
  }
}

/** Process entry: environment → service, with signal handling. */
export async function runFromEnv(mode: Mode, extensions: ExtensionFactory[] = []): Promise<void> {
  const config = loadConfig(process.env);
  const logger = makeLogger(config.logLevel);
  // Workers take jobs before the listener is up: a signal during the start is held until the
  // service can stop in order (Node's default action, exit 143, left the job a worker had just
  // taken active until BullMQ's stall check, 30-60 s). A start that hangs still ends: by the
  // deadline, or at once on a second signal.
  let early: string | null = null;
  const onEarly = (sig: string) => {
    if (early !== null) process.exit(1);
    early = sig;
    logger.info({ sig }, 'signal during start: stopping once started');
    setTimeout(() => process.exit(1), config.shutdownTimeoutMs + 5000).unref();
  };
  const earlyTerm = () => onEarly('SIGTERM');
  const earlyInt = () => onEarly('SIGINT');
  process.on('SIGTERM', earlyTerm);
  process.on('SIGINT', earlyInt);
  const svc = await startService(mode, config, { logger, extensions });
  process.off('SIGTERM', earlyTerm);
  process.off('SIGINT', earlyInt);
  if (svc.url) {
    logger.info({ url: svc.url }, `mnemos ${mode} listening on ${svc.url}`);
    // Shown because the default is shared: two deployments on one Redis with the same prefix take
    // each other's jobs, and a mistyped MNEMOS_PREFIX variable falls back to it.
    const prefixLine = `  Prefix:     ${config.prefix}   (MNEMOS_PREFIX: its Redis keys and queues; one per deployment)`;
    // A worker serves health, readiness and metrics only: no keys, Bull Board or OpenAPI to show.
    const lines =
      mode === 'worker'
        ? [
            `mnemos worker listening on ${svc.url}`,
            prefixLine,
            `  Health:     ${svc.url}/readyz   Metrics: ${svc.url}/metrics`,
          ]
        : [
            `mnemos ${mode} listening on ${svc.url}`,
            // With an admin token, as in embedded mode: the admin API, which needs no shell on
            // the server (a container's operator has none).
            ...(config.databaseUrl
              ? [
                  config.adminToken
                    ? adminKeyLine(svc.url)
                    : `  API keys:   npx mnemos tenant create <name>   (prints a tenant id and its first key)`,
                ]
              : embeddedBannerLines(config, svc.url)),
            config.adminToken
              ? `  Bull Board: ${svc.url}/admin/queues   (user: any, password: MNEMOS_ADMIN_TOKEN)`
              : '  Bull Board: set MNEMOS_ADMIN_TOKEN to enable /admin/queues',
            prefixLine,
            `  Health:     ${svc.url}/readyz   Metrics: ${svc.url}/metrics   OpenAPI: ${svc.url}/openapi.json`,
          ];
    process.stdout.write(`${lines.join('\n')}\n`);
  } else {
    logger.info(`mnemos ${mode} started`);
  }
  let signals = 0;
  const onSignal = (sig: string) => {
    signals++;
    if (signals > 1) {
      logger.warn({ sig }, 'second signal: exiting now');
      process.exit(1);
    }
    logger.info({ sig }, 'shutting down');
    const force = setTimeout(() => {
      logger.error('shutdown deadline passed: exiting');
      process.exit(1);
    }, config.shutdownTimeoutMs + 5000);
    force.unref();
    svc.stop().then(
      () => process.exit(0),
      (err: unknown) => {
        logger.error({ err }, 'shutdown failed');
        process.exit(1);
      },
    );
  };
  process.on('SIGTERM', () => onSignal('SIGTERM'));
  process.on('SIGINT', () => onSignal('SIGINT'));
  if (early !== null) onSignal(early);
}

/**
 * The request's Transfer-Encoding when it is anything but a single `chunked`, else null. Node's parser
 * reads `gzip, chunked` as chunked and hands on the still-compressed bytes, which were then parsed
 * as the body: a coding the server does not understand is a 501 (RFC 9112 §6.1).
 */
export function unsupportedTransferCoding(req: IncomingMessage): string | null {
  const te = req.headers['transfer-encoding'];
  if (te === undefined) return null;
  const codings = te.split(',').map((c) => c.trim().toLowerCase());
  return codings.length === 1 && codings[0] === 'chunked' ? null : te;
}

/**
 * Node runs the handlers of requests pipelined on one connection all at once (only their answers
 * are queued in order): 20 pipelined posts got their seqs shuffled, and a GET pipelined after a
 * post that created the session answered 404. Each request's handler starts once the previous
 * request's answer has finished or its connection closed.
 *
 * A request whose connection can no longer carry an answer when its turn comes is not run at all:
 * the answer before it closed the connection (`connection: close`, as every answer does once the
 * server is stopping), the client half-closed it, or it is gone. Run, a post pipelined behind a
 * `?wait=true` in flight at SIGTERM stored its messages and was never answered, and a client
 * retrying it without ids stored them twice. Not run, the client sees the connection close with no
 * answer, which is safe to retry. The connection is left to close as Node closes it: destroyed here,
 * the answer before it could lose bytes still on their way out.
 */
export function oneAtATimePerConnection(
  handle: (req: IncomingMessage, res: ServerResponse) => void,
  onError: (err: unknown, res: ServerResponse) => void,
): (req: IncomingMessage, res: ServerResponse) => void {
  interface Line {
    tail: Promise<void> | null;
    closed: boolean;
    ends: Set<() => void>;
  }
  const lines = new WeakMap<Socket, Line>();
  const lineOf = (socket: Socket): Line => {
    let line = lines.get(socket);
    if (!line) {
      const l: Line = { tail: null, closed: socket.destroyed, ends: new Set() };
      // One listener per connection (not per request: a keep-alive connection serves thousands).
      socket.once('close', () => {
        l.closed = true;
        for (const end of l.ends) end();
      });
      lines.set(socket, (line = l));
    }
    return line;
  };
  const run = (req: IncomingMessage, res: ServerResponse, line: Line) => {
    // Node ends the socket (without destroying it) as soon as an answer that closes the
    // connection has finished, before that answer's `close` lets the next request go: a socket
    // that is no longer writable is one nothing more will be written on.
    if (line.closed || req.socket.destroyed || !req.socket.writable) return;
    try {
      handle(req, res);
    } catch (err) {
      onError(err, res);
    }
  };
  return (req, res) => {
    const line = lineOf(req.socket);
    const done = new Promise<void>((resolve) => {
      if (line.closed) return resolve();
      const end = () => {
        res.off('close', end);
        line.ends.delete(end);
        resolve();
      };
      res.on('close', end);
      line.ends.add(end);
    });
    const before = line.tail;
    line.tail = done;
    void done.then(() => {
      if (line.tail === done) line.tail = null;
    });
    if (before === null) run(req, res, line);
    else void before.then(() => run(req, res, line));
  };
}

/**
 * Destroys the connection of an answer whose written bytes have made no progress for `stallMs`
 * (its client stopped reading), which frees what was buffered for it: a streamed export waiting
 * for 'drain', or one big `res.json` whose 'finish' never comes. An answer writing nothing (a
 * long-poll) has nothing pending and is left alone. Progress is bytes whose write completed, or
 * the part of the write under way that the kernel has taken (one 22 MB write completes only once
 * all of it is taken). Returns the function that stops the watch.
 */
export function cutStalledWrites(
  answers: Set<ServerResponse>,
  stallMs: number,
  onCut: (res: ServerResponse) => void,
): () => void {
  const seen = new WeakMap<Socket, { done: number; queued: number; since: number }>();
  const check = () => {
    const now = Date.now();
    for (const res of answers) {
      const socket = res.socket;
      if (!socket || socket.destroyed) continue;
      if (socket.writableLength === 0) {
        seen.delete(socket);
        continue;
      }
      const done = socket.bytesWritten - socket.writableLength;
      const queued = (socket as { _handle?: { writeQueueSize?: number } })._handle?.writeQueueSize ?? 0;
      const last = seen.get(socket);
      if (!last || done > last.done || queued < last.queued) {
        seen.set(socket, { done, queued, since: now });
      } else if (now - last.since >= stallMs) {
        onCut(res);
        socket.destroy();
      }
    }
  };
  const timer = setInterval(check, Math.max(10, Math.min(1000, stallMs / 4)));
  timer.unref();
  return () => clearInterval(timer);
}

/** An error answered before the app runs, in the API's error shape; the connection closes. */
function rawError(res: ServerResponse, status: number, code: string, message: string): void {
  const body = JSON.stringify(errorBody(new AppError(status, code, message)));
  res.writeHead(status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
    // As every answer under /v1 (errors included) says: these come before the path is read.
    'cache-control': 'no-store',
    connection: 'close',
  });
  res.end(body);
}

/** The raw HTTP answer to a request Node's parser refused, in mnemos's error shape, and its status. */
export function clientErrorResponse(code: string | undefined): { status: number; raw: string } {
  const [status, errorCode, message] =
    code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'headers_too_large', 'request headers are larger than 16 KB']
      : code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? [408, 'request_timeout', 'the request was not received in time']
        : [400, 'bad_request', 'malformed HTTP request'];
  const body = JSON.stringify(errorBody(new AppError(status, errorCode, message)));
  return {
    status,
    raw:
      `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\ncontent-type: application/json; charset=utf-8\r\n` +
      `content-length: ${Buffer.byteLength(body)}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n${body}`,
  };
}

/**
 * Behind a transaction pooler no connection can be told to default to read committed (db/pool.ts):
 * mnemos's transactions say it themselves, but its single statements run at the database's
 * default. Under repeatable read or serializable they fail with serialisation errors when drains
 * update the same session row: a re-tester's resets answered 503 after they had committed, and a
 * client retrying one resets twice.
 */
async function poolerIsolationWarnings(db: Db, config: Config): Promise<string[]> {
  if (!config.pgTransactionPooler || db.kind !== 'postgres') return [];
  const r = await db.query<{ level: string; float_digits: string }>(
    `SELECT current_setting('default_transaction_isolation') AS level,
            current_setting('extra_float_digits') AS float_digits`,
  );
  const level = r.rows[0]?.level ?? 'read committed';
  const floatDigits = Number(r.rows[0]?.float_digits ?? 1);
  return [
    ...(level === 'read committed'
      ? []
      : [
          `the database's default_transaction_isolation is ${level}: behind a transaction pooler (PG_POOLER) ` +
            `mnemos's single statements run at it and fail when drains update the same row; set it for ` +
            `mnemos's role: ALTER ROLE <role> SET default_transaction_isolation = 'read committed'`,
        ]),
    ...(floatDigits >= 1
      ? []
      : [
          `the database's extra_float_digits is ${floatDigits}: behind a transaction pooler (PG_POOLER) ` +
            `floats are read as Postgres prints them, and search scores lose digits; set it for mnemos's ` +
            `role: ALTER ROLE <role> SET extra_float_digits = 1`,
        ]),
  ];
}

/**
 * Behind a transaction pooler no connection can be told to print timestamps in ISO (db/pool.ts),
 * the only format pg reads: under `SQL, DMY` every statement reading a timestamp would fail.
 */
async function refuseNonIsoDateStyle(db: Db, config: Config): Promise<void> {
  if (!config.pgTransactionPooler || db.kind !== 'postgres') return;
  const r = await db.query<{ style: string }>(`SELECT current_setting('DateStyle') AS style`);
  const style = r.rows[0]?.style ?? 'ISO';
  if (/^ISO\b/.test(style)) return;
  throw new Error(
    `the connection's DateStyle (from the role's or the database's settings) is '${style}': behind ` +
      `a transaction pooler (PG_POOLER) mnemos cannot set it per connection and reads timestamps in ` +
      `ISO only; set it for mnemos's role: ALTER ROLE <role> SET DateStyle = 'ISO, MDY', then make the ` +
      `pooler open new server connections (PgBouncer: RECONNECT in its admin console, or a restart)`,
  );
}
