import { isUtf8 } from 'node:buffer';
import { randomUUID } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import { createRequire } from 'node:module';
import querystring from 'node:querystring';
import { createBullBoard } from '@bull-board/api';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { ExpressAdapter } from '@bull-board/express';
import express from 'express';
import type { RequestHandler, Router } from 'express';
import { recheckTenant, requireAdmin, requireTenant } from './auth.js';
import { rateLimit } from './rate-limit.js';
import { makeKeyAuthenticator } from './tenants.js';
import { monotonicNow } from './time.js';
import type { CoreDeps } from './deps.js';
import { AppError } from './errors.js';
import { makeErrorHandler, notFoundHandler, routeLabel } from './http-errors.js';
import { timeAnswer } from './metrics.js';
import { buildOpenApi } from './openapi.js';
import { forRequests } from './deps.js';
import { responseChecker } from './response-check.js';
import { byteBudget } from './byte-budget.js';
import type { ByteBudget } from './byte-budget.js';
import { MAX_IMPORT_BYTES, clientBody, contentCoding, decodedBody } from './lifecycle/import-input.js';
import { markZeroLengthBody } from './validate.js';
import { MAX_BODY_DEPTH, jsonNestedDeeperThan } from './json-depth.js';
import type { Mounted, RouteMeta } from './openapi.js';
import { adminRoutesMeta, makeAdminRoutes } from './routes/admin-routes.js';
import { jobRoutesMeta, makeJobRoutes, makeOpsRoutes, opsRoutesMeta } from './routes/ops-routes.js';
import { makeSessionRoutes, sessionRoutesMeta } from './routes/session-routes.js';

export const MAX_BODY_BYTES = 8 * 1024 * 1024;
export const VERSION = '0.1.0';

/** Extra routers mounted under /v1 by capability modules (error memory, search, …). */
export interface ExtraRoutes {
  prefix: string;
  router: Router;
  meta: Record<string, RouteMeta>;
  /** Default 'tenant'. */
  auth?: 'tenant' | 'none';
}

export interface AppOptions {
  extraRoutes?: ExtraRoutes[];
  eraseTenant?: (tenantId: string) => Promise<boolean>;
  /** Content types besides JSON that a route accepts raw (e.g. JSON Lines import). */
}

/**
 * The request's id: the client's own (the client library sends one per call, the same on each
 * retry) or a new one. The error handler's log lines carry it as `reqId`.
 */
const requestId: RequestHandler = (req, res, next) => {
  const given = req.header('x-request-id');
  const id = given && /^[A-Za-z0-9._-]{1,128}$/.test(given) ? given : randomUUID();
  res.setHeader('x-request-id', id);
  res.locals.requestId = id;
  next();
};

/**
 * The charsets the body's content-type declares, lower-cased (none, one, or more: body-parser
 * reads the last, so each is checked). Spaces around `=` count, as body-parser allows them. The
 * parameters are read one by one, so that `charset=` inside another one's quoted value
 * (`x="a;charset=utf-16"`) is no charset.
 */
export function charsetsOf(contentType: string): string[] {
  const param = /;\s*([^\s=;]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;]*))/y;
  const out: string[] = [];
  for (let at = contentType.indexOf(';'); at >= 0 && at < contentType.length;) {
    param.lastIndex = at;
    const m = param.exec(contentType);
    // A malformed parameter is skipped, not the rest: a charset after it is still checked.
    if (!m) {
      at = contentType.indexOf(';', at + 1);
      continue;
    }
    if (m[1]!.toLowerCase() === 'charset')
      out.push((m[2] !== undefined ? m[2].replace(/\\(.)/g, '$1') : m[3]!).trim().toLowerCase());
    at = param.lastIndex;
  }
  return out;
}

/** UTF-8 by its names, and ASCII, which is UTF-8's first 128 characters. */
const UTF8_NAMES = new Set(['utf-8', 'utf8', 'us-ascii', 'ascii', '']);

/**
 * Bodies must be JSON (or JSON Lines where a route says so) in UTF-8; anything else is a 415, not
 * a 400. body-parser would decode any `utf-*` charset (utf-7, utf-16, utf-32) through iconv-lite,
 * which turns what it cannot decode into U+FFFD: the text would be stored altered, past the UTF-8
 * check below, which only a UTF-8 body can take.
 */
