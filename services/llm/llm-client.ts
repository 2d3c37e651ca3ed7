/**
 * The only module that talks to an LLM endpoint (OpenAI or anything OpenAI-compatible: Ollama,
 * vLLM, LiteLLM...). Everything else depends on the small LlmClient interface so the SDK stays
 * swappable and tests can use a fake.
 *
 * Retry policy lives here, not in the SDK (its retries are disabled): every failure is
 * classified exactly once into an LlmError whose `retryable` flag tells the caller (a BullMQ
 * job) whether trying again later can help.
 */
import OpenAI, { APIConnectionError, APIConnectionTimeoutError, APIError, APIUserAbortError } from 'openai';
import { throttledKinds, throttledWarn } from '../logger.js';
import { cutUnits } from '../text/fts-text.js';

export type LlmPurpose = 'summary' | 'noise' | 'supersede' | 'relevance' | 'embedding';

export interface LlmUsage {
  purpose: LlmPurpose;
  model: string;
  inputTokens: number;
  outputTokens: number;
  tenantId: string;
  sessionId: string | null;
  /** When the call began (before its first attempt): a session deleted or re-created since does not get it. */
  startedAt: Date;
}

export interface LlmCallContext {
  purpose: LlmPurpose;
  tenantId: string;
  sessionId?: string | null;
  signal?: AbortSignal;
  /** Per attempt; defaults to the client's timeoutMs. */
  timeoutMs?: number;
  /** Attempts for this call; defaults to the client's maxAttempts. */
  maxAttempts?: number;
}

export interface ChatMessage {
  role: 'system' | 'user' | 'assistant';
  content: string;
}

export interface ChatRequest extends LlmCallContext {
  model: string;
  messages: ChatMessage[];
  json?: boolean;
  temperature?: number;
  maxTokens?: number;
}

export interface ChatResult {
  content: string;
  inputTokens: number;
  outputTokens: number;
  /**
   * The endpoint's `finish_reason` when it is a plain word (`stop`, `length`...): `length` means
   * the text was cut at the token limit, which a caller may want to say.
   */
  finishReason?: string;
}

export interface EmbedRequest extends LlmCallContext {
  model: string;
  input: string[];
  dimensions?: number;
}

export interface LlmClient {
  chat(req: ChatRequest): Promise<ChatResult>;
  embed(req: EmbedRequest): Promise<number[][]>;
}

export type LlmErrorKind =
  'timeout' | 'rate_limited' | 'server' | 'network' | 'bad_request' | 'auth' | 'invalid_response' | 'aborted';

export class LlmError extends Error {
  readonly retryable: boolean;
  readonly status: number | undefined;
  readonly kind: LlmErrorKind;
  /**
   * How long the endpoint asked to wait (`retry-after-ms`, `retry-after`), as it asked: the client
   * retries within a call only when this is at most its maxDelayMs; a longer wait is the caller's
   * (the summary queue waits it out, workers/summarize.ts).
   */
  readonly retryAfterMs?: number;
  /**
   * What went wrong, machine-readable and never endpoint text: the endpoint's error code
   * (`model_not_found`, `content_filter`, `context_length_exceeded`: words and underscores only),
   * or, for an answer that could not be used, one of `refusal`, `content_filter`, `length`,
   * `no_choices`, `no_text`, `error_body`; for embeddings, `missing_vectors` (fewer vectors than
   * inputs).
   */
  readonly code?: string;

