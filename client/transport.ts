/**
 * The HTTP layer of the mnemos client: one `fetch` per attempt, a per-attempt timeout, retries
 * and the error type. Nothing but the platform `fetch` (Node ≥ 20): no dependencies.
 *
 * Retry policy (decided here once):
 * - 429 is retried for every request, after `retry-after` (seconds or an HTTP date, plus up to
 *   10 % jitter so a crowd of clients spreads out; one longer than `maxRetryAfterMs` is not
 *   waited for: the call fails at once with `retryAfterMs` on its error), or after
 *   exponential backoff when the header is missing: mnemos's rate limiter answers it before any
 *   route ran.
 * - 503 is retried the same way for idempotent requests (the write that matters most, POST
 *   messages, is idempotent because the client gives every message an id) and for those marked
 *   `retryUnavailable`. A dependency can fail after part of a request was applied (Postgres gone
 *   after a commit), so a 503 does not prove that nothing changed: a reset repeated after one
 *   cleared messages accepted in between.
 * - Network errors, timeouts and 502/504 from a proxy are retried only for idempotent requests
 *   (the request may have been applied), with exponential backoff and full jitter.
 * - An upload streamed from a source that can be read only once (an import from an async
 *   iterable) has one attempt: nothing of it is retried, 429 and 503 included.
 * - Everything else fails at once with a `MnemosError`.
 */

import { canStreamRequests, collect, readOrAbort, startAttempt, uploadStream } from './attempt.js';
import type { Attempt } from './attempt.js';
import { parseRetryAfter } from './retry-after.js';

export interface RetryInfo {
  /** The attempt that failed (1 = the first). */
  attempt: number;
  delayMs: number;
  method: string;
  path: string;
  status?: number;
  error?: unknown;
}

export interface TransportOptions {
  baseUrl: string;
  /** Bearer token: a tenant API key, or the admin token. */
  token?: string;
  /** Defaults to the global fetch. */
  fetch?: typeof fetch;
  /** Retries after the first attempt. Default 4. */
  retries?: number;
  /**
   * Per attempt, until the answer is read. While a body streams (an export's answer, an import's
   * upload) it bounds each pause instead: no bytes for this long is a `timeout`. Default 30 000.
   */
  timeoutMs?: number;
  /** Upper bound on a server-requested wait. Default 30 000. */
  maxRetryAfterMs?: number;
  /** First backoff step for retries without retry-after. Default 250. */
  backoffBaseMs?: number;
  /** Largest backoff step. Default 8 000. */
  backoffMaxMs?: number;
  /** Called before each retry (for logs and metrics). */
  onRetry?: (info: RetryInfo) => void;
}

/** Per-call options every method accepts. */
export interface CallOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
}

export interface RequestSpec extends CallOptions {
  method: 'GET' | 'POST' | 'DELETE';
  /** Already encoded, starting with `/`. */
  path: string;
  query?: Record<string, string | number | boolean | undefined>;
  /** Sent as JSON. */
  json?: unknown;
  /** Sent as is, with `contentType`. */
  body?: string;
  /**
   * Sent as it is produced, with `contentType`: `open` gives the bytes of one attempt. `once`: they
   * come from a source that can be read only once, so the call makes one attempt.
   */
  upload?: { open: () => AsyncIterable<Uint8Array>; once: boolean };
  contentType?: string;
  /** Safe to repeat after a network error, a timeout or a 503. */
  idempotent: boolean;
  /**
   * Not idempotent, but safe to repeat after a 503: a repeat of one that was applied is refused,
   * not applied twice (an import meets a non-empty session: 409).
   */
  retryUnavailable?: boolean;
  /** Statuses besides 2xx returned instead of thrown (e.g. 503 for readiness). */
  okStatuses?: number[];
}

export interface Reply {
  status: number;
  headers: Headers;
  /** Parsed JSON, or null for an empty body. */
  body: unknown;
}

interface ErrorInit {
  status: number;
  code: string;
  message: string;
  details?: unknown;
  requestId: string | null;
  retryAfterMs?: number | null;
  attempts: number;
  cause?: unknown;
}

