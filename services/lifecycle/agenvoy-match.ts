import { parseSentAt, wallClock, zoneOffsetMs } from '../time.js';

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
/** Candidates considered per history.db row and kind (the nearest): bounds the work on repeated texts. */
const MAX_CANDIDATES = 64;
/** Entries looked at per row when walking by position (those whose times disagree are passed over). */
const MAX_STEPS = 4 * MAX_CANDIDATES;
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
  /** Entries spanning more (leading or trailing ones without a time): found by position. */
  wide: number[];
  /** Every entry, by index (an untimed row is also looked for by position). */
  all: number[];
}

/** Candidate pairs of one archive row: json indexes and time gaps. */
interface Found {
  j: number[];
  gap: number[];
}

/**
 * For each `archive` entry, the index of the `json` entry it is a copy of, or -1. Pairs need the
 * same key and times that agree (spans within NEAR_NS of each other) and never cross.
 *
 * A row is paired with the entries nearest in time (at most MAX_CANDIDATES). Where time says
 * little (a row without a time of its own, json entries before the first or after the last
 * header, a history.json without any header), it is also paired with the entries nearest its
 * expected position: the alignment of the timed rows is done first, and a row is expected as far
 * after the last aligned row before it as it is in history.db (before any: as far before the next;
 * none at all: history.json is history.db's tail). Every row's candidates stay bounded, so many
 * copies of a text (`ok`) cost linear time and memory, not quadratic.
 */