const requireJson: RequestHandler = (req, _res, next) => {
  const hasBody =
    req.headers['transfer-encoding'] !== undefined || Number(req.headers['content-length'] ?? 0) > 0;
  const type = req.headers['content-type'];
  // Zero bytes are no body whatever their parameters (body-parser still reads them, and refused
  // `charset=utf8` or `latin1` on an empty DELETE with a 415).
  if (!hasBody) {
    if (type !== undefined) req.headers['content-type'] = type.split(';')[0]!;
    return next();
  }
  const charsets = charsetsOf(type ?? '');
  const other = charsets.find((c) => !UTF8_NAMES.has(c));
  if (other !== undefined)
    throw new AppError(
      415,
      'unsupported_encoding',
      `charset ${other} is not supported: send the body in UTF-8`,
    );
  // `utf8` is UTF-8's common alias, which body-parser (it wants `utf-…`) refused with a 415.
  if (charsets.length > 0) req.headers['content-type'] = `${type!.split(';')[0]!}; charset=utf-8`;
  if (req.method === 'GET' || req.method === 'HEAD') return next();
  // JSON Lines only where a route reads them: elsewhere such a body went unread, and the route
  // ran as if none had been sent (a reset kept the summary its body asked to drop).
  // (Routing ignores case and a trailing slash: so does this. The path, not the request line: an
  // absolute-form `POST http://host/v1/…` is routed by its path too.)
  const lines = req.method === 'POST' && /^\/v1\/sessions\/[^/]+\/import\/?$/i.test(req.baseUrl + req.path);
  // A declared length over the limit is refused at once: body-parser would read (and wait for)
  // the whole body before its 413, so a client sending 1 GB, or stalling, would wait for it (and
  // an import's reader read 64 MiB of it).
  const identity = contentCoding(req.headers['content-encoding']) === 'identity';
  const declared = Number(req.headers['content-length'] ?? 0);
  if (req.is(['application/json', 'application/*+json'])) {
    if (identity && declared > MAX_BODY_BYTES) {
      throw new AppError(413, 'body_too_large', `request body exceeds ${MAX_BODY_BYTES} bytes`, undefined, {
        connection: 'close',
      });
    }
    return next();
  }
  if (lines && req.is(['application/x-ndjson', 'application/jsonl'])) {
    if (identity && declared > MAX_IMPORT_BYTES) {
      // What the import's reader answers past its limit (readJsonLines).
      throw new AppError(
        413,
        'body_too_large',
        `the import exceeds ${MAX_IMPORT_BYTES} bytes`,
        { limit: MAX_IMPORT_BYTES },
        { connection: 'close' },
      );
    }
    return next();
  }
  throw new AppError(
    415,
    'unsupported_media_type',
    lines
      ? 'send the body as application/x-ndjson (JSON Lines, as export writes) or application/json'
      : 'send the body as application/json',
  );
};

/**
 * Bull Board takes HTTP Basic so that a browser can open it, and a browser sends remembered Basic
 * credentials with requests that other sites' pages make: a page could POST jobs into the queues
 * (`…/api/queues/<q>/add` with a form body needs no preflight). A request that changes something
 * must therefore come from the board's own origin: a browser names a foreign one in `Origin` (and
 * `Sec-Fetch-Site`). Clients that send neither (curl, scripts) are not browsers and pass. Behind a
 * proxy that rewrites `Host`, it must pass `X-Forwarded-Host`.
 */
const sameOriginWrites: RequestHandler = (req, _res, next) => {
  if (req.method === 'GET' || req.method === 'HEAD') return next();
  const site = req.headers['sec-fetch-site'];
  const origin = req.headers.origin;
  let foreign = site === 'cross-site' || site === 'same-site';
  if (!foreign && origin !== undefined) {
    foreign = true;
    try {
      const from = new URL(origin);
      const port = from.port || (from.protocol === 'https:' ? '443' : '80');
      const own = [req.headers.host, req.headers['x-forwarded-host']]
        .flatMap((h) => (typeof h === 'string' ? h.split(',') : []))
        .flatMap((h) => {
          try {
            return [new URL(`http://${h.trim()}`)];
          } catch {
            return [];
          }
        });
      // The same host and port; a Host or X-Forwarded-Host without a port (URL drops `:80` too)
      // may name a default one, and a proxy's `$host:$server_port` names 443 explicitly.
      foreign = !own.some(
        (h) =>
          h.hostname === from.hostname &&
          (h.port === port || (h.port === '' && (port === '80' || port === '443'))),
      );
    } catch {
      // `Origin: null`, or a header that is no URL: not the board's own page.
    }
  }
  if (foreign)
    throw new AppError(403, 'cross_origin', 'Bull Board accepts changes only from its own pages (Origin)');
  next();
};

