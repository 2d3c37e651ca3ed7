/** Latency and rate arithmetic shared by the benches. Times are milliseconds unless named otherwise. */

export interface LatencySummary {
  n: number;
  mean: number;
  p50: number;
  p90: number;
  p99: number;
  max: number;
}

/** Nearest-rank percentile of an ascending array (p in 0..100); NaN for an empty array. */
export function percentile(sorted: readonly number[], p: number): number {
  if (sorted.length === 0) return Number.NaN;
  const rank = Math.ceil((p / 100) * sorted.length);
  return sorted[Math.min(sorted.length - 1, Math.max(0, rank - 1))]!;
}

export function summarize(samples: readonly number[]): LatencySummary {
  const s = [...samples].sort((a, b) => a - b);
  const sum = s.reduce((a, b) => a + b, 0);
  return {
    n: s.length,
    mean: s.length ? sum / s.length : Number.NaN,
    p50: percentile(s, 50),
    p90: percentile(s, 90),
    p99: percentile(s, 99),
    max: s.length ? s[s.length - 1]! : Number.NaN,
  };
}

/** Items per second over a wall-clock interval in milliseconds. */
export const perSecond = (count: number, ms: number): number => (ms > 0 ? (count * 1000) / ms : Number.NaN);

/** a / b, NaN when either side is missing. */
export const ratio = (a: number | null | undefined, b: number | null | undefined): number =>
  a == null || b == null || !Number.isFinite(a) || !Number.isFinite(b) || b === 0 ? Number.NaN : a / b;
