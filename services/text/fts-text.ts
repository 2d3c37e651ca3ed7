/**
 * Text preparation for the archive's tsvector. Postgres's parsers do not segment Chinese,
 * Japanese or Korean, so CJK runs are indexed as overlapping character bigrams beside the stemmed
 * English lexemes of the rest of the text. The bigrams are built here and sent as tsvector text
 * (no parser or dictionary involved), and searches build their CJK tsqueries the same way
 * (services/search/parse-query.ts), so the two cannot disagree.
 *
 * No accepted message may produce a tsvector over Postgres's 1 MB of lexemes (the drain's INSERT
 * would fail on every attempt). The CJK part is capped here: 32k CJK characters make at most 32k
 * bigrams (~390 KB worst case). The English part is the whole text (up to FTS_EN_MAX UTF-16
 * units, a bound on work: content is at most 1 MiB): the database indexes the first FTS_EN_SAFE
 * characters instead when the whole would not fit (migration 011), and 64k characters of
 * non-CJK text make at most ~32k lexemes (~400 KB worst case). Until 2026-12-01 the English part
 * was always cut at FTS_EN_SAFE, and the end of a long message was never found by full text.
 */

import { isHighSurrogate, isLowSurrogate } from './code-points.js';

export const FTS_EN_MAX = 1_048_576;
export const FTS_EN_SAFE = 65_536;
export const FTS_CJK_CAP = 32_768;

/**
 * A character of Chinese, Japanese or Korean text: the four scripts, plus the few letters that
 * belong to them but are filed under script Common (the katakana prolonged sound mark ー and its
 * half-width form, the half-width voiced sound marks, 〆, 〼, the kana repeat marks), so that they
 * stay inside their words: `サーバー` was cut at every ー and never found by full text. (Matching
 * on script extensions instead cost 3× the time for every message, CJK or not.)
 */
const CJK_CLASS = String.raw`\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}\u3006\u3031-\u3035\u303C\u30FC\uFF70\uFF9E\uFF9F`;
const CJK_CHAR = new RegExp(`[${CJK_CLASS}]`, 'u');
/** A run of CJK characters (global: use with matchAll or replace). */
export const CJK_RUN = new RegExp(`[${CJK_CLASS}]+`, 'gu');
/** The highest position a tsvector records (Postgres clamps larger ones to it). */
const MAX_TS_POSITION = 16_383;

export const hasCjk = (s: string) => CJK_CHAR.test(s);

/**
 * The lexemes of every CJK run, run by run: overlapping bigrams, or the character itself for a
 * run of one; at most `capChars` characters in all.
 */
function* cjkRunLexemes(text: string, capChars: number): Generator<string[]> {
  let budget = capChars;
  for (const m of text.matchAll(CJK_RUN)) {
    if (budget <= 0) return;
    const chars = Array.from(m[0]).slice(0, budget);
    budget -= chars.length;
    if (chars.length === 1) yield chars;
    else yield chars.slice(1).map((c, i) => chars[i]! + c);
  }
}

/**
 * Positions left out between two CJK runs in the stored tsvector: a run's phrase never matches
 * across into the next run, and a quoted phrase of several runs follows each run by the next at
 * this distance plus one (parse-query.ts). Stored in every CJK row's tsvector: a change needs them
 * all re-derived.
 */
export const CJK_RUN_GAP = 1;

/**
 * The CJK half of the stored tsvector, as tsvector text: the bigrams of `cjkBigrams` with their
 * positions, CJK_RUN_GAP positions left out between two runs, so that a phrase never matches
 * across them (`東京都` matched "東京。京都" when the runs' bigrams were indexed side by side). Its
 * lexemes are letters of these scripts only, never a quote or a backslash, so they need no
 * escaping.
 */