/**
 * Bull Board's pages have buttons that change the queues (retry, clean, promote, add): no other
 * site may show them in a frame and lead a signed-in admin's clicks there (clickjacking).
 */
const noFraming: RequestHandler = (_req, res, next) => {
  res.setHeader('x-frame-options', 'DENY');
  res.setHeader('content-security-policy', "frame-ancestors 'none'");
  next();
};

const badUtf8 = new WeakSet<object>();
/** Requests whose JSON body had zero bytes (`content-length: 0` with a JSON content-type). */
const zeroLength = new WeakSet<object>();

/**
 * Answers `Expect: 100-continue` once the caller is authenticated: main.ts takes Node's
 * checkContinue, so that a request refused before this point (no or a bad key, rate limited, no
 * route) gets its answer without the client being invited to upload the body first. (A server
 * without that listener, as in tests calling the app directly, has already sent it.)
 */
const continueAfterAuth: RequestHandler = (req, res, next) => {
  const sent = (res as { _sent100?: boolean })._sent100 === true;
  if (!sent && !res.headersSent && /^\s*100-continue\s*$/i.test(req.headers.expect ?? ''))
    res.writeContinue();
  next();
};

/**
 * body-parser and raw-body look the body's charset up in iconv-lite, which reads its tables from
 * disk on first use: a process whose first JSON body came while it had no file descriptor free
 * (EMFILE, at its `ulimit -n` under load) answered every JSON request with 415 "unsupported
 * charset UTF-8", a refusal the client library does not retry. They are read here, at start, from
 * the iconv-lite those packages resolve.
 */
function loadCharsetTables(): void {
  const bodyParser = createRequire(createRequire(import.meta.url).resolve('express')).resolve('body-parser');
  const rawBody = createRequire(bodyParser).resolve('raw-body');
  for (const from of [bodyParser, rawBody]) {
    const iconv = createRequire(from)('iconv-lite') as { getDecoder(encoding: string): unknown };
    for (const charset of ['utf-8', 'us-ascii']) iconv.getDecoder(charset);
  }
}
loadCharsetTables();

/**
 * What a JSON body's bytes must be before they are parsed: UTF-8 (a 400 after parsing, as the
 * JSON's own errors come first) and at most MAX_BODY_DEPTH levels deep. Thrown here, the error
 * reaches the error handler as it is (body-parser keeps its status), and the body is never parsed.
 */
function checkJsonBytes(req: IncomingMessage, buf: Buffer): void {
  if (!isUtf8(buf)) badUtf8.add(req);
  if (buf.length === 0) zeroLength.add(req);
  if (jsonNestedDeeperThan(buf, MAX_BODY_DEPTH))
    throw new AppError(
      400,
      'body_too_deep',
      `request body is nested more than ${MAX_BODY_DEPTH} levels deep (objects and arrays)`,
      { limit: MAX_BODY_DEPTH },
    );
}

/**
 * A JSON body of no declared length is read here, as an import's is, rather than by body-parser:
 * a compressed one (`Content-Encoding` gzip, deflate or br), as body-parser's decoder stops where a
 * deflate or br stream ends and drops what follows, so a body of two streams (or one and some
 * garbage) stored its first part only and answered 2xx; a chunked one, as body-parser read all of
 * it, past its limit, before its 413 (a client sending 150 MB had them all read). The limit counts
 * the decoded bytes, and one past it is refused at once, the connection closed. Once read, the
 * body's room in the budget is cut to its decoded size (reserveBodyMemory). A leading UTF-8 BOM is
 * dropped, as body-parser drops it. body-parser then finds the request read and leaves `req.body`
 * as set here.
 */
