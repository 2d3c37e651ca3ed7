/**
 * Ingestion benchmark (issue 3): how fast messages become durable in the archive, end to end
 * through the API, against the storage limit and against LangChain's Postgres chat history.
 * Method, flags and results: docs/benchmarks.md.
 *
 *   npm run bench -- ingest [--phases parts,a,b1,b2,c] [--scale 1] [--topology serve|split]
 *     [--extensions default|none] [--no-ids] [--a-batch 50] [--env KEY=VALUE ...] [--in-process]
 *     [--server-node-args='--cpu-prof …'] [--json <file>]
 *
 * Phases (all on the same Postgres and Redis, each on its own scratch database):
 *   parts  CPU µs per message of each JavaScript step of the path.
 *   a      storage limit: insertArchiveBatch of 50 rows (built as the ingest worker builds them)
 *          into the migrated `messages` table (GIN over the tsvector), 8 writers on 8 connections.
 *   b1     end to end: POST batches of 50 over 100 sessions, 16 closed-loop clients; throughput
 *          counts from the first request to the moment the last message is archived.
 *   b2     the same with one message per request.
 *   c      LangChain PostgresChatMessageHistory.addMessage over 50 sessions, 16 callers (from the
 *          isolated bench/peers project; a labelled non-LangChain stand-in if it cannot load).
 * Diagnostic phases (not in the default run): a-tx (phase a in the drain's transaction shape:
 * lock session row, insert, update counters), b1-split (accept with the API alone, then drain
 * with a worker alone, to separate the two halves of b1) and a-cost (Postgres CPU per archived
 * row, with the full-text index, the tsvector and the secondary indexes taken away in turn).
 *
 * Every loop is bounded by a count and a time; scratch databases and Redis keys are removed at the
 * end, also on failure or Ctrl-C. Numbers vary with the machine's load: compare the ratios.
 */
import { readFileSync, mkdirSync, writeFileSync } from 'node:fs';
import { availableParallelism, loadavg } from 'node:os';
import path from 'node:path';
import { performance } from 'node:perf_hooks';
import { parseArgs } from 'node:util';
import { makePgDb, vectorArrayParam, withTransaction } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { ARCHIVE_TSVECTOR_SQL, archiveBatch, insertArchiveBatch } from '../db/queries/messages.js';
import { lockOrCreateSession } from '../db/queries/sessions.js';
import { localEmbed } from '../services/llm/local-embedder.js';
import { parseMessages } from '../services/messages/message-input.js';
import type { AcceptedMessage } from '../services/messages/message-input.js';
import { createTenant } from '../services/tenants.js';
import { archiveRows } from './lib/archive-rows.js';
import { makeCorpus } from './lib/corpus.js';
import { cpuDiff, cpuSnapshot, pidsByName, procCpuSeconds } from './lib/cpu.js';
import type { CpuProbe, CpuUsage } from './lib/cpu.js';
import { fmtInt, fmtMs, fmtPct, fmtRatio, fmtSec, markdownTable, note } from './lib/format.js';
import { makeJsonClient } from './lib/http-client.js';
import { closedLoop, pollUntil } from './lib/load.js';
import { metricSum, startBenchService } from './lib/mnemos-service.js';
import { ensurePeers, peerVersion, requirePeer } from './lib/peers.js';
import {
  ADMIN_URL,
  cleanupOnSignals,
  cleanupScratch,
  createScratchDatabase,
  dropStaleScratchDatabases,
  onCleanup,
  scratchPrefix,
} from './lib/scratch.js';
import type { ScratchDatabase } from './lib/scratch.js';
import { perSecond, ratio, summarize } from './lib/stats.js';
import type { LatencySummary } from './lib/stats.js';

const { values: args } = parseArgs({
  options: {
    phases: { type: 'string', default: 'parts,a,b1,b2,c' },
    scale: { type: 'string', default: '1' },
    'in-process': { type: 'boolean', default: false },
    extensions: { type: 'string', default: 'default' },
    'no-ids': { type: 'boolean', default: false },
    env: { type: 'string', multiple: true, default: [] },
    'server-node-args': { type: 'string', default: '' },
    'a-batch': { type: 'string', default: '50' },
    topology: { type: 'string', default: 'serve' },
    'no-langchain': { type: 'boolean', default: false },
    json: { type: 'string' },
  },
});

const SCALE = Number(args.scale);
if (!(SCALE > 0 && SCALE <= 10)) throw new Error('--scale must be in (0, 10]');
const PHASES = new Set(args.phases.split(',').map((p) => p.trim()));
const KNOWN = ['parts', 'a', 'a-tx', 'a-cost', 'b1', 'b2', 'c', 'b1-split'];
for (const p of PHASES)
  if (!KNOWN.includes(p)) throw new Error(`unknown phase "${p}" (known: ${KNOWN.join(', ')})`);
if (!['default', 'none'].includes(args.extensions)) throw new Error('--extensions is default or none');
const EXTENSIONS = args.extensions as 'default' | 'none';
const SERVICE_ENV = Object.fromEntries(
  args.env.map((kv) => {
    const i = kv.indexOf('=');
    if (i <= 0) throw new Error(`--env wants KEY=VALUE, got "${kv}"`);
    return [kv.slice(0, i), kv.slice(i + 1)];
  }),
);
const CLIENT_IDS = !args['no-ids'];
if (!['serve', 'split'].includes(args.topology)) throw new Error('--topology is serve or split');
/** serve: one `mnemos serve` process (what `npm start` runs); split: one `mnemos api` + one `mnemos worker`. */
const TOPOLOGY = args.topology as 'serve' | 'split';
const SERVER_NODE_ARGS = args['server-node-args'].split(' ').filter(Boolean);

