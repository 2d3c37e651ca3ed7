import { parseSentAt } from '../time.js';

/**
 * Which rows of Agenvoy's history.db are copies of history.json messages, and in which time zone
 * history.json's naive header times line up with history.db's absolute ones (`import agenvoy`).
 *
 * Both sequences are in write order (Agenvoy writes every message to both, and compaction trims
 * history.json from the front), so copies are found by an order-preserving alignment: the most
 * pairs of equal role and text whose times agree, and among those the nearest in time. A greedy
 * match can reorder a conversation: a compacted "ok" would take the slot of a later "ok" that is
 * still in history.json, and the later one would then be imported a second time.
 */

export interface Entry {
  /** Role and text. */
  key: string;
  /** Its time: its own, or for an entry without one an estimate (the previous entry's + 1 ns). */
  ns: bigint;
  /** Whether `ns` is its own (a history.json header, a history.db `send_at`), not an estimate. */
  timed: boolean;
}

/** history.json times are whole-second headers (replies: + 1 ns); history.db may hold the real time. */
export const NEAR_NS = 60_000_000_000n;
/** Candidates considered per history.db row (the nearest in time): bounds the work on repeated texts. */
const MAX_CANDIDATES = 64;
const DAY_NS = 86_400_000_000_000n;
const NO_LOWER = -(2n ** 63n);
const NO_UPPER = 2n ** 63n;

/** An entry without a time of its own was written between its timed neighbours. */
function spans(entries: Entry[]): Array<[bigint, bigint]> {
  const out: Array<[bigint, bigint]> = entries.map((e) => [e.ns, e.ns]);
  let lo = NO_LOWER;
  entries.forEach((e, i) => {
    if (e.timed) lo = e.ns;
    else out[i]![0] = lo;
  });
  let hi = NO_UPPER;
  for (let i = entries.length - 1; i >= 0; i--) {
    const e = entries[i]!;
    if (e.timed) hi = e.ns;
    else out[i]![1] = hi;
    // Headers out of order (a clock change) must not make an empty span.
    if (out[i]![0] > out[i]![1]) out[i] = [out[i]![1], out[i]![0]];
  }
  return out;
}

const gap = (a: bigint, b: bigint) => Number(a > b ? a - b : b - a);

interface Bucket {
  /** Entries spanning at most a day, by the start of their span. */
  narrow: number[];
  widest: bigint;
  /** Entries spanning more (leading or trailing ones without a time): checked against every row. */
  wide: number[];
}

/**
 * For each `archive` entry, the index of the `json` entry it is a copy of, or -1. Pairs need the
 * same key and times that agree (spans within NEAR_NS of each other) and never cross.
 */
