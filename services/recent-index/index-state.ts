import { PG, pgCode } from '../../db/pool.js';
import type { Queryable } from '../../db/pool.js';
import { getVectorIndex, initVectorIndex, sampleVectorDims } from '../../db/queries/vectors.js';

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
 */
export async function ensureVectorIndex(
  q: Queryable,
  want: { model: string; dimensions: number },
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
  throw new VectorIndexMismatchError(
    `the recent index was built with ${index.model}/${index.dimensions}, but the configuration says ` +
      `${want.model}/${want.dimensions} (EMBEDDING_MODEL/EMBEDDING_DIMENSIONS): ${REEMBED_HINT}, ` +
      `or restore the previous setting. The service refuses to start until they match.`,
  );
}
