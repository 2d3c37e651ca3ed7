import { oneLine } from '../text/one-line.js';
import { classifyError, significantTerms } from './normalise.js';
import type { ErrorClass, ErrorRecord, Outcome, StoredError } from './types.js';
import {
  codePoints,
  isHighSurrogate,
  isLowSurrogate,
  lastCodePoints,
  takeCodePoints,
} from '../text/code-points.js';

/**
 * Ranking without a search module: a record matches when it shares at least one significant
 * term with the query; relevance weighs where the shared terms sit (keywords > symptom > cause >
 * action) and how much of the query they cover, plus small boosts for the error class, a tool
 * named in the query, and embedding cosine. Relevance is compared in buckets of 0.05 so that
 * near-equal candidates fall through to outcome, hits and recency.
 */

export const MAX_QUERY_TERMS = 32;
export const MAX_INDEXED_TERMS = 256;
/**
 * Index terms a record's keywords, cause and action each get before the symptom takes the rest
 * (at least 96); what a field leaves of its share goes to the others.
 */
const KEYWORD_SHARE = 64;
const CAUSE_SHARE = 48;
const ACTION_SHARE = 48;

/** At most `max` terms: all of them, or the first and last halves when there are more. */
function headAndTail(terms: readonly string[], max: number): string[] {
  if (terms.length <= max) return [...terms];
  const head = Math.ceil(max / 2);
  return [...terms.slice(0, head), ...terms.slice(terms.length - (max - head))];
}

export type RankQuery = {
  terms: string[];
  errorClass: ErrorClass;
  /** Set when the caller filtered by tool (every candidate already matches it). */
  toolName: string | undefined;
  vector: number[] | null;
};

export function buildQuery(
  text: string,
  toolName: string | undefined,
  embed: ((text: string) => number[]) | undefined,
): RankQuery {
  return {
    // Both ends: a JS stack trace puts the message first, a Python traceback puts it last.
    terms: headAndTail(significantTerms(text, Infinity, true), MAX_QUERY_TERMS),
    errorClass: classifyError(text),
    toolName,
    vector: embed ? embed(text) : null,
  };
}

/**
 * The most of a field, in code points after NFKC, that the index and ranking read: all of it, or
 * its first and last halves. Ranking reads every fetched record (up to MAX_FETCHED per lookup),
 * so its work per record must not grow with the text: NFKC makes one character up to 18
 * (U+FDFA), and CJK text gives a term per character. The API takes a symptom, cause or action
 * of up to 4,000 characters, so one is read whole unless NFKC expands it (a record's keywords, up
 * to 32 of 64 characters, may be a little longer).
 */
export const FIELD_CHARS = 4000;
/** UTF-16 units normalised at a time, so that NFKC is applied to little more than is read. */
const NFKC_PIECE = 256;

/**
 * NFKC of the start of `text`, a piece at a time until it has at least `units` UTF-16 units, and
 * whether that took all of `text`. A combining mark cut from its base by a piece boundary is put
 * back by the NFKC that significantTerms applies to the whole again.
 */
function nfkcHead(text: string, units: number): { norm: string; all: boolean } {
  let norm = '';
  let i = 0;
  while (i < text.length && norm.length < units) {
    let j = Math.min(text.length, i + NFKC_PIECE);
    if (j < text.length && isHighSurrogate(text.charCodeAt(j - 1))) j++;
    norm += text.slice(i, j).normalize('NFKC');
    i = j;
  }
  return { norm, all: i === text.length };
}

/** As nfkcHead, from the end of `text`. */
function nfkcTail(text: string, units: number): string {
  let norm = '';
  let i = text.length;
  while (i > 0 && norm.length < units) {
    let j = Math.max(0, i - NFKC_PIECE);
    if (j > 0 && isLowSurrogate(text.charCodeAt(j))) j--;
    norm = text.slice(j, i).normalize('NFKC') + norm;
    i = j;
  }
  return norm;
}

