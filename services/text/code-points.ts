/**
 * Sizes in Unicode code points, as limits meant for people and models count them ("128
 * characters", SUMMARY_RUNES), never UTF-16 units (`.length`) or bytes: an emoji is one, a CJK
 * character is one.
 */

const SURROGATE_PAIR = /[\uD800-\uDBFF][\uDC00-\uDFFF]/g;

/** Code points in `s`: UTF-16 units minus one per surrogate pair (a lone surrogate counts as one). */
export function codePoints(s: string): number {
  const pairs = s.match(SURROGATE_PAIR);
  return pairs === null ? s.length : s.length - pairs.length;
}

export const isHighSurrogate = (c: number) => c >= 0xd800 && c <= 0xdbff;
export const isLowSurrogate = (c: number) => c >= 0xdc00 && c <= 0xdfff;

/** The first `n` code points of `s` (never splits a surrogate pair). */
export function takeCodePoints(s: string, n: number): string {
  if (n <= 0) return '';
  let count = 0;
  let i = 0;
  while (i < s.length && count < n) {
    i += isHighSurrogate(s.charCodeAt(i)) && i + 1 < s.length ? 2 : 1;
    count++;
  }
  return s.slice(0, i);
}

/** The last `n` code points of `s` (never splits a surrogate pair). */
export function lastCodePoints(s: string, n: number): string {
  let i = s.length;
  for (let count = 0; i > 0 && count < n; count++) {
    i -= i >= 2 && isLowSurrogate(s.charCodeAt(i - 1)) && isHighSurrogate(s.charCodeAt(i - 2)) ? 2 : 1;
  }
  return s.slice(i);
}