export function matchArchive(archive: Entry[], json: Entry[]): number[] {
  const jSpan = spans(json);
  const aSpan = spans(archive);
  const buckets = new Map<string, Bucket>();
  json.forEach((e, j) => {
    let b = buckets.get(e.key);
    if (!b) buckets.set(e.key, (b = { narrow: [], widest: 0n, wide: [], all: [] }));
    b.all.push(j);
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
  const agrees = (a: number, j: number) =>
    jSpan[j]![0] - NEAR_NS <= aSpan[a]![1] && jSpan[j]![1] + NEAR_NS >= aSpan[a]![0];

  /** The narrow entries nearest in time whose span can reach the row's span. */
  const byTime = (a: number, b: Bucket, out: Found) => {
    const e = archive[a]!;
    const [lo, hi] = aSpan[a]!;
    const from = lo - NEAR_NS - b.widest;
    const to = hi + NEAR_NS;
    let right = lowerBound(b.narrow.length, (k) => jSpan[b.narrow[k]!]![0] >= e.ns);
    let left = right - 1;
    let n = 0;
    while (n < MAX_CANDIDATES) {
      const l = left >= 0 ? b.narrow[left]! : -1;
      const r = right < b.narrow.length ? b.narrow[right]! : -1;
      const lOk = l >= 0 && jSpan[l]![0] >= from;
      const rOk = r >= 0 && jSpan[r]![0] <= to;
      if (!lOk && !rOk) break;
      const takeLeft = lOk && (!rOk || gap(json[l]!.ns, e.ns) <= gap(json[r]!.ns, e.ns));
      const j = takeLeft ? l : r;
      if (takeLeft) left--;
      else right++;
      if (agrees(a, j)) {
        out.j.push(j);
        out.gap.push(gap(json[j]!.ns, e.ns));
        n++;
      }
    }
  };
  /** The entries of `list` (json indexes, ascending) nearest the expected index `at`. */
  const byPosition = (a: number, list: number[], at: number, out: Found) => {
    const e = archive[a]!;
    let right = lowerBound(list.length, (k) => list[k]! >= at);
    let left = right - 1;
    let n = 0;
    for (let step = 0; n < MAX_CANDIDATES && step < MAX_STEPS; step++) {
      const lOk = left >= 0;
      const rOk = right < list.length;
      if (!lOk && !rOk) break;
      const takeLeft = lOk && (!rOk || at - list[left]! <= list[right]! - at);
      const j = takeLeft ? list[left--]! : list[right++]!;
      if (!out.j.includes(j) && agrees(a, j)) {
        out.j.push(j);
        out.gap.push(gap(json[j]!.ns, e.ns));
        n++;
      }
    }
  };

  // 1. The timed rows, by time: the anchors.
  const timed: Found[] = archive.map((e, a) => {
    const found: Found = { j: [], gap: [] };
    const b = buckets.get(e.key);
    if (b && e.timed) byTime(a, b, found);
    return found;
  });
  const anchors = align(timed, json.length);

  // 2. Every row, adding candidates by position.
  const expected = expectedIndexes(anchors, json.length);
  const every: Found[] = archive.map((e, a) => {
    const b = buckets.get(e.key);
    if (!b) return { j: [], gap: [] };
    const found: Found = { j: [...timed[a]!.j], gap: [...timed[a]!.gap] };
    if (!e.timed) byTime(a, b, found);
    byPosition(a, e.timed ? b.wide : b.all, expected[a]!, found);
    return found;
  });
  return align(every, json.length);
}

/** Where each archive row's copy is expected in history.json, from the rows already aligned. */
function expectedIndexes(anchors: number[], jsonLength: number): number[] {
  const n = anchors.length;
  const out = new Array<number>(n).fill(NaN);
  let lastA = -1;
  for (let a = 0; a < n; a++) {
    if (anchors[a]! >= 0) lastA = a;
    if (lastA >= 0) out[a] = anchors[lastA]! + (a - lastA);
  }
  let nextA = -1;
  for (let a = n - 1; a >= 0; a--) {
    if (anchors[a]! >= 0) nextA = a;
    if (nextA < 0) continue;
    const before = anchors[nextA]! - (nextA - a);
    out[a] = Number.isNaN(out[a]!) ? before : Math.min(out[a]!, anchors[nextA]!);
  }
  // No anchor at all: history.json is history.db's tail (compaction trims it from the front).
  for (let a = 0; a < n; a++) if (Number.isNaN(out[a]!)) out[a] = a - (n - jsonLength);
  return out;
}

/**
 * The longest chain of pairs increasing in both indexes, weighted (most pairs, then the smallest
 * total time gap): a Fenwick tree of prefix maxima over the json index. Pairs of one archive row
 * are taken in descending json order, so two of them never chain.
 */
function align(candidates: Found[], m: number): number[] {
  const total = candidates.reduce((n, f) => n + f.j.length, 0);
  const pairA = new Int32Array(total);
  const pairJ = new Int32Array(total);
  const pairGap = new Float64Array(total);
  const pairCount = new Int32Array(total);
  const prev = new Int32Array(total);
  const treeCount = new Int32Array(m + 1);
  const treeGap = new Float64Array(m + 1);
  const treeAt = new Int32Array(m + 1).fill(-1);
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
  let i = 0;
  candidates.forEach((f, a) => {
    const order = f.j.map((_j, k) => k).sort((x, y) => f.j[y]! - f.j[x]!);
    for (const k of order) {
      const j = f.j[k]!;
      const before = best(j);
      pairA[i] = a;
      pairJ[i] = j;
      pairCount[i] = before.count + 1;
      pairGap[i] = before.g + f.gap[k]!;
      prev[i] = before.at;
      for (let x = j + 1; x <= m; x += x & -x) {
        if (pairCount[i]! > treeCount[x]! || (pairCount[i] === treeCount[x] && pairGap[i]! < treeGap[x]!)) {
          treeCount[x] = pairCount[i]!;
          treeGap[x] = pairGap[i]!;
          treeAt[x] = i;
        }
      }
      i++;
    }
  });
  const copyOf = new Array<number>(candidates.length).fill(-1);
  for (let p = best(m).at; p >= 0; p = prev[p]!) copyOf[pairA[p]!] = pairJ[p]!;
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
  /** Headers whose text history.db holds with a time (at most MAX_SAMPLES, rare texts first). */
  samples: number;
}

const naiveOf = (w: ReturnType<typeof wallClock>) =>
  `${w.year}-${w.month}-${w.day} ${w.hour}:${w.minute}:${w.second}`;

/**
 * The instants a naive local time names in `zone`: none (no date), one, or two in a fall-back
 * overlap (01:10 in New York on 2025-11-02 happened in EDT and again an hour later in EST),
 * earlier first. `parseSentAt` takes the earlier one.
 */
export function localInstants(naive: string, zone: string): bigint[] {
  const early = parseSentAt(naive, zone);
  if (typeof early !== 'bigint') return [];
  const ms = Number(early / 1_000_000n);
  const drop = zoneOffsetMs(zone, ms) - zoneOffsetMs(zone, ms + 86_400_000);
  if (drop <= 0) return [early];
  const late = ms + drop;
  return naiveOf(wallClock(zone, late)) === naive ? [early, BigInt(late) * 1_000_000n] : [early];
}

/**
 * history.json's headers are naive local times; history.db stores absolute ones. The zone is the
 * one in which the most headers whose text history.db holds line up with a copy (the given zone
 * wins ties; another must line up at least half). Candidates besides the given zone: the zones at
 * the offset between the last header and history.db's last copy of its text (history.json is
 * history.db's tail, which tells a periodic text's true offset from the others that line it up
 * as well), then at the offsets most headers vote for. Null when there is nothing to compare.
 * `archive`: the timed history.db rows' times by key, ascending.
 */
export function lineUpZone(
  headers: Array<{ key: string; naive: string }>,
  archive: Map<string, bigint[]>,
  given: string,
): ZoneReading | null {
  const comparable = headers.filter((h) => archive.has(h.key));
  if (comparable.length === 0) return null;
  // Samples spread evenly, texts history.db holds once or twice first: a text repeated on a
  // schedule finds a copy in many wrong zones (west of UTC, read as UTC, every "status?" has one
  // a few hours earlier), a rare text only in the right one.
  const spread = <T>(from: T[], n: number): T[] => {
    const step = Math.max(1, from.length / n);
    const out: T[] = [];
    for (let i = 0; i < from.length && out.length < n; i += step) out.push(from[Math.floor(i)]!);
    return out;
  };
  const rare = spread(
    comparable.filter((h) => archive.get(h.key)!.length <= 2),
    MAX_SAMPLES / 2,
  );
  const taken = new Set(rare);
  const samples = [
    ...rare,
    ...spread(
      comparable.filter((h) => !taken.has(h)),
      MAX_SAMPLES - rare.length,
    ),
  ];
  const lined = (zone: string) =>
    samples.filter((s) =>
      localInstants(s.naive, zone).some((ns) => nearest(archive.get(s.key)!, ns) <= Number(NEAR_NS)),
    ).length;
  const givenLined = lined(given);
  let best = { zone: given, lined: givenLined };
  const reading = () => ({ ...best, givenLined, samples: samples.length });
  if (givenLined === samples.length) return reading();

  const asUtc = (s: { naive: string }) => BigInt(Date.parse(`${s.naive.replace(' ', 'T')}Z`)) * 1_000_000n;
  /** The whole quarter hour within NEAR_NS of `diff` (header read as UTC minus a copy's time). */
  const quarter = (diff: bigint): bigint | null => {
    const q = (diff + (diff < 0n ? -QUARTER_HOUR_NS : QUARTER_HOUR_NS) / 2n) / QUARTER_HOUR_NS;
    const off = q * QUARTER_HOUR_NS;
    return q < -56n || q > 56n || gap(diff, off) > Number(NEAR_NS) ? null : off;
  };
  const offsets: Array<{ off: bigint; probe: { naive: string } }> = [];
  const last = comparable.at(-1)!;
  const tail = quarter(asUtc(last) - archive.get(last.key)!.at(-1)!);
  if (tail !== null) offsets.push({ off: tail, probe: last });
  // Offsets near a whole quarter hour, by votes.
  const votes = new Map<bigint, { count: number; sample: number }>();
  samples.forEach((s, i) => {
    const seen = new Set<bigint>();
    for (const ns of archive.get(s.key)!) {
      const off = quarter(asUtc(s) - ns);
      if (off === null || seen.has(off)) continue;
      seen.add(off);
      const v = votes.get(off) ?? { count: 0, sample: i };
      v.count++;
      votes.set(off, v);
    }
  });
  for (const [off, v] of [...votes].sort((x, y) => y[1].count - x[1].count)) {
    if (offsets.length >= 4) break;
    if (off !== tail) offsets.push({ off, probe: samples[v.sample]! });
  }
  const zones = [...new Set([...PREFERRED, ...Intl.supportedValuesOf('timeZone')])];
  for (const { off, probe } of offsets) {
    // Zones that read the probe's instant as its header (checked whole, so daylight saving counts).
    const want = Number((asUtc(probe) - off) / 1_000_000n);
    for (const zone of zones) {
      if (zone === given || naiveOf(wallClock(zone, want)) !== probe.naive) continue;
      const n = lined(zone);
      if (n > best.lined) best = { zone, lined: n };
    }
  }
  if (best.zone !== given && best.lined * 2 < samples.length) best = { zone: given, lined: givenLined };
  return reading();
}

/** Distance from `ns` to the nearest of `sorted`. */
export function nearest(sorted: bigint[], ns: bigint): number {
  const i = lowerBound(sorted.length, (k) => sorted[k]! >= ns);
  let d = Infinity;
  if (i < sorted.length) d = gap(sorted[i]!, ns);
  if (i > 0) d = Math.min(d, gap(sorted[i - 1]!, ns));
  return d;
}
