/**
 * Context endpoint throughput: closed-loop maximum throughput and latency of
 * `POST /v1/sessions/:sid/context` (full app: auth, validation, window repair, no decision model)
 * against a bare Express route in the same process running the same SQL (`loadContext`) and
 * returning its row as JSON. Two more variants mount the real context router behind auth and the
 * rate limiter applied once, and behind no auth at all, to show where the time goes. 1,000 sessions of 20–40 messages in a scratch database;
 * loopback only; every loop is bounded by a deadline.
 *
 *   node --import tsx bench/context.ts [--seconds 18] [--concurrency 16] [--sessions 1000]
 *
 * --seconds is the measured time per variant, taken in interleaved slices of 1.5 s.
 */
import { randomBytes } from 'node:crypto';
import { Agent, request } from 'node:http';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import express from 'express';
import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { loadContext } from '../db/queries/context.js';
import { insertArchiveBatch } from '../db/queries/messages.js';
import type { ArchiveInsertRow } from '../db/queries/messages.js';
import { lockOrCreateSession, recordArchived } from '../db/queries/sessions.js';
import { contextExtension } from '../services/context/context-extension.js';
import { makeContextBuilder } from '../services/context/build-context.js';
import { makeErrorHandler } from '../services/http-errors.js';
import { makeLogger } from '../services/logger.js';
import { startService } from '../services/main.js';
import { makeContextRoutes } from '../services/routes/context-routes.js';
import { createTenant } from '../services/tenants.js';
import { ftsDocument } from '../services/text/fts-text.js';
import {
  createTestDatabase,
  deleteRedisPrefix,
  dropTestDatabase,
  testConfig,
} from '../test/support/harness.js';
import { numberArg } from './lib/args.js';

const SECONDS = numberArg('seconds', 18);
const CONCURRENCY = numberArg('concurrency', 16);
const SESSIONS = numberArg('sessions', 1000);
const WARMUP_MS = 2000;
/** Length of one measured slice; variants take turns slice by slice. */
const SLICE_S = 1.5;

const words = 'the deploy pipeline cache release summary window token agent tool result error retry'.split(
  ' ',
);
const sentence = (n: number) =>
  Array.from({ length: n }, (_, i) => words[(i * 7 + n) % words.length]).join(' ');

function sessionRows(n: number, startSeq: number): ArchiveInsertRow[] {
  const rows: ArchiveInsertRow[] = [];
  let seq = startSeq;
  const push = (m: Pick<ArchiveInsertRow, 'role' | 'content' | 'tool_call_id' | 'tool_calls'>) => {
    const text = m.content ?? '';
    const fts = ftsDocument(text);
    rows.push({
      seq,
      id: `m${seq}`,
      name: null,
      parts: null,
      metadata: null,
      sent_at_ns: String(BigInt(Date.now()) * 1_000_000n + BigInt(seq)),
      sent_at_given: false,
      bytes: Buffer.byteLength(JSON.stringify(m)),
      fingerprint: randomBytes(8).toString('hex'),
      fts_en: fts.en,
      fts_cjk: fts.cjk,
      ...m,
    });
    seq++;
  };
  while (rows.length < n) {
    push({ role: 'user', content: sentence(20 + (seq % 30)), tool_call_id: null, tool_calls: null });
    if (seq % 5 === 0) {
      const id = `call_${seq}`;
      const call = { id, type: 'function', function: { name: 'search', arguments: '{"q":"x"}' } };
      push({ role: 'assistant', content: null, tool_call_id: null, tool_calls: [call] });
      push({ role: 'tool', content: sentence(60), tool_call_id: id, tool_calls: null });
    }
    push({ role: 'assistant', content: sentence(80 + (seq % 60)), tool_call_id: null, tool_calls: null });
  }
  return rows;
}

const SUMMARY = {
  key_decisions: ['Do: reply in English', 'Do: use pnpm', "Don't: deploy on Fridays"],
  past_discussions: [
    { topic: 'CI', description: 'moved to Actions', direction: 'done', last_discussed: '2026-01-01' },
  ],
  current_discussion: {
    topic: 'release',
    description: 'planning 2.0',
    perspectives: 'beta first',
    direction: 'timeline',
  },
};

async function load(db: Db, tenantId: string): Promise<string[]> {
  const ids: string[] = [];
  for (let i = 0; i < SESSIONS; i++) {
    const sid = `bench-${i}`;
    ids.push(sid);
    const rows = sessionRows(20 + (i % 21), 1);
    await db.transaction(async (tx) => {
      await lockOrCreateSession(tx, tenantId, sid);
      await insertArchiveBatch(tx, tenantId, sid, rows);
      await recordArchived(tx, {
        tenantId,
        sessionId: sid,
        nextSeq: rows.length + 1,
        count: rows.length,
        bytes: rows.reduce((a, r) => a + r.bytes, 0),
        lastSentNs: rows[rows.length - 1]!.sent_at_ns,
      });
      if (i % 2 === 0) {
        await tx.query(
          'INSERT INTO summaries (tenant_id, session_id, summary, cursor_seq, version) VALUES ($1, $2, $3::jsonb, 1, 1)',
          [tenantId, sid, JSON.stringify(SUMMARY)],
        );
      }
    });
  }
  await db.query('ANALYZE');
  return ids;
}

interface Variant {
  name: string;
  port: number;
  path: (sid: string) => string;
  auth?: string;
  agent: Agent;
  lat: number[];
  errors: number;
  seconds: number;
}