/** Bounds of every phase (count × scale, and a time cap that does not scale). */
const LIMITS = {
  a: { rows: Math.round(60_000 * SCALE), ms: 20_000 },
  b1: { requests: Math.round(2000 * SCALE), ms: 60_000, drainMs: 60_000 },
  b2: { requests: Math.round(20_000 * SCALE), ms: 30_000, drainMs: 30_000 },
  c: { messages: Math.round(60_000 * SCALE), ms: 20_000 },
};
const BATCH = 50;
/** Rows per INSERT in phases a and a-tx (diagnostic knob; the reference is 50, like b1's requests). */
const STORAGE_BATCH = Number(args['a-batch']);
if (!(Number.isInteger(STORAGE_BATCH) && STORAGE_BATCH >= 1 && STORAGE_BATCH <= 1000)) {
  throw new Error('--a-batch must be an integer from 1 to 1000');
}
const SESSIONS_B = 100;
const SESSIONS_C = 50;
const CLIENTS = 16;
/** Phase a: writers = connections. WORKER_CONCURRENCY (default 8) bounds the concurrent drains of b. */
const WRITERS_A = 8;
/** Phase c: pg.Pool's default size, which is also the size of mnemos's own pool. */
const POOL_C = 10;

const corpus = makeCorpus();

const sessionId = (s: number) => `s${String(s).padStart(3, '0')}`;

function wireMessages(session: number, firstPos: number, n: number) {
  return Array.from({ length: n }, (_, k) => {
    const m = corpus.message(session, firstPos + k);
    return CLIENT_IDS ? { id: `m-${firstPos + k}`, ...m } : m;
  });
}

interface PhaseResult {
  phase: string;
  label: string;
  messages: number;
  wallMs: number;
  rate: number;
  ack?: LatencySummary;
  opLatency?: LatencySummary;
  failures: Record<string, number>;
  cpu?: CpuUsage;
  details: Record<string, string | number>;
}

const results: PhaseResult[] = [];
let partsTable: string[][] | null = null;

function backendProbe(db: Db, name: string): CpuProbe {
  return {
    label: 'postgres backends (scratch db)',
    pids: async () =>
      (
        await db.query<{ pid: number }>(
          'SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()',
          [name],
        )
      ).rows.map((r) => r.pid),
  };
}

const redisProbe: CpuProbe = { label: 'redis-server (shared)', pids: () => pidsByName('redis-server') };
const selfProbe = (label: string): CpuProbe => ({ label, pids: async () => [process.pid] });
/** The HTTP load generator stands for remote clients: its CPU is shown but not charged to the system. */
const LOAD_GENERATOR = 'load generator (not charged)';

/**
 * CPU core-milliseconds per stored message of the processes doing the storing (the writer or
 * mnemos, its Postgres backends, Redis): a cost that the machine's other load barely moves,
 * unlike wall-clock rates. Postgres's shared background processes (WAL writer, checkpointer) are
 * not included; Redis is the whole shared server.
 */
function cpuMsPerMessage(r: Pick<PhaseResult, 'cpu' | 'messages'>): number {
  if (!r.cpu || r.messages === 0) return Number.NaN;
  const charged = Object.entries(r.cpu.groups)
    .filter(([k]) => k !== LOAD_GENERATOR)
    .reduce((a, [, v]) => a + v, 0);
  return (charged * 1000) / r.messages;
}

function printPhase(r: PhaseResult): void {
  const lines = [
    `\n## ${r.phase}: ${r.label}`,
    `messages ${fmtInt(r.messages)} in ${fmtSec(r.wallMs)} → ${fmtInt(r.rate)} msgs/s`,
  ];
  if (r.ack)
    lines.push(
      `ack latency p50 ${fmtMs(r.ack.p50)}, p90 ${fmtMs(r.ack.p90)}, p99 ${fmtMs(r.ack.p99)}, max ${fmtMs(r.ack.max)}`,
    );
  if (r.opLatency) lines.push(`op latency p50 ${fmtMs(r.opLatency.p50)}, p99 ${fmtMs(r.opLatency.p99)}`);
  if (Object.keys(r.failures).length) lines.push(`FAILURES: ${JSON.stringify(r.failures)}`);
  for (const [k, v] of Object.entries(r.details))
    lines.push(`${k}: ${typeof v === 'number' ? fmtInt(v) : v}`);
  if (r.cpu) {
    const g = Object.entries(r.cpu.groups)
      .map(([k, v]) => `${k} ${(v / r.cpu!.wallSeconds).toFixed(2)}`)
      .join(', ');
    lines.push(
      `CPU (average cores over ${r.cpu.wallSeconds.toFixed(1)} s): machine ${r.cpu.machineCores.toFixed(2)} of ${availableParallelism()}; ${g}`,
    );
    lines.push(`CPU cost: ${cpuMsPerMessage(r).toFixed(3)} core-ms per message`);
  }
  process.stdout.write(`${lines.join('\n')}\n`);
}

/** Builds the accepted messages of phase a's batches (API validation is not part of the storage limit). */
function buildBatches(
  count: number,
): Array<{ session: number; firstSeq: number; messages: AcceptedMessage[] }> {
  return Array.from({ length: count }, (_, k) => {
    const session = k % SESSIONS_B;
    const firstPos = Math.floor(k / SESSIONS_B) * STORAGE_BATCH;
    return {
      session,
      firstSeq: firstPos + 1,
      messages: parseMessages({ messages: wireMessages(session, firstPos, STORAGE_BATCH) }, 'UTC'),
    };
  });
}

