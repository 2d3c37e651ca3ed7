import {
  archiveKeysAfter,
  archiveTexts,
  loadPass,
  rederiveTsvectors,
  savePass,
} from '../../db/queries/fts-backfill.js';
import { DRAIN_MAX_BYTES, ftsColumns, searchableText } from '../../workers/ingest.js';
import type { CoreDeps } from '../deps.js';
import { hasCjk } from '../text/fts-text.js';

export const FTS_CJK_PASS = 'fts-cjk-v2';

/**
 * One run of the `fts-backfill` maintenance task: re-derives the tsvector of archive rows that
 * hold CJK text, which rows archived before 2026-12-01 got without the position gap between CJK
 * runs and with the katakana prolonged sound mark (ー) as a word break, so that today's queries
 * would miss `サーバー` in them. Walks the archive in primary-key order, `batch` rows (and at most
 * 16 MiB of messages) at a time, at most `maxBatches` per run, and records where it stopped
 * (migration 010); once through, it is done and every later run is one SELECT. Rows archived
 * since are derived the same way already: re-deriving them changes nothing.
 */
export async function backfillCjkTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: { batch?: number; maxBatches?: number; maxBytes?: number } = {},
): Promise<{ scanned: number; updated: number; done: boolean }> {
  const out = { scanned: 0, updated: 0, done: true };
  const pass = await loadPass(deps.db, FTS_CJK_PASS);
  if (!pass || pass.done) return out;
  let cursor = pass.cursor;
  for (let i = 0; i < (opts.maxBatches ?? 50); i++) {
    const keys = await archiveKeysAfter(deps.db, cursor, opts.batch ?? 1000);
    if (keys.length === 0) {
      await savePass(deps.db, FTS_CJK_PASS, cursor, true);
      deps.logger.info(out, 'full-text backfill of CJK rows done');
      return out;
    }
    // Messages of up to 1 MiB each: read no more than a drain writes at once (at least one).
    let size = 0;
    const take = keys.filter((k, j) => (size += k.bytes) <= (opts.maxBytes ?? DRAIN_MAX_BYTES) || j === 0);
    const rows = await archiveTexts(deps.db, take);
    const cjk = rows.flatMap((r) => {
      const text = searchableText(r);
      if (!hasCjk(text)) return [];
      const { tenant_id, session_id, seq, content } = r;
      return [{ tenant_id, session_id, seq, content, ...ftsColumns(text, content) }];
    });
    out.updated += await rederiveTsvectors(deps.db, cjk);
    out.scanned += take.length;
    const last = take[take.length - 1]!;
    cursor = { tenant_id: last.tenant_id, session_id: last.session_id, seq: last.seq };
    await savePass(deps.db, FTS_CJK_PASS, cursor, false);
  }
  return { ...out, done: false };
}
