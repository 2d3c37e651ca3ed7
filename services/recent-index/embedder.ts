import type { Config } from '../config.js';
import { BadVectorError, LlmError } from '../llm/llm-client.js';
import type { LlmClient } from '../llm/llm-client.js';
import { LOCAL_EMBEDDING_MODEL, hasLocalFeatures, localEmbed } from '../llm/local-embedder.js';

/**
 * The embedder of the recent index: the configured OpenAI-compatible model through the LLM
 * client, or the built-in lexical `local-hash` embedder when no LLM is configured (or
 * EMBEDDING_MODEL=local-hash). Search embeds its queries through the same object so query and
 * stored vectors always come from one model.
 */

/** Characters of a message sent to the embedder (SQL fetches no more than this). */
export const MAX_EMBED_CHARS = 24_000;
/**
 * Rough token budget per input. OpenAI's embedding models take 8,191 tokens; we cannot tokenise
 * offline, so we estimate (ASCII ≈ 1/3 token per character, anything else ≈ 1.5) and stay
 * under 7,000. English prose is ~4 characters per token, CJK ~1–2 tokens per character.
 */
export const MAX_EMBED_TOKENS = 7_000;
/** Estimated tokens per HTTP request (OpenAI caps a request at 300k tokens and 2,048 inputs). */
const MAX_REQUEST_TOKENS = 120_000;
const MAX_REQUEST_INPUTS = 256;

export interface EmbedContext {
  tenantId: string;
  sessionId: string | null;
  /** Aborts the call (its retries included): a search that stopped waiting for its query vector. */
  signal?: AbortSignal;
}

export interface Embedder {
  /** What `vector_index` records: `local-hash` for the built-in embedder. */
  model: string;
  dimensions: number;
  local: boolean;
  /** One vector per text, in order. Texts must be non-empty (see prepareEmbedText). */
  embed(texts: string[], ctx: EmbedContext): Promise<number[][]>;
}

export function estimateTokens(text: string): number {
  let t = 0;
  for (const ch of text) t += ch.charCodeAt(0) < 128 ? 1 / 3 : 1.5;
  return Math.ceil(t);
}

/**
 * The text embedded for a message: at most MAX_EMBED_CHARS code points and about
 * MAX_EMBED_TOKENS estimated tokens, cut at a code-point boundary. Null when there is nothing to
 * embed (empty or whitespace-only): an embeddings API rejects empty strings.
 */
export function prepareEmbedText(content: string | null): string | null {
  if (content === null || !/\S/.test(content)) return null;
  // Short enough that even all-non-ASCII text is under both limits: nothing to cut (the usual
  // case; the loop below costs as much as embedding the text locally).
  if (content.length <= MAX_EMBED_CHARS && content.length * 1.5 <= MAX_EMBED_TOKENS) return content;
  let units = 0;
  let chars = 0;
  let end = 0;
  for (const ch of content) {
    units += ch.charCodeAt(0) < 128 ? 1 / 3 : 1.5;
    if (units > MAX_EMBED_TOKENS || chars >= MAX_EMBED_CHARS) break;
    end += ch.length;
    chars++;
  }
  return content.slice(0, end);
}

/** OpenAI's text-embedding-3 family takes a `dimensions` parameter; other models may reject it. */
function acceptsDimensions(model: string): boolean {
  return /text-embedding-3/.test(model);
}

/** Splits inputs into requests under the per-request token and input caps. */
function requestChunks(texts: string[]): Array<{ start: number; texts: string[] }> {
  const chunks: Array<{ start: number; texts: string[] }> = [];
  let current: string[] = [];
  let start = 0;
  let tokens = 0;
  texts.forEach((text, i) => {
    const t = estimateTokens(text);
    if (current.length > 0 && (tokens + t > MAX_REQUEST_TOKENS || current.length >= MAX_REQUEST_INPUTS)) {
      chunks.push({ start, texts: current });
      current = [];
      tokens = 0;
      start = i;
    }
    current.push(text);
    tokens += t;
  });
  if (current.length > 0) chunks.push({ start, texts: current });
  return chunks;
}

export function makeEmbedder(
  config: Pick<Config, 'embedding'>,
  llm: LlmClient | null,
  logger?: { warn(obj: object, msg: string): void },
): Embedder {
  const { dimensions } = config.embedding;
  if (config.embedding.local) {
    if (config.embedding.model !== LOCAL_EMBEDDING_MODEL) {
      logger?.warn(
        { configured: config.embedding.model },
        'EMBEDDING_MODEL is ignored without OPENAI_API_KEY/OPENAI_BASE_URL: using the local-hash embedder',
      );
    }
    return {
      model: LOCAL_EMBEDDING_MODEL,
      dimensions,
      local: true,
      embed: (texts) => Promise.resolve(texts.map((t) => localEmbed(t, dimensions))),
    };
  }
  if (!llm)
    throw new Error(`embedding model ${config.embedding.model} needs OPENAI_API_KEY or OPENAI_BASE_URL`);
  const model = config.embedding.model;
  const sendDimensions = acceptsDimensions(model);
  return {
    model,
    dimensions,
    local: false,
    async embed(texts, ctx) {
      const out: number[][] = new Array<number[]>(texts.length);
      for (const chunk of requestChunks(texts)) {
        const vectors = await llm.embed({
          purpose: 'embedding',
          model,
          input: chunk.texts,
          tenantId: ctx.tenantId,
          sessionId: ctx.sessionId,
          ...(ctx.signal ? { signal: ctx.signal } : {}),
          ...(sendDimensions ? { dimensions } : {}),
        });
        vectors.forEach((v, j) => {
          // A BadVectorError: one input's vector may be the only one of another length (an
          // endpoint's fault for that text). A model of another size fails the canary too, and the
          // job with this message (embedIsolating).
          if (v.length !== dimensions) {
            throw new BadVectorError(
              `embedder ${model} returned ${v.length} dimensions but EMBEDDING_DIMENSIONS is ${dimensions}`,
              chunk.start + j,
            );
          }
          out[chunk.start + j] = v;
        });
      }
      return out;
    },
  };
}