/** A field as the index and ranking read it: NFKC of it, cut to its two ends past FIELD_CHARS. */
function fieldText(text: string): string {
  // Two units per code point at most, so a field of FIELD_CHARS code points is read to its end.
  const head = nfkcHead(text, 2 * FIELD_CHARS + 1);
  if (head.all && codePoints(head.norm) <= FIELD_CHARS) return head.norm;
  const half = FIELD_CHARS / 2;
  // The space keeps the ends from joining into a word or a CJK bigram that is not in the text.
  return `${takeCodePoints(head.norm, half)} ${lastCodePoints(nfkcTail(text, 2 * half), half)}`;
}

type FieldTerms = { keywords: Set<string>; symptom: Set<string>; cause: Set<string>; action: Set<string> };

/**
 * The terms of each field that the index and ranking use: of a field's text as fieldText reads
 * it, the first MAX_INDEXED_TERMS terms, and of the symptom also the last MAX_INDEXED_TERMS. That
 * covers whatever indexTerms takes from the field, so ranking still sees every term a record is
 * found through and the index is what it was: indexTerms takes at most MAX_INDEXED_TERMS terms
 * of a record, the first ones of keywords, cause and action, and of the symptom a head and a tail
 * after at most KEYWORD_SHARE + CAUSE_SHARE + ACTION_SHARE (160) terms of the others, which lie
 * within its first and last (256 + 160) / 2 = 208 terms.
 */
function fieldTerms(rec: StoredError): FieldTerms {
  const first = (text: string) => new Set(significantTerms(fieldText(text), MAX_INDEXED_TERMS));
  return {
    keywords: first(rec.keywords.join(' ')),
    symptom: new Set(headAndTail(significantTerms(fieldText(rec.symptom)), 2 * MAX_INDEXED_TERMS)),
    cause: first(rec.cause ?? ''),
    action: first(rec.action),
  };
}

/**
 * The terms a record is indexed under, at most MAX_INDEXED_TERMS, each field with its share so
 * that no long field crowds the others out: keywords, cause and action up to their shares, then
 * the head and tail of the symptom, then the rest of keywords, cause and action.
 * A function of the record alone: a merge recomputes the old set to drop what it no longer has.
 */
export function indexTerms(rec: StoredError): string[] {
  const f = fieldTerms(rec);
  const out = new Set<string>();
  const add = (terms: Iterable<string>, share: number) => {
    let left = share;
    for (const t of terms) {
      if (left <= 0 || out.size >= MAX_INDEXED_TERMS) return;
      if (!out.has(t)) {
        out.add(t);
        left--;
      }
    }
  };
  add(f.keywords, KEYWORD_SHARE);
  add(f.cause, CAUSE_SHARE);
  add(f.action, ACTION_SHARE);
  const symptom = [...f.symptom].filter((t) => !out.has(t));
  add(headAndTail(symptom, MAX_INDEXED_TERMS - out.size), MAX_INDEXED_TERMS);
  add(f.keywords, MAX_INDEXED_TERMS);
  add(f.cause, MAX_INDEXED_TERMS);
  add(f.action, MAX_INDEXED_TERMS);
  return [...out];
}

const WEIGHTS = { keywords: 3, symptom: 2, cause: 1.5, action: 1 } as const;
const MAX_WEIGHT = 3;

function cosine(a: readonly number[], b: readonly number[]): number {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let i = 0; i < Math.min(a.length, b.length); i++) {
    const x = a[i] ?? 0;
    const y = b[i] ?? 0;
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  return na === 0 || nb === 0 ? 0 : dot / Math.sqrt(na * nb);
}

/** Relevance in [0, ~1.6], or null when the record shares no significant term with the query. */
export function relevance(rec: StoredError, q: RankQuery): number | null {
  if (q.terms.length === 0) return null;
  const f = fieldTerms(rec);
  let matched = 0;
  let weighted = 0;
  for (const t of q.terms) {
    let w = 0;
    for (const field of ['keywords', 'symptom', 'cause', 'action'] as const) {
      if (f[field].has(t)) w = Math.max(w, WEIGHTS[field]);
    }
    if (w > 0) {
      matched++;
      weighted += w;
    }
  }
  if (matched === 0) return null;
  let score = 0.5 * (matched / q.terms.length) + 0.5 * (weighted / (MAX_WEIGHT * q.terms.length));
  if (q.errorClass !== 'other' && q.errorClass === rec.error_class) score += 0.15;
  if (q.toolName === undefined) {
    const toolTerms = significantTerms(rec.tool_name);
    if (toolTerms.length > 0 && toolTerms.every((t) => q.terms.includes(t))) score += 0.2;
  }
  if (q.vector && rec.embedding) score += 0.25 * Math.max(0, cosine(q.vector, rec.embedding));
  return score;
}

