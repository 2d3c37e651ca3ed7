import type { ServerResponse } from 'node:http';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';

/**
 * One registry per process (not prom-client's global one, so tests can build several apps).
 * No tenant or session labels: their cardinality is unbounded.
 */
export function makeMetrics(opts: { defaultMetrics?: boolean } = {}) {
  const registry = new Registry();
  if (opts.defaultMetrics) collectDefaultMetrics({ register: registry, prefix: 'mnemos_' });
  const m = {
    registry,
    httpDuration: new Histogram({
      name: 'mnemos_http_request_duration_seconds',
      help: 'HTTP request duration by method, route and status: every answer, those given before any route ran under route "unmatched" (method "unknown" when Node could not parse the request)',
      labelNames: ['method', 'route', 'status'] as const,
      // Up to 60 s: a summarize?wait=true waits that long, and would otherwise land in +Inf only.
      buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
      registers: [registry],
    }),
    messagesAccepted: new Counter({
      name: 'mnemos_messages_accepted_total',
      help: 'Messages accepted by the API (new, not idempotent repeats)',
      registers: [registry],
    }),
    messagesDuplicate: new Counter({
      name: 'mnemos_messages_duplicate_total',
      help: 'Idempotent re-posts answered with the original seq',
      registers: [registry],
    }),
    messagesArchived: new Counter({
      name: 'mnemos_messages_archived_total',
      help: 'Messages written to the archive by ingest workers',
      registers: [registry],
    }),
    messagesDropped: new Counter({
      name: 'mnemos_messages_dropped_total',
      help: 'Inbox entries dropped because their session was reset or deleted, or their tenant erased, meanwhile, or their id was archived already (Redis lost its id state), or their seq went to another message (another Redis namespace was used meanwhile)',
      registers: [registry],
    }),
    ingestDeadLetter: new Counter({
      name: 'mnemos_ingest_dead_letter_total',
      help: 'Unreadable inbox entries moved to the per-session dead-letter list, or removed with it by a reset or delete',
      registers: [registry],
    }),
    ingestInboxMoved: new Counter({
      name: 'mnemos_ingest_inbox_moved_total',
      help: 'Drains rolled back because the inbox no longer held what they read (Redis came back behind them)',
      registers: [registry],
    }),
    redisBehind: new Counter({
      name: 'mnemos_redis_behind_total',
      help: "Accepts that found a session's Redis counter behind its archive: Redis lost acknowledged writes (a snapshot restore, a lagging replica promoted)",
      registers: [registry],
    }),
    jobDuration: new Histogram({
      name: 'mnemos_job_duration_seconds',
      help: 'Job processing time by queue: runs that end their job (done or failed), not runs that put it back (delayed, rate-limited)',
      labelNames: ['queue'] as const,
      // Up to 10 minutes: a summary job runs several LLM calls of up to 60 s each in turn.
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600],
      registers: [registry],
    }),
    jobFailures: new Counter({
      name: 'mnemos_job_failures_total',
      help: 'Failed job attempts by queue and whether the job is now dead-lettered (no attempts left)',
      labelNames: ['queue', 'final'] as const,
      registers: [registry],
    }),
    queueJobs: new Gauge({
      name: 'mnemos_queue_jobs',
      help: 'Jobs per queue and state (sampled); delayed includes the next run each job scheduler keeps there, a constant baseline',
      labelNames: ['queue', 'state'] as const,
      registers: [registry],
    }),
    queueOldestAge: new Gauge({
      name: 'mnemos_queue_oldest_job_age_seconds',
      help: 'Age of the oldest waiting job per queue (sampled)',
      labelNames: ['queue'] as const,
      registers: [registry],
    }),
    queuePaused: new Gauge({
      name: 'mnemos_queue_paused',
      help: 'Whether the queue is paused (Bull Board or the BullMQ API), 1 or 0 (sampled): no worker takes its jobs',
      labelNames: ['queue'] as const,
      registers: [registry],
    }),
    queueLongestActive: new Gauge({
      name: 'mnemos_queue_longest_active_job_seconds',
      help: 'How long the longest-running active job per queue has run, 0 when none (sampled): a job stuck on a dead connection',
      labelNames: ['queue'] as const,
      registers: [registry],
    }),
    summaryLag: new Gauge({
      name: 'mnemos_summary_lag_seconds',
      help: 'Age of the oldest archived message not yet summarised (sampled every minute; 0 without an LLM)',
      registers: [registry],
    }),
    errorMemoryHits: new Counter({
      name: 'mnemos_error_memory_hits_total',
      help: 'Error-memory records returned, by via: search, lookup, get (a read by id)',
      labelNames: ['via'] as const,
      registers: [registry],
    }),
    errorMemorySkipped: new Counter({
      name: 'mnemos_error_memory_upkeep_skipped_total',
      help: "Error-memory upkeep skipped because Redis refused writes (full under noeviction, read-only): a hit's TTL renewal (renew), dropping ids whose record is gone (forget), marking deleted ids for the sweep (mark)",
      labelNames: ['step'] as const,
      registers: [registry],
    }),
    rateLimited: new Counter({
      name: 'mnemos_rate_limited_total',
      help: 'Requests refused with 429 by the per-key rate limit',
      registers: [registry],
    }),
    enqueueFailures: new Counter({
      name: 'mnemos_enqueue_failures_total',
      help: 'Flush requests that could not be enqueued (the ingest sweeper recovers them)',
      registers: [registry],
    }),
    llmCalls: new Counter({
      name: 'mnemos_llm_calls_total',
      help: 'LLM call attempts (each retry counts) by purpose, model and outcome: ok, or the failure kind; an answer with text under HTTP 200 is ok even when its caller cannot use it',
      labelNames: ['purpose', 'model', 'outcome'] as const,
      registers: [registry],
    }),
    llmTokens: new Counter({
      name: 'mnemos_llm_tokens_total',
      help: 'LLM tokens by purpose, model and direction (input, output)',
      labelNames: ['purpose', 'model', 'direction'] as const,
      registers: [registry],
    }),
  };
  return m;
}

export type Metrics = ReturnType<typeof makeMetrics>;

/**
 * Times one answer into mnemos_http_request_duration_seconds, from now until it is sent. An answer
 * its client gave up on never finishes: it is timed when its connection closes, with status 499
 * (nginx's "client closed request"); otherwise the slowest requests, those whose clients time out,
 * would drop out of the request rate and the latency quantiles. The labels are read when the answer
 * ends (the route is known only once the app has routed the request).
 */
export function timeAnswer(
  metrics: Pick<Metrics, 'httpDuration'>,
  res: ServerResponse,
  labels: () => { method: string; route: string },
): void {
  const end = metrics.httpDuration.startTimer();
  let timed = false;
  const record = (status: string) => {
    if (timed) return;
    timed = true;
    end({ ...labels(), status });
  };
  res.on('finish', () => record(String(res.statusCode)));
  res.on('close', () => record(res.writableFinished ? String(res.statusCode) : '499'));
}
