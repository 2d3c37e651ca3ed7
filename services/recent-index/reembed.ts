import { randomUUID } from 'node:crypto';
import { withTransaction } from '../../db/pool.js';
import type { Db } from '../../db/pool.js';
import { insertUsage } from '../../db/queries/usage.js';
import {
  countEmbeddable,
  createShadowTable,
  deleteVectorSkips,
  dropShadowTable,
  initVectorIndex,
  insertShadowVectors,
  insertVectorSkips,
  lockVectorIndex,
  markReembedding,
  missingShadowPage,
  sampleVectorDims,
  shadowTableExists,
  swapShadowTable,
  touchReembed,
} from '../../db/queries/vectors.js';
import type { ShadowPageRow } from '../../db/queries/vectors.js';
import type { Config } from '../config.js';
import { LlmError, makeLlmClient } from '../llm/llm-client.js';
import { MAX_EMBED_CHARS, embedIsolating, makeEmbedder, prepareEmbedText } from './embedder.js';
import type { EmbedOutcome, Embedder } from './embedder.js';

/**
 * `mnemos reembed`: rebuilds the recent index for the configured embedder, in this process.
 *
 * 1. Takes the reembed lease in `vector_index` (state `reembedding`, target model/dimension).
 * 2. Builds `message_vectors_next` beside the live table: every hot message of EMBED_ROLES,
 *    in primary-key order, in batches through the embedder; a heartbeat per batch.
 * 3. Sweeps again from the start for messages archived behind the cursor meanwhile.
 * 4. Swaps in one transaction: the live table is dropped, the shadow table renamed, and
 *    `vector_index` records the new model and dimension.
 * The live index keeps serving (old model) until the swap. An interrupted run leaves the old index
 * intact; running the command again resumes the same target (already-built rows are kept).
 */

/** A lease whose heartbeat is older than this may be taken over by another run. */
export const REEMBED_LEASE_MS = 10 * 60_000;
const MAX_SWEEPS = 3;
const BATCH_RETRIES = 6;

export interface ReembedProgress {
  phase: 'build' | 'sweep';
  done: number;
  total: number;
}

export interface ReembedResult {
  status: 'rebuilt' | 'up_to_date' | 'initialised';
  model: string;
  dimensions: number;
  from: { model: string; dimensions: number } | null;
  vectors: number;
  skipped: number;
}

export class ReembedBusyError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ReembedBusyError';
  }
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Transient embedder faults get a few patient retries here: a long rebuild should survive a blip. */
async function embedWithPatience(
  embedder: Embedder,
  texts: string[],
  tenantId: string,
): Promise<EmbedOutcome> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await embedIsolating(embedder, texts, { tenantId, sessionId: null });
    } catch (err) {
      if (!(err instanceof LlmError) || !err.retryable || attempt >= BATCH_RETRIES) throw err;
      await sleep(Math.min(30_000, 1000 * 2 ** attempt));
    }
  }
}

export async function reembed(
  db: Db,
  config: Pick<Config, 'embedRoles'>,
  embedder: Embedder,
  opts: {
    batchSize?: number;
    force?: boolean;
    /** No other process can hold the database (embedded mode's data-directory lock): a lease is stale. */
    exclusive?: boolean;
    onProgress?: (p: ReembedProgress) => void;
  } = {},
): Promise<ReembedResult> {
  const target = { model: embedder.model, dimensions: embedder.dimensions };
  const batchSize = opts.batchSize ?? 128;
  if (!Number.isInteger(batchSize) || batchSize < 1 || batchSize > 2048) {
    throw new RangeError(`batch size must be a whole number from 1 to 2048, got ${batchSize}`);
  }
  const id = randomUUID();

  const claim = await withTransaction(db, async (tx) => {
    let index = await lockVectorIndex(tx);
    if (!index) {
      const dims = await sampleVectorDims(tx);
      // Nothing built yet (or built with exactly this dimension before bookkeeping existed).
      if (dims === null || dims === target.dimensions) {
        await initVectorIndex(tx, target.model, target.dimensions);
        return { kind: 'initialised' as const };
      }
      await initVectorIndex(tx, 'unknown', dims);
      index = await lockVectorIndex(tx);
      if (!index) throw new Error('vector_index could not be initialised');
    }
    const same = index.model === target.model && index.dimensions === target.dimensions;
    if (same && index.state === 'ready' && !opts.force) return { kind: 'up_to_date' as const };
    // Judged by the database's clock (the heartbeat's): another process's own clock may be
    // minutes off, which made a live lease look stale (two runs at once) or a dead one live.
    const alive =
      index.state === 'reembedding' && index.reembed_id !== null && index.updated_ms_ago < REEMBED_LEASE_MS;
    if (alive && !opts.force && !opts.exclusive) {
      throw new ReembedBusyError(
        `another reembed to ${index.target_model}/${index.target_dimensions} is running (last progress ` +
          `${index.updated_at.toISOString()}); wait for it, or pass --force if that process is gone`,
      );
    }
    const resume =
      index.state === 'reembedding' &&
      index.target_model === target.model &&
      index.target_dimensions === target.dimensions;
    await markReembedding(tx, { ...target, id, keepStartedAt: resume });
    // A fresh rebuild gives every message a new chance with the target model: its skip marks go,
    // those of an earlier era or of the live index itself when the name stays (--force, or a new
    // endpoint serving the same model name). A resumed run keeps the marks its predecessor made.
    if (!resume) await deleteVectorSkips(tx, target.model);
    return { kind: 'claimed' as const, resume, from: { model: index.model, dimensions: index.dimensions } };
  });
  if (claim.kind !== 'claimed') {
    return { status: claim.kind, ...target, from: null, vectors: 0, skipped: 0 };
  }

  try {
    if (!claim.resume || !(await shadowTableExists(db))) {
      await dropShadowTable(db);
      await createShadowTable(db);
    }
    const total = await countEmbeddable(db, config.embedRoles);
    let vectors = 0;
    let skipped = 0;
    for (let sweep = 0; sweep < MAX_SWEEPS; sweep++) {
      let after: { tenantId: string; sessionId: string; seq: string } | null = null;
      let found = 0;
      for (;;) {
        const page = await missingShadowPage(db, {
          after,
          roles: config.embedRoles,
          model: target.model,
          limit: batchSize,
          maxChars: MAX_EMBED_CHARS,
        });
        if (page.length === 0) break;
        found += page.length;
        const r = await embedPage(db, embedder, page);
        vectors += r.vectors;
        skipped += r.skipped;
        const last = page[page.length - 1]!;
        after = { tenantId: last.tenant_id, sessionId: last.session_id, seq: last.seq };
        if (!(await touchReembed(db, id)))
          throw new ReembedBusyError('another reembed took over this one; stopping');
        opts.onProgress?.({ phase: sweep === 0 ? 'build' : 'sweep', done: vectors + skipped, total });
      }
      // A sweep that finds nothing means the shadow table has caught up with the archive.
      if (found === 0) break;
    }
    await withTransaction(db, async (tx) => {
      const index = await lockVectorIndex(tx);
      if (index?.reembed_id !== id)
        throw new ReembedBusyError('another reembed took over this one; not swapping');
      await swapShadowTable(tx, target);
    });
    return { status: 'rebuilt', ...target, from: claim.from, vectors, skipped };
  } catch (err) {
    // Keep state and target (a rerun resumes), but let a rerun take the lease at once.
    await db
      .query(`UPDATE vector_index SET reembed_id = NULL WHERE reembed_id = $1`, [id])
      .catch(() => undefined);
    throw err;
  }
}

