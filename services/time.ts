/**
 * Timestamps are stored as UTC unix nanoseconds (bigint). Clients send RFC 3339, unix ns as a
 * decimal string (a JSON number cannot hold ns precisely), or naive `YYYY-MM-DD HH:MM:SS` in TZ.
 */

/**
 * Milliseconds on a clock that never steps (the process's start plus the monotonic time since):
 * for durations and deadlines inside one process. Date.now() follows the wall clock, which NTP or
 * a resumed VM moves: a cache entry stamped before a step back of an hour stayed fresh for that
 * hour, and a key revoked elsewhere kept working here.
 */
export const monotonicNow = (): number => performance.timeOrigin + performance.now();

// RFC 3339 allows any number of fractional digits; those past nanoseconds are dropped (truncated).
const RFC3339 = /^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$/;
const NAIVE = /^(\d{4})-(\d{2})-(\d{2}) (\d{2}):(\d{2}):(\d{2})$/;
const UNIX_NS = /^\d{1,19}$/;
// 1970 .. 2262 (int64 ns range); anything else is a client bug.
const MAX_NS = 9_223_372_036_854_775_807n;
// Before this year no offset reaches 1970. It is checked before Date.UTC, which reads a year of
// 0–99 as 1900–1999: `0070-01-01T00:00:00Z` was stored as 1970, `0099-06-15` as 1999.
const FIRST_YEAR = 1969;
const BEFORE_1970 = 'dates before 1970 are not supported';

function validParts(y: number, mo: number, d: number, h: number, mi: number, s: number): boolean {
  if (mo < 1 || mo > 12 || d < 1 || h > 23 || mi > 59 || s > 59) return false;
  const dim = new Date(Date.UTC(y, mo, 0)).getUTCDate();
  return d <= dim;
}

const wallClockFormatters = new Map<string, Intl.DateTimeFormat>();

export interface WallClock {
  year: string;
  month: string;
  day: string;
  hour: string;
  minute: string;
  second: string;
  /** `+08:00`, `-05:00`, `+00:00`. */
  offset: string;
}

/**
 * The wall-clock reading of an instant in `zone`. Building an Intl formatter costs far more than
 * using one (and this runs per message), so there is one per zone, reused.
 */
export function wallClock(zone: string, utcMs: number): WallClock {
  let f = wallClockFormatters.get(zone);
  if (!f) {
    f = new Intl.DateTimeFormat('en-US', {
      timeZone: zone,
      hourCycle: 'h23',
      year: 'numeric',
      month: '2-digit',
      day: '2-digit',
      hour: '2-digit',
      minute: '2-digit',
      second: '2-digit',
      timeZoneName: 'longOffset',
    });
    wallClockFormatters.set(zone, f);
  }
  const p = Object.fromEntries(f.formatToParts(new Date(utcMs)).map((x) => [x.type, x.value]));
  return {
    year: p.year!,
    month: p.month!,
    day: p.day!,
    hour: p.hour!,
    minute: p.minute!,
    second: p.second!,
    offset: (p.timeZoneName ?? 'GMT').replace(/^GMT/, '') || '+00:00',
  };
}

/** Offset of `zone` from UTC in ms at the given UTC instant. */
export function zoneOffsetMs(zone: string, utcMs: number): number {
  const p = wallClock(zone, utcMs);
  const asUtc = Date.UTC(+p.year, +p.month - 1, +p.day, +p.hour, +p.minute, +p.second);
  return asUtc - Math.floor(utcMs / 1000) * 1000;
}

/** Wall-clock time in `zone` → UTC ms (two passes settle DST transitions). */
export function zonedToUtcMs(
  zone: string,
  y: number,
  mo: number,
  d: number,
  h: number,
  mi: number,
  s: number,
): number {
  const naive = Date.UTC(y, mo - 1, d, h, mi, s);
  // The zone's offsets a day either side (zones change offset at most once in two days).
  const before = naive - zoneOffsetMs(zone, naive - DAY_MS);
  const after = naive - zoneOffsetMs(zone, naive + DAY_MS);
  const exists = [before, after].filter((u) => u + zoneOffsetMs(zone, u) === naive);
  // A wall time that exists once, or twice in a fall-back overlap (then the earlier instant).
  if (exists.length > 0) return Math.min(...exists);
  // A wall time in a spring-forward gap never happened: read it with the offset from before the
  // change (02:30 in New York's gap is 03:30 EDT, as Temporal's "compatible" does), so it never
  // lands before the times written ahead of the gap.
  return before;
}

const DAY_MS = 86_400_000;

/** Every form ends as int64 nanoseconds (the archive's `sent_at_ns`): later dates do not fit. */
const inRange = (ns: bigint): bigint | string =>
  ns <= MAX_NS ? ns : 'dates after 2262-04-11T23:47:16.854775807Z are not supported';

/** Parses a client `sent_at`; returns unix ns, or an error message for the 400. */
export function parseSentAt(value: string, zone: string): bigint | string {
  const v = value.trim();
  if (UNIX_NS.test(v)) {
    const ns = BigInt(v);
    return ns <= MAX_NS ? ns : 'unix nanoseconds out of range';
  }
  let m = RFC3339.exec(v);
  if (m) {
    const [y, mo, d, h, mi, s] = m.slice(1, 7).map(Number) as [
      number,
      number,
      number,
      number,
      number,
      number,
    ];
    if (y < FIRST_YEAR) return BEFORE_1970;
    if (!validParts(y, mo, d, h, mi, s)) return 'not a valid date/time';
    const frac = (m[7] ?? '.').slice(1, 10).padEnd(9, '0');
    const tz = m[8]!;
    let offsetMin = 0;
    if (tz !== 'Z' && tz !== 'z') {
      const sign = tz[0] === '-' ? -1 : 1;
      const [oh, om] = [Number(tz.slice(1, 3)), Number(tz.slice(4, 6))];
      // RFC 3339's offset is a time of day: +24:00 or +05:60 is no offset.
      if (oh > 23 || om > 59) return 'not a valid UTC offset';
      offsetMin = sign * (oh * 60 + om);
    }
    const ms = Date.UTC(y, mo - 1, d, h, mi, s) - offsetMin * 60_000;
    if (ms < 0) return BEFORE_1970;
    return inRange(BigInt(ms) * 1_000_000n + BigInt(frac));
  }
  m = NAIVE.exec(v);
  if (m) {
    const [y, mo, d, h, mi, s] = m.slice(1, 7).map(Number) as [
      number,
      number,
      number,
      number,
      number,
      number,
    ];
    if (y < FIRST_YEAR) return BEFORE_1970;
    if (!validParts(y, mo, d, h, mi, s)) return 'not a valid date/time';
    const ms = zonedToUtcMs(zone, y, mo, d, h, mi, s);
    if (ms < 0) return BEFORE_1970;
    return inRange(BigInt(ms) * 1_000_000n);
  }
  return 'must be RFC 3339 (2026-01-02T03:04:05Z), unix nanoseconds as a decimal string, or "YYYY-MM-DD HH:MM:SS"';
}

export const nowNs = (): bigint => BigInt(Date.now()) * 1_000_000n;

/** RFC 3339 in UTC with nanosecond precision. */
export function nsToRfc3339(ns: bigint | string): string {
  const n = BigInt(ns);
  const ms = Number(n / 1_000_000n);
  const frac = (n % 1_000_000_000n).toString().padStart(9, '0');
  return new Date(ms).toISOString().replace(/\.\d{3}Z$/, `.${frac}Z`);
}
