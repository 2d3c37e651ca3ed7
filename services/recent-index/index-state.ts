import { PG, pgCode } from '../../db/pool.js';
import type { Queryable } from '../../db/pool.js';
import { getVectorIndex, initVectorIndex, sampleVectorDims } from '../../db/queries/vectors.js';
import { LOCAL_EMBEDDING_MODEL } from '../llm/local-embedder.js';

export class VectorIndexMismatchError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'VectorIndexMismatchError';
  }
}

const REEMBED_HINT = 'run `npx mnemos reembed` to rebuild the recent index for the configured embedder';

/**
 * The start-up guard: the recent index records the model and dimension of its vectors; a process
 * configured for another embedder would write vectors its neighbours cannot be compared with, so
 * it refuses to start and says how to fix it. An empty record is filled with the configuration;
 * on a database that takes no writes (a standby after a failover, `default_transaction_read_only`)
 * the process starts without it, to serve reads as migrate lets it, and the first embed job that
 * finds it empty fills it (embedSession).
 *
 * `withoutLlm`: the embedder is local-hash because no LLM is configured (the EMBEDDING_MODEL given,
 * `configuredModel`, is then ignored). An index built with a model the LLM endpoint served is then
 * most likely a missing OPENAI_* setting, and the refusal says so first: a reembed would move the
 * index to the lexical embedder for good.
 */
export async function ensureVectorIndex(
  q: Queryable,
  want: { model: string; dimensions: number },
  opts: { withoutLlm?: boolean; configuredModel?: string } = {},
): Promise<void> {
  let index = await getVectorIndex(q);
  if (!index) {
    const dims = await sampleVectorDims(q);
    if (dims !== null && dims !== want.dimensions) {
      throw new VectorIndexMismatchError(
        `the recent index holds ${dims}-dimensional vectors of an unrecorded model, but the configuration ` +
          `says ${want.model}/${want.dimensions} (EMBEDDING_MODEL/EMBEDDING_DIMENSIONS): ${REEMBED_HINT}`,
      );
    }
    try {
      await initVectorIndex(q, want.model, want.dimensions);
    } catch (err) {
      if (pgCode(err) === PG.readOnlyTransaction) return;
      throw err;
    }
    index = await getVectorIndex(q);
    if (!index) throw new Error('vector_index could not be initialised');
  }
  if (index.model === want.model && index.dimensions === want.dimensions) return;
  if (
    index.state === 'reembedding' &&
    index.target_model === want.model &&
    index.target_dimensions === want.dimensions
  ) {
    throw new VectorIndexMismatchError(
      `a reembed to ${want.model}/${want.dimensions} is in progress (started ` +
        `${index.reembed_started_at?.toISOString() ?? 'recently'}, last progress ${index.updated_at.toISOString()}); ` +
        `the index still holds ${index.model}/${index.dimensions}. Wait for \`npx mnemos reembed\` to finish ` +
        `(or run it again if it was interrupted), then start the service.`,
    );
  }
  if (opts.withoutLlm && index.model !== LOCAL_EMBEDDING_MODEL) {
    const ignored =
      opts.configuredModel !== undefined && opts.configuredModel !== LOCAL_EMBEDDING_MODEL
        ? ` (EMBEDDING_MODEL=${opts.configuredModel} is ignored without them)`
        : '';
    throw new VectorIndexMismatchError(
      `no LLM is configured (OPENAI_API_KEY and OPENAI_BASE_URL are unset), so the embedder is the built-in ` +
        `lexical ${want.model}/${want.dimensions}${ignored}, but the recent index was built with ` +
        `${index.model}/${index.dimensions}: set OPENAI_API_KEY or OPENAI_BASE_URL as when it was built. ` +
        `Only to move the index to ${want.model} for good (lexical, not semantic search), run ` +
        '`npx mnemos reembed` with this configuration. The service refuses to start until they match.',
    );
  }
  throw new VectorIndexMismatchError(
    `the recent index was built with ${index.model}/${index.dimensions}, but the configuration says ` +
      `${want.model}/${want.dimensions} (EMBEDDING_MODEL/EMBEDDING_DIMENSIONS): ${REEMBED_HINT}, ` +
      `or restore the previous setting. The service refuses to start until they match.`,
  );
}