  constructor(
    message: string,
    init: {
      kind: LlmErrorKind;
      retryable: boolean;
      status?: number;
      retryAfterMs?: number;
      code?: string;
      cause?: unknown;
    },
  ) {
    super(message, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = 'LlmError';
    this.kind = init.kind;
    this.retryable = init.retryable;
    this.status = init.status;
    if (init.retryAfterMs !== undefined) this.retryAfterMs = init.retryAfterMs;
    if (init.code !== undefined) this.code = init.code;
  }
}

export interface LlmCallEvent {
  purpose: LlmPurpose;
  model: string;
  outcome: 'ok' | 'error';
  kind?: string;
  durationMs: number;
}

export interface LlmClientOptions {
  apiKey?: string;
  baseURL?: string;
  timeoutMs: number;
  /** Total attempts including the first. Default 3. */
  maxAttempts?: number;
  /** Default 250. */
  baseDelayMs?: number;
  /**
   * Caps the computed backoff, and the server-sent retry-after a call waits for: a failure whose
   * retry-after is longer ends the call at once (a retry sooner than asked is refused again; the
   * error carries the wait asked for). Default 8000.
   */
  maxDelayMs?: number;
  onUsage?: (u: LlmUsage) => void | Promise<void>;
  /** Called after every attempt (not every call), for metrics. */
  onCall?: (e: LlmCallEvent) => void;
  logger?: { warn(obj: object, msg: string): void };
}

const DEFAULT_BASE_URL = 'https://api.openai.com/v1';
// The SDK refuses to start without a key, but local servers (Ollama, vLLM) ignore it.
const PLACEHOLDER_API_KEY = 'unused';
// Bounds how much of an endpoint's error text ends up in our messages (and hence logs).
const MAX_ERROR_TEXT = 300;
// Bounds the text of an error body we re-wrap for the SDK (fetchWithErrorEnvelope): long enough
// for a validation error listing several fields, so learnFromRejection still sees the one it needs.
const MAX_REWRAPPED_TEXT = 2000;
// What an endpoint's error code or finish reason must look like to be passed on: words and
// underscores only, so a token, a number or quoted input never is.
const WORD_CODE = /^[a-z_]{1,64}$/;

/** Per-model knowledge about what an OpenAI-compatible endpoint rejects, learnt from 400s and 422s. */
interface ModelCompat {
  noJsonMode: boolean;
  useMaxCompletionTokens: boolean;
  noTemperature: boolean;
  noDimensions: boolean;
}

interface ChatParams {
  model: string;
  messages: ChatMessage[];
  response_format?: { type: 'json_object' };
  temperature?: number;
  max_tokens?: number;
  max_completion_tokens?: number;
}

export function makeLlmClient(opts: LlmClientOptions): LlmClient {
  if (!opts.apiKey && !opts.baseURL) {
    throw new LlmError('LLM client needs an apiKey or a baseURL', { kind: 'auth', retryable: false });
  }
  assertPositive('timeoutMs', opts.timeoutMs);
  const maxAttempts = Math.max(1, Math.floor(opts.maxAttempts ?? 3));
  const baseDelayMs = Math.max(0, opts.baseDelayMs ?? 250);
  const maxDelayMs = Math.max(0, opts.maxDelayMs ?? 8000);
  const logger = opts.logger;
  const endpoint = splitBaseURL(opts.baseURL || DEFAULT_BASE_URL);
  // Attempts that will be retried: one line per purpose, model and failure per 5 s. An endpoint
  // answering 500 to every call logged a line per attempt: 2,426 in 2 minutes for 253 sessions'
  // summaries. A call that fails for good is its caller's to log.
  const retryLogOf = throttledKinds(100);

  // Everything is passed explicitly so the SDK does not pick up OPENAI_* variables behind the
  // config module's back; its own logging is off because it can dump request bodies.
  const sdk = new OpenAI({
    apiKey: opts.apiKey || PLACEHOLDER_API_KEY,
    baseURL: endpoint.baseURL,
    ...(endpoint.query ? { defaultQuery: endpoint.query } : {}),
    organization: null,
    project: null,
    webhookSecret: null,
    maxRetries: 0,
    timeout: sdkTimeout(opts.timeoutMs),
    logLevel: 'off',
    fetch: fetchWithErrorEnvelope,
  });

  const compatByModel = new Map<string, ModelCompat>();
  const compatFor = (model: string): ModelCompat => {
    let compat = compatByModel.get(model);
    if (!compat) {
      compat = {
        noJsonMode: false,
        useMaxCompletionTokens: false,
        noTemperature: false,
        noDimensions: false,
      };
      compatByModel.set(model, compat);
    }
    return compat;
  };

  function emitCall(event: LlmCallEvent): void {
    try {
      opts.onCall?.(event);
    } catch (err) {
      logger?.warn({ err: errorSummary(err), purpose: event.purpose }, 'llm onCall hook failed');
    }
  }

  async function reportUsage(usage: LlmUsage): Promise<void> {
    if (!opts.onUsage) return;
    try {
      // Awaited so usage accounting is done (or has failed visibly) when the call resolves.
      await opts.onUsage(usage);
    } catch (err) {
      logger?.warn(
        { err: errorSummary(err), purpose: usage.purpose, model: usage.model },
        'llm onUsage hook failed',
      );
    }
  }

  async function withRetries<T>(
    ctx: LlmCallContext,
    model: string,
    attempt: (signal: AbortSignal, timeoutMs: number) => Promise<T>,
  ): Promise<T> {
    const timeoutMs = ctx.timeoutMs ?? opts.timeoutMs;
    assertPositive('timeoutMs', timeoutMs);
    const attempts = Math.max(1, Math.floor(ctx.maxAttempts ?? maxAttempts));
    const external = ctx.signal;

    for (let n = 1; ; n++) {
      if (external?.aborted) throw abortedError();
      const started = performance.now();
      // One controller per attempt: it fires on our timeout or the caller's abort, and we
      // record which, because the SDK reports both as the same "user abort".
      const controller = new AbortController();
      let timedOut = false;
      const timer = setTimeout(() => {
        timedOut = true;
        controller.abort();
      }, timeoutMs);
      const onExternalAbort = (): void => controller.abort();
      external?.addEventListener('abort', onExternalAbort, { once: true });

      let failure: LlmError;
      try {
        const result = await attempt(controller.signal, timeoutMs);
        emitCall({ purpose: ctx.purpose, model, outcome: 'ok', durationMs: performance.now() - started });
        return result;
      } catch (err) {
        failure = classify(err, {
          externallyAborted: external?.aborted === true,
          timedOut,
          timeoutMs,
        });
        emitCall({
          purpose: ctx.purpose,
          model,
          outcome: 'error',
          kind: failure.kind,
          durationMs: performance.now() - started,
        });
      } finally {
        clearTimeout(timer);
        external?.removeEventListener('abort', onExternalAbort);
      }

      if (!failure.retryable || n >= attempts) throw failure;
      // The endpoint asked for a longer wait than a call waits: a retry after 8 s of its 60 was
      // refused again, and every such retry counts against the limit it enforces.
      if (failure.retryAfterMs !== undefined && failure.retryAfterMs > maxDelayMs) throw failure;
      const delayMs = failure.retryAfterMs ?? fullJitter(n, baseDelayMs, maxDelayMs);
      const retried = `${ctx.purpose} ${model} ${failure.kind} ${failure.status ?? ''}`;
      retryLogOf(retried, () => throttledWarn(logger, 'llm call failed, retrying'))({
        purpose: ctx.purpose,
        model,
        tenantId: ctx.tenantId,
        ...(ctx.sessionId ? { sessionId: ctx.sessionId } : {}),
        kind: failure.kind,
        status: failure.status,
        attempt: n,
        maxAttempts: attempts,
        delayMs,
      });
      await sleep(delayMs, external);
    }
  }

  /**
   * Sends a request again, without the optional parameter an endpoint refused (`learn` names it
   * and stops sending it for the model), until it is accepted or refused for something else.
   */
  async function adapting<T>(
    req: { purpose: LlmPurpose; model: string },
    send: () => Promise<T>,
    learn: (err: unknown) => string | undefined,
  ): Promise<T> {
    for (;;) {
      try {
        return await send();
      } catch (err) {
        const dropped = learn(err);
        if (!dropped) throw err;
        logger?.warn(
          { purpose: req.purpose, model: req.model, dropped },
          'llm endpoint rejected a parameter; adapting',
        );
      }
    }
  }

  async function chat(req: ChatRequest): Promise<ChatResult> {
    const startedAt = new Date();
    const compat = compatFor(req.model);
    const result = await withRetries(req, req.model, async (signal, timeoutMs) => {
      // Each compatibility fallback stops sending one parameter for good, so this makes at most
      // three extra requests; they share the attempt's timeout.
      let params!: ChatParams;
      const raw: unknown = await adapting(
        req,
        () =>
          sdk.chat.completions.create(
            (params = chatParams(req, compat)),
            sdkRequestOptions(signal, timeoutMs),
          ),
        (err) => learnFromRejection(err, params, compat),
      );
      // Validated inside the attempt so a bad payload is classified (and counted) like any
      // other failed attempt.
      throwIfErrorBody(raw, 'choices');
      const answer = readFirstChoice(raw);
      const usage = readUsage(raw);
      // A refusal is one also when it comes with text ("I'm sorry", or part of an answer that
      // gateways pass along): that text is not an answer, and the input will be refused again.
      if (answer.content === undefined || answer.refused) {
        // An unusable answer is billed like any other: its usage is recorded.
        await reportUsage({
          purpose: req.purpose,
          model: req.model,
          inputTokens: usage.prompt,
          outputTokens: usage.completion,
          tenantId: req.tenantId,
          sessionId: req.sessionId ?? null,
          startedAt,
        });
        throw unusableAnswer(answer);
      }
      return {
        content: answer.content,
        inputTokens: usage.prompt,
        outputTokens: usage.completion,
        ...(answer.finishReason !== undefined ? { finishReason: answer.finishReason } : {}),
      };
    });
    await reportUsage({
      purpose: req.purpose,
      model: req.model,
      inputTokens: result.inputTokens,
      outputTokens: result.outputTokens,
      tenantId: req.tenantId,
      sessionId: req.sessionId ?? null,
      startedAt,
    });
    return result;
  }

  async function embed(req: EmbedRequest): Promise<number[][]> {
    // The API rejects an empty input list; nothing to embed is not an error for our callers.
    if (req.input.length === 0) return [];
    const startedAt = new Date();
    const compat = compatFor(req.model);
    const response = await withRetries(req, req.model, async (signal, timeoutMs) => {
      // Explicit floats: without encoding_format the SDK asks for base64 and decodes it itself,
      // which some compatible servers do not implement. Dropping `dimensions` is the only
      // fallback, so this makes at most one extra request.
      const paramsNow = (): OpenAI.EmbeddingCreateParams => ({
        model: req.model,
        input: req.input,
        encoding_format: 'float',
        ...(req.dimensions !== undefined && !compat.noDimensions ? { dimensions: req.dimensions } : {}),
      });
      let params!: OpenAI.EmbeddingCreateParams;
      const raw: unknown = await adapting(
        req,
        () => sdk.embeddings.create((params = paramsNow()), sdkRequestOptions(signal, timeoutMs)),
        (err) => learnFromEmbeddingRejection(err, params, compat),
      );
      // Validated inside the attempt so a bad payload is classified like any other failure.
      // The configured dimensions are still checked when the endpoint was not told them: a
      // model of another native size must not reach the index.
      throwIfErrorBody(raw, 'data');
      return { vectors: readEmbeddings(raw, req.input.length, req.dimensions), usage: readUsage(raw) };
    });
    await reportUsage({
      purpose: req.purpose,
      model: req.model,
      inputTokens: response.usage.prompt,
      outputTokens: 0,
      tenantId: req.tenantId,
      sessionId: req.sessionId ?? null,
      startedAt,
    });
    return response.vectors;
  }

  return { chat, embed };
}

function sdkRequestOptions(signal: AbortSignal, timeoutMs: number) {
  return { signal, timeout: sdkTimeout(timeoutMs), maxRetries: 0 };
}

// Our own per-attempt timer is authoritative because it also covers reading the body (the
// SDK's stops at the headers); the SDK's is set a little later as a backstop. The SDK insists
// on a positive integer.
function sdkTimeout(timeoutMs: number): number {
  return Math.ceil(timeoutMs) + 1000;
}

/**
 * The base URL without its query, and the query's parameters: the SDK appends paths to the base
 * URL as text, so Azure's `.../deployments/d?api-version=2024-02-01` became
 * `?api-version=2024-02-01/chat/completions` and every call a 404. The parameters go on every
 * request as the SDK's default query instead.
 */
function splitBaseURL(baseURL: string): { baseURL: string; query?: Record<string, string> } {
  // Config refuses a fragment; a client built from anything else must not drop one silently.
  if (baseURL.includes('#')) throw new RangeError('baseURL must not have a #fragment');
  if (!baseURL.includes('?')) return { baseURL };
  const url = new URL(baseURL);
  const query = Object.fromEntries(url.searchParams);
  url.search = '';
  // `new URL` keeps a bare `?`; the SDK would append the path after it.
  const base = url.toString().replace(/\?$/, '');
  return Object.keys(query).length > 0 ? { baseURL: base, query } : { baseURL: base };
}

/**
 * fetch for the SDK: a non-2xx JSON body outside OpenAI's `{"error": ...}` envelope (vLLM's
 * top-level `{"object":"error","message":...}`, FastAPI's and TGI's `{"detail":[...]}`) is
 * re-wrapped as `{"error":{"message":...}}`, because the SDK reads only `error` and reported
 * these as "400 status code (no body)": learnFromRejection could not see which parameter an
 * endpoint refused. Status and headers stay as they were (retry-after still counts).
 */
async function fetchWithErrorEnvelope(input: string | URL | Request, init?: RequestInit): Promise<Response> {
  const response = await fetch(input, init);
  if (response.ok) return response;
  let body: unknown;
  try {
    body = JSON.parse(await response.clone().text());
  } catch {
    // Not JSON: the SDK keeps such text as the message itself.
    return response;
  }
  // The SDK reads `error` when it is anything but null or absent.
  if (body === null || (isRecord(body) && body['error'] !== undefined && body['error'] !== null)) {
    return response;
  }
  const headers = new Headers(response.headers);
  // The new body is another length, and already decoded.
  headers.delete('content-length');
  headers.delete('content-encoding');
  headers.set('content-type', 'application/json');
  const message = cutUnits(errorBodyText(body), MAX_REWRAPPED_TEXT);
  return new Response(JSON.stringify({ error: { message } }), {
    status: response.status,
    statusText: response.statusText,
    headers,
  });
}

/** An error body's message or validation details as one line of text. */
function errorBodyText(body: unknown): string {
  if (isRecord(body)) {
    if (typeof body['message'] === 'string') return body['message'];
    const detail = body['detail'];
    if (typeof detail === 'string') return detail;
    if (Array.isArray(detail)) {
      // pydantic's items: {loc: ["body", "response_format"], msg: "extra fields not permitted"}.
      return detail
        .map((item: unknown) => {
          if (!isRecord(item) || typeof item['msg'] !== 'string') return safeJson(item);
          const loc = Array.isArray(item['loc']) ? item['loc'].map(String).join('.') : '';
          return loc === '' ? item['msg'] : `${loc}: ${item['msg']}`;
        })
        .join('; ');
    }
  }
  return safeJson(body);
}

function chatParams(req: ChatRequest, compat: ModelCompat): ChatParams {
  const params: ChatParams = { model: req.model, messages: req.messages };
  if (req.json && !compat.noJsonMode) params.response_format = { type: 'json_object' };
  if (req.temperature !== undefined && !compat.noTemperature) params.temperature = req.temperature;
  if (req.maxTokens !== undefined) {
    // max_tokens is what compatible servers understand; OpenAI's reasoning models only accept
    // max_completion_tokens and say so in a 400, which flips this per model.
    if (compat.useMaxCompletionTokens) params.max_completion_tokens = req.maxTokens;
    else params.max_tokens = req.maxTokens;
  }
  return params;
}

// How endpoints say a parameter is not theirs: OpenAI ("Unsupported parameter", "This model does
// not support specifying dimensions"), vLLM, and pydantic behind FastAPI/TGI ("extra fields not
// permitted", "Extra inputs are not permitted").
const UNSUPPORTED =
  /unsupported|not supported|does not support|unknown|unrecogni[sz]ed|not allowed|extra (?:fields|inputs)/i;

/**
 * The text of a 400 or 422 (FastAPI's and TGI's status for a request that fails validation) in
 * which an endpoint may name a parameter it refuses; otherwise undefined.
 */
function rejectionText(err: unknown): string | undefined {
  if (!(err instanceof APIError) || (err.status !== 400 && err.status !== 422)) return undefined;
  return `${err.message} ${err.param ?? ''} ${safeJson(err.error)}`;
}

/**
 * If `err` is a 400 or 422 complaining about an optional parameter we sent, remember (per model)
 * to stop sending it and return its name; otherwise undefined.
 */
function learnFromRejection(err: unknown, params: ChatParams, compat: ModelCompat): string | undefined {
  const text = rejectionText(err);
  if (text === undefined) return undefined;

  // OpenAI's "messages must contain the word 'json'" also mentions response_format, but it is a
  // prompt bug, not a missing feature; dropping JSON mode would hide it.
  if (params.response_format && text.includes('response_format') && !/must contain the word/i.test(text)) {
    compat.noJsonMode = true;
    return 'response_format';
  }
  if (params.max_tokens !== undefined && text.includes('max_tokens') && UNSUPPORTED.test(text)) {
    compat.useMaxCompletionTokens = true;
    return 'max_tokens';
  }
  if (params.temperature !== undefined && text.includes('temperature') && UNSUPPORTED.test(text)) {
    compat.noTemperature = true;
    return 'temperature';
  }
  return undefined;
}

/**
 * learnFromRejection for embeddings: an endpoint that does not take `dimensions` (ada-002, most
 * local servers) gets none, and answers its model's native size, which readEmbeddings still
 * checks against the configured one.
 */
function learnFromEmbeddingRejection(
  err: unknown,
  params: OpenAI.EmbeddingCreateParams,
  compat: ModelCompat,
): string | undefined {
  const text = rejectionText(err);
  if (text === undefined || params.dimensions === undefined) return undefined;
  if (/\bdimensions\b/.test(text) && UNSUPPORTED.test(text)) {
    compat.noDimensions = true;
    return 'dimensions';
  }
  return undefined;
}

interface ClassifyContext {
  externallyAborted: boolean;
  timedOut: boolean;
  timeoutMs: number;
}

function classify(err: unknown, ctx: ClassifyContext): LlmError {
  if (err instanceof LlmError) return err;
  // The caller's abort wins over whatever the request died of.
  if (ctx.externallyAborted) return abortedError(err);
  if (ctx.timedOut || err instanceof APIConnectionTimeoutError) {
    return new LlmError(`llm request timed out after ${ctx.timeoutMs}ms`, {
      kind: 'timeout',
      retryable: true,
      cause: err,
    });
  }
  if (err instanceof APIUserAbortError) return abortedError(err);
  if (err instanceof APIConnectionError) {
    return new LlmError(`llm endpoint unreachable: ${truncate(err.message)}`, {
      kind: 'network',
      retryable: true,
      cause: err,
    });
  }
  if (err instanceof APIError && typeof err.status === 'number') return classifyStatus(err, err.status);
  // A 200 whose body claims to be JSON but is not.
  if (err instanceof SyntaxError) {
    return new LlmError('llm endpoint returned malformed JSON', {
      kind: 'invalid_response',
      retryable: false,
      cause: err,
    });
  }
  // Errors raised while reading a response body escape the SDK's wrapping (undici "terminated",
  // socket resets); they are connection trouble.
  if (isNetworkLike(err)) {
    return new LlmError(`llm connection failed: ${truncate(errorSummary(err).message)}`, {
      kind: 'network',
      retryable: true,
      cause: err,
    });
  }
  // Anything else is unexpected (an SDK-side validation error, a bug); retrying will not help.
  return new LlmError(`llm call failed unexpectedly: ${truncate(errorSummary(err).message)}`, {
    kind: 'invalid_response',
    retryable: false,
    cause: err,
  });
}

function classifyStatus(err: APIError, status: number): LlmError {
  // The endpoint's own error text stays out: gateways quote the input in it (message content, a
  // prompt, a masked key), and this message reaches logs, BullMQ's failed reasons, GET /v1/jobs
  // and Redis's event streams. OpenAI's machine-readable type and code say what went wrong.
  // Words and underscores only (`invalid_request_error`, `context_length_exceeded`): a token or a
  // number an endpoint puts there is no error code.
  const tags = [err.type, err.code].filter((t): t is string => typeof t === 'string' && WORD_CODE.test(t));
  const detail = `llm endpoint answered ${status}${tags.length > 0 ? ` (${tags.join(', ')})` : ''}`;
  // The code says more than the type (`content_filter` against `invalid_request_error`); the type
  // stands in for endpoints that only send one.
  // vLLM and others say the model's context was exceeded in words only ("This model's maximum
  // context length is 4096 tokens…", code 400): that text gets OpenAI's code, so a chunk too big
  // for the model is split like one OpenAI refuses, and nothing of the text is kept.
  const code =
    [err.code, err.type].find(
      (t): t is string => typeof t === 'string' && WORD_CODE.test(t) && t !== 'invalid_request_error',
    ) ??
    (CONTEXT_EXCEEDED.test(err.message) ? 'context_length_exceeded' : undefined) ??
    [err.type].find((t): t is string => typeof t === 'string' && WORD_CODE.test(t));
  const withCode = code === undefined ? {} : { code };
  const retryAfterMs = retryAfter(err.headers);
  const withDelay = retryAfterMs === undefined ? {} : { retryAfterMs };
  const init = { status, ...withCode, cause: err };
  if (status === 429)
    return new LlmError(detail, { kind: 'rate_limited', retryable: true, ...init, ...withDelay });
  if (status === 408) return new LlmError(detail, { kind: 'timeout', retryable: true, ...init });
  // 409 is what OpenAI sends for lock contention; the SDK itself treats it as transient.
  if (status >= 500 || status === 409) {
    return new LlmError(detail, { kind: 'server', retryable: true, ...init, ...withDelay });
  }
  if (status === 401 || status === 403)
    return new LlmError(detail, { kind: 'auth', retryable: false, ...init });
  return new LlmError(detail, { kind: 'bad_request', retryable: false, ...init });
}

const CONTEXT_EXCEEDED = /maximum context length|context length (?:is|of)|context window|too many tokens/i;

/**
 * A 200 whose body is an error and not an answer (OpenRouter and some proxies report failures
 * found after the headers went out this way: `{"error":{"code":429,"message":...}}`), classified
 * by the status in its numeric code like a real one, or by a word code. `answerKey` is where the
 * answer would be (`choices`, `data`); an answer beside an error is left to be read. Only a code
 * that says the request is at fault (a 4xx such as 400 or 422, `invalid_request_error`,
 * `context_length_exceeded`, `model_not_found`) is not retried: one without a code, or with a
 * code that says nothing (a gateway's `{"error":{"message":"upstream request timed out"}}`), is
 * an outage like a 5xx: taken for the input's fault, it had the recent index skip a re-tester's
 * messages for good while the endpoint failed every second request.
 */
function throwIfErrorBody(body: unknown, answerKey: string): void {
  if (!isRecord(body)) return;
  const error = body['error'];
  const answer = body[answerKey];
  if (error === undefined || error === null || (Array.isArray(answer) && answer.length > 0)) return;
  const raw = isRecord(error) ? error['code'] : undefined;
  const numeric =
    typeof raw === 'number' && Number.isInteger(raw)
      ? raw
      : typeof raw === 'string' && /^\d{3}$/.test(raw)
        ? Number(raw)
        : undefined;
  // Without a code that says anything, the error's `type` (OpenAI's shape: `"type":
  // "invalid_request_error"`, `"code": null`), read the same way; was an outage, retried for ever.
  const type = isRecord(error) ? error['type'] : undefined;
  const status =
    numeric !== undefined
      ? numeric >= 400 && numeric <= 599
        ? numeric
        : undefined
      : (wordStatus(raw) ?? wordStatus(type));
  const message = `llm endpoint answered 200 with an error${status === undefined ? '' : ` (${status})`}`;
  const init = { code: 'error_body' };
  if (status === 429) throw new LlmError(message, { kind: 'rate_limited', retryable: true, ...init });
  if (status === 408) throw new LlmError(message, { kind: 'timeout', retryable: true, ...init });
  if (status === undefined || status >= 500 || status === 409) {
    throw new LlmError(message, { kind: 'server', retryable: true, ...init });
  }
  if (status === 401 || status === 403)
    throw new LlmError(message, { kind: 'auth', retryable: false, ...init });
  throw new LlmError(message, { kind: 'invalid_response', retryable: false, ...init });
}

/** The HTTP status a word code (or type) of an error under HTTP 200 stands for, if it says. */
function wordStatus(word: unknown): number | undefined {
  if (typeof word !== 'string') return undefined;
  if (/rate_limit|too_many_requests/i.test(word)) return 429;
  if (/overloaded|server_error|unavailable|timeout/i.test(word)) return 503;
  if (/auth|api_key|permission/i.test(word)) return 401;
  return BAD_REQUEST_WORDS.test(word) ? 400 : undefined;
}

/** Word codes of an error under HTTP 200 that say the request is at fault (its input, its model). */
const BAD_REQUEST_WORDS =
  /invalid|bad_request|not_found|unsupported|not_supported|unprocessable|content_filter|content_policy|context_length|too_long|too_large|above_max/i;

/** retry-after-ms (OpenAI's extension) or retry-after (seconds or HTTP date), as asked (≥ 0). */
function retryAfter(headers: Headers | undefined): number | undefined {
  if (!headers) return undefined;
  let ms: number | undefined;
  const msHeader = headers.get('retry-after-ms');
  if (msHeader !== null && msHeader.trim() !== '') {
    const parsed = Number(msHeader);
    if (Number.isFinite(parsed)) ms = parsed;
  }
  const header = headers.get('retry-after');
  if (ms === undefined && header !== null && header.trim() !== '') {
    const seconds = Number(header);
    if (Number.isFinite(seconds)) ms = seconds * 1000;
    else {
      const date = Date.parse(header);
      if (!Number.isNaN(date)) ms = date - Date.now();
    }
  }
  if (ms === undefined) return undefined;
  return Math.max(0, ms);
}

function fullJitter(attempt: number, baseDelayMs: number, maxDelayMs: number): number {
  const ceiling = Math.min(maxDelayMs, baseDelayMs * 2 ** (attempt - 1));
  return Math.random() * ceiling;
}

function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(abortedError());
      return;
    }
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(abortedError());
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