/** One closed-loop slice: CONCURRENCY clients, each sends the next request when the last one answered. */
async function slice(v: Variant, sids: string[], ms: number, record: boolean): Promise<void> {
  const body = JSON.stringify({ input: 'what next?' });
  const once = (sid: string) =>
    new Promise<number>((resolve, reject) => {
      const started = performance.now();
      const req = request(
        {
          host: '127.0.0.1',
          port: v.port,
          method: 'POST',
          path: v.path(sid),
          agent: v.agent,
          headers: {
            'content-type': 'application/json',
            'content-length': Buffer.byteLength(body),
            ...(v.auth ? { authorization: `Bearer ${v.auth}` } : {}),
          },
        },
        (res) => {
          res.resume();
          res.on('end', () =>
            res.statusCode === 200
              ? resolve(performance.now() - started)
              : reject(new Error(String(res.statusCode))),
          );
        },
      );
      req.on('error', reject);
      req.end(body);
    });
  const started = performance.now();
  const deadline = started + ms;
  let k = Math.floor(Math.random() * sids.length);
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async () => {
      while (performance.now() < deadline) {
        const sid = sids[k++ % sids.length]!;
        try {
          const t = await once(sid);
          if (record) v.lat.push(t);
        } catch {
          if (record) v.errors++;
        }
      }
    }),
  );
  if (record) v.seconds += (performance.now() - started) / 1000;
}

function report(v: Variant) {
  const lat = [...v.lat].sort((a, b) => a - b);
  const q = (p: number) => lat[Math.min(lat.length - 1, Math.floor(p * lat.length))] ?? NaN;
  const rps = lat.length / v.seconds;
  console.log(
    `${v.name.padEnd(26)} ${rps.toFixed(0).padStart(6)} req/s  p50 ${q(0.5).toFixed(2)} ms  p99 ${q(0.99).toFixed(2)} ms  (${lat.length} ok, ${v.errors} errors)`,
  );
  return rps;
}

const listen = (app: express.Express) =>
  new Promise<Server>((resolve) => {
    const s = app.listen(0, '127.0.0.1', () => resolve(s));
  });

async function main() {
  const url = await createTestDatabase();
  const prefix = `mbench_${randomBytes(4).toString('hex')}`;
  const config = testConfig({
    DATABASE_URL: url,
    MNEMOS_PREFIX: prefix,
    RATE_LIMIT_PER_MIN: '10000000',
    LOG_LEVEL: 'silent',
  });
  const svc = await startService('api', config, {
    logger: makeLogger('silent'),
    extensions: [contextExtension],
  });
  const bareDb = makePgDb({ connectionString: url, max: 10 });
  const servers: Server[] = [];
  try {
    const t0 = performance.now();
    const { tenant_id: tenantId, api_key: apiKey } = await createTenant(svc.deps.db, 'bench');
    const sids = await load(svc.deps.db, tenantId);
    console.log(`loaded ${sids.length} sessions in ${((performance.now() - t0) / 1000).toFixed(1)} s`);

    // Baseline: the same SQL, no auth, no validation, no post-processing.
    const bare = express();
    bare.use(express.json());
    bare.post('/bare/:sid/context', async (req, res) => {
      const row = await loadContext(bareDb, { tenantId, sessionId: req.params.sid, maxMessages: 16 });
      res.json(row);
    });
    // The real context router behind a stub that sets the tenant: what auth + rate limiting cost.
    const handler = makeContextRoutes(makeContextBuilder({ ...svc.deps, db: bareDb }));
    const noAuth = express();
    noAuth.use(express.json());
    noAuth.use('/v1/sessions', (_req, res, next) => {
      res.locals.tenantId = tenantId;
      next();
    });
    noAuth.use('/v1/sessions', handler);
    noAuth.use(makeErrorHandler(makeLogger('silent')));
    const bareServer = await listen(bare);
    const noAuthServer = await listen(noAuth);
    servers.push(bareServer, noAuthServer);
    const portOf = (s: Server) => (s.address() as AddressInfo).port;
    const mnemosPort = Number(new URL(svc.url!).port);

    const variant = (name: string, port: number, path: (sid: string) => string, auth?: string): Variant => ({
      name,
      port,
      path,
      ...(auth ? { auth } : {}),
      agent: new Agent({ keepAlive: true, maxSockets: CONCURRENCY }),
      lat: [],
      errors: 0,
      seconds: 0,
    });
    const variants = [
      variant('baseline (bare SQL route)', portOf(bareServer), (s) => `/bare/${s}/context`),
      variant('mnemos context (full app)', mnemosPort, (s) => `/v1/sessions/${s}/context`, apiKey),
      variant('handler, no auth', portOf(noAuthServer), (s) => `/v1/sessions/${s}/context`),
    ];
    // Warm Postgres's buffers and the JIT for every variant, then measure in short slices that
    // rotate between the variants, so drifting background load hits all of them alike.
    for (const v of variants) await slice(v, sids, WARMUP_MS, false);
    const slices = Math.max(1, Math.round(SECONDS / SLICE_S));
    console.log(
      `closed loop, ${CONCURRENCY} connections, ${slices} slices of ${SLICE_S} s per variant (interleaved)`,
    );
    for (let i = 0; i < slices; i++) {
      for (let k = 0; k < variants.length; k++)
        await slice(variants[(i + k) % variants.length]!, sids, SLICE_S * 1000, true);
    }
    const rps = variants.map(report);
    for (const v of variants) v.agent.destroy();
    console.log(
      `of baseline: full app ${((rps[1]! / rps[0]!) * 100).toFixed(1)} % (target ≥ 70 %), ` +
        `handler without auth or rate limit ${((rps[2]! / rps[0]!) * 100).toFixed(1)} %`,
    );
  } finally {
    for (const s of servers) s.close();
    await bareDb.close();
    await svc.stop();
    await deleteRedisPrefix(prefix);
    await dropTestDatabase(url);
  }
}

await main();
