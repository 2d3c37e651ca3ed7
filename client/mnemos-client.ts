/**
 * A typed client for the mnemos HTTP API (SPEC §4). Copy the `client/` directory into any
 * Node ≥ 20 (or browser) project: it uses only the platform `fetch` and `crypto.randomUUID`.
 *
 *   const mnemos = createMnemosClient({ baseUrl: 'http://127.0.0.1:8080', apiKey });
 *   await mnemos.postMessages('chat-42', [{ role: 'user', content: 'hi' }], { wait: true });
 *   for await (const m of mnemos.iterateMessages('chat-42')) console.log(m.seq, m.content);
 *
 * Retries: see transport.ts. POST messages is safe to retry only because every message has an
 * id: the client assigns `crypto.randomUUID()` to messages that lack one, and the server answers
 * a re-posted id with its original seq instead of storing it twice.
 * Deletes resolve `false` on 404 (nothing to delete), so a retried delete is not an error.
 */
import { makeErrorMemoryMethods } from './error-memory-methods.js';
import { MnemosError, callOpts, deleteOrFalse, makeTransport, requestJson } from './transport.js';
import type { CallOptions, Reply, RequestSpec, TransportOptions } from './transport.js';
import type {
  ContextResult,
  ExportLine,
  ImportLine,
  ImportResult,
  JobView,
  MatchMode,
  MessageInput,
  MessagePage,
  PostMessagesResult,
  ReadyStatus,
  ResetResult,
  SearchHit,
  SessionInfo,
  SessionListItem,
  StoredMessage,
  SummarizeResult,
  SummaryView,
  TimeRange,
  ToolDefinition,
  UsageRow,
} from './types.js';

// The entry point: everything a user needs is importable from this file.
export { MnemosError, isMnemosError } from './transport.js';
export { parseRetryAfter } from './retry-after.js';
export type { CallOptions, RetryInfo } from './transport.js';
export { createMnemosAdmin } from './mnemos-admin.js';
export type { MnemosAdmin, MnemosAdminOptions } from './mnemos-admin.js';
export type * from './types.js';

export interface MnemosClientOptions extends Omit<TransportOptions, 'token'> {
  /** `http://host:port`, without `/v1`. */
  baseUrl: string;
  apiKey: string;
}

/** The server's limits for one POST (SPEC §4): the client splits bigger batches. */
const MAX_MESSAGES_PER_POST = 1000;
const MAX_POST_BYTES = 7 * 1024 * 1024; // under the 8 MiB body limit, with room for the envelope
/** `summarize?wait=true` and import wait up to 60 s on the server. */
const LONG_WAIT_TIMEOUT_MS = 70_000;
/** An import's upload is sent in pieces of about this size (one write per line would be slow). */
const UPLOAD_CHUNK_CHARS = 64 * 1024;

const enc = encodeURIComponent;

