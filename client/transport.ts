/**
 * The HTTP layer of the mnemos client: one `fetch` per attempt, a per-attempt timeout, retries
 * and the error type. Nothing but the platform `fetch` (Node ≥ 20): no dependencies.
 *
 * Retry policy (decided here once):
 * - 429 and 503 are retried for every request, after `retry-after` (seconds or an HTTP date,
 *   capped at `maxRetryAfterMs`, plus up to 10 % jitter so a crowd of clients spreads out), or
 *   after exponential backoff when the header is missing. mnemos sends them before it changed
 *   anything (rate limit, a dependency down), and the write that matters most, POST messages, is
 *   idempotent because the client gives every message an id.
 * - Network errors, timeouts and 502/504 from a proxy are retried only for idempotent requests
 *   (the request may have been applied), with exponential backoff and full jitter.
 * - Everything else fails at once with a `MnemosError`.
 */

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
  /** Per attempt, until the body is read (for streams: until the headers). Default 30 000. */
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
  contentType?: string;
  /** Safe to repeat after a network error or timeout. */
  idempotent: boolean;
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
  /**
   * For streamed bodies (export): the Response once a 2xx arrived (the caller reads the body), with
   * the call's request id and how many attempts it took, for the errors of reading it.
   */
  stream(spec: RequestSpec): Promise<Sent>;
}

/** A 2xx answer, the x-request-id the call sent with every attempt, and the attempts it took. */
export interface Sent {
  res: Response;
  text: string;
  requestId: string;
  attempts: number;
}

const RETRY_ALWAYS = new Set([429, 503]);
const RETRY_IF_IDEMPOTENT = new Set([502, 504]);

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
    let body: string | undefined;
    if (spec.json !== undefined) {
      body = JSON.stringify(spec.json);
      headers['content-type'] = 'application/json';
    } else if (spec.body !== undefined) {
      body = spec.body;
      headers['content-type'] = spec.contentType ?? 'application/json';
    }
    const timeoutMs = spec.timeoutMs ?? defaultTimeout;

    for (let attempt = 1; ; attempt++) {
      const timeout = new AbortController();
      const timer = setTimeout(
        () => timeout.abort(new DOMException(`no answer within ${timeoutMs} ms`, 'TimeoutError')),
        timeoutMs,
      );
      const signal = spec.signal ? AbortSignal.any([spec.signal, timeout.signal]) : timeout.signal;
      let res: Response;
      let text = '';
      try {
        res = await doFetch(url, { method: spec.method, headers, body, signal });
        if (!streaming || !isOk(res.status, spec)) text = await res.text();
      } catch (err) {
        if (spec.signal?.aborted) throw spec.signal.reason;
        const timedOut = timeout.signal.aborted;
        if (spec.idempotent && attempt <= retries) {
          const delayMs = backoff(attempt);
          opts.onRetry?.({ attempt, delayMs, method: spec.method, path: spec.path, error: err });
          await sleep(delayMs, spec.signal);
          continue;
        }
        throw new MnemosError({
          status: 0,
          code: timedOut ? 'timeout' : 'network_error',
          message: timedOut
            ? `${spec.method} ${spec.path}: no answer within ${timeoutMs} ms`
            : `${spec.method} ${spec.path}: ${(err as Error).message}`,
          requestId,
          attempts: attempt,
          cause: err,
        });
      } finally {
        clearTimeout(timer);
      }

      if (isOk(res.status, spec)) return { res, text, requestId, attempts: attempt };
      const retryAfterMs = parseRetryAfter(res.headers.get('retry-after'));
      const retryable =
        RETRY_ALWAYS.has(res.status) || (spec.idempotent && RETRY_IF_IDEMPOTENT.has(res.status));
      if (retryable && attempt <= retries) {
        const delayMs =
          retryAfterMs !== null
            ? Math.round(Math.min(retryAfterMs, maxRetryAfter) * (1 + Math.random() * 0.1))
            : backoff(attempt);
        opts.onRetry?.({ attempt, delayMs, method: spec.method, path: spec.path, status: res.status });
        await sleep(delayMs, spec.signal);
        continue;
      }
      throw errorFromResponse(res, text, requestId, attempt, retryAfterMs);
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
    stream(spec) {
      return send(spec, true);
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

/** `retry-after` as milliseconds: delta-seconds (decimals tolerated) or an HTTP date. */
export function parseRetryAfter(value: string | null): number | null {
  if (value === null || value.trim() === '') return null;
  const v = value.trim();
  if (/^\d+(\.\d+)?$/.test(v)) return Math.round(Number(v) * 1000);
  const at = Date.parse(v);
  return Number.isNaN(at) ? null : Math.max(0, at - Date.now());
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
