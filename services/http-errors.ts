import type { ErrorRequestHandler, Request, RequestHandler, Response } from 'express';
import { escapeUnstorable, escapeUnstorableDeep } from './text/unstorable.js';
import { isPgUnavailable, pgCode } from '../db/pool.js';
import { AppError, asDependencyError } from './errors.js';
import { errorMessage, throttledKinds, throttledLog } from './logger.js';
import type { Logger } from './logger.js';
import { closeOverUnreadBody } from './unread-body.js';

/** Body-parser and friends throw errors with `type`/`status`; map them onto the API's error shape. */
function fromExpressError(err: unknown): AppError | undefined {
  if (err instanceof AppError) return err;
  if (typeof err !== 'object' || err === null) return undefined;
  const e = err as { type?: string; status?: number; statusCode?: number; message?: string; limit?: number };
  switch (e.type) {
    case 'entity.parse.failed':
      return new AppError(400, 'malformed_json', 'request body is not valid JSON');
    case 'entity.too.large':
      return new AppError(413, 'body_too_large', `request body exceeds ${e.limit ?? 'the limit of'} bytes`);
    case 'encoding.unsupported':
    case 'charset.unsupported':
      return new AppError(415, 'unsupported_encoding', e.message ?? 'unsupported encoding');
    case 'request.aborted':
      return new AppError(400, 'request_aborted', 'request aborted by the client');
    case 'entity.verify.failed':
      return new AppError(400, 'invalid_body', e.message ?? 'invalid body');
  }
  const status = e.status ?? e.statusCode;
  if (status && status >= 400 && status < 500) {
    return new AppError(status, 'bad_request', e.message ?? 'bad request');
  }
  return undefined;
}

/** The longest Postgres or connection message a log line carries. */
const LOGGED_MESSAGE_CHARS = 200;

/**
 * What the log says of why Postgres refused or could not be reached: the SQLSTATE (`pg_code`) and
 * Postgres's primary message, or the connection error's message (a refused connect from several
 * addresses is an AggregateError with an empty message of its own). Bounded, and never DETAIL or
 * the statement's parameters, which can quote stored data. `err` may be an AppError made from
 * the Postgres error (its `cause`). Nothing for errors that are not Postgres's.
 */
export function pgLogFields(err: unknown): { pg_code?: string; pg_message?: string } {
  const source = pgSource(err);
  if (!source) return {};
  const inner = source instanceof AggregateError ? (source.errors[0] as unknown) : undefined;
  const message = source.message || (inner instanceof Error ? inner.message : '');
  return {
    ...(pgCode(source) === undefined ? {} : { pg_code: pgCode(source) }),
    ...(message ? { pg_message: message.slice(0, LOGGED_MESSAGE_CHARS) } : {}),
  };
}

/**
 * The Postgres or connection error behind `err`: itself, or the cause of a 5xx AppError made from
 * it. node-postgres's errors (a DatabaseError has a severity) and those db/pool.ts counts as
 * Postgres being unreachable (a refused or reset connection, a statement without an answer, a
 * pool wait timeout).
 */
function pgSource(err: unknown): Error | undefined {
  const cause =
    err instanceof AppError ? (err.status >= 500 ? (err as { cause?: unknown }).cause : undefined) : err;
  if (!(cause instanceof Error) || cause instanceof AppError) return undefined;
  return 'severity' in cause || isPgUnavailable(cause) ? cause : undefined;
}

/** pgLogFields, when `mapped` blames Postgres (an ioredis connection error looks much like pg's). */
const postgresFields = (err: unknown, mapped: AppError) =>
  (mapped.details as { dependency?: unknown } | undefined)?.dependency === 'postgres' ? pgLogFields(err) : {};

/**
 * What the log says of why Redis refused or could not be reached, when `mapped` blames Redis: the
 * message of the error behind it (`OOM command not allowed…`, `READONLY…`, `connect
 * ECONNREFUSED…`), bounded as pg_message is. Only the message: an ioredis reply error also
 * carries its command, arguments and all (message bodies among them).
 */
function redisFields(err: unknown, mapped: AppError): { redis_error?: string } {
  if ((mapped.details as { dependency?: unknown } | undefined)?.dependency !== 'redis') return {};
  const source = err instanceof AppError ? (err as { cause?: unknown }).cause : err;
  if (!(source instanceof Error) || source instanceof AppError) return {};
  const message = errorMessage(source);
  return message ? { redis_error: message.slice(0, LOGGED_MESSAGE_CHARS) } : {};
}

/**
 * The `route` of the HTTP metrics and of the error log lines: the matched route pattern, never the
 * raw path (it holds tenant-chosen session ids). An answer
 * given before a route matched (a 401, a 429, a 503 of the key check) is labelled by where it was
 * mounted (`/v1/sessions/*`), so that dashboards can tell them apart; `unmatched` is a path that
 * no router took.
 */
export function routeLabel(req: Request, res: Response): string {
  const path: unknown = req.route?.path;
  const mount = typeof res.locals.mount === 'string' ? res.locals.mount : req.baseUrl;
  if (path === undefined) return typeof res.locals.mount === 'string' && mount ? `${mount}/*` : 'unmatched';
  // A router's own several-path routes (Bull Board) are labelled by the mount alone.
  if (typeof path !== 'string') return mount || 'unmatched';
  return path === '/' ? mount || '/' : `${mount}${path}`;
}

/** Kinds of lines the handler keeps a throttle for (throttledKinds). */
const MAX_THROTTLED_KINDS = 1000;

