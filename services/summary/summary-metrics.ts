import { Counter, Gauge } from 'prom-client';
import type { Registry } from 'prom-client';
import type { Queryable } from '../../db/pool.js';
import { countStalledSummaries } from '../../db/queries/summaries.js';
import { orNull } from '../deadline.js';

/** Summary metrics, on the process registry; no tenant or session labels. */
export interface SummaryMetrics {
  jobs: Counter<'outcome'>;
  chunks: Counter<'outcome'>;
  noiseDropped: Counter;
}

const SAMPLE_TIMEOUT_MS = 1000;

function once<T>(registry: Registry, name: string, make: () => T): T {
  return (registry.getSingleMetric(name) as T | undefined) ?? make();
}

export function makeSummaryMetrics(registry: Registry, db: Queryable): SummaryMetrics {
  // Sampled on scrape with a short deadline; a Postgres outage leaves the last value.
  once(
    registry,
    'mnemos_summaries_stalled',
    () =>
      new Gauge({
        name: 'mnemos_summaries_stalled',
        help: 'Summaries stalled after repeated failures (sampled at scrape by every process: aggregate with max(), not sum())',
        registers: [registry],
        async collect() {
          const n = await orNull(countStalledSummaries(db), SAMPLE_TIMEOUT_MS);
          if (n !== null) this.set(n);
        },
      }),
  );
  return {
    jobs: once(
      registry,
      'mnemos_summarize_jobs_total',
      () =>
        new Counter({
          name: 'mnemos_summarize_jobs_total',
          help: 'Summarize jobs by outcome (summarized, pruned, cursor_set, noop, failed, deferred, busy, lost_race, gone, disabled, stopped)',
          labelNames: ['outcome'] as const,
          registers: [registry],
        }),
    ),
    chunks: once(
      registry,
      'mnemos_summary_chunks_total',
      () =>
        new Counter({
          name: 'mnemos_summary_chunks_total',
          help: 'Summary chunks sent to the model, by outcome (merged; failed; refused: split or held, the endpoint refused it for its content or size) and messages left out of the summary (skipped)',
          labelNames: ['outcome'] as const,
          registers: [registry],
        }),
    ),
    noiseDropped: once(
      registry,
      'mnemos_summary_noise_dropped_total',
      () =>
        new Counter({
          name: 'mnemos_summary_noise_dropped_total',
          help: 'Conversations the decision model dropped as noise before summarising',
          registers: [registry],
        }),
    ),
  };
}
