import { CJK_RUN, CJK_RUN_GAP, IN_WORD_FORMAT, cjkBigrams, foldForIndex } from '../text/fts-text.js';

/**
 * Web-search syntax for keyword search, parsed here instead of by Postgres's
 * `websearch_to_tsquery`, because that function does not segment CJK text and we must build the
 * CJK part of the query from the same bigrams the archive's tsvector was built from.
 *
 * Syntax (any input is accepted; nothing here can fail):
 * - words are ANDed: `deploy database`
 * - `"exact phrase"` (an unclosed quote runs to the end of the query)
 * - `a or b` (case-insensitive); `or` binds tighter than the implicit AND, as in web search:
 *   `deploy db or database` = deploy AND (db OR database)
 * - `-word` / `-"a phrase"` excludes; a lone `-`, a leading/trailing/repeated `or`, and an `or`
 *   next to an excluded term are ignored
 * - the syntax may be typed full-width (`－`, `＂`, `ＯＲ`, as CJK input methods give them), with a
 *   minus sign `−` or with typographic quotes `“…”` / `„…“` (SYNTAX_FORMS); a `”` right after a
 *   letter or digit opens no phrase (INCH_MARK)
 */

export interface QueryTerm {
  text: string;
  phrase: boolean;
}

export interface ParsedQuery {
  /** AND of groups; each group is an OR of terms. */
  groups: QueryTerm[][];
  exclude: QueryTerm[];
  /** Excluded terms past MAX_KEYWORD_TERMS: not tested, so the search cannot honour them. */
  excludedPastLimit: number;
  /** The positive terms as plain text, for embedding (semantic search ignores the syntax). */
  embedText: string;
}

/** Terms beyond this many are ignored by keyword search (they still go into embedText). */
export const MAX_KEYWORD_TERMS = 64;

interface Token {
  kind: 'term' | 'or';
  text: string;
  phrase: boolean;
  negated: boolean;
}

/**
 * The characters read as `-` or `"` besides themselves: those whose compatibility form (NFKC) is
 * one (full-width `－` and `＂`, small `﹣`), the minus sign, and typographic double quotes. Each is
 * one UTF-16 unit, as its ASCII form is.
 */
const SYNTAX_FORMS: Record<string, string> = {
  '\uff0d': '-',
  '\ufe63': '-',
  '\u2212': '-',
  '\uff02': '"',
  '\u201c': '"',
  '\u201d': '"',
  '\u201e': '"',
};
const SYNTAX_FORM = new RegExp(`[${Object.keys(SYNTAX_FORMS).join('')}]`, 'g');

/**
 * A `”` right after a letter or digit: the closing quote, which smart punctuation also gives for an
 * inch mark (`27” monitor`). It closes a phrase but opens none; read as an opening quote, it turned
 * `27” monitor -curved` into `27` and the phrase `"monitor -curved"`, and the exclusion was lost.
 * An ASCII or full-width `"` there still opens one, as it always did.
 */
const INCH_MARK = '\u201d';

/** The format characters the index drops inside a word, at a term's start or end. */
const EDGE_FORMAT = new RegExp(`^${IN_WORD_FORMAT.source}+|${IN_WORD_FORMAT.source}+$`, 'g');

/**
 * The query's tokens. The syntax is read from a copy of the query with SYNTAX_FORMS folded to
 * ASCII (of the same length); the terms are cut from the query as typed, which the substring
 * match tests.
 */
function tokenize(query: string): Token[] {
  const out: Token[] = [];
  const syntax = query.replace(SYNTAX_FORM, (c) => SYNTAX_FORMS[c]!);
  const n = query.length;
  let i = 0;
  // The format characters the index drops inside a word are no space (JavaScript's `\s` takes
  // U+FEFF for one): `wide`+U+FEFF+`spread` is one word, as the index reads it.
  const isSpace = (c: string | undefined) => c !== undefined && /\s/u.test(c) && !IN_WORD_FORMAT.test(c);
  // Two units before: the letter or digit may be a surrogate pair.
  const opensPhrase = (at: number) =>
    syntax[at] === '"' &&
    !(query[at] === INCH_MARK && /[\p{L}\p{N}]$/u.test(query.slice(Math.max(0, at - 2), at)));
  while (i < n) {
    if (isSpace(query[i])) {
      i++;
      continue;
    }
    let negated = false;
    if (syntax[i] === '-') {
      let dashes = i;
      while (syntax[dashes] === '-') dashes++;
      // Dashes alone are no term.
      if (dashes === n || isSpace(query[dashes])) {
        i = dashes;
        continue;
      }
      // `-term` excludes; `--term` is a word as written: command-line flags (`--dry-run`) were
      // excluded and never found, and nobody excludes with two dashes. Two or more before a quote
      // are dropped, as before a space: `--"dry run"` is the phrase.
      if (dashes === i + 1) {
        negated = true;
        i++;
      } else if (opensPhrase(dashes)) {
        i = dashes;
      }
    }
    if (opensPhrase(i)) {
      const close = syntax.indexOf('"', i + 1);
      const end = close === -1 ? n : close;
      const text = query.slice(i + 1, end).trim();
      i = close === -1 ? n : close + 1;
      if (text !== '') out.push({ kind: 'term', text, phrase: true, negated });
      continue;
    }
    let j = i;
    while (j < n && !isSpace(query[j]) && !opensPhrase(j)) j++;
    // The term as typed, for the substring match (full text folds it: foldForIndex); only the
    // format characters at its ends go, which hold no word of it.
    const text = query.slice(i, j).replace(EDGE_FORMAT, '');
    i = j;
    if (!negated && foldForIndex(text).toLowerCase() === 'or') {
      out.push({ kind: 'or', text, phrase: false, negated });
    } else if (text !== '') out.push({ kind: 'term', text, phrase: false, negated });
  }
  return out;
}

