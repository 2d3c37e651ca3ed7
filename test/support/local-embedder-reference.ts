/**
 * The reference implementation of the `local-hash` embedder: the original, regular-expression
 * tokeniser, kept unchanged as the oracle for services/llm/local-embedder.ts. The service's
 * implementation is a faster rewrite that must produce exactly these features and vectors
 * (stored vectors depend on it); test/llm-client.test.ts compares the two. Do not "fix" this file.
 */

// Scripts written without spaces between words; whitespace/punctuation splitting is useless
// for them, so they get character bigrams instead. Script_Extensions (not Script) so the
// katakana prolonged-sound mark "ー" counts as kana; the lookahead keeps CJK punctuation
// ("。", "、"), which shares those extensions, out of the runs.
const CJK = String.raw`(?=[\p{L}\p{N}])[\p{scx=Han}\p{scx=Hiragana}\p{scx=Katakana}\p{scx=Hangul}]`;
const CJK_CHAR = new RegExp(CJK, 'u');
// A run is either CJK or a word of letters/digits/marks that are not CJK. The negative
// lookahead stops a Latin word from swallowing CJK characters that follow it without a space.
const RUN = new RegExp(String.raw`(?:${CJK})+|(?:(?!${CJK})[\p{L}\p{N}\p{M}])+`, 'gu');

const ASCII_WORD = /^[a-z]+$/;
const MIN_STEM = 3;

/**
 * Deliberately tiny suffix stripper (not Porter): enough that "compacting", "compaction",
 * "compacted" and "compacts" share the feature `compact`, without pulling in a dependency.
 */
export function lightStem(word: string): string {
  if (word.length <= MIN_STEM || !ASCII_WORD.test(word)) return word;
  const strip = (suffix: string, replacement = ''): string | undefined => {
    if (!word.endsWith(suffix)) return undefined;
    const stem = word.slice(0, word.length - suffix.length) + replacement;
    return stem.length >= MIN_STEM ? stem : undefined;
  };
  const ies = strip('ies', 'y');
  if (ies) return ies;
  for (const suffix of ['ions', 'ion', 'ing', 'ed']) {
    const stem = strip(suffix);
    if (stem) return stem;
  }
  // "-es" is only a plural ending after sibilants (boxes, matches); elsewhere ("databases")
  // the e belongs to the word and only the s goes.
  if (/(?:x|z|ch|sh|ss)es$/.test(word)) {
    const stem = strip('es');
    if (stem) return stem;
  }
  if (word.endsWith('s') && !/(?:ss|us|is)$/.test(word)) {
    const stem = strip('s');
    if (stem) return stem;
  }
  return word;
}

/** Features of a text, with repeats (term frequency is counted by the caller). */
export function localFeatures(text: string): string[] {
  const normalised = text.normalize('NFKC').toLowerCase();
  const features: string[] = [];
  for (const match of normalised.matchAll(RUN)) {
    const run = match[0];
    // A run is wholly CJK or wholly not, so testing any character classifies it.
    if (CJK_CHAR.test(run)) {
      // Array.from iterates code points, so Han extension characters (surrogate pairs) stay whole.
      const chars = Array.from(run);
      if (chars.length === 1) {
        features.push(`c:${chars[0]}`);
        continue;
      }
      for (let i = 0; i + 1 < chars.length; i++) features.push(`c:${chars[i]}${chars[i + 1]}`);
    } else {
      features.push(`w:${lightStem(run)}`);
    }
  }
  return features;
}

function fnv1a32(text: string): number {
  let hash = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    hash ^= text.charCodeAt(i);
    hash = Math.imul(hash, 0x01000193);
  }
  return hash >>> 0;
}

// murmur3's finaliser: FNV's low bits are weakly mixed, and both the bucket (modulo) and the
// sign need well-distributed bits.
function fmix32(value: number): number {
  let h = value;
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b);
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35);
  h ^= h >>> 16;
  return h >>> 0;
}

const SIGN_SEED = 0x9e3779b9;

export function localEmbed(text: string, dimensions: number): number[] {
  if (!Number.isInteger(dimensions) || dimensions < 1) {
    throw new RangeError(`dimensions must be a positive integer, got ${dimensions}`);
  }
  const counts = new Map<string, number>();
  for (const feature of localFeatures(text)) counts.set(feature, (counts.get(feature) ?? 0) + 1);

  const vector = new Array<number>(dimensions).fill(0);
  for (const [feature, tf] of counts) {
    const hash = fnv1a32(feature);
    const index = fmix32(hash) % dimensions;
    const sign = (fmix32(hash ^ SIGN_SEED) & 1) === 0 ? 1 : -1;
    // Sublinear tf so a word repeated ten times does not drown out the rest of the text.
    vector[index] = (vector[index] ?? 0) + sign * (1 + Math.log(tf));
  }

  let norm = 0;
  for (const v of vector) norm += v * v;
  norm = Math.sqrt(norm);
  if (norm === 0) {
    // No features (empty/punctuation-only text, or all features cancelled out). A zero vector
    // makes pgvector's cosine distance NaN, which poisons ORDER BY; a fixed unit vector keeps
    // the distance defined and makes all featureless texts equal to each other.
    vector[0] = 1;
    return vector;
  }
  return vector.map((v) => v / norm);
}

export function localEmbedMany(texts: readonly string[], dimensions: number): number[][] {
  return texts.map((text) => localEmbed(text, dimensions));
}
