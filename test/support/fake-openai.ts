/**
 * A real HTTP server speaking the OpenAI wire format, so tests exercise the actual SDK, HTTP
 * stack, timeouts and retries instead of a mocked client.
 */
import { createServer } from 'node:http';
import type { IncomingMessage, ServerResponse } from 'node:http';
import type { AddressInfo, Socket } from 'node:net';
import { localEmbed } from '../../services/llm/local-embedder.js';

export interface RecordedRequest {
  method: string;
  path: string;
  headers: Record<string, string | string[] | undefined>;
  body: unknown;
  at: number;
}

export type ChatScript =
  | { content: string; usage?: { prompt_tokens: number; completion_tokens: number } }
  | { status: number; body?: unknown; headers?: Record<string, string> }
  | { malformed: true }
  | { delayMs: number; then: ChatScript }
  | { hang: true }
  /** A normal answer whose content is the request's URL as received (path and query). */
  | { echoUrl: true };

export type EmbeddingScript =
  { status: number; body?: unknown; headers?: Record<string, string> } | { delayMs: number } | 'ok';

export interface FakeOpenAI {
  /** Base URL to pass as OPENAI_BASE_URL, ending in /v1. */
  url: string;
  requests: RecordedRequest[];
  chatRequests(): RecordedRequest[];
  embeddingRequests(): RecordedRequest[];
  /** Consumed FIFO by POST /v1/chat/completions. */
  queueChat(...items: ChatScript[]): void;
  /** Used when the chat queue is empty; without one the answer is content '{}'. */
  onChat(handler: ((body: any) => ChatScript) | null): void;
  /** Consumed FIFO by POST /v1/embeddings; 'ok' (or an empty queue) is a normal answer. */
  queueEmbeddings(...items: EmbeddingScript[]): void;
  /** Answers POST /v1/embeddings when the queue is empty; undefined (or no handler) is 'ok'. */
  onEmbeddings(handler: ((body: any) => EmbeddingScript | undefined) | null): void;
  /** Clears queues, handlers and recorded requests. */
  reset(): void;
  close(): Promise<void>;
}

const CHAT_PATH = '/v1/chat/completions';
const EMBEDDINGS_PATH = '/v1/embeddings';
const MODELS_PATH = '/v1/models';
const DEFAULT_EMBEDDING_DIMENSIONS = 1536;

