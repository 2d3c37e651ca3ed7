import { DelayedError, UnrecoverableError } from 'bullmq';
import type { Job } from 'bullmq';
import { withTransaction } from '../db/pool.js';
import {
  getVectorIndex,
  initVectorIndex,
  insertSessionVectors,
  insertVectorSkips,
  lockSessionForVectors,
  missingVectors,
} from '../db/queries/vectors.js';
import type { CoreDeps } from '../services/deps.js';
import { LlmError } from '../services/llm/llm-client.js';
import { throttledWarn } from '../services/logger.js';
import { MAX_EMBED_CHARS, embedIsolating, prepareEmbedText } from '../services/recent-index/embedder.js';
import type { Embedder } from '../services/recent-index/embedder.js';
import { enqueueEmbed } from '../services/recent-index/jobs.js';
import { watchSession } from '../services/session-watch.js';
import { archivingBehind } from '../services/messages/inbox.js';
import { parsePayload } from './queues.js';

/** Messages per embeddings call (the API takes up to 2,048; smaller calls fail and retry cheaper). */
export const EMBED_BATCH = 128;
const LOCAL_EMBED_BATCH = 256;
/** Batches per job; a bigger backlog continues in a follow-up job so other sessions get a turn. */
const MAX_BATCHES_PER_JOB = 16;

export interface EmbedSessionResult {
  written: number;
  skipped: number;
  more: boolean;
}

/**
 * Embeds every hot message of EMBED_ROLES that has no vector yet, batch by batch, oldest first.
 * Vectors are written under a share lock of the session row and only if the session's generation
 * is still the one read (a reset or delete meanwhile drops them) and the message is still at or
 * after the cutoff (a compaction meanwhile drops it). `onRefused` hears of each message the
 * embeddings endpoint refused, once its skip is recorded.
 */
export async function embedSession(
  deps: Pick<CoreDeps, 'db' | 'config'>,
  embedder: Embedder,
  tenantId: string,
  sessionId: string,
  onRefused?: (skip: { seq: string; reason: string }) => void,
): Promise<EmbedSessionResult> {
  const limit = embedder.local ? LOCAL_EMBED_BATCH : EMBED_BATCH;
  const total: EmbedSessionResult = { written: 0, skipped: 0, more: false };
  for (let round = 0; round < MAX_BATCHES_PER_JOB; round++) {
    const page = await missingVectors(deps.db, {
      tenantId,
      sessionId,
      roles: deps.config.embedRoles,
      model: embedder.model,
      limit,
      maxChars: MAX_EMBED_CHARS,
    });
    if (!page || page.rows.length === 0) return total;

    const prepared = page.rows.map((r) => ({ seq: r.seq, text: prepareEmbedText(r.text) }));
    const todo = prepared.filter((p): p is { seq: string; text: string } => p.text !== null);
    // SQL's notion of whitespace is narrower than JavaScript's; such rows are marked, not refetched.
    const skips = prepared.filter((p) => p.text === null).map((p) => ({ seq: p.seq, reason: 'no_text' }));
    // A delete or reset while the call waits on a slow endpoint stops it and its retries: they
    // would send the session's text again after the delete was answered.
    const controller = new AbortController();
    const stopWatching = watchSession(
      deps.db,
      { tenantId, sessionId, generation: page.generation },
      controller,
    );
    let outcome: Awaited<ReturnType<typeof embedIsolating>>;
    try {
      outcome = await embedIsolating(
        embedder,
        todo.map((t) => t.text),
        { tenantId, sessionId, signal: controller.signal },
      );
    } catch (err) {
      // Reset or deleted meanwhile: as below, the next job starts over.
      if (controller.signal.aborted) return total;
      throw err;
    } finally {
      stopWatching();
    }
    const refused = outcome.skipped.map((s) => ({ seq: todo[s.index]!.seq, reason: s.reason }));
    skips.push(...refused);
    const items = todo.flatMap((t, i) => {
      const embedding = outcome.vectors[i];
      return embedding ? [{ seq: t.seq, embedding }] : [];
    });

    // The session's cutoff as the write found it: compaction may have moved it since the read.
    let cutoff: string | null = null;
    const written = await withTransaction(deps.db, async (tx) => {
      const s = await lockSessionForVectors(tx, tenantId, sessionId);
      if (!s || s.generation !== page.generation) return null;
      cutoff = s.start_seq;
      const n = await insertSessionVectors(tx, {
        tenantId,
        sessionId,
        startSeq: s.start_seq,
        model: embedder.model,
        dimensions: embedder.dimensions,
        items,
      });
      await insertVectorSkips(tx, {
        model: embedder.model,
        items: skips.map((k) => ({ tenantId, sessionId, seq: k.seq, reason: k.reason })),
      });
      return n;
    });
    // Reset or deleted meanwhile: the next job (the hook enqueues one per archived batch) starts over.
    if (written === null) return total;
    total.written += written;
    total.skipped += skips.length;
    // The local embedder's skips (`no_features`: "👍") are the text's, not a refusal.
    if (!embedder.local) for (const s of refused) onRefused?.(s);
    if (written === 0 && items.length > 0) {
      const index = await getVectorIndex(deps.db);
      if (!index) {
        // Not recorded: the process started on a read-only database (ensureVectorIndex). Recorded
        // now, and the batch embedded again by the next round.
        await initVectorIndex(deps.db, embedder.model, embedder.dimensions);
        continue;
      }
      if (index.model !== embedder.model || index.dimensions !== embedder.dimensions) {
        throw new UnrecoverableError(
          `the recent index now holds ${index.model}/${index.dimensions} vectors but this process embeds with ` +
            `${embedder.model}/${embedder.dimensions}: restart it with the new EMBEDDING_MODEL/EMBEDDING_DIMENSIONS`,
        );
      }
      // Everything fell below a cutoff that moved meanwhile (a compaction committed between the
      // read and the write): the rows now past the cutoff are read again. Returning here left the
      // new hot tail without vectors until the embed sweep, minutes later, when the session went
      // quiet.
      // (The page comes in seq order: its first row is its lowest.)
      if (cutoff !== null && BigInt(cutoff) > BigInt(items[0]!.seq)) continue;
      return total;
    }
    if (page.rows.length < limit) return total;
  }
  total.more = true;
  return total;
}