export function matchArchive(archive: Entry[], json: Entry[]): number[] {
  const jSpan = spans(json);
  const aSpan = spans(archive);
  const buckets = new Map<string, Bucket>();
  json.forEach((e, j) => {
    let b = buckets.get(e.key);
    if (!b) buckets.set(e.key, (b = { narrow: [], widest: 0n, wide: [] }));
    const [lo, hi] = jSpan[j]!;
    if (hi - lo > DAY_NS) b.wide.push(j);
    else {
      b.narrow.push(j);
      if (hi - lo > b.widest) b.widest = hi - lo;
    }
  });
  for (const b of buckets.values()) {
    b.narrow.sort((x, y) => (jSpan[x]![0] < jSpan[y]![0] ? -1 : jSpan[x]![0] > jSpan[y]![0] ? 1 : x - y));
  }

  // Candidate pairs, by archive index ascending and json index descending (see below).
  const pairs: Array<{ a: number; j: number; gap: number }> = [];
  archive.forEach((e, a) => {
    const b = buckets.get(e.key);
    if (!b) return;
    const [lo, hi] = aSpan[a]!;
    const agrees = (j: number) => jSpan[j]![0] - NEAR_NS <= hi && jSpan[j]![1] + NEAR_NS >= lo;
    const found: Array<{ a: number; j: number; gap: number }> = [];
    // Walk outwards from the row's time over the narrow entries whose span can reach its span.
    const from = lo - NEAR_NS - b.widest;
    const to = hi + NEAR_NS;
    let right = lowerBound(b.narrow.length, (k) => jSpan[b.narrow[k]!]![0] >= e.ns);
    let left = right - 1;
    while (found.length < MAX_CANDIDATES) {
      const l = left >= 0 ? b.narrow[left]! : -1;
      const r = right < b.narrow.length ? b.narrow[right]! : -1;
      const lOk = l >= 0 && jSpan[l]![0] >= from;
      const rOk = r >= 0 && jSpan[r]![0] <= to;
      if (!lOk && !rOk) break;
      const takeLeft = lOk && (!rOk || gap(json[l]!.ns, e.ns) <= gap(json[r]!.ns, e.ns));
      const j = takeLeft ? l : r;
      if (takeLeft) left--;
      else right++;
      if (agrees(j)) found.push({ a, j, gap: gap(json[j]!.ns, e.ns) });
    }
    for (const j of b.wide) if (agrees(j)) found.push({ a, j, gap: gap(json[j]!.ns, e.ns) });
    found.sort((x, y) => y.j - x.j);
    pairs.push(...found);
  });

  // Longest chain of pairs increasing in both indexes, weighted (most pairs, then the smallest
  // total time gap): a Fenwick tree of prefix maxima over the json index. Pairs of one archive row
  // come in descending json order, so two of them never chain.
  const m = json.length;
  const treeCount = new Int32Array(m + 1);
  const treeGap = new Float64Array(m + 1);
  const treeAt = new Int32Array(m + 1).fill(-1);
  const pairCount = new Int32Array(pairs.length);
  const pairGap = new Float64Array(pairs.length);
  const prev = new Int32Array(pairs.length);
  const better = (count: number, g: number, x: number) =>
    count > treeCount[x]! || (count === treeCount[x]! && g < treeGap[x]!);
  const best = (upTo: number) => {
    let count = 0;
    let g = 0;
    let at = -1;
    for (let x = upTo; x > 0; x -= x & -x) {
      if (treeCount[x]! > count || (treeCount[x]! === count && treeGap[x]! < g)) {
        count = treeCount[x]!;
        g = treeGap[x]!;
        at = treeAt[x]!;
      }
    }
    return { count, g, at };
  };
  pairs.forEach((p, i) => {
    const before = best(p.j);
    pairCount[i] = before.count + 1;
    pairGap[i] = before.g + p.gap;
    prev[i] = before.at;
    for (let x = p.j + 1; x <= m; x += x & -x) {
      if (better(pairCount[i]!, pairGap[i]!, x)) {
        treeCount[x] = pairCount[i]!;
        treeGap[x] = pairGap[i]!;
        treeAt[x] = i;
      }
    }
  });
  const copyOf = new Array<number>(archive.length).fill(-1);
  for (let i = best(m).at; i >= 0; i = prev[i]!) copyOf[pairs[i]!.a] = pairs[i]!.j;
  return copyOf;
}