export function createMnemosClient(options: MnemosClientOptions) {
  const { apiKey, ...rest } = options;
  const http = makeTransport({ ...rest, token: apiKey });
  const call = <T>(spec: RequestSpec): Promise<T> => requestJson<T>(http, spec);
  const remove = (spec: RequestSpec): Promise<boolean> => deleteOrFalse(http, spec);
  const session = (sid: string) => `/v1/sessions/${enc(sid)}`;

  const client = {
    /**
     * Appends messages (ids assigned where missing). With `wait`, resolves once they are durable
     * in the archive (`durable: true`; false if the server's wait timed out). Batches over the
     * server's limits are split into several requests, in order. A failure carries every id
     * of the call in `details.ids` (in the caller's order), so that a repeat with them stores
     * nothing twice.
     */
    async postMessages(
      sid: string,
      messages: MessageInput[],
      opts: CallOptions & { wait?: boolean } = {},
    ): Promise<PostMessagesResult> {
      // Only a missing id is made up: an empty one goes to the server, which refuses it (a caller's
      // id variable that came out empty would otherwise lose its idempotency without a word).
      const withIds = messages.map((m) => (m.id === undefined ? { ...m, id: crypto.randomUUID() } : m));
      const ids = withIds.map((m) => m.id as string); // every one set just above
      const out: PostMessagesResult = { session_id: sid, accepted: 0, messages: [], durable: true };
      let offset = 0;
      for (const batch of batches(withIds)) {
        const reply = await http
          .request({
            ...callOpts(opts),
            method: 'POST',
            path: `${session(sid)}/messages`,
            query: { wait: opts.wait ? 'true' : undefined },
            json: { messages: batch },
            idempotent: true, // every message carries an id
          })
          .catch((err: unknown) => {
            throw postError(err, offset, out.messages, ids);
          });
        offset += batch.length;
        const body = reply.body as Omit<PostMessagesResult, 'durable'>;
        out.session_id = body.session_id;
        out.accepted += body.accepted;
        out.messages.push(...body.messages);
        out.durable &&= reply.status === 201;
      }
      return out;
    },

    listMessages(
      sid: string,
      opts: CallOptions & {
        afterSeq?: number;
        beforeSeq?: number;
        limit?: number;
        order?: 'asc' | 'desc';
        /** The first page's `generation`: a later page then answers 409 `session_changed` after a reset (404 after a delete). */
        generation?: number;
      } = {},
    ): Promise<MessagePage> {
      return call({
        ...callOpts(opts),
        method: 'GET',
        path: `${session(sid)}/messages`,
        query: {
          after_seq: opts.afterSeq,
          before_seq: opts.beforeSeq,
          limit: opts.limit,
          order: opts.order,
          generation: opts.generation,
        },
        idempotent: true,
      });
    },

    /**
     * Every archived message in seq order (or newest first with `order: 'desc'`), page by page.
     * Ascending without `beforeSeq` it follows messages archived meanwhile, so on a session that
     * keeps growing it may not end: pass `beforeSeq` for a fixed range. A reset of the session
     * between two pages, or a delete and a new post, rejects with a MnemosError of code
     * `session_changed` (409) rather than going on with the new session's messages: start over
     * (a delete alone: `not_found`, 404).
     */
    async *iterateMessages(
      sid: string,
      opts: CallOptions & {
        afterSeq?: number;
        beforeSeq?: number;
        order?: 'asc' | 'desc';
        pageSize?: number;
      } = {},
    ): AsyncGenerator<StoredMessage> {
      let { afterSeq, beforeSeq } = opts;
      let generation: number | undefined;
      for (;;) {
        const page = await client.listMessages(sid, {
          ...callOpts(opts),
          afterSeq,
          beforeSeq,
          order: opts.order,
          limit: opts.pageSize ?? 500,
          generation,
        });
        // Every later page must come from the generation of the first.
        generation ??= page.generation;
        yield* page.messages;
        if (page.next === null) return;
        if (opts.order === 'desc') beforeSeq = page.next;
        else afterSeq = page.next;
      }
    },

    listSessions(
      opts: CallOptions & { cursor?: string; limit?: number } = {},
    ): Promise<{ sessions: SessionListItem[]; next: string | null }> {
      return call({
        ...callOpts(opts),
        method: 'GET',
        path: '/v1/sessions',
        query: { cursor: opts.cursor, limit: opts.limit },
        idempotent: true,
      });
    },

    async *iterateSessions(opts: CallOptions & { pageSize?: number } = {}): AsyncGenerator<SessionListItem> {
      let cursor: string | undefined;
      for (;;) {
        const page = await client.listSessions({ ...callOpts(opts), cursor, limit: opts.pageSize ?? 500 });
        yield* page.sessions;
        if (page.next === null) return;
        cursor = page.next;
      }
    },

    getSession(sid: string, opts: CallOptions = {}): Promise<SessionInfo> {
      return call({ ...callOpts(opts), method: 'GET', path: session(sid), idempotent: true });
    },

    /** Clears the archive, vectors and cutoff; the summary survives unless `keepSummary: false`. */
    resetSession(sid: string, opts: CallOptions & { keepSummary?: boolean } = {}): Promise<ResetResult> {
      return call({
        ...callOpts(opts),
        method: 'POST',
        path: `${session(sid)}/reset`,
        query: { keep_summary: opts.keepSummary === false ? 'false' : undefined },
        // Not repeated after a network error or a 503: a repeat would also clear messages posted
        // meanwhile.
        idempotent: false,
      });
    },

    /** Removes everything of the session; false when it did not exist. */
    deleteSession(sid: string, opts: CallOptions = {}): Promise<boolean> {
      return remove({ ...callOpts(opts), method: 'DELETE', path: session(sid), idempotent: true });
    },

    /** The session as JSON Lines, parsed and streamed: messages in seq order, then the summary. */
    async *exportSession(sid: string, opts: CallOptions = {}): AsyncGenerator<ExportLine> {
      const reply = await http.stream({
        ...callOpts(opts),
        method: 'GET',
        path: `${session(sid)}/export`,
        idempotent: true,
      });
      yield* readJsonLines<ExportLine>(reply.chunks);
    },

    /**
     * Into an empty session only (else 409 `session_not_empty`); accepts an export's lines, so
     * `importSession(b, exportSession(a))` copies a session. Resolves once the messages are
     * archived (`durable`; the server waits up to 60 s), or at once with `wait: false`.
     * The lines are streamed as JSON Lines while they are read (the server takes at most 64 MiB).
     * From an array, a 429 or 503 (`import_busy`) is retried like any call; from any other
     * iterable it is thrown, since the lines cannot be read again.
     */
    async importSession(
      sid: string,
      lines: Iterable<ImportLine> | AsyncIterable<ImportLine>,
      opts: CallOptions & { wait?: boolean } = {},
    ): Promise<ImportResult> {
      const reply = await http.request({
        ...callOpts(opts),
        timeoutMs: opts.timeoutMs ?? (opts.wait === false ? undefined : LONG_WAIT_TIMEOUT_MS),
        method: 'POST',
        path: `${session(sid)}/import`,
        query: { wait: opts.wait === false ? 'false' : undefined },
        upload: { open: () => jsonLinesBytes(lines), once: !Array.isArray(lines) },
        contentType: 'application/x-ndjson',
        // A repeat after a lost answer would meet a non-empty session (409), not import twice;
        // after a 503 (`import_busy` most often) nothing was imported, or the repeat meets that 409.
        idempotent: false,
        retryUnavailable: true,
      });
      return { ...(reply.body as Omit<ImportResult, 'durable'>), durable: reply.status === 201 };
    },

    /**
     * The next turn's messages: hot window, turn-context (summary), then `input` as a user
     * message. `minSeq` waits (≤ 5 s on the server) until that seq is archived.
     */
    async context(
      sid: string,
      opts: CallOptions & { input?: string; maxMessages?: number; minSeq?: number } = {},
    ): Promise<ContextResult> {
      const reply = await http.request({
        ...callOpts(opts),
        method: 'POST',
        path: `${session(sid)}/context`,
        json: { input: opts.input, max_messages: opts.maxMessages, min_seq: opts.minSeq },
        idempotent: true,
      });
      const minSeqTimedOut = reply.headers.get('x-mnemos-min-seq') === 'timeout';
      return { ...(reply.body as Omit<ContextResult, 'minSeqTimedOut'>), minSeqTimedOut };
    },

    getSummary(sid: string, opts: CallOptions = {}): Promise<SummaryView> {
      return call({ ...callOpts(opts), method: 'GET', path: `${session(sid)}/summary`, idempotent: true });
    },

    /** Queues a summary run (`done: false`, poll `job`); with `wait`, resolves with its result. */
    async summarize(sid: string, opts: CallOptions & { wait?: boolean } = {}): Promise<SummarizeResult> {
      const reply = await http.request({
        ...callOpts(opts),
        timeoutMs: opts.timeoutMs ?? (opts.wait ? LONG_WAIT_TIMEOUT_MS : undefined),
        method: 'POST',
        path: `${session(sid)}/summarize`,
        query: { wait: opts.wait ? 'true' : undefined },
        idempotent: true, // runs are deduplicated per session on the server
      });
      return { ...(reply.body as SummarizeResult), done: reply.status === 200 } as SummarizeResult;
    },

    async search(
      sid: string,
      opts: CallOptions & {
        query: string;
        match?: MatchMode;
        limit?: number;
        timeRange?: TimeRange;
        excludeWindow?: boolean;
        /**
         * With excludeWindow: the context answer's `window.from_seq` (another window size); null
         * (an empty window) is left out, which leaves out the same nothing.
         */
        windowFromSeq?: number | null;
      },
    ): Promise<SearchHit[]> {
      const body = await call<{ hits: SearchHit[] }>({
        ...callOpts(opts),
        method: 'POST',
        path: `${session(sid)}/search`,
        json: {
          query: opts.query,
          match: opts.match,
          limit: opts.limit,
          time_range: opts.timeRange,
          exclude_window: opts.excludeWindow,
          window_from_seq: opts.windowFromSeq ?? undefined,
        },
        idempotent: true,
      });
      return body.hits;
    },

    /**
     * OpenAI function-tool definitions (chat_history, error_history, write_error); `strict: true`
     * gives the ones for structured outputs (every property required, optional ones nullable).
     */
    async tools(opts: CallOptions & { strict?: boolean } = {}): Promise<ToolDefinition[]> {
      const body = await call<{ tools: ToolDefinition[] }>({
        ...callOpts(opts),
        method: 'GET',
        path: '/v1/tools',
        query: { strict: opts.strict ? 'true' : undefined },
        idempotent: true,
      });
      return body.tools;
    },

    /**
     * Runs one tool call; `args` as the model produced them (the JSON string, or parsed). Resolves
     * with the text for the tool message; bad arguments give guidance text, not an error.
     * `windowFromSeq`: the context answer's `window.from_seq`, so that `chat_history` search
     * leaves out the window the agent has (needed when context was asked for another size).
     */
    async runTool(
      sid: string,
      name: string,
      args: string | Record<string, unknown>,
      opts: CallOptions & { windowFromSeq?: number | null } = {},
    ): Promise<string> {
      const body = await call<{ content: string }>({
        ...callOpts(opts),
        method: 'POST',
        path: `${session(sid)}/tools/${enc(name)}`,
        query: { window_from_seq: opts.windowFromSeq ?? undefined },
        json: args,
        // write_error merges into an existing record: a repeat would count one hit too many.
        idempotent: name !== 'write_error',
      });
      return body.content;
    },

    ...makeErrorMemoryMethods(http),

    usage(
      opts: CallOptions & { window?: '24h' | '7d' | '28d'; sessionId?: string } = {},
    ): Promise<{ window: string; rows: UsageRow[] }> {
      return call({
        ...callOpts(opts),
        method: 'GET',
        path: '/v1/usage',
        query: { window: opts.window, session_id: opts.sessionId },
        idempotent: true,
      });
    },

    /** A job id as returned by the API (e.g. `summary.…`). */
    job(id: string, opts: CallOptions = {}): Promise<JobView> {
      return call({ ...callOpts(opts), method: 'GET', path: `/v1/jobs/${enc(id)}`, idempotent: true });
    },

    /** `GET /readyz`: resolves for 200 and 503 alike (read `status`). */
    async ready(opts: CallOptions = {}): Promise<ReadyStatus> {
      const reply: Reply = await http.request({
        ...callOpts(opts),
        method: 'GET',
        path: '/readyz',
        idempotent: true,
        okStatuses: [503],
      });
      return reply.body as ReadyStatus;
    },
  };
  return client;
}