/**
 * What the log says of an error that nothing mapped: its class, message, code and stack. Not the
 * whole object: pino would write every field, and a Postgres error's `detail` ("Failing row
 * contains (…)", which quotes the row), `where`, `table` and the like quote stored data or name
 * it. A Postgres error's message is bounded as pgLogFields bounds it, and its stack loses its
 * first line, which repeats the message in full.
 */
function unhandledLogFields(err: unknown): Record<string, unknown> {
  // A thrown value that is no Error may be anything the code had at hand: its type only.
  if (!(err instanceof Error)) return { err: { type: typeof err } };
  const pg = pgSource(err) === undefined ? undefined : pgLogFields(err);
  const frames = err.stack?.indexOf('\n    at ') ?? -1;
  const code = (err as { code?: unknown }).code;
  // Without a prototype, so that pino's serializer names the error's class (`type`) after `name`,
  // not after this object's constructor (Object).
  const logged: Record<string, unknown> = Object.assign(Object.create(null) as object, {
    name: err.name,
    message: pg ? (pg.pg_message ?? '') : err.message,
    ...(typeof code === 'string' || typeof code === 'number' ? { code } : {}),
    stack: pg ? (frames >= 0 ? err.stack!.slice(frames + 1) : '') : err.stack,
  });
  return { err: logged, ...pg };
}

/** The API's error shape; `details` is always present (SPEC §4), null when there is nothing to add. */
export function errorBody(err: AppError): { error: { code: string; message: string; details: unknown } } {
  // A 400 may quote the field it refused, NUL or lone surrogate in its name included.
  return {
    error: {
      code: err.code,
      message: escapeUnstorable(err.message),
      details: escapeUnstorableDeep(err.details ?? null),
    },
  };
}

export function sendError(res: Parameters<RequestHandler>[1], err: AppError): void {
  if (err.headers) for (const [k, v] of Object.entries(err.headers)) res.setHeader(k, v);
  // A 401 names the scheme it wants (RFC 9110 §15.5.2): a bearer token, on every route but Bull
  // Board, whose Basic challenge is set where it is refused.
  if (err.status === 401 && !res.hasHeader('www-authenticate')) res.setHeader('www-authenticate', 'Bearer');
  closeOverUnreadBody(res.req, res);
  res.status(err.status).json(errorBody(err));
}

/**
 * The last middleware: every error leaves as `{"error":{"code","message","details"}}` (details null
 * when none). Its log lines name the request (`reqId`, the `x-request-id` the client sees and
 * resends with each retry), its tenant when authenticated, its method and route. Each kind of
 * line (a code and message, or an error's class and code, per route) is logged at most once per
 * 5 s, the next counting those left out (`suppressed`): during a Redis outage every request was a
 * line, 469 a second, and a flood of one 500 wrote its stack at request rate.
 */
export function makeErrorHandler(logger: Logger): ErrorRequestHandler {
  const throttleOf = throttledKinds(MAX_THROTTLED_KINDS);
  const log = (level: 'warn' | 'error', kind: unknown[], fields: object, msg: string) =>
    throttleOf(JSON.stringify([level, msg, ...kind]), () =>
      throttledLog((obj, m) => logger[level](obj, m), msg),
    )(fields);
  const requestFields = (req: Request, res: Response) => {
    const tenantId: unknown = res.locals.tenantId;
    return {
      reqId: res.locals.requestId as unknown,
      ...(typeof tenantId === 'string' ? { tenantId } : {}),
      method: req.method,
      route: routeLabel(req, res),
    };
  };
  return (err, req, res, _next) => {
    const request = requestFields(req, res);
    if (pgCode(err) === '22021' && !res.headersSent) {
      // Postgres refused a parameter (a NUL character: text cannot hold one) that a route let
      // through unchecked. It is bad input, and the statement changed nothing; logged as a gap in
      // that route's validation.
      log(
        'warn',
        [request.method, request.route],
        { code: '22021', ...request },
        'unvalidated NUL reached Postgres',
      );
      sendError(
        res,
        new AppError(400, 'invalid_characters', 'NUL characters and lone surrogates are not allowed'),
      );
      return;
    }
    if (
      pgCode(err) === '23503' &&
      /_tenant_id_fkey$/.test(String((err as { constraint?: unknown }).constraint))
    ) {
      // The tenants row went while this request ran: its tenant was erased (nothing else deletes
      // a tenant), after the request's key was verified. Nothing was written (the statement
      // failed); the key is gone with the tenant.
      sendError(
        res,
        new AppError(401, 'unauthorized', 'the API key’s tenant was erased while the request ran'),
      );
      return;
    }
    const mapped = fromExpressError(asDependencyError(err));
    if (mapped) {
      if (mapped.status >= 500)
        log(
          'warn',
          [mapped.code, request.method, request.route],
          { code: mapped.code, ...request, ...postgresFields(err, mapped), ...redisFields(err, mapped) },
          mapped.message,
        );
      sendError(res, mapped);
      return;
    }
    const fields = unhandledLogFields(err);
    const { name, code } = (fields.err ?? {}) as { name?: unknown; code?: unknown };
    log(
      'error',
      [name ?? typeof err, code, request.method, request.route],
      { ...fields, ...request },
      'unhandled error',
    );
    if (res.headersSent) {
      res.end();
      return;
    }
    sendError(res, new AppError(500, 'internal', 'internal server error'));
  };
}

export const notFoundHandler: RequestHandler = (req, res) => {
  sendError(res, new AppError(404, 'not_found', `no route for ${req.method} ${req.path}`));
};