/** How long a deferred embed job waits before it looks at the ingest backlog again. */
const DEFER_STEP_MS = 1000;
/** How long one look at the backlog is reused (many embed jobs ask at once). */
const BEHIND_TTL_MS = 250;

/** `archivingBehind`, asked of Redis at most every BEHIND_TTL_MS; an error counts as not behind. */
function archivingBehindCached(deps: Pick<CoreDeps, 'redis' | 'config'>): () => Promise<boolean> {
  let askedAt = -Infinity;
  let answer = Promise.resolve(false);
  return () => {
    if (Date.now() - askedAt >= BEHIND_TTL_MS) {
      askedAt = Date.now();
      answer = archivingBehind(deps.redis, deps.config.prefix, deps.config.embedDeferBehindMs).catch(
        () => false,
      );
    }
    return answer;
  };
}

/**
 * The embed job processor. Archiving goes first: while archiving is behind (some session's
 * accepted messages have waited more than EMBED_DEFER_BEHIND_MS for their drain: a burst beyond
 * the workers' pace), an embed job created less than EMBED_MAX_DEFER_MS ago goes back to the delayed
 * set for a second instead of taking CPU and connections from the durable write that clients
 * wait for. The recent index catches up when the backlog is gone, and a vector never waits longer
 * than that bound for it. The deduplicated job still covers every later batch of its session: it
 * embeds whatever has no vector when it runs.
 */
export function makeEmbedProcessor(
  deps: Pick<CoreDeps, 'db' | 'config' | 'queues' | 'redis' | 'logger'>,
  embedder: Embedder,
  onResult?: (r: EmbedSessionResult) => void,
) {
  const behind = archivingBehindCached(deps);
  // A message skipped for good is visible: a warning (throttled: a flood of refusals is one line a
  // few seconds, counting the rest) and mnemos_embeddings_skipped_total (onResult).
  const warnRefused = throttledWarn(deps.logger, 'embeddings endpoint refused a message: it gets no vector');
  return async (job: Job, token?: string): Promise<{ written: number; skipped: number }> => {
    const p = parsePayload('embed', job.data);
    const maxDefer = deps.config.embedMaxDeferMs;
    if (token && maxDefer > 0 && Date.now() - job.timestamp < maxDefer && (await behind())) {
      await job.moveToDelayed(Date.now() + Math.min(DEFER_STEP_MS, maxDefer), token);
      throw new DelayedError();
    }
    // p.generation is informational: a deduplicated job may carry an older generation than the
    // session's, so the work always follows the generation read from Postgres.
    let r: EmbedSessionResult;
    try {
      r = await embedSession(deps, embedder, p.tenantId, p.sessionId, (s) =>
        warnRefused({
          tenantId: p.tenantId,
          sessionId: p.sessionId,
          seq: Number(s.seq),
          reason: s.reason,
          model: embedder.model,
        }),
      );
    } catch (err) {
      // Outages (429, 5xx, timeouts) retry with the queue's backoff; the rest cannot get better.
      if (err instanceof LlmError && !err.retryable) throw new UnrecoverableError(err.message);
      throw err;
    }
    onResult?.(r);
    // Kept as the session's one pending job and created when this one ends (keepLastIfActive).
    if (r.more) await enqueueEmbed(deps.queues, p);
    return { written: r.written, skipped: r.skipped };
  };
}