export type MnemosClient = ReturnType<typeof createMnemosClient>;

/** Splits a post into requests within the server's count and body-size limits, in order. */
function batches(messages: MessageInput[]): MessageInput[][] {
  const out: MessageInput[][] = [];
  const encoder = new TextEncoder();
  let current: MessageInput[] = [];
  let bytes = 0;
  for (const m of messages) {
    const size = encoder.encode(JSON.stringify(m)).length + 1;
    if (current.length > 0 && (current.length >= MAX_MESSAGES_PER_POST || bytes + size > MAX_POST_BYTES)) {
      out.push(current);
      current = [];
      bytes = 0;
    }
    current.push(m);
    bytes += size;
  }
  // No messages is one (empty) request, which the server refuses (400): a caller's list that came
  // out empty was answered "durable" without a request.
  if (current.length > 0 || out.length === 0) out.push(current);
  return out;
}

/**
 * A failed `postMessages` request's error with every id of the call in `details.ids`: the ids the
 * client made up are otherwise lost with the call, and a repeat with new ones could store the
 * messages twice. For a later request of a split call, its paths (`messages[3]`) and `index` are
 * made relative to the caller's array, and it says what the earlier requests stored
 * (`details.accepted_before`), since each request is atomic but the call is not.
 */
function postError(
  err: unknown,
  offset: number,
  before: Array<{ id: string; seq: number }>,
  ids: string[],
): unknown {
  if (!(err instanceof MnemosError)) return err;
  const shift = (text: string) =>
    text.replace(/messages\[(\d+)\]/g, (_m, n: string) => `messages[${Number(n) + offset}]`);
  let details: Record<string, unknown> = {};
  if (err.details && typeof err.details === 'object' && !Array.isArray(err.details)) {
    details = JSON.parse(shift(JSON.stringify(err.details))) as Record<string, unknown>;
    if (typeof details.index === 'number') details.index += offset;
  } else if (err.details !== undefined) details = { value: err.details };
  if (offset > 0) details.accepted_before = before;
  return new MnemosError({
    status: err.status,
    code: err.code,
    message:
      offset === 0
        ? err.message
        : `${shift(err.message)} (messages[0]..messages[${offset - 1}] were stored by earlier requests of this call)`,
    details: { ...details, ids },
    requestId: err.requestId,
    retryAfterMs: err.retryAfterMs,
    attempts: err.attempts,
    cause: offset === 0 ? err.cause : err,
  });
}

