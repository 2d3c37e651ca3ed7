/**
 * Built-in offline embedder: feature hashing over words, light English stems and CJK
 * character bigrams. It is LEXICAL, not semantic: "car" and "automobile" are unrelated to it.
 * It exists so mnemos works (and tests run) without any model endpoint.
 *
 * Stored vectors depend on every detail below (normalisation, tokenisation, stemming, hash,
 * index/sign derivation). Changing any of them silently invalidates embeddings already in the
 * database, so treat this file as a versioned format: change it only together with a new
 * LOCAL_EMBEDDING_MODEL name (which forces a re-embed).
 */

export const LOCAL_EMBEDDING_MODEL = 'local-hash';

// Scripts written without spaces between words; whitespace/punctuation splitting is useless
// for them, so they get character bigrams instead. Script_Extensions (not Script) so the
// katakana prolonged-sound mark "ー" counts as kana; the lookahead keeps CJK punctuation
// ("。", "、"), which shares those extensions, out of the runs.
const CJK_CHAR = /^(?=[\p{L}\p{N}])[\p{scx=Han}\p{scx=Hiragana}\p{scx=Katakana}\p{scx=Hangul}]$/u;
const WORD_CHAR = /^[\p{L}\p{N}\p{M}]$/u;

/**
 * What a code point is to the tokeniser. A text is cut into runs of one kind: a CJK run is
 * letters/digits of a CJK script, a word run letters/digits/marks of any other script;
 * everything else separates runs.
 */
const SEP = 0;
const WORD = 1;
const CJK = 2;
type CharKind = typeof SEP | typeof WORD | typeof CJK;

// Unicode property tests are the slow part of tokenising, so each non-ASCII code point is
// classified once per process (bounded: a text in a rare script cannot grow it without end).
const kindCache = new Map<number, CharKind>();
const KIND_CACHE_MAX = 1 << 16;

function charKind(cp: number): CharKind {
  if (cp < 0x80) {
    // ASCII letters and digits; after lower-casing A–Z do not occur, but they are words too.
    return (cp >= 0x61 && cp <= 0x7a) || (cp >= 0x30 && cp <= 0x39) || (cp >= 0x41 && cp <= 0x5a)
      ? WORD
      : SEP;
  }
  const cached = kindCache.get(cp);
  if (cached !== undefined) return cached;
  const ch = String.fromCodePoint(cp);
  const kind: CharKind = CJK_CHAR.test(ch) ? CJK : WORD_CHAR.test(ch) ? WORD : SEP;
  if (kindCache.size < KIND_CACHE_MAX) kindCache.set(cp, kind);
  return kind;
}

const ASCII_WORD = /^[a-z]+$/;
const MIN_STEM = 3;

/**
 * Deliberately tiny suffix stripper (not Porter): enough that "compacting", "compaction",
 * "compacted" and "compacts" share the feature `compact`, without pulling in a dependency.
 */
export function lightStem(word: string): string {
  if (word.length <= MIN_STEM || !ASCII_WORD.test(word)) return word;
  return stemLowerAscii(word);
}

const S = 0x73;
const N = 0x6e;
const G = 0x67;
const D = 0x64;

// (Hot-path helpers are module-level functions, not closures: tsx compiles with esbuild's
// keepNames, which wraps every named closure in a defineProperty call each time it is created.)

function stripSuffix(word: string, suffix: string, replacement: string): string | undefined {
  if (!word.endsWith(suffix)) return undefined;
  const stem = word.slice(0, word.length - suffix.length) + replacement;
  return stem.length >= MIN_STEM ? stem : undefined;
}

const VERB_SUFFIXES = ['ions', 'ion', 'ing', 'ed'];
const SIBILANT_ES = /(?:x|z|ch|sh|ss)es$/;
const KEEPS_S = /(?:ss|us|is)$/;

/** lightStem for a word already known to be longer than MIN_STEM and all a–z. */
function stemLowerAscii(word: string): string {
  // Every rule strips a suffix ending in s, n, g or d; most words end otherwise.
  const last = word.charCodeAt(word.length - 1);
  if (last !== S && last !== N && last !== G && last !== D) return word;
  const ies = stripSuffix(word, 'ies', 'y');
  if (ies) return ies;
  for (const suffix of VERB_SUFFIXES) {
    const stem = stripSuffix(word, suffix, '');
    if (stem) return stem;
  }
  // "-es" is only a plural ending after sibilants (boxes, matches); elsewhere ("databases")
  // the e belongs to the word and only the s goes.
  if (SIBILANT_ES.test(word)) {
    const stem = stripSuffix(word, 'es', '');
    if (stem) return stem;
  }
  if (last === S && !KEEPS_S.test(word)) {
    const stem = stripSuffix(word, 's', '');
    if (stem) return stem;
  }
  return word;
}

/**
 * Appends the features of a text to `keys`/`kinds`, in text order, with repeats: a word run
 * gives its stem (feature `w:<stem>`), a CJK run its code-point bigrams (`c:<bigram>`), or the
 * character itself when the run is one character long. One pass over the text with a cached
 * per-code-point classification; the output is exactly that of the regular-expression
 * tokeniser it replaced (test/support/local-embedder-reference.ts; checked by the tests).
 */