export function cjkTsvector(text: string, capChars: number): string {
  const out: string[] = [];
  let pos = 0;
  for (const lexemes of cjkRunLexemes(text, capChars)) {
    if (out.length > 0) pos += CJK_RUN_GAP;
    for (const l of lexemes) out.push(`'${l}':${Math.min(++pos, MAX_TS_POSITION)}`);
  }
  return out.join(' ');
}

/** Overlapping bigrams of every CJK run; a run of one character is kept as a unigram. */
export function cjkBigrams(text: string, capChars = Infinity): string[] {
  return [...cjkRunLexemes(text, capChars)].flat();
}

/**
 * `s` cut to at most `max` UTF-16 code units, never between the two halves of a surrogate pair: a
 * lone half is not valid JSON for Postgres (`invalid input syntax for type json`), so a cut through
 * an emoji once made the drain's INSERT fail on every attempt, and the session stop archiving.
 */
export function cutUnits(s: string, max: number): string {
  if (s.length <= max) return s;
  const last = s.charCodeAt(max - 1);
  return s.slice(0, isHighSurrogate(last) ? max - 1 : max);
}

/**
 * At most `max` UTF-16 units of `s`: all of it, or its head and its tail joined by a newline (never
 * splitting a surrogate pair). For text whose telling part may be at either end: a stack trace
 * starts with where it was thrown and ends with the error itself.
 */
export function headAndTailUnits(s: string, max: number): string {
  if (s.length <= max) return s;
  const head = cutUnits(s, Math.floor((max - 1) / 2));
  let from = s.length - (max - 1 - head.length);
  if (isLowSurrogate(s.charCodeAt(from))) from++;
  return `${head}\n${s.slice(from)}`;
}

/**
 * Text as full text indexes and queries it: Unicode compatibility forms unified (NFKC: full-width
 * `ＧＰＵ` is `GPU`, half-width `ｻｰﾊﾞｰ` is `サーバー`, and a word typed decomposed, `Tiếng` as
 * e + two combining marks, is the composed word), invisible format characters dropped or made word
 * breaks (COMPAT_SYMBOL), and Greek final sigma `ς` as `σ`, which is what
 * Postgres lower-cases `Σ` to. Without it a search in one form missed messages in the other
 * (2026-12-02). Accents are kept: `café` and `cafe` stay two words. Both the archive's tsvector
 * (ftsDocument) and the query's leaves (parse-query.ts) go through it.
 */
export function foldForIndex(text: string): string {
  // ASCII is its own NFKC form (most messages): one test instead of a copy.
  if (!/[\u0080-\uffff]/.test(text)) return text;
  const n = text.replace(COMPAT_SYMBOL, spacedForm).normalize('NFKC');
  return n.includes('ς') ? n.replaceAll('ς', 'σ') : n;
}

/**
 * Symbols and number forms whose compatibility form is letters or digits (`™` TM, `²` 2, `½`
 * 1⁄2, `①` 1, `㍿` 株式会社) become that form between spaces: NFKC alone glued them to the word
 * before, and `Acme™` was indexed as the word `acmetm`, `km²` as `km2`, `1½` as `11`, so `Acme` and
 * `km` no longer found them and `11` did. (Letters keep their place: full-width `ＧＰＵ` is `GPU`.)
 *
 * Invisible format characters (general category Cf) are decided here too, not left to the
 * database's parser, which embedded PGlite (Postgres 18) and Postgres 15 read differently: 15
 * splits a word at every one, PGlite at none, so `خواهم` of Persian `می‌خواهم` (ZWNJ) was found by
 * full text on Postgres only (2026-12-03). Those that only mark where a line may or may not break
 * inside a word (soft hyphen, word joiner, zero-width no-break space) are dropped, so `software`
 * finds `soft\u00adware`; every other one (ZWNJ, ZWJ, zero-width space, bidirectional marks) is a word
 * break.
 */