async function phaseStorage(txShape: boolean): Promise<void> {
  const phase = txShape ? 'a-tx' : 'a';
  const scratch = await createScratchDatabase(phase.replace('-', '_'));
  const db = makePgDb({ connectionString: scratch.url, max: WRITERS_A, applicationName: 'mnemos-bench' });
  const monitor = makePgDb({
    connectionString: scratch.url,
    max: 1,
    applicationName: 'mnemos-bench-monitor',
  });
  onCleanup(() => db.close().catch(() => undefined));
  onCleanup(() => monitor.close().catch(() => undefined));
  try {
    const { tenant_id: tenantId } = await createTenant(db, 'bench');
    for (let s = 0; s < SESSIONS_B; s++) {
      await withTransaction(db, (tx) => lockOrCreateSession(tx, tenantId, sessionId(s)));
    }
    const batches = buildBatches(Math.ceil(LIMITS.a.rows / STORAGE_BATCH));
    // Open every connection before the clock starts.
    await Promise.all(
      Array.from({ length: WRITERS_A }, () => withTransaction(db, (tx) => tx.query('SELECT 1'))),
    );
    const probes = [selfProbe('bench process (row building + driver)'), backendProbe(monitor, scratch.name)];
    const c0 = await cpuSnapshot(probes);
    const load = await closedLoop({
      concurrency: WRITERS_A,
      maxOps: batches.length,
      maxDurationMs: LIMITS.a.ms,
      op: async (k) => {
        const b = batches[k]!;
        const sid = sessionId(b.session);
        if (!txShape) {
          const rows = archiveRows(b.messages, b.firstSeq);
          return (await insertArchiveBatch(db, tenantId, sid, rows)).length;
        }
        return withTransaction(db, async (tx) => {
          await lockOrCreateSession(tx, tenantId, sid);
          const rows = archiveRows(b.messages, b.firstSeq);
          const { archived } = await archiveBatch(tx, {
            tenantId,
            sessionId: sid,
            nextSeq: b.firstSeq + STORAGE_BATCH,
            rows,
          });
          return archived;
        });
      },
      classify: (n) =>
        n === STORAGE_BATCH ? { ok: true } : { ok: false, label: `inserted ${n} of ${STORAGE_BATCH}` },
    });
    const cpu = cpuDiff(c0, await cpuSnapshot(probes));
    const stored = Number(
      (await monitor.query<{ n: string }>('SELECT count(*) AS n FROM messages')).rows[0]!.n,
    );
    const wallMs = load.t1 - load.t0;
    const r: PhaseResult = {
      phase,
      label: txShape
        ? `storage limit in the drain's transaction shape (lock session, insert ${STORAGE_BATCH} and update counters in one statement, commit), ${WRITERS_A} connections`
        : `storage limit: insertArchiveBatch of ${STORAGE_BATCH} rows, ${WRITERS_A} connections`,
      messages: stored,
      wallMs,
      rate: perSecond(stored, wallMs),
      opLatency: summarize(load.latencies),
      failures: load.failures,
      cpu,
      details: { batches: load.ok, 'stopped by': load.stoppedBy },
    };
    results.push(r);
    printPhase(r);
  } finally {
    await db.close().catch(() => undefined);
    await monitor.close().catch(() => undefined);
  }
}

interface EndToEndOptions {
  phase: 'b1' | 'b2';
  perRequest: number;
  requests: number;
  maxMs: number;
  drainMs: number;
}

/** Mnemos up on a scratch database with one tenant; returns what the phases need. */
async function setupService(label: string, mode: 'serve' | 'api' = 'serve') {
  const scratch = await createScratchDatabase(label);
  const prefix = scratchPrefix();
  const svc = await startBenchService({
    databaseUrl: scratch.url,
    prefix,
    mode,
    inProcess: args['in-process'],
    extensions: EXTENSIONS,
    env: SERVICE_ENV,
    nodeArgs: SERVER_NODE_ARGS,
  });
  const monitor = makePgDb({
    connectionString: scratch.url,
    max: 1,
    applicationName: 'mnemos-bench-monitor',
  });
  onCleanup(() => monitor.close().catch(() => undefined));
  const tenant = await createTenant(monitor, 'bench');
  return { scratch, prefix, svc, monitor, tenant };
}

const archivedCount = async (monitor: Db, tenantId: string) =>
  Number(
    (
      await monitor.query<{ n: string }>(
        'SELECT coalesce(sum(message_count), 0)::bigint AS n FROM sessions WHERE tenant_id = $1',
        [tenantId],
      )
    ).rows[0]!.n,
  );

function requestBodies(perRequest: number, requests: number): string[] {
  return Array.from({ length: requests }, (_, i) => {
    const session = i % SESSIONS_B;
    const firstPos = Math.floor(i / SESSIONS_B) * perRequest;
    return JSON.stringify({ messages: wireMessages(session, firstPos, perRequest) });
  });
}