const readUnsizedJsonBody: RequestHandler = (req, _res, next) => {
  const coding = contentCoding(req.headers['content-encoding']);
  // Read already, on this request's way through an earlier router of the same mount (the
  // tenant chain runs again for each router at `/v1/sessions`): decoding its consumed stream
  // again found no data and answered 400 on every route of a later router.
  if (req.readableEnded) return next();
  const chunked =
    req.headers['transfer-encoding'] !== undefined && req.headers['content-length'] === undefined;
  if (coding === 'identity' && !chunked) return next();
  if (!req.is(['application/json', 'application/*+json'])) return next();
  void (async () => {
    const parts: Buffer[] = [];
    let size = 0;
    // Left as it is when the reading stops (past the limit): destroyed, it took the connection
    // down before the 413 was sent.
    const body = clientBody(req.iterator({ destroyOnReturn: false }) as AsyncIterable<Buffer>);
    for await (const chunk of decodedBody(body, coding)) {
      size += chunk.length;
      if (size > MAX_BODY_BYTES)
        throw new AppError(413, 'body_too_large', `request body exceeds ${MAX_BODY_BYTES} bytes`, undefined, {
          connection: 'close',
        });
      parts.push(chunk);
    }
    const buf = Buffer.concat(parts);
    bodyRead.get(req)?.(buf.length);
    checkJsonBytes(req, buf);
    // body-parser's reading of an empty body (a BOM alone is one: it drops the BOM first), and
    // strict: false.
    const text = buf.toString('utf8').replace(/^\uFEFF/, '');
    try {
      req.body = text === '' ? {} : (JSON.parse(text) as unknown);
    } catch {
      throw new AppError(400, 'malformed_json', 'request body is not valid JSON');
    }
  })().then(() => next(), next);
};

/**
 * JSON request bodies one API process reads and holds at once, in declared bytes (a body of
 * unknown length, chunked or compressed, counts as the 8 MiB limit until it is read, then as its
 * decoded size: counted as 8 MiB until their answers, four tiny compressed `?wait=true` posts held
 * a tenant's whole share for their 10 s wait), and one tenant's share of them. A parsed body costs
 * about three times its size until its answer is sent: 40 concurrent posts of 7 MB each took a
 * process to 828 MB, and 10 of them killed one limited to a 96 MB heap (a tester, 2026-12-03),
 * taking every other tenant's requests and, in `serve`, the workers with it. A request that finds
 * no room waits up to BODY_MEMORY_WAIT_MS, before its body is read (nor is a client that sent
 * `Expect: 100-continue` invited to send it), then answers 503 `body_busy`.
 */
export const BODY_MEMORY_BYTES = 64 * 1024 * 1024;
const BODY_MEMORY_WAIT_MS = 5_000;

/** For a request holding room for a body of unknown length: cuts it to the body's size, once read. */
const bodyRead = new WeakMap<object, (bytes: number) => void>();

function reserveBodyMemory(budget: ByteBudget): RequestHandler {
  return (req, res, next) => {
    // Once per request: the tenant chain runs again for each router mounted at `/v1/sessions`,
    // and an import, charged on each, was refused for six times its size. GET bodies count too:
    // body-parser reads them.
    if (res.locals.bodyReserved === true) return next();
    if (!req.is(['application/json', 'application/*+json'])) return next();
    res.locals.bodyReserved = true;
    const identity = contentCoding(req.headers['content-encoding']) === 'identity';
    const length = req.headers['content-length'];
    const declared = Number(length);
    // (A larger declared length is a 413 before this, or past the limit as the body is read.) A
    // request with neither a length nor chunks has no body.
    let bytes =
      length === undefined && req.headers['transfer-encoding'] === undefined
        ? 0
        : identity && Number.isSafeInteger(declared)
          ? Math.min(declared, MAX_BODY_BYTES)
          : MAX_BODY_BYTES;
    if (bytes <= 0) return next();
    const key = typeof res.locals.tenantId === 'string' ? res.locals.tenantId : '';
    // Given back when the answer is done or the connection goes: a pipelined request whose
    // connection died while its answer waited behind an earlier one never saw its response's
    // `close`, and held its room for good (two tenants so blocked every JSON write).
    const socket = req.socket;
    // A request the parser hands on after its connection closed (pipelined behind others, all
    // received) would never see that `close`: its body is all here, and it takes no room.
    if (socket.destroyed) return next();
    let state: 'waiting' | 'held' | 'done' = 'waiting';
    const done = () => {
      if (state === 'held') budget.give(key, bytes);
      state = 'done';
      res.off('close', done);
      socket.off('close', done);
    };
    res.once('close', done);
    socket.once('close', done);
    bodyRead.set(req, (read) => {
      if (state !== 'held' || read >= bytes) return;
      budget.give(key, bytes - read);
      bytes = read;
    });
    budget.take(key, bytes, BODY_MEMORY_WAIT_MS).then((got) => {
      if (got !== true) {
        done();
        return next(bodyBusy(got));
      }
      // The client left while it waited: the room goes back at once.
      if (state === 'done') return budget.give(key, bytes);
      state = 'held';
      next();
    }, next);
  };
}

