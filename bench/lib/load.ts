/**
 * A closed-loop load driver: `concurrency` callers, each starting its next operation as soon as
 * the previous one finished, until `maxOps` operations were started or `maxDurationMs` passed
 * (whichever first; both bounds are mandatory so a bench always stops by itself). Latency is
 * measured per operation with a monotonic clock; failures are counted by label, not retried.
 */
import { performance } from 'node:perf_hooks';

export interface LoadOptions<R> {
  concurrency: number;
  maxOps: number;
  maxDurationMs: number;
  /** Operation number i (0-based, in start order). Throw or return `{ ok: false }` for a failure. */
  op: (i: number) => Promise<R>;
  /** Classifies a result; default: every resolved op is ok. */
  classify?: (r: R) => { ok: boolean; label?: string };
  /** Called after every op (progress counters); r is undefined when the op threw. */
  onDone?: (r: R | undefined, i: number) => void;
}

export interface LoadResult<R> {
  started: number;
  ok: number;
  failed: number;
  failures: Record<string, number>;
  /** Latencies of successful ops, ms. */
  latencies: number[];
  /** performance.now() of the first start and of the last completion. */
  t0: number;
  t1: number;
  results: R[];
  stoppedBy: 'count' | 'time';
}

export async function closedLoop<R>(o: LoadOptions<R>): Promise<LoadResult<R>> {
  if (!(o.maxOps > 0) || !(o.maxDurationMs > 0))
    throw new Error('closedLoop needs positive maxOps and maxDurationMs');
  const latencies: number[] = [];
  const results: R[] = [];
  const failures: Record<string, number> = {};
  let next = 0;
  let ok = 0;
  let failed = 0;
  let stoppedBy: 'count' | 'time' = 'count';
  const t0 = performance.now();
  const deadline = t0 + o.maxDurationMs;
  let t1 = t0;

  const caller = async () => {
    for (;;) {
      if (next >= o.maxOps) return;
      if (performance.now() >= deadline) {
        stoppedBy = 'time';
        return;
      }
      const i = next++;
      const start = performance.now();
      let r: R | undefined;
      try {
        r = await o.op(i);
        const c = o.classify ? o.classify(r) : { ok: true };
        const end = performance.now();
        t1 = Math.max(t1, end);
        if (c.ok) {
          ok++;
          latencies.push(end - start);
          results.push(r);
        } else {
          failed++;
          const label = c.label ?? 'failed';
          failures[label] = (failures[label] ?? 0) + 1;
        }
      } catch (err) {
        t1 = Math.max(t1, performance.now());
        failed++;
        const label = (err as Error)?.message?.slice(0, 80) ?? 'error';
        failures[label] = (failures[label] ?? 0) + 1;
      }
      o.onDone?.(r, i);
    }
  };
  await Promise.all(Array.from({ length: o.concurrency }, caller));
  return { started: next, ok, failed, failures, latencies, t0, t1, results, stoppedBy };
}

/** Polls `check` every `everyMs` until it returns true or `timeoutMs` passes; returns the time it did. */
export async function pollUntil(
  check: () => Promise<boolean>,
  opts: { everyMs: number; timeoutMs: number },
): Promise<{ done: boolean; at: number }> {
  const deadline = performance.now() + opts.timeoutMs;
  for (;;) {
    if (await check()) return { done: true, at: performance.now() };
    if (performance.now() >= deadline) return { done: false, at: performance.now() };
    await new Promise((r) => setTimeout(r, opts.everyMs));
  }
}
