import {
  archiveKeysAfter,
  archiveTexts,
  loadPass,
  rederiveTsvectors,
  savePass,
} from '../../db/queries/fts-backfill.js';
import { DRAIN_MAX_BYTES, ftsColumns, searchableText } from '../../workers/ingest.js';
import type { CoreDeps } from '../deps.js';
import { FTS_EN_SAFE, compoundParts, foldForIndex, hasCjk } from '../text/fts-text.js';

export const FTS_CJK_PASS = 'fts-cjk-v2';
export const FTS_LONG_PASS = 'fts-long-v3';
// v6 (migration 016): numbers as written and every value of a repeated key; v4 (014) left behind.
export const FTS_ARGS_PASS = 'fts-args-v6';
export const FTS_FOLD_PASS = 'fts-fold-v5';
export const FTS_COMPOUND_PASS = 'fts-compound-v7';
export const FTS_FORMAT_PASS = 'fts-format-v8';

interface BackfillOptions {
  batch?: number;
  maxBatches?: number;
  maxBytes?: number;
}

type BackfillResult = { scanned: number; updated: number; done: boolean };

/**
 * One run of the first pass of the `fts-backfill` maintenance task: re-derives the tsvector of
 * archive rows that hold CJK text, which rows archived before 2026-12-01 got without the position
 * gap between CJK runs and with the katakana prolonged sound mark (ー) as a word break, so that
 * today's queries would miss `サーバー` in them.
 */
export function backfillCjkTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, { name: FTS_CJK_PASS, what: 'CJK rows', minBytes: 0, wants: hasCjk });
}

/**
 * The second pass: rows whose searchable text is longer than FTS_EN_SAFE, whose English part was
 * cut there before 2026-12-01 (services/text/fts-text.ts), get their whole text indexed. A row's
 * `bytes` (its stored JSON) is at least its searchable text's length, so only rows above that
 * size are read.
 */
export function backfillLongTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, {
    name: FTS_LONG_PASS,
    what: 'long rows',
    minBytes: FTS_EN_SAFE + 1,
    wants: (text) => text.length > FTS_EN_SAFE,
  });
}

/**
 * The third pass: rows with tool calls, whose arguments were indexed as raw JSON before
 * 2026-12-02 (escapes glued to the next word), or through JSON.parse (numbers rounded, a repeated
 * key's first value lost), get them indexed as their decoded keys and values as written
 * (`argumentsText` in workers/ingest.ts). Only rows with tool calls are read.
 */
export function backfillToolCallTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, {
    name: FTS_ARGS_PASS,
    what: 'rows with tool calls',
    minBytes: 0,
    callsOnly: true,
    wants: () => true,
  });
}

/**
 * The fourth pass: rows whose searchable text full text now reads folded (foldForIndex: NFKC,
 * final sigma), which rows archived before 2026-12-02 were indexed without, so that `GPU` missed
 * `ＧＰＵ` in them. Every row is read; only those the folding changes are written.
 */
export function backfillFoldedTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, {
    name: FTS_FOLD_PASS,
    what: 'rows with compatibility forms',
    minBytes: 0,
    wants: (text) => foldForIndex(text) !== text,
  });
}

/**
 * The fifth pass: rows whose searchable text has compounds (`java.lang.NullPointerException`,
 * `tasks.py`, `ops-team@example.org`), which rows archived before 2026-12-02 were indexed with as
 * one token only, get the compounds' parts indexed as words too (compoundParts). Every row is
 * read; only those with compounds are written.
 */
export function backfillCompoundTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, {
    name: FTS_COMPOUND_PASS,
    what: 'rows with compounds',
    minBytes: 0,
    wants: (text) => compoundParts(foldForIndex(text)) !== '',
  });
}

/**
 * The sixth pass: rows whose searchable text has invisible format characters (a soft hyphen, a
 * ZWNJ, a zero-width space), which full text now reads the same on Postgres and embedded PGlite
 * (foldForIndex) and which rows archived before 2026-12-03 were indexed with as the database's
 * parser read them. Every row is read; only those with such a character are written.
 */
export function backfillFormatTsvectors(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions = {},
): Promise<BackfillResult> {
  return backfillPass(deps, opts, {
    name: FTS_FORMAT_PASS,
    what: 'rows with format characters',
    minBytes: 0,
    wants: (text) => FORMAT_CHAR.test(text),
  });
}
const FORMAT_CHAR = /\p{Cf}/u;

/**
 * A pass walks the archive in primary-key order, `batch` rows (and at most 16 MiB of messages) at
 * a time, at most `maxBatches` per run, and records where it stopped (maintenance_state,
 * migrations 010 and 011); once through, it is done and every later run is one SELECT. Rows
 * this version archives are derived the same way already: re-deriving them changes nothing. (A
 * worker of an older version still running beside it writes the old form; the README's
 * "Upgrading" says how to run the passes again after such a mixed period.)
 */
async function backfillPass(
  deps: Pick<CoreDeps, 'db' | 'logger'>,
  opts: BackfillOptions,
  p: {
    name: string;
    what: string;
    minBytes: number;
    callsOnly?: boolean;
    wants: (text: string) => boolean;
  },
): Promise<BackfillResult> {
  const out = { scanned: 0, updated: 0, done: true };
  const pass = await loadPass(deps.db, p.name);
  if (!pass || pass.done) return out;
  let cursor = pass.cursor;
  for (let i = 0; i < (opts.maxBatches ?? 50); i++) {
    const keys = await archiveKeysAfter(deps.db, cursor, opts.batch ?? 1000);
    if (keys.length === 0) {
      await savePass(deps.db, p.name, cursor, true);
      deps.logger.info(out, `full-text backfill of ${p.what} done`);
      return out;
    }
    // Messages of up to 1 MiB each: read no more than a drain writes at once (at least one).
    let size = 0;
    const take = keys.filter((k, j) => (size += k.bytes) <= (opts.maxBytes ?? DRAIN_MAX_BYTES) || j === 0);
    const candidates = take.filter((k) => k.bytes >= p.minBytes && (!p.callsOnly || k.calls));
    const rows = candidates.length > 0 ? await archiveTexts(deps.db, candidates) : [];
    const wanted = rows.flatMap((r) => {
      const text = searchableText(r);
      if (!p.wants(text)) return [];
      const { tenant_id, session_id, seq, content } = r;
      return [{ tenant_id, session_id, seq, content, ...ftsColumns(text, content) }];
    });
    out.updated += await rederiveTsvectors(deps.db, wanted);
    out.scanned += take.length;
    const last = take[take.length - 1]!;
    cursor = { tenant_id: last.tenant_id, session_id: last.session_id, seq: last.seq };
    await savePass(deps.db, p.name, cursor, false);
  }
  return { ...out, done: false };
}