function abortedError(cause?: unknown): LlmError {
  return new LlmError('llm call aborted', { kind: 'aborted', retryable: false, cause });
}

interface FirstChoice {
  /** Undefined when the answer has no text we can use. */
  content: string | undefined;
  finishReason: string | undefined;
  noChoices: boolean;
  refused: boolean;
}

function readFirstChoice(completion: unknown): FirstChoice {
  const choices = isRecord(completion) ? completion['choices'] : undefined;
  const choice: unknown = Array.isArray(choices) ? choices[0] : undefined;
  if (!isRecord(choice))
    return { content: undefined, finishReason: undefined, noChoices: true, refused: false };
  const reason = choice['finish_reason'];
  const finishReason = typeof reason === 'string' && WORD_CODE.test(reason) ? reason : undefined;
  const message = isRecord(choice['message']) ? choice['message'] : {};
  const text = messageText(message['content']);
  const refusal = message['refusal'];
  return {
    content: text === '' ? undefined : text,
    finishReason,
    noChoices: false,
    refused: typeof refusal === 'string' && refusal !== '',
  };
}

/**
 * A message's text: a string, or the `text` parts of an array (Mistral's reasoning models answer
 * `[{type: "thinking", ...}, {type: "text", text: "..."}]`; the thinking is not the answer).
 */