function scanFeatures(text: string, keys: string[], kinds: number[]): void {
  const s = text.normalize('NFKC').toLowerCase();
  const len = s.length;
  let runKind: CharKind = SEP;
  let runStart = 0;
  // Word runs: whether every unit is a–z (only those are stemmed).
  let lowerAscii = true;
  // CJK runs: the UTF-16 offset of the previous code point (for bigrams) and the run's length.
  let prev = 0;
  let cjkCount = 0;
  for (let i = 0; i <= len;) {
    const cp = i < len ? s.codePointAt(i)! : -1;
    const kind = cp < 0 ? SEP : charKind(cp);
    if (kind !== runKind) {
      if (runKind === WORD) {
        const word = s.slice(runStart, i);
        keys.push(lowerAscii && word.length > MIN_STEM ? stemLowerAscii(word) : word);
        kinds.push(WORD);
      } else if (runKind === CJK && cjkCount === 1) {
        keys.push(s.slice(runStart, i));
        kinds.push(CJK);
      }
      runKind = kind;
      runStart = i;
      lowerAscii = true;
      cjkCount = 0;
    }
    if (cp < 0) break;
    const width = cp > 0xffff ? 2 : 1;
    if (kind === WORD) {
      if (lowerAscii && !(cp >= 0x61 && cp <= 0x7a)) lowerAscii = false;
    } else if (kind === CJK) {
      if (cjkCount > 0) {
        keys.push(s.slice(prev, i + width));
        kinds.push(CJK);
      }
      prev = i;
      cjkCount++;
    }
    i += width;
  }
}

/** Features of a text, with repeats (term frequency is counted by the caller). */
export function localFeatures(text: string): string[] {
  const keys: string[] = [];
  const kinds: number[] = [];
  scanFeatures(text, keys, kinds);
  return keys.map((key, i) => (kinds[i] === WORD ? `w:${key}` : `c:${key}`));
}

/** FNV-1a over UTF-16 code units, continuing from `hash` (so a prefix can be hashed once). */
function fnv1a32(text: string, hash = 0x811c9dc5): number {
  let h = hash;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193);
  }
  return h >>> 0;
}

// A feature's hash is that of its string `w:<stem>` or `c:<bigram>`; the prefix is hashed once.
const WORD_PREFIX_HASH = fnv1a32('w:');
const CJK_PREFIX_HASH = fnv1a32('c:');

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

let scratch = new Float64Array(384);

export function localEmbed(text: string, dimensions: number): number[] {
  if (!Number.isInteger(dimensions) || dimensions < 1) {
    throw new RangeError(`dimensions must be a positive integer, got ${dimensions}`);
  }
  // Term frequency per feature, in order of first occurrence (the order the buckets are summed
  // in, which floating-point results depend on). Word and CJK keys never coincide (no character
  // is both), so one map holds both: the low bit is the kind, the rest the count.
  const keys: string[] = [];
  const kinds: number[] = [];
  scanFeatures(text, keys, kinds);
  const counts = new Map<string, number>();
  for (let i = 0; i < keys.length; i++) {
    const key = keys[i]!;
    counts.set(key, (counts.get(key) ?? (kinds[i] === CJK ? 1 : 0)) + 2);
  }

  // Summed in a scratch buffer reused across calls: only the returned array is allocated.
  if (scratch.length < dimensions) scratch = new Float64Array(dimensions);
  const acc = scratch;
  acc.fill(0, 0, dimensions);
  for (const [key, packed] of counts) {
    const hash = fnv1a32(key, (packed & 1) === 1 ? CJK_PREFIX_HASH : WORD_PREFIX_HASH);
    const tf = packed >>> 1;
    const index = fmix32(hash) % dimensions;
    const sign = (fmix32(hash ^ SIGN_SEED) & 1) === 0 ? 1 : -1;
    // Sublinear tf so a word repeated ten times does not drown out the rest of the text.
    acc[index] = acc[index]! + sign * (1 + Math.log(tf));
  }

  let norm = 0;
  for (let i = 0; i < dimensions; i++) norm += acc[i]! * acc[i]!;
  norm = Math.sqrt(norm);
  const vector = new Array<number>(dimensions);
  if (norm === 0) {
    // No features (empty/punctuation-only text, or all features cancelled out). A zero vector
    // makes pgvector's cosine distance NaN, which poisons ORDER BY; a fixed unit vector keeps
    // the distance defined and makes all featureless texts equal to each other.
    vector.fill(0);
    vector[0] = 1;
    return vector;
  }
  for (let i = 0; i < dimensions; i++) vector[i] = acc[i]! / norm;
  return vector;
}

/**
 * Whether `text` has a feature (a word or a CJK character). Without one its vector is the fixed
 * unit vector that all featureless texts share (see localEmbed), which says nothing about it.
 */
export function hasLocalFeatures(text: string): boolean {
  const keys: string[] = [];
  scanFeatures(text, keys, []);
  return keys.length > 0;
}

/**
 * The distinct features of a text (words' stems, CJK bigrams or lone characters; the two kinds
 * never coincide), for sharesLocalFeature.
 */
export function localFeatureSet(text: string): Set<string> {
  const keys: string[] = [];
  scanFeatures(text, keys, []);
  return new Set(keys);
}

/**
 * Whether `text` has a feature of `features` (a localFeatureSet). Two texts' local vectors score
 * above 0 without one when features of each land in one of the few hundred buckets with one sign:
 * "Thanks, that helps a lot." scored 0.45 against "kubectl", as much as a real match of one
 * word does, so only this test tells a real match from a collision.
 */
export function sharesLocalFeature(features: ReadonlySet<string>, text: string): boolean {
  if (features.size === 0) return false;
  const keys: string[] = [];
  scanFeatures(text, keys, []);
  return keys.some((key) => features.has(key));
}

export function localEmbedMany(texts: readonly string[], dimensions: number): number[][] {
  return texts.map((text) => localEmbed(text, dimensions));
}