/**
 * Every failure the client reports. `status` 0 means no HTTP answer (network error, timeout);
 * `code` is the API's snake_case error code (`not_found`, `validation_failed`, `id_conflict`,
 * `rate_limited`, …), or `network_error` / `timeout` / `http_<status>` for non-API answers, or
`invalid_argument` (status 0, no attempt) for an empty, "." or ".." id.
 */
export class MnemosError extends Error {
  readonly status: number;
  readonly code: string;
  readonly details: unknown;
  /** The `x-request-id` of the last attempt (the client sends one; the server echoes it). */
  readonly requestId: string | null;
  readonly retryAfterMs: number | null;
  readonly attempts: number;

  constructor(init: ErrorInit) {
    super(init.message, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = 'MnemosError';
    this.status = init.status;
    this.code = init.code;
    this.details = init.details;
    this.requestId = init.requestId;
    this.retryAfterMs = init.retryAfterMs ?? null;
    this.attempts = init.attempts;
  }
}

/** `err` is a MnemosError (with this code, when given). */
export function isMnemosError(err: unknown, code?: string): err is MnemosError {
  return err instanceof MnemosError && (code === undefined || err.code === code);
}

/**
 * Ids go into the path encoded, but an empty id, "." or ".." would still change which route is
 * called (fetch resolves dot segments: `DELETE /v1/errors/.` is `DELETE /v1/errors/`, the purge
 * of every record). Such a call fails here, before anything is sent.
 */
function assertPath(path: string): void {
  // Paths are built here with encodeURIComponent, which never writes `%2e`: dots stay dots.
  const bad = path
    .split('/')
    .slice(1)
    .some((s) => s === '' || s === '.' || s === '..');
  if (!bad) return;
  throw new MnemosError({
    status: 0,
    code: 'invalid_argument',
    message: `an id in the path ${path} is empty, "." or "..": nothing was sent`,
    details: { path },
    requestId: null,
    attempts: 0,
  });
}

export interface Transport {
  request(spec: RequestSpec): Promise<Reply>;
  /** For streamed answers (export): resolves once a 2xx arrived; the caller reads `chunks`. */
  stream(spec: RequestSpec): Promise<StreamedReply>;
}

export interface StreamedReply {
  status: number;
  headers: Headers;
  /** The x-request-id the call sent with every attempt. */
  requestId: string;
  attempts: number;
  /**
   * The body as text, as it arrives. No bytes for `timeoutMs` while a read waits is a `timeout`,
   * a connection cut midway is `stream_truncated`, and the caller's abort rejects with its reason.
   * Stop early with `return()` (a `break` out of `for await`): that closes the connection.
   */
  chunks: AsyncGenerator<string>;
}

/** A 2xx answer (for a stream: its body unread, its attempt still live) and the attempts it took. */
interface Sent {
  res: Response;
  text: string;
  requestId: string;
  attempts: number;
  live: Attempt;
}

const RETRY_IF_IDEMPOTENT = new Set([502, 503, 504]);

export function makeTransport(opts: TransportOptions): Transport {
  const doFetch = opts.fetch ?? globalThis.fetch;
  const base = opts.baseUrl.replace(/\/+$/, '');
  const retries = Math.max(0, opts.retries ?? 4);
  const defaultTimeout = opts.timeoutMs ?? 30_000;
  const maxRetryAfter = opts.maxRetryAfterMs ?? 30_000;
  const backoffBase = opts.backoffBaseMs ?? 250;
  const backoffMax = opts.backoffMaxMs ?? 8_000;

  const backoff = (attempt: number) => {
    const cap = Math.min(backoffMax, backoffBase * 2 ** (attempt - 1));
    return Math.round(cap / 2 + (Math.random() * cap) / 2);
  };

  async function send(spec: RequestSpec, streaming: boolean): Promise<Sent> {
    assertPath(spec.path);
    const url = base + spec.path + queryString(spec.query);
    // One id for all attempts of a call, so server logs show the retries together.
    const requestId = crypto.randomUUID();
    const headers: Record<string, string> = { accept: 'application/json', 'x-request-id': requestId };
    if (opts.token) headers.authorization = `Bearer ${opts.token}`;
    let body: string | Blob | undefined;
    let upload = spec.upload;
    if (spec.json !== undefined) {
      body = JSON.stringify(spec.json);
      headers['content-type'] = 'application/json';
    } else if (spec.body !== undefined || upload) {
      body = spec.body;
      headers['content-type'] = spec.contentType ?? 'application/json';
    }
    if (upload && !canStreamRequests()) {
      // A fetch without request streams (Firefox, Safari) gets the upload whole, as before.
      body = new Blob([await collect(upload.open())]);
      upload = undefined;
    }
    const once = upload?.once ?? false;
    const timeoutMs = spec.timeoutMs ?? defaultTimeout;

    for (let attempt = 1; ; attempt++) {
      const live = startAttempt(spec.signal, timeoutMs);
      const sending = upload ? uploadStream(upload.open(), live) : undefined;
      let res: Response;
      let text = '';
      try {
        res = await doFetch(url, {
          method: spec.method,
          headers,
          body: sending?.body ?? body,
          signal: live.signal,
          ...(sending ? { duplex: 'half' as const } : {}),
        });
        // The server answered: what it did not read of an upload (an early 413) is not sent.
        sending?.stop();
        if (!streaming || !isOk(res.status, spec)) text = await res.text();
      } catch (err) {
        live.end();
        sending?.stop();
        if (spec.signal?.aborted) throw spec.signal.reason;
        // The upload's own source failed (an export that broke off, the caller's generator): the
        // request was cut, nothing was applied, and its error says more than "fetch failed".
        if (sending?.failure) throw sending.failure.error;
        if (spec.idempotent && !once && attempt <= retries) {
          const delayMs = backoff(attempt);
          opts.onRetry?.({ attempt, delayMs, method: spec.method, path: spec.path, error: err });
          await sleep(delayMs, spec.signal);
          continue;
        }
        throw new MnemosError({
          status: 0,
          code: live.timedOut ? 'timeout' : 'network_error',
          message: live.timedOut
            ? `${spec.method} ${spec.path}: no answer within ${timeoutMs} ms`
            : `${spec.method} ${spec.path}: ${(err as Error).message}`,
          requestId,
          attempts: attempt,
          cause: err,
        });
      }

      if (isOk(res.status, spec)) {
        // A stream's attempt lives on while its body is read (see `bodyChunks`).
        if (streaming) live.pause();
        else live.end();
        return { res, text, requestId, attempts: attempt, live };
      }
      live.end();
      const retryAfterMs = parseRetryAfter(res.headers.get('retry-after'));
      // A wait longer than the cap ends the call at once: a retry sooner than asked meets the same
      // refusal (a rate limit's 48 s spent four retries on 429s), and the error carries the wait.
      const retryable =
        !once &&
        (retryAfterMs === null || retryAfterMs <= maxRetryAfter) &&
        (res.status === 429 ||
          (res.status === 503 && spec.retryUnavailable === true) ||
          (spec.idempotent && RETRY_IF_IDEMPOTENT.has(res.status)));
      if (retryable && attempt <= retries) {
        const delayMs =
          retryAfterMs !== null ? Math.round(retryAfterMs * (1 + Math.random() * 0.1)) : backoff(attempt);
        opts.onRetry?.({ attempt, delayMs, method: spec.method, path: spec.path, status: res.status });
        await sleep(delayMs, spec.signal);
        continue;
      }
      throw errorFromResponse(res, text, requestId, attempt, retryAfterMs);
    }
  }

  /**
   * A 2xx answer's body as text. The attempt's timer runs while a read waits for bytes (not while
   * the consumer holds a chunk): an export that stalled after its headers hung for ever.
   */
  async function* bodyChunks(spec: RequestSpec, sent: Sent): AsyncGenerator<string> {
    const { res, live } = sent;
    const timeoutMs = spec.timeoutMs ?? defaultTimeout;
    try {
      if (!res.body) return;
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      try {
        for (;;) {
          live.arm();
          const { done, value } = await readOrAbort(reader, live.signal).catch((err: unknown) => {
            // The caller's own abort is the caller's reason, as everywhere else.
            if (spec.signal?.aborted) throw spec.signal.reason;
            throw new MnemosError({
              status: res.status,
              code: live.timedOut ? 'timeout' : 'stream_truncated',
              // The server cuts the connection when an export fails midway: never a silent short one.
              message: live.timedOut
                ? `${spec.method} ${spec.path}: no bytes of the answer within ${timeoutMs} ms`
                : `${spec.method} ${spec.path}: the answer broke off: ${(err as Error).message}`,
              requestId: res.headers.get('x-request-id') ?? sent.requestId,
              attempts: sent.attempts,
              cause: err,
            });
          });
          live.pause();
          if (done) return;
          yield value;
        }
      } finally {
        await reader.cancel().catch(() => undefined);
      }
    } finally {
      live.end();
    }
  }

  return {
    async request(spec) {
      const { res, text, requestId, attempts } = await send(spec, false);
      let parsed: unknown = null;
      if (text !== '') {
        try {
          parsed = JSON.parse(text);
        } catch (err) {
          throw new MnemosError({
            status: res.status,
            code: 'invalid_response',
            message: `${spec.method} ${spec.path}: the answer is not JSON`,
            details: { body: text.slice(0, 200) },
            requestId: res.headers.get('x-request-id') ?? requestId,
            attempts,
            cause: err,
          });
        }
      }
      return { status: res.status, headers: res.headers, body: parsed };
    },
    async stream(spec) {
      const sent = await send(spec, true);
      const { res, requestId, attempts } = sent;
      return {
        status: res.status,
        headers: res.headers,
        requestId,
        attempts,
        chunks: bodyChunks(spec, sent),
      };
    },
  };
}

function isOk(status: number, spec: RequestSpec): boolean {
  return (status >= 200 && status < 300) || (spec.okStatuses?.includes(status) ?? false);
}

function queryString(query: RequestSpec['query']): string {
  if (!query) return '';
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) if (v !== undefined) params.set(k, String(v));
  const s = params.toString();
  return s ? `?${s}` : '';
}