function messageText(content: unknown): string | undefined {
  if (typeof content === 'string') return content;
  if (!Array.isArray(content)) return undefined;
  const parts = content.flatMap((part: unknown) =>
    isRecord(part) && part['type'] === 'text' && typeof part['text'] === 'string' ? [part['text']] : [],
  );
  return parts.length > 0 ? parts.join('') : undefined;
}

/**
 * Why an answer is of no use (a refusal, or no text), as an error whose code tells a refused or
 * filtered input (which will be refused again) from an answer cut short or a broken endpoint. The
 * refusal's own text stays out: it may quote the input.
 */
function unusableAnswer(answer: FirstChoice): LlmError {
  const fail = (message: string, code: string): LlmError =>
    new LlmError(message, { kind: 'invalid_response', retryable: false, code });
  if (answer.noChoices) return fail('chat completion has no choices', 'no_choices');
  if (answer.refused) return fail('chat completion was refused by the model', 'refusal');
  if (answer.finishReason === 'content_filter') {
    return fail("chat completion was stopped by the endpoint's content filter", 'content_filter');
  }
  if (answer.finishReason === 'length') {
    return fail('chat completion reached its token limit before any text', 'length');
  }
  return fail('chat completion has no text content in choices[0]', 'no_text');
}

function readUsage(body: unknown): { prompt: number; completion: number } {
  const usage = isRecord(body) && isRecord(body['usage']) ? body['usage'] : {};
  const count = (v: unknown): number => (typeof v === 'number' && Number.isFinite(v) && v >= 0 ? v : 0);
  return { prompt: count(usage['prompt_tokens']), completion: count(usage['completion_tokens']) };
}