const bodyBusy = (full: 'key' | 'total') =>
  new AppError(
    503,
    'body_busy',
    full === 'key'
      ? `this tenant's other requests hold its share (${BODY_MEMORY_BYTES / 2 / 2 ** 20} MiB) of the request bodies this process reads at once: retry`
      : `requests hold the ${BODY_MEMORY_BYTES / 2 ** 20} MiB of request bodies this process reads at once: retry`,
    { scope: full === 'key' ? 'tenant' : 'process' },
    { 'retry-after': '1' },
  );

/**
 * Reads a JSON body. body-parser would turn bytes that are not UTF-8 into U+FFFD and store the
 * altered text: a body declared (or defaulting to) UTF-8 that is not valid UTF-8 is a 400 instead.
 */
const readJsonBody = (memory: ByteBudget): RequestHandler[] => [
  // The type and a declared length are checked before the client is invited to send the body.
  requireJson,
  reserveBodyMemory(memory),
  continueAfterAuth,
  readUnsizedJsonBody,
  express.json({
    limit: MAX_BODY_BYTES,
    strict: false,
    type: ['application/json', 'application/*+json'],
    // requireJson let only UTF-8 (declared or by default) through.
    verify: (req, _res, buf) => checkJsonBytes(req, buf),
  }),
  (req, _res, next) => {
    if (badUtf8.has(req)) throw new AppError(400, 'invalid_utf8', 'request body is not valid UTF-8');
    if (zeroLength.has(req) && typeof req.body === 'object' && req.body !== null)
      markZeroLengthBody(req.body);
    next();
  },
];

/**
 * Where a router is mounted, remembered for the metrics label: once an error has left a router,
 * `req.baseUrl` is its parent's again (a 404 of `/v1/jobs/:id` was labelled `/:id`).
 */
const rememberMount: RequestHandler = (req, res, next) => {
  // Routing ignores case: the label must not (`/V1/SESSIONS` would be a label of its own).
  res.locals.mount = req.baseUrl.toLowerCase();
  next();
};

/**
 * No answer is conditional: Express counts `If-None-Match: *` as matching any answer, with or
 * without an ETag, and answered GETs with an empty 304.
 */
const unconditional: RequestHandler = (req, _res, next) => {
  delete req.headers['if-none-match'];
  delete req.headers['if-modified-since'];
  next();
};