function errorFromResponse(
  res: Response,
  text: string,
  sentRequestId: string,
  attempts: number,
  retryAfterMs: number | null,
): MnemosError {
  let code = `http_${res.status}`;
  let message = `HTTP ${res.status}${res.statusText ? ` ${res.statusText}` : ''}`;
  let details: unknown;
  try {
    const parsed = JSON.parse(text) as { error?: { code?: unknown; message?: unknown; details?: unknown } };
    if (parsed.error && typeof parsed.error.code === 'string') {
      code = parsed.error.code;
      if (typeof parsed.error.message === 'string') message = parsed.error.message;
      details = parsed.error.details;
    }
  } catch {
    // Not the API's error shape (a proxy's page): keep a short excerpt for the log.
    if (text) details = { body: text.slice(0, 200) };
  }
  return new MnemosError({
    status: res.status,
    code,
    message,
    details,
    requestId: res.headers.get('x-request-id') ?? sentRequestId,
    retryAfterMs,
    attempts,
  });
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason as Error);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason as Error);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

/** The parsed JSON body of a request. */
export async function requestJson<T>(http: Transport, spec: RequestSpec): Promise<T> {
  return (await http.request(spec)).body as T;
}

/** A delete: true when something was deleted, false on 404 (so a retried delete is no error). */
export async function deleteOrFalse(http: Transport, spec: RequestSpec): Promise<boolean> {
  try {
    await http.request(spec);
    return true;
  } catch (err) {
    if (err instanceof MnemosError && err.status === 404) return false;
    throw err;
  }
}

/** Only the per-call fields of an options bag (callers pass their own options objects). */
export function callOpts(opts: CallOptions): CallOptions {
  return { signal: opts.signal, timeoutMs: opts.timeoutMs };
}