function readEmbeddings(body: unknown, expected: number, dimensions: number | undefined): number[][] {
  const invalid = (why: string, code?: string): LlmError =>
    new LlmError(`invalid embeddings response: ${why}`, {
      kind: 'invalid_response',
      retryable: false,
      ...(code === undefined ? {} : { code }),
    });
  if (!isRecord(body) || !Array.isArray(body['data'])) throw invalid('no data array');
  const data: unknown[] = body['data'];
  // Fewer vectors may be one input's fault (an endpoint that leaves out a text it cannot embed):
  // the code lets the recent index isolate it.
  if (data.length !== expected) {
    const why = `expected ${expected} vectors, got ${data.length}`;
    throw invalid(why, data.length < expected ? 'missing_vectors' : undefined);
  }

  const vectors = new Array<number[] | undefined>(expected).fill(undefined);
  for (const [position, item] of data.entries()) {
    if (!isRecord(item)) throw invalid(`item ${position} is not an object`);
    // Order by `index` as the API specifies; fall back to position for servers that omit it.
    const index = item['index'] ?? position;
    if (typeof index !== 'number' || !Number.isInteger(index) || index < 0 || index >= expected) {
      throw invalid(`item ${position} has index ${String(index)}`);
    }
    if (vectors[index] !== undefined) throw invalid(`duplicate index ${index}`);
    const embedding = item['embedding'];
    if (!Array.isArray(embedding)) throw invalid(`vector ${index} is not a number array`);
    // An empty vector or one of another dimension may be one input's fault too (a re-tester's
    // endpoint answered [] for one text, and the session's index stalled): isolated like the rest.
    // Wrong for every input (a model of another dimension) fails the recent index's canary too.
    const fault =
      embedding.length === 0
        ? 'is empty'
        : dimensions !== undefined && embedding.length !== dimensions
          ? `has ${embedding.length} dimensions, expected ${dimensions}`
          : vectorFault(embedding);
    if (fault) throw new BadVectorError(`invalid embeddings response: vector ${index} ${fault}`, index);
    vectors[index] = embedding;
  }
  return vectors.map((v, i) => {
    if (!v) throw invalid(`missing vector ${i}`);
    return v;
  });
}