export function parseSearchQuery(query: string): ParsedQuery {
  const groups: QueryTerm[][] = [];
  const exclude: QueryTerm[] = [];
  const positive: string[] = [];
  let pendingOr = false;
  // Whether the previous token was a positive term, i.e. an `or` now joins the last group.
  let lastWasPositive = false;
  let kept = 0;
  let excludedPastLimit = 0;
  for (const t of tokenize(query)) {
    if (t.kind === 'or') {
      pendingOr = lastWasPositive;
      continue;
    }
    const term = { text: t.text, phrase: t.phrase };
    if (t.negated) {
      if (kept < MAX_KEYWORD_TERMS) exclude.push(term);
      else excludedPastLimit++;
      kept++;
      pendingOr = false;
      lastWasPositive = false;
      continue;
    }
    positive.push(t.text);
    if (kept < MAX_KEYWORD_TERMS) {
      const last = groups[groups.length - 1];
      if (pendingOr && last) last.push(term);
      else groups.push([term]);
    }
    kept++;
    pendingOr = false;
    lastWasPositive = true;
  }
  return { groups, exclude, excludedPastLimit, embedText: positive.join(' ') };
}

/**
 * One piece of a term's full-text query. English text goes through the `english` configuration
 * (stemming, stop words); a CJK run becomes the phrase of its overlapping bigrams, as tsquery
 * text, exactly as the archive indexed them (fts-text.ts: no parser or dictionary on either
 * side); a single CJK character becomes a prefix match on the bigrams, since the archive keeps
 * single characters only for one-character runs. The CJK runs of a quoted phrase are one
 * `cjk-phrase`, each run followed by the next across the archive's gap between runs.
 */
export type FtsLeaf =
  | { kind: 'english-words'; text: string }
  | { kind: 'english-phrase'; text: string }
  | { kind: 'cjk-phrase'; text: string }
  | { kind: 'cjk-prefix'; text: string };

/**
 * How much of one term reaches its tsquery: at most 32 words or bigrams per leaf and 8 leaves.
 * Postgres builds a phrase or an AND of n words as a tree n deep, and the embedded PGlite (WASM,
 * a small stack) returned no rows for a 7,000-bigram phrase and then hung on the next statement
 * with the whole process. Dropping the rest only widens the full-text match (fewer conditions
 * ANDed); the substring match over the recent part still tests the whole term when it is at most
 * MAX_SUBSTRING_CHARS long.
 */
export const MAX_LEAF_TOKENS = 32;
export const MAX_LEAVES_PER_TERM = 8;

/**
 * The most words and bigrams of a whole query's full-text leaves (budgetLeaves). `ts_rank_cd`
 * works through every item of the query for every match: 64 alternatives of 32-bigram phrases
 * (2,048 items, within the per-term limits) took 6 s per search over a few long CJK messages.
 */
export const MAX_QUERY_TOKENS = 256;

const leafTokens = (leaf: FtsLeaf): number =>
  leaf.kind === 'cjk-prefix'
    ? 1
    : leaf.kind === 'cjk-phrase'
      ? leaf.text.split(/ <(?:-|\d+)> /).length
      : Math.max(1, [...leaf.text.matchAll(/[\p{L}\p{N}]+/gu)].length);

/**
 * The leaves of a query's terms (groups of alternatives), in order, until MAX_QUERY_TOKENS: the
 * leaves past it are left out, and a term left without leaves matches by substring only (if at
 * all), as a term without indexable text does.
 */
export function budgetLeaves(groups: FtsLeaf[][][]): FtsLeaf[][][] {
  let left = MAX_QUERY_TOKENS;
  return groups.map((terms) =>
    terms.map((leaves) =>
      leaves.filter((leaf) => {
        const n = leafTokens(leaf);
        if (n > left) return false;
        left -= n;
        return true;
      }),
    ),
  );
}

/** `text` up to the end of its `n`-th word (a run of letters or digits, as the parser splits). */
function firstWords(text: string, n: number): string {
  let count = 0;
  for (const m of text.matchAll(/[\p{L}\p{N}]+/gu)) {
    if (++count === n) return text.slice(0, m.index + m[0].length);
  }
  return text;
}