export interface EmbedOutcome {
  /** Same order as the input; null where the input was skipped. */
  vectors: Array<number[] | null>;
  skipped: Array<{ index: number; reason: string }>;
}

/** What a canary probe sends: short, plain, accepted by any working embeddings endpoint. */
export const CANARY_TEXT = 'mnemos embedding probe';

/**
 * Codes of answers that may be one input's fault: an error sent with HTTP 200 whose code says the
 * request is at fault (OpenRouter and proxies refuse an input so: `{"error":{"code":400}}`; one
 * without such a code is an outage, retried: see throwIfErrorBody), and fewer vectors than inputs
 * (an endpoint that leaves out a text it cannot embed).
 */
const INPUT_FAULT_CODES = new Set(['error_body', 'missing_vectors']);

/**
 * An answer that may be the fault of one input: a 400 (too long for a model whose limit we do not
 * know, say), an invalid response with one of INPUT_FAULT_CODES, or a vector that cannot be stored
 * or is of another length (see BadVectorError). Retryable errors are not.
 */
function refusesInput(err: unknown): err is LlmError {
  return (
    err instanceof LlmError &&
    !err.retryable &&
    (err.kind === 'bad_request' ||
      err instanceof BadVectorError ||
      (err.kind === 'invalid_response' && err.code !== undefined && INPUT_FAULT_CODES.has(err.code)))
  );
}

function skipReason(err: LlmError): string {
  if (err instanceof BadVectorError) return 'bad_vector';
  if (err.kind === 'invalid_response' && err.code !== undefined) return err.code;
  return `${err.kind}${err.status ? ` ${err.status}` : ''}`;
}

/**
 * Embeds a batch; when the endpoint refuses it (a 400, an error sent with a 200 that blames the
 * request, a missing or an unusable vector: refusesInput), embeds the inputs one by one so a
 * single poison input cannot block the rest. When every input
 * is refused alone (a batch of one included), a fixed short text (CANARY_TEXT) is embedded: if the
 * endpoint accepts it, the inputs are at fault and are all marked skipped, however many; if it is
 * refused too, the fault is the configuration (unknown model, bad parameter, an endpoint that
 * answers only zero vectors) and not the data: the batch's error is thrown and nothing is marked.
 * Retryable errors (429, 5xx, timeouts) always propagate so the job retries later, the canary's
 * included.
 */
export async function embedIsolating(
  embedder: Embedder,
  texts: string[],
  ctx: EmbedContext,
): Promise<EmbedOutcome> {
  if (embedder.local) return withoutFeatureless(texts, await embedder.embed(texts, ctx));
  try {
    return { vectors: await embedder.embed(texts, ctx), skipped: [] };
  } catch (err) {
    if (!refusesInput(err)) throw err;
    const vectors: Array<number[] | null> = [];
    const skipped: Array<{ index: number; reason: string }> = [];
    for (const [index, text] of texts.entries()) {
      let refusal: LlmError = err;
      if (texts.length > 1) {
        try {
          vectors.push((await embedder.embed([text], ctx))[0] ?? null);
          continue;
        } catch (one) {
          if (!refusesInput(one)) throw one;
          refusal = one;
        }
      }
      vectors.push(null);
      skipped.push({ index, reason: skipReason(refusal) });
    }
    if (skipped.length === texts.length) {
      try {
        await embedder.embed([CANARY_TEXT], ctx);
      } catch (canary) {
        throw refusesInput(canary) ? err : canary;
      }
    }
    return { vectors, skipped };
  }
}

/**
 * The local embedder gives every text without a word or CJK character ("👍", "...", "?!") one
 * fixed vector, the first unit vector. Stored, such messages all matched a query whose features
 * land on that dimension with a plus sign ("win") with a score of 1, ahead of the message that
 * holds the word. They are skipped (reason `no_features`), as texts without characters are. Only
 * a vector equal to that one is looked at: a text whose features all land there has it too.
 */
function withoutFeatureless(texts: string[], vectors: number[][]): EmbedOutcome {
  const skipped: EmbedOutcome['skipped'] = [];
  const out = vectors.map((v, index) => {
    if (v[0] !== 1 || hasLocalFeatures(texts[index]!)) return v;
    skipped.push({ index, reason: 'no_features' });
    return null;
  });
  return { vectors: out, skipped };
}