async function phaseEndToEnd(o: EndToEndOptions): Promise<void> {
  const bodies = requestBodies(o.perRequest, o.requests);
  const { scratch, prefix, svc, monitor, tenant } = await setupService(
    o.phase,
    TOPOLOGY === 'split' ? 'api' : 'serve',
  );
  const worker =
    TOPOLOGY === 'split'
      ? await startBenchService({
          databaseUrl: scratch.url,
          prefix,
          mode: 'worker',
          inProcess: args['in-process'],
          extensions: EXTENSIONS,
          env: SERVICE_ENV,
          nodeArgs: SERVER_NODE_ARGS,
        })
      : null;
  const client = makeJsonClient(svc.url!, { token: tenant.api_key, maxSockets: CLIENTS });
  try {
    const probes: CpuProbe[] = [
      {
        label: worker ? 'mnemos api + worker' : 'mnemos serve',
        pids: async () => (worker ? [svc.pid, worker.pid] : [svc.pid]),
      },
      backendProbe(monitor, scratch.name),
      redisProbe,
      ...(args['in-process'] ? [] : [selfProbe(LOAD_GENERATOR)]),
    ];
    let acked = 0;
    let maxBacklog = 0;
    let sampling = true;
    const samples: Array<{ t: number; acked: number; archived: number }> = [];
    const c0 = await cpuSnapshot(probes);
    const tStart = performance.now();
    const sampler = (async () => {
      while (sampling) {
        const archived = await archivedCount(monitor, tenant.tenant_id).catch(() => null);
        if (archived === null) break; // the monitor pool closed (Ctrl-C): stop sampling
        samples.push({ t: performance.now() - tStart, acked, archived });
        maxBacklog = Math.max(maxBacklog, acked - archived);
        await new Promise((r) => setTimeout(r, 250));
      }
    })();
    const load = await closedLoop({
      concurrency: CLIENTS,
      maxOps: bodies.length,
      maxDurationMs: o.maxMs,
      op: (i) => client.request('POST', `/v1/sessions/${sessionId(i % SESSIONS_B)}/messages`, bodies[i]),
      classify: (r) => (r.status === 202 ? { ok: true } : { ok: false, label: `HTTP ${r.status}` }),
      onDone: (r) => {
        if (r?.status === 202) acked += (JSON.parse(r.body) as { accepted: number }).accepted;
      },
    });
    const archivedAtLastAck = await archivedCount(monitor, tenant.tenant_id);
    const done = await pollUntil(async () => (await archivedCount(monitor, tenant.tenant_id)) >= acked, {
      everyMs: 20,
      timeoutMs: o.drainMs,
    });
    sampling = false;
    await sampler;
    const cpu = cpuDiff(c0, await cpuSnapshot(probes));
    const archived = await archivedCount(monitor, tenant.tenant_id);

    // What a user sees: every session's last message through the API, and the counters in SQL.
    const check = await monitor.query<{ bad: number; n: string }>(
      `SELECT count(*) FILTER (WHERE next_seq - 1 <> message_count)::int AS bad, coalesce(sum(message_count), 0) AS n
       FROM sessions WHERE tenant_id = $1`,
      [tenant.tenant_id],
    );
    const lastSession = sessionId(Math.min(SESSIONS_B, load.ok) - 1);
    const lastPage = await client.request('GET', `/v1/sessions/${lastSession}/messages?order=desc&limit=1`);
    const lastSeq = (JSON.parse(lastPage.body) as { messages: Array<{ seq: number }> }).messages[0]?.seq ?? 0;
    const expectedLast = Number(
      (
        await monitor.query<{ c: number }>(
          'SELECT message_count AS c FROM sessions WHERE tenant_id = $1 AND id = $2',
          [tenant.tenant_id, lastSession],
        )
      ).rows[0]?.c ?? -1,
    );

    // The recent index is derived and may lag archiving (EMBED_CONCURRENCY): how far behind it
    // was when the last message was archived, and what the whole path costs once it caught up.
    // Every bench message is user/assistant text, so each gets a vector.
    let indexed: { lagged: number; atMs: number; cpuMsPerMsg: number } | null = null;
    if (EXTENSIONS === 'default') {
      const vectorCount = async () =>
        Number(
          (
            await monitor.query<{ n: string }>(
              'SELECT count(*) AS n FROM message_vectors WHERE tenant_id = $1',
              [tenant.tenant_id],
            )
          ).rows[0]!.n,
        );
      const lagged = archived - (await vectorCount());
      // Polled through the service's own counter, confirmed by the count once it says done: a
      // count of 100,000 vectors every 50 ms cost ~23 ms of Postgres CPU each time (seen with
      // pg_stat_statements), which slowed the catch-up it measures and was charged to it.
      const written = async () =>
        metricSum(
          `${await svc.metricsText()}\n${worker ? await worker.metricsText().catch(() => '') : ''}`,
          'mnemos_embeddings_written_total',
        );
      const caught = await pollUntil(
        async () => (await written()) >= archived && (await vectorCount()) >= archived,
        { everyMs: 50, timeoutMs: o.drainMs },
      );
      const all = cpuDiff(c0, await cpuSnapshot(probes));
      indexed = caught.done
        ? {
            lagged,
            atMs: caught.at - load.t0,
            cpuMsPerMsg: cpuMsPerMessage({ cpu: all, messages: archived }),
          }
        : null;
      if (!indexed)
        process.stdout.write(`recent index: NOT caught up ${fmtSec(o.drainMs)} after the last archive\n`);
    }

    const metrics = `${await svc.metricsText()}\n${worker ? await worker.metricsText().catch(() => '') : ''}`;
    const ingestJobs = metricSum(metrics, 'mnemos_job_duration_seconds_count', 'queue="ingest"');
    const ingestSecs = metricSum(metrics, 'mnemos_job_duration_seconds_sum', 'queue="ingest"');
    const embedJobs = metricSum(metrics, 'mnemos_job_duration_seconds_count', 'queue="embed"');
    const embedSecs = metricSum(metrics, 'mnemos_job_duration_seconds_sum', 'queue="embed"');
    const postCount = metricSum(metrics, 'mnemos_http_request_duration_seconds_count', 'method="POST"');
    const postSecs = metricSum(metrics, 'mnemos_http_request_duration_seconds_sum', 'method="POST"');

    const wallMs = done.at - load.t0;
    const acceptMs = load.t1 - load.t0;
    const r: PhaseResult = {
      phase: o.phase,
      label: `end to end through the API until archived: ${o.perRequest === 1 ? 'one message' : `batches of ${o.perRequest}`} per POST, ${SESSIONS_B} sessions, ${CLIENTS} clients${worker ? ' (api + worker processes)' : ''}`,
      messages: archived,
      wallMs,
      rate: perSecond(archived, wallMs),
      ack: summarize(load.latencies),
      failures: load.failures,
      cpu,
      details: {
        'requests (202)': load.ok,
        'stopped by': load.stoppedBy,
        'accept phase': `${fmtSec(acceptMs)}, ${fmtInt(perSecond(acked, acceptMs))} msgs/s acknowledged`,
        'archived when the last ack arrived': `${fmtInt(archivedAtLastAck)} of ${fmtInt(acked)} (${fmtPct(archivedAtLastAck / acked)})`,
        'drain tail after the last ack': fmtSec(done.at - load.t1),
        'max backlog (acked − archived, 250 ms samples)': maxBacklog,
        'all archived': done.done ? 'yes' : `NO: ${archived} of ${acked} after ${fmtSec(o.drainMs)}`,
        'check: sessions with next_seq - 1 ≠ message_count': check.rows[0]!.bad,
        [`check: GET /v1/sessions/${lastSession}/messages?order=desc&limit=1`]: `seq ${lastSeq} (archived count ${expectedLast})`,
        'server: ingest jobs, mean messages per job': `${fmtInt(ingestJobs)}, ${(archived / Math.max(1, ingestJobs)).toFixed(1)}`,
        'server: mean concurrent ingest jobs': (ingestSecs / (wallMs / 1000)).toFixed(2),
        'server: mean ingest job duration': fmtMs((ingestSecs / Math.max(1, ingestJobs)) * 1000),
        'server: embed jobs, mean concurrent': `${fmtInt(embedJobs)}, ${(embedSecs / (wallMs / 1000)).toFixed(2)}`,
        'server: mean POST handling time': fmtMs((postSecs / Math.max(1, postCount)) * 1000),
        ...(indexed
          ? {
              'recent index: messages without a vector when the last was archived': fmtInt(indexed.lagged),
              'recent index: all vectors written': `${fmtSec(indexed.atMs - wallMs)} after the last archive → ${fmtInt(perSecond(archived, indexed.atMs))} msgs/s archived and indexed, CPU ${indexed.cpuMsPerMsg.toFixed(3)} core-ms per message`,
            }
          : {}),
      },
    };
    if (archived !== acked || check.rows[0]!.bad !== 0 || lastSeq !== expectedLast) {
      r.failures.verification = 1;
    }
    results.push(r);
    printPhase(r);
    if (process.env.BENCH_SAMPLES) process.stdout.write(`${JSON.stringify(samples)}\n`);
  } finally {
    client.close();
    await svc.stop();
    await worker?.stop();
    await monitor.close().catch(() => undefined);
  }
}

