import { CJK_RUN, foldForIndex } from '../text/fts-text.js';

/**
 * The stop words of Postgres's `english` text search configuration (PostgreSQL 15's
 * `tsearch_data/english.stop`, Snowball's list), which full text leaves out of a
 * tsquery: an excluded term made only of them has an empty tsquery, so full text cannot exclude
 * it (search-session.ts). Words the parser would split differently only make the check stricter.
 */
export const ENGLISH_STOP_WORDS: ReadonlySet<string> = new Set(
  'i me my myself we our ours ourselves you your yours yourself yourselves he him his himself she her hers herself it its itself they them their theirs themselves what which who whom this that these those am is are was were be been being have has had having do does did doing a an the and but if or because as until while of at by for with about against between into through during before after above below to from up down in out on off over under again further then once here there when where why how all any both each few more most other some such no nor not only own same so than too very s t can will just don should now'.split(
    ' ',
  ),
);

/** Whether every word of `text` (letters and digits, lower-cased) is an English stop word. */
export function onlyStopWords(text: string): boolean {
  const words = text.toLowerCase().match(/[\p{L}\p{N}]+/gu) ?? [];
  return words.every((w) => ENGLISH_STOP_WORDS.has(w));
}

/**
 * Whether some but not all of the words of `text` (folded as the archive's text) are English stop
 * words, a CJK run counting as a word that is not one: the words full text would test are then
 * fewer than the term's (`-"no error"`, `-"記憶 of"`).
 */
export function partlyStopWords(text: string): boolean {
  const folded = foldForIndex(text);
  const words =
    folded
      .replace(CJK_RUN, ' ')
      .toLowerCase()
      .match(/[\p{L}\p{N}]+/gu) ?? [];
  const stops = words.filter((w) => ENGLISH_STOP_WORDS.has(w)).length;
  const others = words.length - stops + (folded.match(CJK_RUN)?.length ?? 0);
  return stops > 0 && others > 0;
}
