/**
 * Text preparation for the archive's tsvector. Postgres's parsers do not segment Chinese,
 * Japanese or Korean, so CJK runs are indexed as overlapping character bigrams (with the 'simple'
 * configuration) beside the stemmed English lexemes of the rest of the text.
 *
 * Both parts are capped so that no accepted message (content ≤ 1 MiB) can produce a tsvector
 * over Postgres's 1 MB limit: 64k characters of non-CJK text make at most ~32k lexemes (~400 KB
 * worst case), 32k CJK characters at most 32k bigrams (~390 KB).
 */

export const FTS_EN_CAP = 65_536;
export const FTS_CJK_CAP = 32_768;

const CJK_CHAR = /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]/u;
const CJK_RUN = /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]+/gu;

export const hasCjk = (s: string) => CJK_CHAR.test(s);

/** Overlapping bigrams of every CJK run; a run of one character is kept as a unigram. */
export function cjkBigrams(text: string, capChars = Infinity): string[] {
  const out: string[] = [];
  let budget = capChars;
  for (const m of text.matchAll(CJK_RUN)) {
    if (budget <= 0) break;
    const chars = Array.from(m[0]).slice(0, budget);
    budget -= chars.length;
    if (chars.length === 1) out.push(chars[0]!);
    for (let i = 0; i + 1 < chars.length; i++) out.push(chars[i]! + chars[i + 1]!);
  }
  return out;
}

/**
 * `s` cut to at most `max` UTF-16 code units, never between the two halves of a surrogate pair: a
 * lone half is not valid JSON for Postgres (`invalid input syntax for type json`), so a cut through
 * an emoji once made the drain's INSERT fail on every attempt, and the session stop archiving.
 */
export function cutUnits(s: string, max: number): string {
  if (s.length <= max) return s;
  const last = s.charCodeAt(max - 1);
  return s.slice(0, last >= 0xd800 && last <= 0xdbff ? max - 1 : max);
}

/** The two inputs of the stored tsvector: `to_tsvector('english', en) || to_tsvector('simple', cjk)`. */
export function ftsDocument(text: string): { en: string; cjk: string } {
  const cap = (s: string) => cutUnits(s, FTS_EN_CAP);
  // Most messages have no CJK: one scan instead of three.
  if (!hasCjk(text)) return { en: cap(text), cjk: '' };
  return { en: cap(text.replace(CJK_RUN, ' ')), cjk: cjkBigrams(text, FTS_CJK_CAP).join(' ') };
}