export async function startFakeOpenAI(opts: { port?: number } = {}): Promise<FakeOpenAI> {
  const requests: RecordedRequest[] = [];
  const chatQueue: ChatScript[] = [];
  const embeddingQueue: EmbeddingScript[] = [];
  let chatHandler: ((body: any) => ChatScript) | null = null;
  let embeddingsHandler: ((body: any) => EmbeddingScript | undefined) | null = null;
  let nextId = 1;

  // Hanging and keep-alive connections would otherwise keep close() (and the test run) waiting.
  const sockets = new Set<Socket>();
  const server = createServer((req, res) => {
    void handle(req, res).catch((err: unknown) => {
      if (!res.headersSent && !res.destroyed) {
        sendJson(res, 500, errorBody(`fake server failure: ${String(err)}`, 'server_error'));
      }
    });
  });
  server.on('connection', (socket) => {
    sockets.add(socket);
    socket.on('close', () => sockets.delete(socket));
  });

  async function handle(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const raw = await readBody(req);
    let body: unknown = raw;
    if (raw.length > 0) {
      try {
        body = JSON.parse(raw);
      } catch {
        // Kept as text; recording what the client sent matters more than rejecting it.
      }
    } else {
      body = undefined;
    }
    const path = (req.url ?? '/').split('?')[0] ?? '/';
    requests.push({ method: req.method ?? 'GET', path, headers: { ...req.headers }, body, at: Date.now() });

    if (req.method === 'POST' && path === CHAT_PATH) {
      const script = chatQueue.shift() ?? chatHandler?.(body) ?? { content: '{}' };
      await answerChat(res, script, body, req.url ?? '');
      return;
    }
    if (req.method === 'POST' && path === EMBEDDINGS_PATH) {
      await answerEmbeddings(res, embeddingQueue.shift() ?? embeddingsHandler?.(body) ?? 'ok', body);
      return;
    }
    if (req.method === 'GET' && path === MODELS_PATH) {
      const created = Math.floor(Date.now() / 1000);
      sendJson(res, 200, {
        object: 'list',
        data: ['gpt-4o-mini', 'text-embedding-3-small'].map((id) => ({
          id,
          object: 'model',
          created,
          owned_by: 'fake',
        })),
      });
      return;
    }
    sendJson(
      res,
      404,
      errorBody(`Unknown request URL: ${req.method} ${path}`, 'invalid_request_error', 'unknown_url'),
    );
  }

  async function answerChat(
    res: ServerResponse,
    script: ChatScript,
    body: unknown,
    url: string,
  ): Promise<void> {
    if ('delayMs' in script) {
      await delay(script.delayMs);
      return answerChat(res, script.then, body, url);
    }
    if ('echoUrl' in script) return answerChat(res, { content: url }, body, url);
    if ('hang' in script) return; // never answered; close() destroys the socket
    if (res.destroyed) return;
    if ('malformed' in script) {
      // Claims JSON but is not, like a proxy that truncated the body.
      res.writeHead(200, { 'content-type': 'application/json' });
      res.end('{"id": "chatcmpl-broken", "choices": [');
      return;
    }
    if ('status' in script) {
      sendScripted(res, script);
      return;
    }
    const request = isRecord(body) ? body : {};
    const model = typeof request['model'] === 'string' ? request['model'] : 'gpt-4o-mini';
    const usage = script.usage ?? {
      prompt_tokens: roughTokens(JSON.stringify(request['messages'] ?? '')),
      completion_tokens: roughTokens(script.content),
    };
    sendJson(res, 200, {
      id: `chatcmpl-fake-${nextId++}`,
      object: 'chat.completion',
      created: Math.floor(Date.now() / 1000),
      model,
      choices: [
        {
          index: 0,
          message: { role: 'assistant', content: script.content, refusal: null },
          logprobs: null,
          finish_reason: 'stop',
        },
      ],
      usage: { ...usage, total_tokens: usage.prompt_tokens + usage.completion_tokens },
    });
  }

  async function answerEmbeddings(
    res: ServerResponse,
    script: EmbeddingScript,
    body: unknown,
  ): Promise<void> {
    if (typeof script === 'object' && 'delayMs' in script) await delay(script.delayMs);
    if (res.destroyed) return;
    if (typeof script === 'object' && 'status' in script) {
      sendScripted(res, script);
      return;
    }
    const request = isRecord(body) ? body : {};
    const inputs = toInputs(request['input']);
    if (inputs === undefined) {
      sendJson(
        res,
        400,
        errorBody("'input' must be a string or an array of strings", 'invalid_request_error'),
      );
      return;
    }
    const dimensions = request['dimensions'] ?? DEFAULT_EMBEDDING_DIMENSIONS;
    if (typeof dimensions !== 'number' || !Number.isInteger(dimensions) || dimensions < 1) {
      sendJson(res, 400, errorBody("'dimensions' must be a positive integer", 'invalid_request_error'));
      return;
    }
    const format = request['encoding_format'] ?? 'base64';
    if (format !== 'float' && format !== 'base64') {
      sendJson(res, 400, errorBody("'encoding_format' must be 'float' or 'base64'", 'invalid_request_error'));
      return;
    }
    const promptTokens = inputs.reduce((sum, text) => sum + roughTokens(text), 0);
    sendJson(res, 200, {
      object: 'list',
      data: inputs.map((text, index) => {
        // Rounded to float32 because that is what the real service stores; it also makes the
        // float and base64 encodings of one vector exactly equal.
        const vector = localEmbed(text, dimensions).map((v) => Math.fround(v));
        return { object: 'embedding', index, embedding: format === 'float' ? vector : float32Base64(vector) };
      }),
      model: typeof request['model'] === 'string' ? request['model'] : 'text-embedding-3-small',
      usage: { prompt_tokens: promptTokens, total_tokens: promptTokens },
    });
  }

  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.port ?? 0, '127.0.0.1', () => {
      server.off('error', reject);
      resolve();
    });
  });
  const { port } = server.address() as AddressInfo;

  return {
    url: `http://127.0.0.1:${port}/v1`,
    requests,
    chatRequests: () => requests.filter((r) => r.path === CHAT_PATH),
    embeddingRequests: () => requests.filter((r) => r.path === EMBEDDINGS_PATH),
    queueChat: (...items) => void chatQueue.push(...items),
    onChat: (handler) => {
      chatHandler = handler;
    },
    queueEmbeddings: (...items) => void embeddingQueue.push(...items),
    onEmbeddings: (handler) => {
      embeddingsHandler = handler;
    },
    reset: () => {
      // In place, so a test holding `fake.requests` keeps seeing the live list.
      requests.length = 0;
      chatQueue.length = 0;
      embeddingQueue.length = 0;
      chatHandler = null;
      embeddingsHandler = null;
    },
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        for (const socket of sockets) socket.destroy();
      }),
  };
}

function sendScripted(
  res: ServerResponse,
  script: { status: number; body?: unknown; headers?: Record<string, string> },
): void {
  const body =
    script.body !== undefined
      ? script.body
      : errorBody(
          `fake error ${script.status}`,
          errorType(script.status),
          script.status === 429 ? 'rate_limit_exceeded' : null,
        );
  sendJson(res, script.status, body, script.headers);
}

function errorType(status: number): string {
  if (status === 429) return 'requests';
  if (status === 401) return 'invalid_request_error';
  if (status >= 500) return 'server_error';
  return 'invalid_request_error';
}

function errorBody(message: string, type: string, code: string | null = null): unknown {
  return { error: { message, type, param: null, code } };
}

function sendJson(
  res: ServerResponse,
  status: number,
  body: unknown,
  headers: Record<string, string> = {},
): void {
  if (res.destroyed) return;
  const text = JSON.stringify(body);
  res.writeHead(status, {
    'content-type': 'application/json',
    'content-length': String(Buffer.byteLength(text)),
    ...headers,
  });
  res.end(text);
}

function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    req.on('error', reject);
  });
}

function toInputs(input: unknown): string[] | undefined {
  if (typeof input === 'string') return [input];
  if (!Array.isArray(input) || input.length === 0) return undefined;
  // Token-id arrays are legal on the wire; stringify them so they still embed deterministically.
  return input.map((item) => (typeof item === 'string' ? item : JSON.stringify(item)));
}

/** Little-endian float32, base64 — the real API's `encoding_format: 'base64'`. */
export function float32Base64(vector: readonly number[]): string {
  const buffer = Buffer.alloc(vector.length * 4);
  vector.forEach((v, i) => buffer.writeFloatLE(v, i * 4));
  return buffer.toString('base64');
}

/** Inverse of float32Base64, for tests that call the fake directly. */
export function decodeFloat32Base64(text: string): number[] {
  const buffer = Buffer.from(text, 'base64');
  const out: number[] = [];
  for (let offset = 0; offset + 4 <= buffer.length; offset += 4) out.push(buffer.readFloatLE(offset));
  return out;
}

function roughTokens(text: string): number {
  return Math.max(1, Math.ceil(text.length / 4));
}

function delay(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}