/** The first index in [0, length) where `atOrAfter` holds (it holds from some index on). */
function lowerBound(length: number, atOrAfter: (index: number) => boolean): number {
  let lo = 0;
  let hi = length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (atOrAfter(mid)) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/** Zones named first when several read the headers alike (the rest follow in IANA order). */
const PREFERRED = [
  'UTC',
  'Asia/Taipei',
  'Asia/Shanghai',
  'Asia/Hong_Kong',
  'Asia/Tokyo',
  'Asia/Seoul',
  'Asia/Singapore',
  'Asia/Kolkata',
  'Europe/London',
  'Europe/Paris',
  'Europe/Berlin',
  'America/New_York',
  'America/Chicago',
  'America/Denver',
  'America/Los_Angeles',
  'America/Sao_Paulo',
  'Australia/Sydney',
];
const QUARTER_HOUR_NS = 900_000_000_000n;
const MAX_SAMPLES = 64;

export interface ZoneReading {
  /** The zone that lines most headers up with history.db (`given` unless another does better). */
  zone: string;
  lined: number;
  /** How many line up when read in the given zone. */
  givenLined: number;
  /** Headers whose text history.db holds with a time (at most MAX_SAMPLES, spread evenly). */
  samples: number;
}

/**
 * history.json's headers are naive local times; history.db stores absolute ones. When fewer than
 * half of the headers whose text history.db holds line up with a copy in the given zone, the zone
 * is wrong (no `--tz`, or the wrong one): the offsets between header and copy tell which zones to
 * try, and the one lining up the most (at least half) is returned. Null when there is nothing to
 * compare. `archive`: the timed history.db rows' times by key, ascending.
 */
export function lineUpZone(
  headers: Array<{ key: string; naive: string }>,
  archive: Map<string, bigint[]>,
  given: string,
): ZoneReading | null {
  const comparable = headers.filter((h) => archive.has(h.key));
  if (comparable.length === 0) return null;
  const step = Math.max(1, comparable.length / MAX_SAMPLES);
  const samples: typeof comparable = [];
  for (let i = 0; i < comparable.length && samples.length < MAX_SAMPLES; i += step) {
    samples.push(comparable[Math.floor(i)]!);
  }
  const lined = (zone: string) =>
    samples.filter((s) => {
      const ns = parseSentAt(s.naive, zone);
      return typeof ns === 'bigint' && nearest(archive.get(s.key)!, ns) <= Number(NEAR_NS);
    }).length;
  const givenLined = lined(given);
  let best = { zone: given, lined: givenLined };
  const reading = () => ({ ...best, givenLined, samples: samples.length });
  if (givenLined * 2 >= samples.length) return reading();

  // Offsets (header read as UTC minus the copy's time) near a whole quarter hour, by votes.
  const votes = new Map<bigint, { count: number; sample: number }>();
  samples.forEach((s, i) => {
    const asUtc = BigInt(Date.parse(`${s.naive.replace(' ', 'T')}Z`)) * 1_000_000n;
    const seen = new Set<bigint>();
    for (const ns of archive.get(s.key)!) {
      const diff = asUtc - ns;
      const q = (diff + (diff < 0n ? -QUARTER_HOUR_NS : QUARTER_HOUR_NS) / 2n) / QUARTER_HOUR_NS;
      const off = q * QUARTER_HOUR_NS;
      if (q < -56n || q > 56n || gap(diff, off) > Number(NEAR_NS) || seen.has(off)) continue;
      seen.add(off);
      const v = votes.get(off) ?? { count: 0, sample: i };
      v.count++;
      votes.set(off, v);
    }
  });
  const zones = [...new Set([...PREFERRED, ...Intl.supportedValuesOf('timeZone')])];
  for (const [off, v] of [...votes].sort((x, y) => y[1].count - x[1].count).slice(0, 3)) {
    // Zones at that offset at the sample's time (checked whole, so daylight saving counts).
    const s = samples[v.sample]!;
    const want = BigInt(Date.parse(`${s.naive.replace(' ', 'T')}Z`)) * 1_000_000n - off;
    for (const zone of zones.filter((z) => parseSentAt(s.naive, z) === want)) {
      const n = lined(zone);
      if (n > best.lined) best = { zone, lined: n };
    }
  }
  if (best.lined * 2 < samples.length) best = { zone: given, lined: givenLined };
  return reading();
}

/** Distance from `ns` to the nearest of `sorted`. */
function nearest(sorted: bigint[], ns: bigint): number {
  const i = lowerBound(sorted.length, (k) => sorted[k]! >= ns);
  let d = Infinity;
  if (i < sorted.length) d = gap(sorted[i]!, ns);
  if (i > 0) d = Math.min(d, gap(sorted[i - 1]!, ns));
  return d;
}