/**
 * An embeddings answer whose vector `index` is unusable: empty or of another dimension than
 * configured, a value that is no number, is not finite, or is beyond float4's range (the stored
 * type: 1e39 is a valid JSON double that becomes Infinity, and Postgres refuses the row), or a
 * vector whose length is zero in float4 (all zeros, or values that round to 0 such as 1e-50: its
 * cosine distance to anything is NaN). Like any invalid_response it is not retried; as it may be
 * the fault of one input, the recent index isolates it (embedIsolating), as it does an answer with
 * fewer vectors than inputs (`missing_vectors`) and an error sent with a 200 whose code blames the
 * request (`error_body`).
 */
export class BadVectorError extends LlmError {
  readonly index: number;
  constructor(message: string, index: number) {
    super(message, { kind: 'invalid_response', retryable: false });
    this.name = 'BadVectorError';
    this.index = index;
  }
}

/**
 * Why `values` cannot be stored and compared as a pgvector `vector`, or undefined. Its squared
 * length is summed in float4, as pgvector's cosine distance does: a sum of 0 (every square
 * underflows) or of Infinity makes that distance NaN or meaningless.
 */
function vectorFault(values: unknown[]): string | undefined {
  let squares = 0;
  for (const v of values) {
    if (typeof v !== 'number' || !Number.isFinite(v)) return 'has non-finite values';
    const f = Math.fround(v);
    if (!Number.isFinite(f)) return "has values beyond float4's range";
    squares = Math.fround(squares + Math.fround(f * f));
  }
  if (squares === 0) return 'has zero length in float4';
  if (!Number.isFinite(squares)) return "has a length beyond float4's range";
  return undefined;
}

function isNetworkLike(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = (err as { code?: unknown }).code;
  const causeCode = (err.cause as { code?: unknown } | undefined)?.code;
  const codes = [code, causeCode].filter((c): c is string => typeof c === 'string');
  if (codes.some((c) => /^(?:E[A-Z]+|UND_ERR_[A-Z_]+)$/.test(c))) return true;
  return err.name === 'AbortError' || /fetch failed|terminated|socket|network/i.test(err.message);
}

function errorSummary(err: unknown): { name: string; message: string } {
  if (err instanceof Error) return { name: err.name, message: err.message };
  return { name: typeof err, message: String(err) };
}

function truncate(text: string): string {
  return text.length > MAX_ERROR_TEXT ? `${cutUnits(text, MAX_ERROR_TEXT)}…` : text;
}

function safeJson(value: unknown): string {
  try {
    return JSON.stringify(value) ?? '';
  } catch {
    return '';
  }
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function assertPositive(name: string, value: number): void {
  if (!Number.isFinite(value) || value <= 0)
    throw new RangeError(`${name} must be a positive number, got ${value}`);
}