export function makeApp(deps: CoreDeps, opts: AppOptions = {}): express.Express {
  const app = express();
  const bodyMemory = byteBudget(BODY_MEMORY_BYTES, BODY_MEMORY_BYTES / 2);
  app.disable('x-powered-by');
  // Answers are one tenant's current state: no validator to revalidate a copy against (Express's
  // weak ETag answered If-None-Match with a 304), and /v1 says no-store below.
  app.set('etag', false);
  app.set('trust proxy', false);
  // Node's querystring keeps the first 1,000 pieces and drops the rest without a word (empty ones
  // count): `DELETE /v1/errors?` + 1,000 `&` + `tool_name=psql` purged every tool's records. Every
  // piece is read (a URL is bounded by the 16 KB header limit anyway).
  app.set('query parser', (qs: string) => querystring.parse(qs, undefined, undefined, { maxKeys: 0 }));

  app.use(requestId);
  app.use(unconditional);
  app.use((req, res, next) => {
    timeAnswer(deps.metrics, res, () => ({ method: req.method, route: routeLabel(req, res) }));
    next();
  });
  // Bodies are read only after authentication (below): a caller without a valid key gets a 401,
  // whatever its body, and never has us parse 8 MiB.

  // Express answers HEAD with a GET route's handler, side effects and all (a HEAD of an error
  // record renewed its TTL, one of an export ran the whole export): under /v1 and /admin it has
  // no route, as any method a route does not list. The ops routes (probes) keep it. So does
  // OPTIONS, which Express answered itself in plain text, listing HEAD (there is no CORS here).
  // A tenant's answers (and the admin API's keys) are for their caller only, and stale the moment
  // a message is posted: no shared cache or client may keep or serve a copy. First, so that every
  // answer below says it (the HEAD and OPTIONS 404s did not).
  app.use('/v1', (_req, res, next) => {
    res.setHeader('cache-control', 'no-store');
    next();
  });
  app.use(['/v1', '/admin'], (req, _res, next) => {
    if (req.method === 'HEAD' || req.method === 'OPTIONS')
      throw new AppError(404, 'not_found', `no route for ${req.method} ${req.baseUrl}${req.path}`);
    next();
  });

  const mounts: Mounted[] = [];
  const openapi = () => buildOpenApi(mounts, VERSION);
  const checker = responseChecker(mounts);
  if (checker) app.use(checker);

  const ops = makeOpsRoutes(deps, openapi);
  app.use('/', rememberMount, ops);
  mounts.push({ prefix: '', router: ops, meta: opsRoutesMeta });

  // Bull Board: behind the admin token (bearer, or Basic for browsers: only here); 404 without a token.
  if (deps.config.adminToken) {
    const board = new ExpressAdapter();
    board.setBasePath('/admin/queues');
    createBullBoard({
      queues: Object.values(deps.queues)
        .filter((q): q is CoreDeps['queues']['ingest'] => typeof q === 'object' && q !== null && 'add' in q)
        .map((q) => new BullMQAdapter(q)),
      serverAdapter: board,
    });
    app.use(
      '/admin/queues',
      rememberMount,
      noFraming,
      sameOriginWrites,
      requireAdmin(deps.config.adminToken, { basic: true }),
      continueAfterAuth,
      board.getRouter(),
    );
  } else {
    app.use('/admin', rememberMount, requireAdmin(undefined));
  }

  // A backstop behind the pool's own bounds (5 s for a connection, then the statement's), which
  // answer first. Embedded (PGlite) statements queue behind each other in the process: no outage.
  // Postgres statements made for a request get PG_REQUEST_TIMEOUT_MS to answer (db/pool.ts).
  const routeDeps = forRequests(deps);
  const keys = makeKeyAuthenticator(routeDeps.db, monotonicNow, {
    readTimeoutMs:
      deps.db.kind === 'postgres' && deps.config.pgRequestTimeoutMs > 0
        ? deps.config.pgRequestTimeoutMs + 5000
        : 0,
  });
  const admin = makeAdminRoutes({
    db: routeDeps.db,
    onKeysChanged: () => keys.clear(),
    ...(deps.llm
      ? {
          sweepSummaries: async () => {
            await deps.queues.summary.add('sweep', { v: 1, kind: 'sweep' });
          },
        }
      : {}),
    // An erasure deletes rows by the thousand: its statements are not bounded as a request's.
    ...(opts.eraseTenant ? { eraseTenant: opts.eraseTenant } : {}),
  });
  app.use('/v1/admin', rememberMount, requireAdmin(deps.config.adminToken), readJsonBody(bodyMemory), admin);
  // Without MNEMOS_ADMIN_TOKEN the admin routes answer 404: not documented then either.
  if (deps.config.adminToken) mounts.push({ prefix: '/v1/admin', router: admin, meta: adminRoutesMeta });

  const tenant = [
    rememberMount,
    requireTenant(keys),
    rateLimit(deps),
    ...readJsonBody(bodyMemory),
    recheckTenant,
  ];
  const sessions = makeSessionRoutes(routeDeps);
  app.use('/v1/sessions', tenant, sessions);
  mounts.push({ prefix: '/v1/sessions', router: sessions, meta: sessionRoutesMeta });

  const jobs = makeJobRoutes(routeDeps);
  app.use('/v1/jobs', tenant, jobs);
  mounts.push({ prefix: '/v1/jobs', router: jobs, meta: jobRoutesMeta });

  for (const extra of opts.extraRoutes ?? []) {
    if (extra.auth === 'none') app.use(extra.prefix, rememberMount, continueAfterAuth, extra.router);
    else app.use(extra.prefix, tenant, extra.router);
    mounts.push({ prefix: extra.prefix, router: extra.router, meta: extra.meta });
  }

  app.use(notFoundHandler);
  app.use(makeErrorHandler(deps.logger));
  return app;
}

/** The ops surface alone (health, readiness, metrics), for worker processes. */
export function makeOpsApp(deps: CoreDeps): express.Express {
  const app = express();
  app.disable('x-powered-by');
  // As the API's: no ETag, no 304.
  app.set('etag', false);
  app.use(requestId);
  app.use(unconditional);
  const checker = responseChecker([{ prefix: '', router: express.Router(), meta: opsRoutesMeta }]);
  if (checker) app.use(checker);
  app.use(
    '/',
    makeOpsRoutes(deps, () => ({
      openapi: '3.1.0',
      info: { title: 'mnemos worker', version: VERSION },
      paths: {},
    })),
  );
  app.use(notFoundHandler);
  app.use(makeErrorHandler(deps.logger));
  return app;
}