/** Import lines as JSON Lines bytes, read from `lines` only as fast as they are sent. */
async function* jsonLinesBytes(
  lines: Iterable<ImportLine> | AsyncIterable<ImportLine>,
): AsyncGenerator<Uint8Array> {
  const encoder = new TextEncoder();
  let text = '';
  let sent = 0;
  // The server reads at most MAX_IMPORT_BYTES, then answers 413 and closes the connection while
  // a streamed body is still being written: the client saw only "fetch failed" (EPIPE). It stops
  // at the limit itself, with the code the server gives; nothing is imported.
  const chunk = (t: string): Uint8Array => {
    const bytes = encoder.encode(t);
    sent += bytes.length;
    if (sent > MAX_IMPORT_BYTES)
      throw new MnemosError({
        status: 0,
        code: 'body_too_large',
        message: `the import exceeds ${MAX_IMPORT_BYTES} bytes, the server's limit: stopped there, nothing was imported`,
        details: { limit: MAX_IMPORT_BYTES },
        requestId: null,
        attempts: 1,
      });
    return bytes;
  };
  for await (const line of lines) {
    text += `${JSON.stringify(line)}\n`;
    if (text.length >= UPLOAD_CHUNK_CHARS) {
      yield chunk(text);
      text = '';
    }
  }
  if (text) yield chunk(text);
}

/** What the server takes of one import (services/lifecycle/import-input.ts MAX_IMPORT_BYTES). */
const MAX_IMPORT_BYTES = 64 * 1024 * 1024;

/** Parses a JSON Lines body as it streams in; stops reading when the consumer stops. */
async function* readJsonLines<T>(chunks: AsyncIterable<string>): AsyncGenerator<T> {
  let buffer = '';
  // Leaving the loop early (the consumer stopped, a line is not JSON) returns `chunks`, which
  // closes the connection.
  for await (const chunk of chunks) {
    buffer += chunk;
    for (let nl = buffer.indexOf('\n'); nl >= 0; nl = buffer.indexOf('\n')) {
      const line = buffer.slice(0, nl).trim();
      buffer = buffer.slice(nl + 1);
      if (line) yield JSON.parse(line) as T;
    }
  }
  if (buffer.trim()) yield JSON.parse(buffer) as T;
}
