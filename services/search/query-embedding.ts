import type { CoreDeps } from '../deps.js';
import { makeEmbedder, prepareEmbedText } from '../recent-index/embedder.js';

/** A search request waits at most this long for its query embedding (retries included). */
export const QUERY_EMBED_DEADLINE_MS = 5000;

/**
 * Embeds a search query with the recent index's embedder (the same object the embed job uses, so
 * query and stored vectors come from one model, dimension and input cut). Returns null when it
 * cannot (provider down, timeout, bad answer): semantic search then has no results and hybrid
 * search falls back to its keyword half. It never throws.
 */
export async function embedQuery(
  deps: Pick<CoreDeps, 'config' | 'llm' | 'logger'>,
  tenantId: string,
  sessionId: string,
  text: string,
): Promise<number[] | null> {
  const input = prepareEmbedText(text);
  if (input === null) return null;
  let timer: NodeJS.Timeout | undefined;
  // The LLM client's own timeout and retries are sized for jobs; a search answers sooner, and
  // then aborts the call: its request and any retry (which would run for minutes, its usage
  // recorded long after the answer).
  const abort = new AbortController();
  try {
    // No logger: the embed job already warns once about an ignored EMBEDDING_MODEL.
    const embedder = makeEmbedder(deps.config, deps.llm);
    const call = embedder.embed([input], { tenantId, sessionId, signal: abort.signal });
    call.catch(() => undefined);
    const deadline = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () => {
          abort.abort();
          reject(Object.assign(new Error('query embedding deadline'), { kind: 'timeout' }));
        },
        Math.min(QUERY_EMBED_DEADLINE_MS, deps.config.llmTimeoutMs),
      );
    });
    const [vector] = await Promise.race([call, deadline]);
    return vector ?? null;
  } catch (err) {
    // Kind and status only: an endpoint's error text may echo the query.
    const e = err as { name?: string; kind?: string; status?: number };
    deps.logger.warn(
      { err: { name: e.name, kind: e.kind, status: e.status }, tenantId },
      'search: query embedding failed; semantic results skipped',
    );
    return null;
  } finally {
    clearTimeout(timer);
  }
}
