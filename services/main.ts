import { STATUS_CODES, createServer } from 'node:http';
import type { IncomingMessage, Server, ServerResponse } from 'node:http';
import { migrate, newerSchemaWarning, unknownMigrations } from '../db/migrate.js';
import { startWorkers } from '../workers/main.js';
import type { RunningWorkers, WorkerOptions } from '../workers/main.js';
import { makeApp, makeOpsApp } from './app.js';
import { startQueueSampler } from './metrics-sampler.js';
import { endWaits } from './messages/accept-messages.js';
import { loadConfig, shownUrl } from './config.js';
import type { Config } from './config.js';
import type { CoreDeps } from './deps.js';
import type { Extension, ExtensionFactory } from './extension.js';
import { makeLogger } from './logger.js';
import type { Logger } from './logger.js';
import { redisDurabilityWarnings, waitForRedis } from './redis.js';
import { closeDeps, embeddedBannerLines, openDeps } from './runtime.js';
import { AppError } from './errors.js';
import { errorBody } from './http-errors.js';

export type Mode = 'api' | 'worker' | 'serve';

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
  opts: { logger?: Logger; worker?: WorkerOptions; extensions?: ExtensionFactory[] } = {},
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

  const stop = () =>
    (stopping ??= (async () => {
      // Ordered: stop intake, finish in-flight work, then close queues, Redis and the pool. One
      // deadline for all of it: requests first (jobs keep running meanwhile, so that a ?wait=true
      // still sees its drain), then jobs with what is left of it. (Each phase once had the whole
      // grace period: twice SHUTDOWN_TIMEOUT_MS, past compose's stop_grace_period.)
      const until = Date.now() + config.shutdownTimeoutMs;
      const left = () => Math.max(0, until - Date.now());
      // A ?wait=true still waiting a second before the deadline answers its 202 then, rather
      // than have its connection cut with it.
      const waits = setTimeout(() => endWaits(inFlight), Math.max(0, left() - 1000));
      waits.unref();
      stopSampler?.();
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
    await migrate(deps.db);
    const newer = await unknownMigrations(deps.db);
    if (newer.length > 0) logger.warn(newerSchemaWarning(newer));
    if (!(await waitForRedis(deps.redis, 5000))) {
      throw new Error(`cannot reach Redis at ${shownUrl(config.redisUrl)} (is it running?)`);
    }
    for (const w of [...config.warnings, ...(await redisDurabilityWarnings(deps.redis))]) logger.warn(w);
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
      const handle = (req: IncomingMessage, res: ServerResponse) => {
        if (stopping) res.setHeader('connection', 'close');
        else {
          inFlight.add(res);
          res.once('close', () => inFlight.delete(res));
        }
        if (req.headers.host === undefined && req.httpVersion !== '1.0') {
          rawError(res, 400, 'missing_host', 'an HTTP/1.1 request must carry a Host header');
          return;
        }
        if ((req.headersDistinct.host?.length ?? 0) > 1) {
          rawError(res, 400, 'duplicate_host', 'a request carries one Host header (RFC 9112 §3.2)');
          return;
        }
        app(req, res);
      };
      const s = createServer({ requireHostHeader: false }, handle);
      // `Expect: 100-continue` is answered by the app once the caller is authenticated (app.ts),
      // not by Node before any route runs: a caller without a valid key is not invited to upload.
      s.on('checkContinue', handle);
      s.on('checkExpectation', (_req: IncomingMessage, res: ServerResponse) =>
        rawError(res, 417, 'expectation_failed', 'the only supported expectation is Expect: 100-continue'),
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
        socket.end(clientErrorResponse(err.code));
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
    // A worker serves health, readiness and metrics only: no keys, Bull Board or OpenAPI to show.
    const lines =
      mode === 'worker'
        ? [
            `mnemos worker listening on ${svc.url}`,
            `  Health:     ${svc.url}/readyz   Metrics: ${svc.url}/metrics`,
          ]
        : [
            `mnemos ${mode} listening on ${svc.url}`,
            ...(config.databaseUrl
              ? [`  API keys:   npx mnemos tenant create <name>   (prints a tenant id and its first key)`]
              : embeddedBannerLines(config, svc.url)),
            config.adminToken
              ? `  Bull Board: ${svc.url}/admin/queues   (user: any, password: MNEMOS_ADMIN_TOKEN)`
              : '  Bull Board: set MNEMOS_ADMIN_TOKEN to enable /admin/queues',
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

/** An error answered before the app runs, in the API's error shape; the connection closes. */
function rawError(res: ServerResponse, status: number, code: string, message: string): void {
  const body = JSON.stringify(errorBody(new AppError(status, code, message)));
  res.writeHead(status, {
    'content-type': 'application/json; charset=utf-8',
    'content-length': Buffer.byteLength(body),
    connection: 'close',
  });
  res.end(body);
}

/** The raw HTTP answer to a request Node's parser refused, in mnemos's error shape. */
export function clientErrorResponse(code: string | undefined): string {
  const [status, errorCode, message] =
    code === 'HPE_HEADER_OVERFLOW'
      ? [431, 'headers_too_large', 'request headers are larger than 16 KB']
      : code === 'ERR_HTTP_REQUEST_TIMEOUT'
        ? [408, 'request_timeout', 'the request was not received in time']
        : [400, 'bad_request', 'malformed HTTP request'];
  const body = JSON.stringify(errorBody(new AppError(status, errorCode, message)));
  return (
    `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\ncontent-type: application/json; charset=utf-8\r\n` +
    `content-length: ${Buffer.byteLength(body)}\r\nconnection: close\r\n\r\n${body}`
  );
}