/** b1's two halves apart: accept with `mnemos api` alone (no worker), then drain with a worker alone. */
async function phaseSplit(): Promise<void> {
  const bodies = requestBodies(BATCH, LIMITS.b1.requests);
  const { scratch, prefix, svc, monitor, tenant } = await setupService('b1_split', 'api');
  const client = makeJsonClient(svc.url!, { token: tenant.api_key, maxSockets: CLIENTS });
  let acked = 0;
  try {
    const acceptProbes: CpuProbe[] = [
      { label: 'mnemos api', pids: async () => [svc.pid] },
      backendProbe(monitor, scratch.name),
      redisProbe,
      ...(args['in-process'] ? [] : [selfProbe(LOAD_GENERATOR)]),
    ];
    const a0 = await cpuSnapshot(acceptProbes);
    const load = await closedLoop({
      concurrency: CLIENTS,
      maxOps: bodies.length,
      maxDurationMs: LIMITS.b1.ms,
      op: (i) => client.request('POST', `/v1/sessions/${sessionId(i % SESSIONS_B)}/messages`, bodies[i]),
      classify: (r) => (r.status === 202 ? { ok: true } : { ok: false, label: `HTTP ${r.status}` }),
      onDone: (r) => {
        if (r?.status === 202) acked += (JSON.parse(r.body) as { accepted: number }).accepted;
      },
    });
    const acceptMs = load.t1 - load.t0;
    const acceptCpu = cpuDiff(a0, await cpuSnapshot(acceptProbes));
    const accept: PhaseResult = {
      phase: 'b1-accept',
      label: `accept only (mnemos api, no worker): batches of ${BATCH}, ${CLIENTS} clients`,
      messages: acked,
      wallMs: acceptMs,
      rate: perSecond(acked, acceptMs),
      ack: summarize(load.latencies),
      failures: load.failures,
      cpu: acceptCpu,
      details: {},
    };
    results.push(accept);
    printPhase(accept);
    client.close();
    await svc.stop();

    const worker = await startBenchService({
      databaseUrl: scratch.url,
      prefix,
      inProcess: args['in-process'],
      mode: 'worker',
      extensions: EXTENSIONS,
      env: SERVICE_ENV,
      nodeArgs: SERVER_NODE_ARGS,
    });
    const probes: CpuProbe[] = [
      { label: 'mnemos worker', pids: async () => [worker.pid] },
      backendProbe(monitor, scratch.name),
      redisProbe,
    ];
    const c0 = await cpuSnapshot(probes);
    const t0 = performance.now();
    // The worker starts with every session armed; the sweeper (or the pending flush jobs) drain them.
    const done = await pollUntil(async () => (await archivedCount(monitor, tenant.tenant_id)) >= acked, {
      everyMs: 20,
      timeoutMs: LIMITS.b1.drainMs,
    });
    const cpu = cpuDiff(c0, await cpuSnapshot(probes));
    const metrics = await worker.metricsText().catch(() => '');
    const ingestJobs = metricSum(metrics, 'mnemos_job_duration_seconds_count', 'queue="ingest"');
    const archived = await archivedCount(monitor, tenant.tenant_id);
    const drain: PhaseResult = {
      phase: 'b1-drain',
      label: 'drain only (mnemos worker on the inbox that b1-accept filled; includes worker start-up)',
      messages: archived,
      wallMs: done.at - t0,
      rate: perSecond(archived, done.at - t0),
      failures: done.done ? {} : { 'not all archived': acked - archived },
      cpu,
      details: { 'ingest jobs': ingestJobs || 'n/a (worker has no HTTP metrics endpoint)' },
    };
    results.push(drain);
    printPhase(drain);
    await worker.stop();
  } finally {
    client.close();
    await svc.stop();
    await monitor.close().catch(() => undefined);
  }
}

interface LangChainApi {
  PostgresChatMessageHistory: new (f: { pool: unknown; sessionId: string; tableName?: string }) => {
    ensureTable(): Promise<void>;
    addMessage(m: unknown): Promise<void>;
  };
  HumanMessage: new (content: string) => unknown;
  AIMessage: new (content: string) => unknown;
  Pool: new (o: { connectionString: string; max: number }) => {
    query(q: string): Promise<unknown>;
    end(): Promise<void>;
  };
}

function loadLangChain(): { api: LangChainApi; version: string } | { error: string } {
  if (args['no-langchain']) return { error: 'LangChain skipped with --no-langchain' };
  const installError = ensurePeers();
  if (installError) return { error: installError };
  try {
    const { PostgresChatMessageHistory } = requirePeer('@langchain/community/stores/message/postgres');
    const { HumanMessage, AIMessage } = requirePeer('@langchain/core/messages');
    const pg = requirePeer('pg');
    const version = `@langchain/community ${peerVersion('@langchain/community')}, @langchain/core ${peerVersion('@langchain/core')}, pg ${peerVersion('pg')}`;
    return { api: { PostgresChatMessageHistory, HumanMessage, AIMessage, Pool: pg.Pool }, version };
  } catch (err) {
    return { error: `cannot load LangChain from bench/peers: ${(err as Error).message}` };
  }
}