/**
 * The leaves of one term, ANDed (empty when the term has no indexable text, e.g. `&|!`), of its
 * text folded as the archive's was (foldForIndex).
 */
export function ftsLeaves(term: QueryTerm): FtsLeaf[] {
  const leaves: FtsLeaf[] = [];
  const folded = foldForIndex(term.text);
  const english = folded.replace(CJK_RUN, ' ');
  if (/[\p{L}\p{N}]/u.test(english)) {
    const text = firstWords(english, MAX_LEAF_TOKENS);
    leaves.push({ kind: term.phrase ? 'english-phrase' : 'english-words', text });
  }
  const runs = Array.from(folded.matchAll(CJK_RUN), (m) => m[0]);
  if (term.phrase && runs.length > 1) {
    leaves.push({ kind: 'cjk-phrase', text: cjkRunsPhrase(runs) });
    return leaves;
  }
  for (const run of runs) {
    leaves.push(runLeaf(run, MAX_LEAF_TOKENS));
    if (leaves.length === MAX_LEAVES_PER_TERM) break;
  }
  return leaves;
}

/**
 * A CJK run's leaf, of at most `max` bigrams. A run of one character is a prefix match on the
 * bigrams, or with `exact` the archive's unigram of a one-character run, and only that.
 */
function runLeaf(run: string, max: number, exact = false): FtsLeaf {
  const chars = Array.from(run);
  // CJK letters are never a quote or a backslash: the lexemes need no escaping.
  if (chars.length === 1)
    return exact ? { kind: 'cjk-phrase', text: `'${run}'` } : { kind: 'cjk-prefix', text: `'${run}':*` };
  const bigrams = cjkBigrams(run).slice(0, max);
  return { kind: 'cjk-phrase', text: bigrams.map((b) => `'${b}'`).join(' <-> ') };
}

/**
 * The CJK runs of a quoted phrase as one tsquery of at most MAX_LEAF_TOKENS items, in order and
 * adjacent: the archive leaves CJK_RUN_GAP positions between two runs (cjkTsvector), so a run's
 * last bigram is followed by the next run's first at that distance plus one, whatever separated
 * them (a space, `、`, `・`, English words: these are not in the CJK positions). ANDing the runs
 * matched `"大阪 東京"` in "東京は晴れ、大阪は雨".
 *
 * A one-character run is its exact unigram except as the last run, which may begin a longer run
 * of the message (the prefix finds it). A middle run stands for a whole run of the message; the
 * first for a run that ends with the character, which no tsquery item can name (the bigram before
 * it is any), so full text finds only a run of that one character there, and the substring match
 * the rest in the recent part. As a prefix, `"京 大阪"` found "京東 大阪".
 */
function cjkRunsPhrase(runs: string[]): string {
  const parts: string[] = [];
  let left = MAX_LEAF_TOKENS;
  for (const [i, run] of runs.entries()) {
    if (left === 0) break;
    const leaf = runLeaf(run, left, i < runs.length - 1);
    left -= leafTokens(leaf);
    parts.push(leaf.text);
  }
  return parts.join(` <${CJK_RUN_GAP + 1}> `);
}

/**
 * The longest term matched as a substring, in code points: an identifier, a path, a sha256 in
 * hex. Postgres matches `%term%` in up to the text's length times the term's (a 10,000-character
 * term over one 100,000-character message took 22 s of a backend, and 16 such searches held the
 * whole pool); longer terms are matched by full text only.
 */
export const MAX_SUBSTRING_CHARS = 64;
/** The most code points of all of a query's substring terms together (searchSession). */
export const MAX_SUBSTRING_BUDGET = 256;

/**
 * Whether a term is worth a substring match: one ASCII character (`a`, `'`, `\`) would match
 * nearly every message, so it only counts when it is not ASCII (a CJK character, an emoji); and
 * not past MAX_SUBSTRING_CHARS.
 */
export function usableSubstring(text: string): boolean {
  const chars = Array.from(text);
  if (chars.length > MAX_SUBSTRING_CHARS) return false;
  if (chars.length >= 2) return true;
  return chars.length === 1 && chars[0]!.codePointAt(0)! > 0x7f;
}

/**
 * A term of one ASCII letter or digit (`step 2`, `python 3`, `plan b`) as a whole word, a regular
 * expression (`\m2\M`) rather than a LIKE pattern: `%2%` would match every message with a 2 in it
 * (`step 12`). Null for anything else, and for `a`, `i`, `s` and `t`, stop words of the `english`
 * configuration, which full text leaves out too. The substring match tells the two apart by the
 * first character: a LIKE pattern always starts with `%`.
 */
export function wordRegex(text: string): string | null {
  return /^[A-Za-z0-9]$/.test(text) && !/^[aist]$/i.test(text) ? `\\m${text}\\M` : null;
}

/** `%`, `_` and `\` escaped for LIKE/ILIKE with the default escape character. */
export function likePattern(text: string): string {
  return `%${text.replace(/[\\%_]/g, (c) => `\\${c}`)}%`;
}