async function embedPage(
  db: Db,
  embedder: Embedder,
  page: ShadowPageRow[],
): Promise<{ vectors: number; skipped: number }> {
  const byTenant = new Map<string, ShadowPageRow[]>();
  for (const row of page) byTenant.set(row.tenant_id, [...(byTenant.get(row.tenant_id) ?? []), row]);
  let vectors = 0;
  const skips: Array<{ tenantId: string; sessionId: string; seq: string; reason: string }> = [];
  for (const [tenantId, rows] of byTenant) {
    const prepared = rows.map((r) => ({ row: r, text: prepareEmbedText(r.text) }));
    const todo = prepared.filter((p): p is { row: ShadowPageRow; text: string } => p.text !== null);
    for (const p of prepared) {
      if (p.text === null)
        skips.push({ tenantId, sessionId: p.row.session_id, seq: p.row.seq, reason: 'no_text' });
    }
    const outcome = await embedWithPatience(
      embedder,
      todo.map((t) => t.text),
      tenantId,
    );
    for (const s of outcome.skipped) {
      const row = todo[s.index]!.row;
      skips.push({ tenantId, sessionId: row.session_id, seq: row.seq, reason: s.reason });
    }
    const items = todo.flatMap((t, i) => {
      const embedding = outcome.vectors[i];
      return embedding ? [{ tenantId, sessionId: t.row.session_id, seq: t.row.seq, embedding }] : [];
    });
    vectors += await insertShadowVectors(db, items);
  }
  await insertVectorSkips(db, { model: embedder.model, items: skips });
  return { vectors, skipped: skips.length };
}

/** The CLI's entry: builds the configured embedder (usage recorded like the service's) and runs. */
export async function reembedCommand(
  db: Db,
  config: Config,
  opts: { batchSize?: number; force?: boolean; print: (line: string) => void },
): Promise<ReembedResult> {
  const llm =
    config.llm.configured && !config.embedding.local
      ? makeLlmClient({
          ...(config.llm.apiKey ? { apiKey: config.llm.apiKey } : {}),
          ...(config.llm.baseURL ? { baseURL: config.llm.baseURL } : {}),
          timeoutMs: config.llmTimeoutMs,
          onUsage: (u) => insertUsage(db, u),
        })
      : null;
  const embedder = makeEmbedder(config, llm);
  // Not "building": an index already built says so next, with nothing to do.
  opts.print(`reembed: the recent index for ${embedder.model}/${embedder.dimensions}`);
  let lastPrint = 0;
  const result = await reembed(db, config, embedder, {
    ...(opts.batchSize !== undefined ? { batchSize: opts.batchSize } : {}),
    ...(opts.force !== undefined ? { force: opts.force } : {}),
    // Embedded mode: this process holds the data directory's lock, so a reembed that left its
    // lease behind (killed) is gone, and the rerun resumes it without --force.
    exclusive: db.kind !== 'postgres',
    onProgress: (p) => {
      if (Date.now() - lastPrint < 2000) return;
      lastPrint = Date.now();
      opts.print(`reembed: ${p.phase} ${p.done}/${p.total}`);
    },
  });
  if (result.status === 'up_to_date') {
    opts.print(
      `reembed: the index is already built with ${result.model}/${result.dimensions}; nothing to do (--force rebuilds)`,
    );
  } else if (result.status === 'initialised') {
    opts.print(`reembed: the index was empty; recorded ${result.model}/${result.dimensions}`);
  } else {
    opts.print(
      `reembed: done: ${result.vectors} vectors (${result.skipped} messages skipped) with ` +
        `${result.model}/${result.dimensions}, replacing ${result.from?.model}/${result.from?.dimensions}`,
    );
  }
  return result;
}