async function phaseLangChain(): Promise<void> {
  const scratch: ScratchDatabase = await createScratchDatabase('c');
  const monitor = makePgDb({
    connectionString: scratch.url,
    max: 1,
    applicationName: 'mnemos-bench-monitor',
  });
  onCleanup(() => monitor.close().catch(() => undefined));
  const lc = loadLangChain();
  const total = LIMITS.c.messages;
  const items = Array.from({ length: total }, (_, i) => ({
    session: i % SESSIONS_C,
    pos: Math.floor(i / SESSIONS_C),
  }));
  let op: (i: number) => Promise<void>;
  let close: () => Promise<void>;
  let label: string;
  let table: string;
  if ('api' in lc) {
    const { PostgresChatMessageHistory, HumanMessage, AIMessage, Pool } = lc.api;
    const pool = new Pool({ connectionString: scratch.url, max: POOL_C });
    onCleanup(() => pool.end().catch(() => undefined));
    table = 'langchain_chat_histories';
    const histories = Array.from(
      { length: SESSIONS_C },
      (_, s) => new PostgresChatMessageHistory({ pool, sessionId: sessionId(s), tableName: table }),
    );
    for (const h of histories) await h.ensureTable(); // CREATE TABLE IF NOT EXISTS: once per instance, untimed
    const msgs = items.map(({ session, pos }) => {
      const m = corpus.message(session, pos);
      return m.role === 'user' ? new HumanMessage(m.content) : new AIMessage(m.content);
    });
    op = (i) => histories[items[i]!.session]!.addMessage(msgs[i]);
    close = () => pool.end();
    label = `LangChain PostgresChatMessageHistory.addMessage (${lc.version}), ${SESSIONS_C} sessions, ${CLIENTS} callers, pool ${POOL_C}`;
  } else {
    note(`LangChain unavailable: ${lc.error}; measuring a stand-in that is NOT LangChain`);
    table = 'lc_shaped_histories';
    await monitor.query(
      `CREATE TABLE ${table} (id SERIAL PRIMARY KEY, session_id VARCHAR(255) NOT NULL, message JSONB NOT NULL)`,
    );
    const db = makePgDb({ connectionString: scratch.url, max: POOL_C, applicationName: 'mnemos-bench' });
    onCleanup(() => db.close().catch(() => undefined));
    op = async (i) => {
      const { session, pos } = items[i]!;
      const m = corpus.message(session, pos);
      const message = {
        type: m.role === 'user' ? 'human' : 'ai',
        content: m.content,
        additional_kwargs: {},
        response_metadata: {},
      };
      await db.query(`INSERT INTO ${table} (session_id, message) VALUES ($1, $2)`, [
        sessionId(session),
        message,
      ]);
    };
    close = () => db.close();
    label = `NOT LangChain (${lc.error}): one awaited INSERT per message into a LangChain-shaped table, ${SESSIONS_C} sessions, ${CLIENTS} callers`;
  }
  try {
    const probes = [selfProbe('bench process (writer + driver)'), backendProbe(monitor, scratch.name)];
    const c0 = await cpuSnapshot(probes);
    const load = await closedLoop({ concurrency: CLIENTS, maxOps: total, maxDurationMs: LIMITS.c.ms, op });
    const cpu = cpuDiff(c0, await cpuSnapshot(probes));
    const stored = Number(
      (await monitor.query<{ n: string }>(`SELECT count(*) AS n FROM ${table}`)).rows[0]!.n,
    );
    const wallMs = load.t1 - load.t0;
    const r: PhaseResult = {
      phase: 'c',
      label,
      messages: stored,
      wallMs,
      rate: perSecond(stored, wallMs),
      opLatency: summarize(load.latencies),
      failures: load.failures,
      cpu,
      details: {
        'stopped by': load.stoppedBy,
        'what it stores':
          'JSONB message per row; no FTS, no ordering guarantee beyond SERIAL, no idempotency',
      },
    };
    if (stored !== load.ok) r.failures.verification = 1;
    results.push(r);
    printPhase(r);
  } finally {
    await close().catch(() => undefined);
    await monitor.close().catch(() => undefined);
  }
}

/**
 * Where the archive insert's Postgres CPU goes: the same 50-row batches on one connection, into
 * `messages` through insertArchiveBatch itself, and into copies of the table with parts of its
 * indexing removed, batch by batch in turn so the machine's load hits all alike. The backend's
 * CPU is read from /proc around each statement (10 ms ticks, summed over many batches).
 */