const COMPAT_SYMBOL = /[\p{No}\p{S}\p{Cf}]/gu;
/** The format characters dropped inside a word (a query does not split its words at them either). */
export const IN_WORD_FORMAT = /[\u00ad\u2060\ufeff]/;
const spacedForm = (c: string): string => {
  if (/\p{Cf}/u.test(c)) return IN_WORD_FORMAT.test(c) ? '' : ' ';
  const n = c.normalize('NFKC');
  return n === c ? c : ` ${n} `;
};

/**
 * The two inputs of the stored tsvector: `to_tsvector('english', en) || cjk::tsvector`, the CJK
 * half first for an English input over FTS_EN_SAFE bytes (ARCHIVE_TSVECTOR_SQL, migration 011),
 * both of the folded text (foldForIndex).
 */
export function ftsDocument(raw: string): { en: string; cjk: string } {
  const text = foldForIndex(raw);
  const cap = (s: string) => cutUnits(withCompoundParts(s), FTS_EN_MAX);
  // Most messages have no CJK: one scan instead of three.
  if (!hasCjk(text)) return { en: cap(text), cjk: '' };
  return { en: cap(text.replace(CJK_RUN, ' ')), cjk: cjkTsvector(text, FTS_CJK_CAP) };
}

/**
 * Words joined by `.`, `/` or `@` with no space: Postgres's parser reads the whole run as one
 * token (a host, file, URL or e-mail address: `java.lang.NullPointerException`,
 * `/app/worker/tasks.py`, `ops-team@example.org`), so full text found none of its words alone, and
 * once a message left the recent part (whose substring match does find them) `NullPointerException`,
 * `tasks` or `example` no longer found it. A compound here is a whitespace-delimited token with
 * such a separator between two other characters (the lookbehind starts a match only at a token's
 * start: without it the scan retried at every character of every word, 34 µs per message).
 */
const COMPOUND = /(?<!\S)\S*?[^\s./@][./@]+[^\s./@]\S*/g;
const SEGMENT_SEPARATOR = /[/@]+/;
// A letter, or any non-ASCII character (the parser decides what it is).
const HAS_LETTER = /[A-Za-z\u0080-\uffff]/;

/**
 * The parts of the text's compounds (COMPOUND) that full text would not see alone: those of at
 * least two characters with a letter (not the `e` and `g` of `e.g.`, nor the digits of `3.5` or an
 * address), each compound's after the text and apart from it (PART_GAP). After it, so that the
 * text's own phrases keep their positions.
 */
export function compoundParts(text: string): string {
  let out = '';
  for (const [compound] of text.matchAll(COMPOUND)) {
    const parts: string[] = [];
    // A path's or address's segments first, whole (`tasks.py` of `/app/worker/tasks.py`, which
    // the parser then reads as a file name of its own), then their dotted words.
    const segments = compound.split(SEGMENT_SEPARATOR);
    for (const segment of segments) {
      if (segments.length > 1 && segment.includes('.')) keep(parts, segment);
      for (const word of segment.split('.')) keep(parts, word);
    }
    if (parts.length > 0) out += `${PART_GAP}${parts.join(' ')}`;
  }
  return out;
}

/**
 * Stop words take positions in a tsvector and give no lexeme: between the text and each
 * compound's parts they keep a quoted phrase from matching across (`"module foo"` matched "foo.bar
 * module" through the parts that followed the text; a query's own stop words allow a gap of one
 * or two, this is five).
 */
const PART_GAP = '\nthe the the the\n';

function keep(parts: string[], part: string): void {
  if (part.length >= 2 && HAS_LETTER.test(part)) parts.push(part);
}

/** `text` and its compounds' parts (compoundParts). */
export function withCompoundParts(text: string): string {
  // Most text has no separator before a word character: one cheap test instead of the scan.
  if (!SEPARATOR_BEFORE_WORD.test(text)) return text;
  return text + compoundParts(text);
}
const SEPARATOR_BEFORE_WORD = /[./@][^\s./@]/;