const OUTCOME_ORDER: Record<Outcome, number> = { resolved: 0, failed: 1, abandoned: 2 };

/**
 * Ranks `records` for `q`. `exact` is the record of exactly the searched text (its tool's dedupe
 * key: the same normalised symptom): it matches even when the text has no significant term
 * (`127.0.0.1:5432`, `第12行`), ranked as one that shares them all.
 */
export function rankRecords(
  records: readonly StoredError[],
  q: RankQuery,
  limit: number,
  exact: string | null = null,
): StoredError[] {
  const scored: Array<{ rec: StoredError; bucket: number }> = [];
  for (const rec of records) {
    if (q.toolName !== undefined && rec.tool_name !== q.toolName) continue;
    const r = relevance(rec, q) ?? (rec.id === exact ? 1 : null);
    if (r !== null) scored.push({ rec, bucket: Math.round(r * 20) });
  }
  scored.sort(
    (a, b) =>
      b.bucket - a.bucket ||
      OUTCOME_ORDER[a.rec.outcome] - OUTCOME_ORDER[b.rec.outcome] ||
      b.rec.hits - a.rec.hits ||
      b.rec.last_hit_ms - a.rec.last_hit_ms ||
      b.rec.created_ms - a.rec.created_ms ||
      (a.rec.id < b.rec.id ? -1 : a.rec.id > b.rec.id ? 1 : 0),
  );
  return scored.slice(0, limit).map((s) => s.rec);
}

export function toApiRecord(rec: StoredError): ErrorRecord {
  return {
    id: rec.id,
    tool_name: rec.tool_name,
    symptom: rec.symptom,
    cause: rec.cause,
    action: rec.action,
    outcome: rec.outcome,
    keywords: rec.keywords,
    hits: rec.hits,
    created_at: new Date(rec.created_ms).toISOString(),
    last_hit_at: new Date(rec.last_hit_ms).toISOString(),
  };
}

export const RELATED_MAX_RECORDS = 4;
export const RELATED_MAX_CHARS = 1500;

function clip(text: string, max: number): string {
  const flat = oneLine(text);
  const chars = Array.from(flat);
  return chars.length <= max ? flat : `${chars.slice(0, max - 1).join('')}…`;
}

// Field lengths (tool, symptom, action, cause), from roomy to tight: the roomiest that lets
// every record fit is used. The tightest always fits four records in RELATED_MAX_CHARS: a line
// is at most 36 characters of its own plus 32 + 80 + 140 + 60 clipped, 4 × 348 + 3 ≤ 1,500.
const CLIP_LEVELS = [
  [64, 240, 480, 200],
  [48, 160, 300, 120],
  [40, 120, 200, 90],
  [32, 80, 140, 60],
] as const;

function relatedLines(records: readonly StoredError[], level: (typeof CLIP_LEVELS)[number]): string[] {
  const [tool, symptom, action, cause] = level;
  return records.map((rec) => {
    const why = rec.cause ? ` (cause: ${clip(rec.cause, cause)})` : '';
    const verb = rec.outcome === 'resolved' ? 'fix' : 'tried';
    return `- [${rec.outcome}] ${clip(rec.tool_name, tool)}: ${clip(rec.symptom, symptom)} → ${verb}: ${clip(rec.action, action)}${why}`;
  });
}

/**
 * The hint appended to a failed tool result: one line per record, best first, at most
 * RELATED_MAX_RECORDS lines and RELATED_MAX_CHARS characters; exactly `NONE` when nothing matched.
 */
export function renderRelated(records: readonly StoredError[]): string {
  const top = records.slice(0, RELATED_MAX_RECORDS);
  if (top.length === 0) return 'NONE';
  let text = '';
  for (const level of CLIP_LEVELS) {
    text = relatedLines(top, level).join('\n');
    if (codePoints(text) <= RELATED_MAX_CHARS) break;
  }
  return text;
}