async function phaseArchiveCost(): Promise<void> {
  const scratch = await createScratchDatabase('a_cost');
  const db = makePgDb({ connectionString: scratch.url, max: 1, applicationName: 'mnemos-bench' });
  onCleanup(() => db.close().catch(() => undefined));
  const tsvector = ARCHIVE_TSVECTOR_SQL;
  const variants: Array<{ name: string; table: string | null; drop: string[]; tsv: string; alter?: string }> =
    [
      { name: 'messages (insertArchiveBatch)', table: null, drop: [], tsv: tsvector },
      {
        name: 'GIN without fastupdate',
        table: 'm_gin_direct',
        drop: [],
        tsv: tsvector,
        alter: 'ALTER INDEX m_gin_direct_search_tsv_idx SET (fastupdate = off)',
      },
      {
        name: 'GIN with a 32 MB pending list',
        table: 'm_gin_32mb',
        drop: [],
        tsv: tsvector,
        alter: 'ALTER INDEX m_gin_32mb_search_tsv_idx SET (gin_pending_list_limit = 32768)',
      },
      { name: 'without the GIN index', table: 'm_no_gin', drop: ['search_tsv_idx'], tsv: tsvector },
      {
        name: 'without GIN and tsvector (empty)',
        table: 'm_no_tsv',
        drop: ['search_tsv_idx'],
        tsv: `''::tsvector`,
      },
      {
        name: 'also without the client-id and sent_at btrees',
        table: 'm_bare',
        drop: ['search_tsv_idx', 'tenant_id_session_id_id_idx', 'tenant_id_session_id_sent_at_ns_idx'],
        tsv: `''::tsvector`,
      },
    ];
  try {
    const { tenant_id: tenantId } = await createTenant(db, 'bench');
    const pid = (await db.query<{ p: number }>('SELECT pg_backend_pid() AS p')).rows[0]!.p;
    const backendCpuMs = async () => ((await procCpuSeconds(pid)) ?? Number.NaN) * 1000;
    for (const v of variants) {
      if (!v.table) continue;
      await db.query(`CREATE TABLE ${v.table} (LIKE messages INCLUDING ALL)`);
      for (const suffix of v.drop) await db.query(`DROP INDEX ${v.table}_${suffix}`);
      if (v.alter) await db.query(v.alter);
    }
    const sessions = 20;
    const rounds = Math.max(2, Math.round(60 * SCALE));
    const cpuMs = variants.map(() => 0);
    let rows = 0;
    for (let r = 0; r < rounds; r++) {
      for (let s = 0; s < sessions; s++) {
        await withTransaction(db, (tx) => lockOrCreateSession(tx, tenantId, sessionId(s)));
        const first = r * STORAGE_BATCH;
        const batch = archiveRows(
          parseMessages({ messages: wireMessages(s, first, STORAGE_BATCH) }, 'UTC'),
          first + 1,
        );
        for (const [i, v] of variants.entries()) {
          const c0 = await backendCpuMs();
          if (!v.table) await insertArchiveBatch(db, tenantId, sessionId(s), batch);
          else
            // insertArchiveBatch's statement, on the copy and with this variant's tsvector.
            await db.query(
              `INSERT INTO ${v.table} (tenant_id, session_id, seq, id, role, content, parts, name, tool_call_id,
                 tool_calls, metadata, sent_at_ns, sent_at_given, bytes, fingerprint, search_tsv)
               SELECT $1, $2, x.seq, x.id, x.role, x.content, x.parts, x.name, x.tool_call_id, x.tool_calls,
                 x.metadata, x.sent_at_ns, x.sent_at_given, x.bytes, x.fingerprint, ${v.tsv}
               FROM jsonb_to_recordset($3::jsonb) AS x(seq bigint, id text, role text, content text, parts jsonb,
                 name text, tool_call_id text, tool_calls jsonb, metadata jsonb, sent_at_ns bigint,
                 sent_at_given boolean, bytes integer, fingerprint text, fts_en text, fts_cjk text)
               ORDER BY x.seq
               ON CONFLICT DO NOTHING
               RETURNING seq, bytes, sent_at_ns`,
              [tenantId, sessionId(s), JSON.stringify(batch)],
            );
          cpuMs[i]! += (await backendCpuMs()) - c0;
        }
        rows += batch.length;
      }
    }
    const full = cpuMs[0]!;
    const table = variants.map((v, i) => [
      v.name,
      ((cpuMs[i]! * 1000) / rows).toFixed(1),
      fmtRatio(cpuMs[i]! / full),
    ]);
    process.stdout.write(
      `\n## a-cost: Postgres CPU per archived row (${fmtInt(rows)} rows per variant, ${STORAGE_BATCH}-row INSERTs, one connection)\n\n${markdownTable(['table', 'CPU µs/row', 'vs messages'], table)}\n`,
    );
  } finally {
    await db.close().catch(() => undefined);
  }
}

/**
 * CPU (not wall) microseconds per message of each in-process step of the ingest path, measured with
 * process.cpuUsage over the same batches of 50: what the API and the worker spend in JavaScript
 * before and after their round trips. Robust to the machine's other load.
 */
function phaseParts(): void {
  const n = Math.max(20, Math.round(200 * SCALE));
  const bodies = requestBodies(BATCH, n);
  const perMsg = (fn: () => void) => {
    fn(); // warm-up (JIT)
    const c0 = process.cpuUsage();
    fn();
    const c = process.cpuUsage(c0);
    return (c.user + c.system) / (n * BATCH);
  };
  const parsedBodies = bodies.map((b) => JSON.parse(b) as unknown);
  const accepted = parsedBodies.map((b) => parseMessages(b, 'UTC'));
  const inboxEntries = accepted.map((ms) => ms.map((m, i) => `${i + 1} 1 ${JSON.stringify(m)}`));
  const rows = accepted.map((ms) => archiveRows(ms, 1));
  const steps: Array<[string, string, () => void]> = [
    [
      'API',
      'JSON.parse of the request body (express.json)',
      () => void bodies.map((b) => JSON.parse(b) as unknown),
    ],
    [
      'API',
      'parseMessages: zod validation, sha256 fingerprint',
      () => void parsedBodies.map((b) => parseMessages(b, 'UTC')),
    ],
    [
      'API',
      'JSON.stringify of each message for the inbox (Lua ARGV)',
      () => void accepted.map((ms) => ms.map((m) => JSON.stringify(m))),
    ],
    [
      'worker',
      'JSON.parse of inbox entries (readInbox)',
      () =>
        void inboxEntries.map((es) =>
          es.map((e) => JSON.parse(e.slice(e.indexOf(' ', e.indexOf(' ') + 1) + 1)) as unknown),
        ),
    ],
    [
      'worker',
      'archive rows: searchable text, ftsDocument (CJK bigrams)',
      () => void accepted.map((ms) => archiveRows(ms, 1)),
    ],
    [
      'worker',
      'JSON.stringify of the rows (insert parameter)',
      () => void rows.map((r) => JSON.stringify(r)),
    ],
    [
      'embed',
      'local-hash embedding (384-d) + binary vector[] parameter',
      // The type's OID is read from the database by the writer; any number costs the same here.
      () =>
        void accepted.map((ms) =>
          vectorArrayParam(
            ms.map((m) => localEmbed(m.content ?? '', 384)),
            0,
          ),
        ),
    ],
  ];
  const table = steps.map(([where, what, fn]) => [where, what, perMsg(fn).toFixed(1)]);
  process.stdout.write(
    `\n## parts: CPU µs per message of the JavaScript steps (${fmtInt(n * BATCH)} messages, batches of ${BATCH})\n\n${markdownTable(['where', 'step', 'CPU µs/msg'], table)}\n`,
  );
  partsTable = table;
}

async function machineNote(): Promise<string> {
  const db = makePgDb({ connectionString: ADMIN_URL, max: 1 });
  try {
    const v = (await db.query<{ v: string }>("SELECT current_setting('server_version') AS v")).rows[0]!.v;
    const s = await db.query<{ name: string; setting: string; unit: string | null }>(
      `SELECT name, setting, unit FROM pg_settings WHERE name IN ('shared_buffers','synchronous_commit','fsync','max_wal_size')`,
    );
    const settings = s.rows
      .map(
        (r) =>
          `${r.name}=${r.setting}${r.unit && r.unit !== '8kB' ? r.unit : r.unit === '8kB' ? '×8kB' : ''}`,
      )
      .join(' ');
    let cpuModel = 'unknown CPU';
    try {
      cpuModel = /model name\s*:\s*(.+)/.exec(readFileSync('/proc/cpuinfo', 'utf8'))?.[1] ?? cpuModel;
    } catch {
      /* not Linux */
    }
    return `${availableParallelism()} cores (${cpuModel}), Node ${process.version}, PostgreSQL ${v} (${settings}), load average at start ${loadavg()
      .map((x) => x.toFixed(2))
      .join(' ')}`;
  } finally {
    await db.close();
  }
}

function summaryTable(): string {
  const by = (p: string) => results.find((r) => r.phase === p);
  const a = by('a');
  const b1 = by('b1');
  const b2 = by('b2');
  const c = by('c');
  const rows = results.map((r) => [
    r.phase,
    r.label.length > 90 ? `${r.label.slice(0, 87)}...` : r.label,
    fmtInt(r.messages),
    fmtSec(r.wallMs),
    fmtInt(r.rate),
    r.ack ? fmtMs(r.ack.p50) : r.opLatency ? `(op ${fmtMs(r.opLatency.p50)})` : '',
    r.ack ? fmtMs(r.ack.p99) : r.opLatency ? `(op ${fmtMs(r.opLatency.p99)})` : '',
    Number.isFinite(cpuMsPerMessage(r)) ? cpuMsPerMessage(r).toFixed(3) : 'n/a',
    Object.keys(r.failures).length ? JSON.stringify(r.failures) : '0',
  ]);
  const table = markdownTable(
    ['phase', 'what', 'messages', 'wall', 'msgs/s', 'ack p50', 'ack p99', 'CPU ms/msg', 'failures'],
    rows,
  );
  const verdict = (x: number, target: number) =>
    Number.isFinite(x) ? (x >= target ? 'meets' : 'MISSES') : 'n/a';
  const ratios = [
    ['b1 / a', fmtRatio(ratio(b1?.rate, a?.rate)), '≥ 0.50×', verdict(ratio(b1?.rate, a?.rate), 0.5)],
    ['b1 / c', fmtRatio(ratio(b1?.rate, c?.rate)), '≥ 1.00×', verdict(ratio(b1?.rate, c?.rate), 1)],
    ['b2 / c', fmtRatio(ratio(b2?.rate, c?.rate)), '(reported)', ''],
    ['b2 / a', fmtRatio(ratio(b2?.rate, a?.rate)), '(reported)', ''],
    [
      'CPU per message b1 / a',
      fmtRatio(ratio(b1 && cpuMsPerMessage(b1), a && cpuMsPerMessage(a))),
      '(lower is better)',
      '',
    ],
    [
      'CPU per message b1 / c',
      fmtRatio(ratio(b1 && cpuMsPerMessage(b1), c && cpuMsPerMessage(c))),
      '(lower is better)',
      '',
    ],
    [
      'CPU per message b2 / c',
      fmtRatio(ratio(b2 && cpuMsPerMessage(b2), c && cpuMsPerMessage(c))),
      '(lower is better)',
      '',
    ],
  ];
  return `${table}\n\n${markdownTable(['ratio', 'value', 'target', ''], ratios)}`;
}

async function main(): Promise<void> {
  cleanupOnSignals();
  const started = Date.now();
  const stale = await dropStaleScratchDatabases();
  if (stale.length) note(`dropped ${stale.length} stale scratch database(s) of crashed earlier runs`);
  const machine = await machineNote();
  const stats = corpus.stats();
  process.stdout.write(
    `# mnemos ingestion benchmark\n${machine}\n` +
      `corpus: ${Math.round(stats.meanChars)} characters (${Math.round(stats.meanBytes)} UTF-8 bytes) per message on average, ` +
      `${stats.minChars}–${stats.maxChars} characters, ${fmtPct(stats.cjkShare)} with Chinese; client ids ${CLIENT_IDS ? 'on' : 'off'}; ` +
      `server ${args['in-process'] ? 'in the bench process' : TOPOLOGY === 'split' ? 'as mnemos api + mnemos worker child processes' : 'as one mnemos serve child process'}, extensions ${EXTENSIONS}` +
      `${Object.keys(SERVICE_ENV).length ? `, env ${JSON.stringify(SERVICE_ENV)}` : ''}\n`,
  );
  let failed = false;
  try {
    if (PHASES.has('parts')) phaseParts();
    if (PHASES.has('a')) await phaseStorage(false);
    if (PHASES.has('a-tx')) await phaseStorage(true);
    if (PHASES.has('a-cost')) await phaseArchiveCost();
    if (PHASES.has('b1'))
      await phaseEndToEnd({
        phase: 'b1',
        perRequest: BATCH,
        requests: LIMITS.b1.requests,
        maxMs: LIMITS.b1.ms,
        drainMs: LIMITS.b1.drainMs,
      });
    if (PHASES.has('b2'))
      await phaseEndToEnd({
        phase: 'b2',
        perRequest: 1,
        requests: LIMITS.b2.requests,
        maxMs: LIMITS.b2.ms,
        drainMs: LIMITS.b2.drainMs,
      });
    if (PHASES.has('b1-split')) await phaseSplit();
    if (PHASES.has('c')) await phaseLangChain();
  } catch (err) {
    failed = true;
    process.stderr.write(`[bench] FAILED: ${(err as Error).stack ?? String(err)}\n`);
  } finally {
    const cleaned = await cleanupScratch();
    note(`cleaned up: ${cleaned.join('; ') || 'nothing'}`);
  }
  process.stdout.write(
    `\n## Summary (${fmtSec(Date.now() - started)} in all; load average now ${loadavg()[0]!.toFixed(2)})\n\n${summaryTable()}\n`,
  );
  if (args.json) {
    const file = path.resolve(args.json);
    mkdirSync(path.dirname(file), { recursive: true });
    writeFileSync(
      file,
      JSON.stringify({ at: new Date().toISOString(), machine, args, results, parts: partsTable }, null, 2),
    );
    note(`results written to ${file}`);
  }
  if (failed || results.some((r) => Object.keys(r.failures).length > 0)) process.exitCode = 1;
}

await main();
