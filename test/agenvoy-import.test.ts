import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { findHistoryDb, readAgenvoySession } from '../services/lifecycle/agenvoy-import.js';
import { parseCursorValue, splitTimeHeader } from '../services/lifecycle/agenvoy-time.js';
import { importAgenvoySessions } from '../services/lifecycle/agenvoy-migrate.js';
import { sortForImport } from '../services/lifecycle/import-session.js';
import { openSqlite } from '../services/lifecycle/sqlite.js';
import { parseSentAt } from '../services/time.js';
import { REDIS_URL, deleteRedisPrefix, eventually, startTestService } from './support/harness.js';
import type { Api, TestService } from './support/harness.js';
import { startPrivateRedis } from './support/private-redis.js';

const run = promisify(execFile);
const cli = path.resolve(import.meta.dirname, '..', 'bin', 'mnemos.js');
const TZ = 'Asia/Taipei'; // UTC+8, no DST
/** Naive Taipei wall-clock time → unix ns (as a decimal string). */
const taipei = (naive: string) => String(BigInt(Date.parse(`${naive.replace(' ', 'T')}+08:00`)) * 1_000_000n);
const plus = (ns: string, n: number) => String(BigInt(ns) + BigInt(n));

const SUMMARY = {
  key_decisions: ['Do: answer briefly'],
  past_discussions: [
    { topic: 'files', description: 'listing files', direction: 'done', last_discussed: '2025-03-01' },
  ],
  current_discussion: { topic: 'shell', description: 'ls flags', perspectives: 'none', direction: 'open' },
};

let svc: TestService;
/** The CLI's environment: this suite's database, key prefix and Redis, quiet logs. */
const cliEnv = (extra: Record<string, string | undefined> = {}) => ({
  ...process.env,
  DATABASE_URL: svc.config.databaseUrl,
  MNEMOS_PREFIX: svc.config.prefix,
  REDIS_URL,
  TZ,
  LOG_LEVEL: 'silent',
  ...extra,
});
const roots: string[] = [];

const header = (time: string, body: string) =>
  `---\n當前時間: ${time}\n工作目錄: /home/me/proj\n---\n${body}`;

interface DbRow {
  session: string;
  sendAt: string;
  role: string;
  content: string;
}

/** An Agenvoy config dir: sessions/<sid>/… and .store/history.db (beside, or inside sessions/). */
function buildFixture(opts: { dbInside?: boolean } = {}): { root: string; sessions: string } {
  const root = mkdtempSync(path.join(tmpdir(), 'agenvoy-'));
  const sessions = path.join(root, 'sessions');
  const write = (sid: string, file: string, data: unknown) => {
    mkdirSync(path.join(sessions, sid), { recursive: true });
    writeFileSync(path.join(sessions, sid, file), typeof data === 'string' ? data : JSON.stringify(data));
  };
  const rows: DbRow[] = [];

  // 1. history.json only (its dual-written copy in history.db is an exact duplicate), new cursor file.
  const p = [
    { role: 'user', content: header('2025-03-01 10:00:00', 'how do I list files?') },
    { role: 'assistant', content: 'use ls' },
    { role: 'user', content: header('2025-03-01 10:05:00', 'and hidden ones?') },
    { role: 'assistant', content: 'ls -a' },
  ];
  write('plain-1', 'history.json', p);
  write('plain-1', 'summary.json', SUMMARY);
  write('plain-1', '.summary_cursor', '2025-03-01 10:00:00\n');
  const t1 = taipei('2025-03-01 10:00:00');
  const t2 = taipei('2025-03-01 10:05:00');
  rows.push(
    { session: 'plain-1', sendAt: t1, role: 'user', content: p[0]!.content },
    { session: 'plain-1', sendAt: plus(t1, 1), role: 'assistant', content: 'use ls' },
    { session: 'plain-1', sendAt: t2, role: 'user', content: p[2]!.content },
    { session: 'plain-1', sendAt: plus(t2, 1), role: 'assistant', content: 'ls -a' },
  );

  // 2. Legacy bare `sendAt:` headers, structured content, tool calls; cursor as unix ns.
  write('legacy-2', 'history.json', [
    {
      role: 'user',
      content: [
        { type: 'text', text: 'sendAt: 2025-03-02 09:00:00\nwhat is in this picture?' },
        { type: 'image_url', image_url: { url: 'data:image/jpeg;base64,AAAA', detail: 'auto' } },
      ],
    },
    {
      role: 'assistant',
      tool_calls: [
        {
          id: 'call_1',
          type: 'function',
          function: { name: 'vision', arguments: '{}' },
          thought_signature: 'x',
        },
      ],
    },
    { role: 'tool', tool_call_id: 'call_1', content: 'a cat' },
    { role: 'assistant', content: 'a cat' },
    { role: 'user', content: 'sendAt: 2025-03-02 09:30:00\nthanks' },
    { role: 'assistant', content: "you're welcome" },
  ]);
  write('legacy-2', 'summary.json', SUMMARY);
  write('legacy-2', '.summary_cursor', taipei('2025-03-02 09:00:00'));

  // 3. The older summary.meta.json cursor.
  write('meta-3', 'history.json', [
    { role: 'user', content: header('2025-03-03 08:00:00', 'first') },
    { role: 'assistant', content: 'one' },
    { role: 'user', content: header('2025-03-03 09:00:00', 'second') },
    { role: 'assistant', content: 'two' },
  ]);
  write('meta-3', 'summary.json', SUMMARY);
  write('meta-3', 'summary.meta.json', { last_message_time: '2025-03-03 08:00:00' });

  // 4. Compacted: history.json kept the last two turns; history.db holds all four.
  const turns = ['10:00', '10:10', '10:20', '10:30'].map((hm, i) => ({
    at: taipei(`2025-03-04 ${hm}:00`),
    user: header(`2025-03-04 ${hm}:00`, `question ${i + 1}`),
    answer: `answer ${i + 1}`,
  }));
  write(
    'compacted-4',
    'history.json',
    turns.slice(2).flatMap((t) => [
      { role: 'user', content: t.user },
      { role: 'assistant', content: t.answer },
    ]),
  );
  write('compacted-4', 'summary.json', SUMMARY);
  write('compacted-4', '.summary_cursor', '2025-03-04 10:10:00');
  turns.forEach((t, i) => {
    rows.push({ session: 'compacted-4', sendAt: t.at, role: 'user', content: t.user });
    // Agenvoy stamps a reply it cannot time with 0 (turn 2 here).
    rows.push({
      session: 'compacted-4',
      sendAt: i === 1 ? '0' : plus(t.at, 1),
      role: 'assistant',
      content: t.answer,
    });
  });

  // 5. A legacy-shaped summary is not imported (the summary sweep rebuilds one).
  write('legacy-sum-5', 'history.json', [{ role: 'user', content: header('2025-03-05 08:00:00', 'hi') }]);
  write('legacy-sum-5', 'summary.json', { core_discussion: 'x', discussion_log: [] });

  write('empty-6', 'summary.json', {});

  // 7. An archive that holds the real send time (finer than the whole-second headers): the
  // same messages, not twice.
  write('subsec-7', 'history.json', [
    { role: 'user', content: header('2025-03-07 10:00:00', 'first question') },
    { role: 'assistant', content: 'first answer' },
    { role: 'user', content: header('2025-03-07 10:01:00', 'second question') },
    { role: 'assistant', content: 'first answer' },
  ]);
  const s1 = taipei('2025-03-07 10:00:00');
  const s2 = taipei('2025-03-07 10:01:00');
  rows.push(
    {
      session: 'subsec-7',
      sendAt: plus(s1, 123_456_789),
      role: 'user',
      content: header('2025-03-07 10:00:00', 'first question'),
    },
    { session: 'subsec-7', sendAt: plus(s1, 2_500_000_000), role: 'assistant', content: 'first answer' },
    {
      session: 'subsec-7',
      sendAt: plus(s2, 400_000_000),
      role: 'user',
      content: header('2025-03-07 10:01:00', 'second question'),
    },
    { session: 'subsec-7', sendAt: plus(s2, 3_000_000_000), role: 'assistant', content: 'first answer' },
    // A compacted-away message with the same text two hours earlier is another message.
    { session: 'subsec-7', sendAt: plus(s1, -7_200_000_000_000), role: 'assistant', content: 'first answer' },
  );

  // 8. A summary and its cursor, no history: restored once; a re-run leaves it alone.
  write('sumonly-8', 'summary.json', SUMMARY);
  write('sumonly-8', '.summary_cursor', '2025-03-08 10:00:00');

  // 9-11. Damaged files: a byte-order mark, a broken summary.json (costs the summary, not the
  // history), a time header that is no date.
  write('bom-9', 'history.json', `\uFEFF${JSON.stringify([{ role: 'user', content: 'with a BOM' }])}`);
  write('badsum-10', 'history.json', [{ role: 'user', content: header('2025-03-10 08:00:00', 'kept') }]);
  write('badsum-10', 'summary.json', '{not json');
  write('oddtime-11', 'history.json', [
    { role: 'user', content: header('2025-03-11 08:00:00', 'before') },
    { role: 'user', content: header('2025-13-45 25:61:61', 'odd') },
  ]);
  mkdirSync(path.join(sessions, 'not a session id'), { recursive: true });

  const storeDir = opts.dbInside ? path.join(sessions, '.store') : path.join(root, '.store');
  mkdirSync(storeDir, { recursive: true });
  const db = openSqlite(path.join(storeDir, 'history.db'));
  db.exec(`CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,
    send_at INTEGER NOT NULL DEFAULT 0, role TEXT NOT NULL, content TEXT NOT NULL, sender TEXT)`);
  const insert = db.prepare('INSERT INTO messages (session_id, send_at, role, content) VALUES (?, ?, ?, ?)');
  for (const r of rows) insert.run(r.session, BigInt(r.sendAt), r.role, r.content);
  db.close();
  return { root, sessions };
}

interface RawRow {
  session: string;
  /** unix ns as a decimal string, 0 when Agenvoy could not time it; or any SQLite value. */
  sendAt: string | bigint | null;
  role: string;
  content: string | Buffer;
}

/**
 * A sessions dir in Agenvoy's real layout: `.store/history.db` with the schema of Agenvoy's
 * store (no tool_call_id, no sender), beside `sessions/`.
 */
function agenvoyDir(files: Record<string, Record<string, unknown>>, rows: RawRow[]): string {
  const root = mkdtempSync(path.join(tmpdir(), 'agenvoy-'));
  roots.push(root);
  const sessions = path.join(root, 'sessions');
  for (const [sid, byName] of Object.entries(files)) {
    mkdirSync(path.join(sessions, sid), { recursive: true });
    for (const [name, data] of Object.entries(byName)) {
      writeFileSync(
        path.join(sessions, sid, name),
        typeof data === 'string' || Buffer.isBuffer(data) ? data : JSON.stringify(data),
      );
    }
  }
  mkdirSync(path.join(root, '.store'));
  const db = openSqlite(path.join(root, '.store', 'history.db'));
  db.exec(`CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL,
    send_at INTEGER NOT NULL DEFAULT 0, role TEXT NOT NULL, content TEXT NOT NULL)`);
  const insert = db.prepare('INSERT INTO messages (session_id, send_at, role, content) VALUES (?, ?, ?, ?)');
  db.exec('BEGIN');
  for (const r of rows) {
    const sendAt = typeof r.sendAt === 'string' && /^\d+$/.test(r.sendAt) ? BigInt(r.sendAt) : r.sendAt;
    insert.run(r.session, sendAt, r.role, r.content);
  }
  db.exec('COMMIT');
  db.close();
  return sessions;
}

/** A compacted session: every turn in history.db (dual write), the last `keep` in history.json. */
function compacted(
  sid: string,
  turns: Array<{ at: string; ms?: number; user: string; reply: string; replyAt?: string }>,
  keep: number,
): { json: unknown[]; rows: RawRow[] } {
  const json: unknown[] = [];
  const rows: RawRow[] = [];
  turns.forEach((t, i) => {
    const user = header(t.at, t.user);
    const at = plus(taipei(t.at), (t.ms ?? 0) * 1_000_000);
    rows.push({ session: sid, sendAt: at, role: 'user', content: user });
    rows.push({ session: sid, sendAt: t.replyAt ?? plus(at, 1), role: 'assistant', content: t.reply });
    if (i >= turns.length - keep)
      json.push({ role: 'user', content: user }, { role: 'assistant', content: t.reply });
  });
  return { json, rows };
}

/**
 * A session of heartbeat turns every 10 minutes from `start` in a zone `offsetHours` from UTC,
 * each answered "ok": history.db holds every turn (sub-second times), history.json the last `keep`.
 */
function heartbeat(
  session: string,
  a: { start: string; offsetHours: number; turns: number; keep: number; text?: (i: number) => string },
): { dir: string; base: number } {
  const base = Date.parse(a.start);
  const json: unknown[] = [];
  const rows: RawRow[] = [];
  for (let i = 0; i < a.turns; i++) {
    const ms = base + i * 600_000;
    const naive = new Date(ms + a.offsetHours * 3_600_000).toISOString().slice(0, 19).replace('T', ' ');
    const user = header(naive, a.text?.(i) ?? 'status?');
    if (i >= a.turns - a.keep)
      json.push({ role: 'user', content: user }, { role: 'assistant', content: 'ok' });
    const ns = BigInt(ms) * 1_000_000n;
    rows.push(
      { session, sendAt: String(ns + 200_000_000n), role: 'user', content: user },
      { session, sendAt: String(ns + 2_000_000_000n), role: 'assistant', content: 'ok' },
    );
  }
  return { dir: agenvoyDir({ [session]: { 'history.json': json } }, rows), base };
}

/** Reads one session as the import does (no service), its messages in import order. */
async function readOne(sessions: string, sid: string, zone: string) {
  const db = openSqlite(findHistoryDb(sessions)!, { readonly: true });
  try {
    const read = await readAgenvoySession(path.join(sessions, sid), sid, db, zone);
    const listing = sortForImport(read.input.messages).map((m) => m.message);
    return { ...read, listing, contents: listing.map((m) => m.content) };
  } finally {
    db.close();
  }
}

/** A naive time in `zone` (Intl-free: the offset is given) → unix ns as a decimal string. */
const at = (naive: string, offset: string) =>
  String(BigInt(Date.parse(`${naive.replace(' ', 'T')}${offset}`)) * 1_000_000n);

async function listed(t: Api, sid: string): Promise<any[]> {
  const r = await t.get(`/v1/sessions/${sid}/messages?limit=500`);
  assert.equal(r.status, 200, `${sid}: ${r.text}`);
  return r.body.messages;
}

before(async () => {
  svc = await startTestService({ env: { TZ } });
});
after(async () => {
  await svc.stop();
  await deleteRedisPrefix(svc.config.prefix);
  for (const r of roots) rmSync(r, { recursive: true, force: true });
});

void describe('agenvoy import', () => {
  void test('imports history.json, summary and both cursor formats, merging history.db without duplicates', async () => {
    const fx = buildFixture();
    roots.push(fx.root);
    const t = await svc.newTenant();
    const report = await importAgenvoySessions(svc.deps, t.tenantId, fx.sessions, { timeZone: TZ });
    assert.equal(report.historyDb, path.join(fx.sessions, '..', '.store', 'history.db'));
    // 'not a session id' holds no session files: no session, not reported.
    assert.deepEqual(report.invalidDirs, []);
    const by = Object.fromEntries(report.sessions.map((s) => [s.session_id, s]));
    assert.deepEqual(
      Object.fromEntries(
        report.sessions.map((s) => [
          s.session_id,
          [
            s.status,
            s.imported,
            s.from_history_json,
            s.from_history_db,
            s.duplicates_merged,
            s.summary?.cursor_seq ?? null,
          ],
        ]),
      ),
      {
        'plain-1': ['imported', 4, 4, 0, 4, 2],
        'legacy-2': ['imported', 6, 6, 0, 0, 4],
        'meta-3': ['imported', 4, 4, 0, 0, 2],
        'compacted-4': ['imported', 8, 4, 4, 4, 4],
        'legacy-sum-5': ['imported', 1, 1, 0, 0, null],
        'empty-6': ['skipped', 0, 0, 0, 0, null],
        'subsec-7': ['imported', 5, 4, 1, 4, null],
        // A summary with no cursor covers what came with it: nothing, for a summary alone.
        'sumonly-8': ['imported', 0, 0, 0, 0, 0],
        'bom-9': ['imported', 1, 1, 0, 0, null],
        'badsum-10': ['imported', 1, 1, 0, 0, null],
        'oddtime-11': ['imported', 2, 2, 0, 0, null],
      },
    );
    assert.match(
      by['badsum-10']!.notes.join(' '),
      /summary\.json is not valid JSON at line 1, column 2 \(.+\): summary skipped/,
    );
    assert.ok(
      report.sessions.every((s) => !s.notes.some((n) => n.includes('WARNING'))),
      "report.sessions.every((s) => !s.notes.some((n) => n.includes('WARNING')))",
    );
    assert.match(
      by['oddtime-11']!.notes.join(' '),
      /1 time header\(s\) could not be read \("2025-13-45 25:61:61"\)/,
    );
    assert.equal(by['legacy-sum-5']!.summary, null);
    assert.match(by['legacy-sum-5']!.notes.join(' '), /not in the current summary shape/);

    await eventually(
      async () => (await listed(t.api, 'compacted-4')).length === 8,
      15_000,
      'compacted-4 archived',
    );
    await eventually(async () => (await listed(t.api, 'legacy-2')).length === 6, 15_000, 'legacy-2 archived');

    // Headers become sent_at (local time → UTC); replies follow their turn by 1 ns.
    const plain = await listed(t.api, 'plain-1');
    assert.deepEqual(
      plain.map((m) => [m.seq, m.role, m.content, m.sent_at]),
      [
        [1, 'user', 'how do I list files?', '2025-03-01T02:00:00.000000000Z'],
        [2, 'assistant', 'use ls', '2025-03-01T02:00:00.000000001Z'],
        [3, 'user', 'and hidden ones?', '2025-03-01T02:05:00.000000000Z'],
        [4, 'assistant', 'ls -a', '2025-03-01T02:05:00.000000001Z'],
      ],
    );
    assert.deepEqual(plain[0].metadata, { work_dir: '/home/me/proj' });
    const sum = await t.api.get('/v1/sessions/plain-1/summary');
    assert.deepEqual(sum.body.summary, SUMMARY);
    assert.equal(sum.body.cursor_seq, 2);

    const legacy = await listed(t.api, 'legacy-2');
    assert.deepEqual(legacy[0].content, [
      { type: 'text', text: 'what is in this picture?' },
      { type: 'image_url', image_url: { url: 'data:image/jpeg;base64,AAAA', detail: 'auto' } },
    ]);
    assert.equal(legacy[0].sent_at, '2025-03-02T01:00:00.000000000Z');
    assert.deepEqual(legacy[1].tool_calls, [
      { id: 'call_1', type: 'function', function: { name: 'vision', arguments: '{}' } },
    ]);
    assert.equal(legacy[2].tool_call_id, 'call_1');
    assert.equal(legacy[4].content, 'thanks');
    assert.equal((await t.api.get('/v1/sessions/legacy-2/summary')).body.cursor_seq, 4);

    assert.equal((await t.api.get('/v1/sessions/meta-3/summary')).body.cursor_seq, 2);

    const compacted = await listed(t.api, 'compacted-4');
    assert.deepEqual(
      compacted.map((m) => m.content),
      [
        'question 1',
        'answer 1',
        'question 2',
        'answer 2',
        'question 3',
        'answer 3',
        'question 4',
        'answer 4',
      ],
    );
    assert.deepEqual(
      compacted.map((m) => m.seq),
      [1, 2, 3, 4, 5, 6, 7, 8],
    );
    const times = compacted.map((m) => BigInt(m.sent_at_ns));
    assert.ok(
      times.every((ns, i) => i === 0 || ns > times[i - 1]!),
      'times.every((ns, i) => i === 0 || ns > times[i - 1]!)',
    );
    assert.equal((await t.api.get('/v1/sessions/compacted-4/summary')).body.cursor_seq, 4);
    assert.equal((await t.api.get('/v1/sessions/empty-6')).status, 404);

    await eventually(async () => (await listed(t.api, 'subsec-7')).length === 5, 15_000, 'subsec-7 archived');
    // A header message takes its copy's finer time (within the header's second); replies follow by 1 ns.
    assert.deepEqual(
      (await listed(t.api, 'subsec-7')).map((m) => [m.content, m.sent_at]),
      [
        ['first answer', '2025-03-07T00:00:00.000000000Z'],
        ['first question', '2025-03-07T02:00:00.123456789Z'],
        ['first answer', '2025-03-07T02:00:00.123456790Z'],
        ['second question', '2025-03-07T02:01:00.400000000Z'],
        ['first answer', '2025-03-07T02:01:00.400000001Z'],
      ],
    );
    const restored = (await t.api.get('/v1/sessions/sumonly-8/summary')).body;
    assert.deepEqual(restored.summary, SUMMARY);

    // Re-running skips sessions that already hold messages, or (holding none) a summary.
    const again = await importAgenvoySessions(svc.deps, t.tenantId, fx.sessions, { timeZone: TZ });
    assert.ok(
      again.sessions.filter((s) => s.session_id !== 'empty-6').every((s) => s.status === 'skipped'),
      "again.sessions.filter((s) => s.session_id !== 'empty-6').every((s) => s.status === 'skipped')",
    );
    assert.equal((await listed(t.api, 'compacted-4')).length, 8);
    assert.equal((await listed(t.api, 'subsec-7')).length, 5);
    assert.equal((await t.api.get('/v1/sessions/sumonly-8/summary')).body.version, restored.version);
  });

  void test('mnemos import agenvoy (CLI) finds .store inside the sessions dir and is durable when it returns', async () => {
    const fx = buildFixture({ dbInside: true });
    roots.push(fx.root);
    const name = `agenvoy-cli-${Date.now()}`;
    const t = await svc.newTenant(name);
    const env = cliEnv();
    const { stdout } = await run(
      process.execPath,
      [cli, 'import', 'agenvoy', fx.sessions, '--tenant', name, '--json'],
      {
        env,
      },
    );
    const report = JSON.parse(stdout.trim().split('\n').pop()!);
    assert.equal(report.historyDb, path.join(fx.sessions, '.store', 'history.db'));
    const compacted = report.sessions.find((s: { session_id: string }) => s.session_id === 'compacted-4');
    assert.equal(compacted.imported, 8);
    assert.equal(compacted.from_history_db, 4);
    // No waiting: the command archived what it imported before returning.
    assert.equal((await listed(t.api, 'compacted-4')).length, 8);
    assert.equal((await listed(t.api, 'plain-1')).length, 4);

    const text = await run(process.execPath, [cli, 'import', 'agenvoy', fx.sessions, '--tenant', name], {
      env,
    });
    assert.match(text.stdout, /plain-1: skipped/);
    assert.match(text.stdout, /imported 0 of 11 sessions/);

    // Mistakes are one line on stderr and exit 1, before anything is done.
    const failing = async (args: string[]) => {
      const err = (await run(process.execPath, [cli, ...args], { env }).then(
        () => assert.fail(`${args.join(' ')} succeeded`),
        (e: unknown) => e,
      )) as { code: number; stderr: string };
      assert.equal(err.code, 1);
      assert.equal(err.stderr.trim().split('\n').length, 1, err.stderr);
      return err.stderr;
    };
    assert.match(
      await failing(['import', 'agenvoy', fx.sessions, '--tenant', name, '--tz', 'Mars/Olympus']),
      /^mnemos: --tz: unknown time zone "Mars\/Olympus"/,
    );
    const nope = await run(
      process.execPath,
      [cli, 'import', 'agenvoy', fx.sessions, '--tenant', name, '--session', 'nope-x'],
      { env },
    ).then(
      () => assert.fail('a missing --session succeeded'),
      (e: { code: number; stdout: string }) => e,
    );
    assert.equal(nope.code, 3, 'no session imported');
    assert.match(nope.stdout, /nope-x: failed \(no such session directory/);
    const missing = path.join(fx.root, 'no-such-dir', 'out.jsonl');
    assert.match(
      await failing(['export', 'plain-1', '--tenant', name, '--out', missing]),
      /^mnemos: ENOENT: no such file or directory/,
    );
    const out = path.join(fx.root, 'plain-1.jsonl');
    await run(process.execPath, [cli, 'export', 'plain-1', '--tenant', name, '--out', out], { env });
    assert.equal(readFileSync(out, 'utf8').trim().split('\n').length, 5, 'four messages and the summary');
  });

  /** Runs `mnemos import agenvoy <root>/<dir> --tenant <tenant> …`; never rejects. */
  const importer = (root: string, tenant: string, env: Record<string, string | undefined> = {}) => {
    const fullEnv = cliEnv(env);
    return (dir: string, ...args: string[]) =>
      run(process.execPath, [cli, 'import', 'agenvoy', path.join(root, dir), '--tenant', tenant, ...args], {
        env: fullEnv,
      }).then(
        ({ stdout, stderr }) => ({ code: 0, stdout, stderr }),
        (e: { code: number; stdout: string; stderr: string }) => e,
      );
  };
  const good = (text: string) =>
    JSON.stringify([{ role: 'user', content: header('2025-04-01 09:00:00', text) }]);
  /** A temporary folder holding `files` (a path under it: its text), removed after the suite. */
  const folderOf = (prefix: string, files: Record<string, string>) => {
    const root = mkdtempSync(path.join(tmpdir(), prefix));
    roots.push(root);
    for (const [file, text] of Object.entries(files)) {
      mkdirSync(path.dirname(path.join(root, file)), { recursive: true });
      writeFileSync(path.join(root, file), text);
    }
    return root;
  };

  void test('mnemos import agenvoy exits 0 only when the sessions are in mnemos: 2 partial, 3 none, 1 on an empty folder', async () => {
    // Setup: an empty folder; one with a good and a broken session; one where none can be imported.
    const root = folderOf('agenvoy-exit-', {
      'mixed/good-1/history.json': good('hello'),
      'mixed/broken-2/history.json': '[{"role": "user", "content": ',
      'none/broken-3/history.json': '{not json',
      'none/hollow-4/history.json': '[]',
    });
    mkdirSync(path.join(root, 'empty'));
    const name = `agenvoy-exit-${Date.now()}`;
    const t = await svc.newTenant(name);
    const importing = importer(root, name);

    // Action + Assert: an empty folder is an error, with what it expected.
    const empty = await importing('empty');
    assert.equal(empty.code, 1, empty.stdout);
    assert.match(empty.stderr, /^mnemos: .*empty holds no session directories .*nothing imported\n$/);

    // One imported, one failed: partial, and said so on stderr; the same on a re-run.
    const mixed = await importing('mixed');
    assert.equal(mixed.code, 2, mixed.stdout);
    assert.match(mixed.stdout, /good-1: imported, 1 messages/);
    assert.match(mixed.stdout, /broken-2: failed/);
    assert.match(mixed.stderr, /mnemos: import agenvoy: 1 of 2 sessions failed \(imported 1\)/);
    assert.equal((await listed(t.api, 'good-1')).length, 1);
    assert.equal((await importing('mixed')).code, 2, 'a re-run: good-1 is there, broken-2 fails again');
    // Everything asked for already there: success.
    const again = await importing('mixed', '--session', 'good-1');
    assert.equal(again.code, 0, again.stderr);
    assert.match(again.stdout, /good-1: skipped/);
    assert.equal(again.stderr, '');

    // Nothing could be imported: neither 0 nor a crash's 1.
    const none = await importing('none', '--json');
    assert.equal(none.code, 3, none.stdout);
    assert.deepEqual(
      (
        JSON.parse(none.stdout) as {
          sessions: Array<{ session_id: string; status: string; skip_reason: string | null }>;
        }
      ).sessions.map((s) => [s.session_id, s.status, s.skip_reason]),
      [
        ['broken-3', 'failed', null],
        ['hollow-4', 'skipped', 'nothing_to_import'],
      ],
    );
    assert.match(
      none.stderr,
      /mnemos: import agenvoy: no session imported of 2 \(1 failed, 1 had nothing to import\)/,
    );
  });

  void test('a directory holding a session but no valid session id is a session not imported; --session counts only what it names', async () => {
    // Setup: a good session, one with nothing to import, one whose name is no session id but
    // holds a message, and a directory that is no session (no session files, an invalid name).
    const root = folderOf('agenvoy-names-', {
      'dir/ok-1/history.json': good('kept'),
      'dir/hollow-2/history.json': '[]',
      'dir/bad name/history.json': good('lost'),
      'dir/old notes/README.txt': 'not a session',
    });
    const name = `agenvoy-names-${Date.now()}`;
    const t = await svc.newTenant(name);
    const importing = importer(root, name);

    // Action + Assert: the invalid name is a failure (it exited 0), the other directory ignored.
    const all = await importing('dir');
    assert.equal(all.code, 2, all.stdout);
    assert.match(all.stdout, /^bad name: failed \(its name is not a valid session id\)$/m);
    assert.doesNotMatch(all.stdout, /old notes/);
    assert.match(
      all.stderr,
      /^mnemos: import agenvoy: 1 of 3 sessions failed \(imported 1; 1 not a valid session id\); see their notes\n$/,
    );
    assert.equal((await listed(t.api, 'ok-1')).length, 1);

    // --session counts and reports only what it names (it named "bad name" too, "of 2").
    const hollow = await importing('dir', '--session', 'hollow-2');
    assert.equal(hollow.code, 3, hollow.stdout);
    assert.doesNotMatch(hollow.stdout, /bad name/);
    assert.match(hollow.stderr, /no session imported of 1 \(1 had nothing to import\)\n$/);

    // An invalid name given to --session is said to be one, once (it was "no such session
    // directory" beside "not a valid session id", "of 2").
    const bad = await importing('dir', '--session', 'bad name');
    assert.equal(bad.code, 3, bad.stdout);
    assert.deepEqual(
      bad.stdout.split('\n').filter((l) => l.startsWith('bad name')),
      ['bad name: failed (its name is not a valid session id)'],
    );
    assert.match(bad.stderr, /no session imported of 1 \(1 not a valid session id\)\n$/);
  });

  void test('mnemos import agenvoy stops and exits 1 when a store refuses mid-run, not 3 as for bad data', async () => {
    // Setup: two good sessions, and a Redis of the command's own that refuses every write (full
    // under noeviction), as a store that is down for now.
    const root = folderOf('agenvoy-down-', {
      'dir/f-1/history.json': good('f-1'),
      'dir/f-2/history.json': good('f-2'),
    });
    const name = `agenvoy-down-${Date.now()}`;
    const t = await svc.newTenant(name);
    const r = await startPrivateRedis();
    const admin = new Redis(r.url);
    try {
      await admin.config('SET', 'maxmemory', '1');
      const importing = importer(root, name, { REDIS_URL: r.url });

      // Action
      const down = await importing('dir');

      // Assert: "try again later" (1), and it says so; the session after it was not tried.
      assert.equal(down.code, 1, `${down.stdout}\n${down.stderr}`);
      assert.match(
        down.stderr,
        /^mnemos: import agenvoy: stopped after 1 session\(s\), imported 0: redis is unavailable, retry later; run it again later/,
      );
      assert.match(down.stdout, /f-1: failed/);
      assert.doesNotMatch(down.stdout, /f-2/);

      // Once Redis takes writes again, a re-run imports both.
      await admin.config('SET', 'maxmemory', '0');
      const later = await importing('dir');
      assert.equal(later.code, 0, `${later.stdout}\n${later.stderr}`);
      assert.equal((await listed(t.api, 'f-2')).length, 1);
    } finally {
      admin.disconnect();
      await r.stop();
    }
  });

  // Compacted sessions whose texts repeat: each history.json message must merge with its own copy
  // in history.db, and the compacted turn must come before it.
  for (const c of [
    {
      title: 'a compacted reply Agenvoy could not time (send_at 0) keeps its place before the same reply',
      sid: 'untimed-12',
      turns: [
        { at: '2025-03-12 10:00:00', user: 'q1', reply: 'ok', replyAt: '0' },
        { at: '2025-03-12 10:10:00', user: 'q2', reply: 'ok', replyAt: '0' },
      ],
      want: ['q1', 'ok', 'q2', 'ok'],
    },
    {
      title: 'a text sent twice within a minute merges with the copy nearest in time, not the first',
      sid: 'near-13',
      // history.db holds the real, sub-second send times.
      turns: [
        { at: '2025-03-13 10:00:00', ms: 500, user: 'ok', reply: 'A1' },
        { at: '2025-03-13 10:00:30', ms: 700, user: 'ok', reply: 'A2' },
      ],
      want: ['ok', 'A1', 'ok', 'A2'],
    },
  ]) {
    void test(c.title, async () => {
      // Setup: two turns in history.db, the second also in history.json.
      const session = compacted(c.sid, c.turns, 1);
      const dir = agenvoyDir({ [c.sid]: { 'history.json': session.json } }, session.rows);
      const t = await svc.newTenant();

      // Action
      const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });

      // Assert
      const [s] = report.sessions;
      assert.deepEqual(
        [s!.status, s!.imported, s!.from_history_db, s!.duplicates_merged],
        ['imported', 4, 2, 2],
      );
      await eventually(async () => (await listed(t.api, c.sid)).length === 4, 15_000, c.sid);
      assert.deepEqual(
        (await listed(t.api, c.sid)).map((m) => m.content),
        c.want,
      );
    });
  }

  void test('refuses a session whose files are not UTF-8, naming the file and the byte', async () => {
    // Setup: history.json in Big5, history.json with one Latin-1 byte, summary.json in Latin-1.
    const prefix = '[{"role":"user","content":"sendAt: 2025-03-01 10:00:00\\n';
    const big5 = Buffer.concat([
      Buffer.from(prefix),
      Buffer.from('a7daadccb051bdd7b04fbed0a874b2ce', 'hex'), // 我們討論記憶系統
      Buffer.from('"}]'),
    ]);
    const latin1 = Buffer.from(`${prefix}caf\xe9 au lait"}]`, 'latin1');
    const dir = agenvoyDir(
      {
        'enc-big5': { 'history.json': big5 },
        'enc-latin1': { 'history.json': latin1 },
        'enc-summary': {
          'history.json': [{ role: 'user', content: 'fine' }],
          'summary.json': Buffer.from(
            JSON.stringify(SUMMARY).replace('ls flags', 'ls dr\xe9apeaux'),
            'latin1',
          ),
        },
      },
      [],
    );
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });

    // Assert: refused (a re-run after converting the file imports it), and nothing stored.
    const by = Object.fromEntries(report.sessions.map((s) => [s.session_id, s]));
    assert.deepEqual(
      report.sessions.map((s) => [s.session_id, s.status, s.imported]),
      [
        ['enc-big5', 'failed', 0],
        ['enc-latin1', 'failed', 0],
        ['enc-summary', 'failed', 0],
      ],
    );
    assert.match(
      by['enc-big5']!.notes.join(' '),
      new RegExp(`^history\\.json is not valid UTF-8 \\(byte offset ${prefix.length}, line 1\\)`),
    );
    assert.match(
      by['enc-latin1']!.notes.join(' '),
      new RegExp(`^history\\.json is not valid UTF-8 \\(byte offset ${prefix.length + 3}, line 1\\)`),
    );
    assert.match(
      by['enc-summary']!.notes.join(' '),
      /^summary\.json is not valid UTF-8 \(byte offset \d+, line 1\)/,
    );
    for (const sid of ['enc-big5', 'enc-latin1', 'enc-summary']) {
      assert.equal((await t.api.get(`/v1/sessions/${sid}`)).status, 404, sid);
    }
  });

  void test('reads history.json in the zone that lines it up with history.db when the zone given is wrong', async () => {
    // Setup: a Taipei session, compacted (history.db holds 6 turns, history.json the last 3),
    // imported with --tz UTC.
    const turns = ['10:00:00', '10:00:30', '10:10:00', '10:20:00', '10:20:40', '10:30:00'].map((hm, i) => ({
      at: `2025-03-14 ${hm}`,
      user: `q${i + 1}`,
      reply: i === 5 ? 'a6' : 'ok',
    }));
    const c = compacted('zone-14', turns, 3);
    const dir = agenvoyDir(
      {
        'zone-14': {
          'history.json': c.json,
          'summary.json': SUMMARY,
          '.summary_cursor': '2025-03-14 10:10:00',
        },
      },
      c.rows,
    );
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: 'UTC' });

    // Assert: every message once, at its Taipei time, the cursor after turn 3, and a warning.
    const [s] = report.sessions;
    assert.deepEqual(
      [s!.status, s!.imported, s!.from_history_json, s!.from_history_db, s!.duplicates_merged, s!.summary],
      ['imported', 12, 6, 6, 6, { cursor_seq: 6 }],
    );
    assert.match(
      s!.notes.join(' '),
      /^WARNING: history\.json's times are not UTC time: read in UTC, 0 of the 3 timed message\(s\) of history\.json compared line up with their copies in history\.db; read in Asia\/Taipei, 3 do\. Imported them as Asia\/Taipei time/,
    );
    await eventually(async () => (await listed(t.api, 'zone-14')).length === 12, 15_000, 'zone-14');
    const listing = await listed(t.api, 'zone-14');
    assert.deepEqual(
      listing.map((m) => m.content),
      ['q1', 'ok', 'q2', 'ok', 'q3', 'ok', 'q4', 'ok', 'q5', 'ok', 'q6', 'a6'],
    );
    assert.equal(listing[10].sent_at, '2025-03-14T02:30:00.000000000Z');
  });

  void test('keeps compacted tool results of history.db as tool messages after a synthesised call', async () => {
    // Setup: Agenvoy archives a tool result with role "tool" and no tool_call_id, and never the
    // assistant message that called it (its content is empty). The turn was compacted away.
    const t0 = taipei('2025-03-15 10:00:00');
    const t1 = taipei('2025-03-15 11:00:00');
    const thanks = header('2025-03-15 11:00:00', 'thanks');
    const dir = agenvoyDir(
      {
        'tools-15': {
          'history.json': [
            { role: 'user', content: thanks },
            { role: 'assistant', content: 'welcome' },
          ],
        },
      },
      [
        {
          session: 'tools-15',
          sendAt: t0,
          role: 'user',
          content: header('2025-03-15 10:00:00', 'list my files'),
        },
        { session: 'tools-15', sendAt: plus(t0, 1), role: 'tool', content: 'README.md\nsecret-plans.txt' },
        { session: 'tools-15', sendAt: plus(t0, 2), role: 'assistant', content: 'You have two files' },
        { session: 'tools-15', sendAt: t1, role: 'user', content: thanks },
        { session: 'tools-15', sendAt: plus(t1, 1), role: 'assistant', content: 'welcome' },
      ],
    );
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });

    // Assert: the tool output is kept, after a call marked as synthesised, and found by search.
    const [s] = report.sessions;
    assert.deepEqual(
      [s!.status, s!.imported, s!.from_history_db, s!.duplicates_merged, s!.messages_skipped],
      ['imported', 6, 3, 2, 0],
    );
    assert.match(s!.notes.join(' '), /1 tool result\(s\) of history\.db had no tool call/);
    await eventually(async () => (await listed(t.api, 'tools-15')).length === 6, 15_000, 'tools-15');
    const listing = await listed(t.api, 'tools-15');
    assert.deepEqual(
      listing.map((m) => [m.role, m.content]),
      [
        ['user', 'list my files'],
        ['assistant', null],
        ['tool', 'README.md\nsecret-plans.txt'],
        ['assistant', 'You have two files'],
        ['user', 'thanks'],
        ['assistant', 'welcome'],
      ],
    );
    assert.deepEqual(listing[1].tool_calls, [
      { id: 'agenvoy_row_2', type: 'function', function: { name: 'agenvoy_tool', arguments: '{}' } },
    ]);
    assert.deepEqual(listing[1].metadata, { agenvoy_synthesised: 'tool_call' });
    assert.equal(listing[2].tool_call_id, 'agenvoy_row_2');
    assert.deepEqual(listing[2].metadata, { agenvoy_synthesised: 'tool_call_id' });
    const found = await t.api.post('/v1/sessions/tools-15/search', { query: 'secret', match: 'keyword' });
    assert.equal(found.status, 200, found.text);
    assert.ok(
      (found.body.hits as Array<{ seq: number }>).some((h) => h.seq === listing[2].seq),
      `the tool output is a hit: ${found.text}`,
    );
  });

  void test('notes every row and file it cannot read, and counts the skips past the first ten', async () => {
    // Setup: history.db rows with an unknown role, a BLOB content, a send_at that is text; a
    // broken history.json; a broken summary.meta.json.
    const rows: RawRow[] = [
      {
        session: 'rows-16',
        sendAt: taipei('2025-03-16 09:00:00'),
        role: 'user',
        content: Buffer.from('blob'),
      },
      ...Array.from({ length: 11 }, (_, i) => ({
        session: 'rows-16',
        sendAt: plus(taipei('2025-03-16 09:00:00'), i + 1),
        role: 'function',
        content: `legacy ${i}`,
      })),
      { session: 'rows-16', sendAt: '2025-03-16 09:30:00', role: 'user', content: 'a time as text' },
    ];
    const dir = agenvoyDir(
      {
        'rows-16': { 'history.json': [{ role: 'user', content: header('2025-03-16 10:00:00', 'kept') }] },
        'badjson-17': { 'history.json': '[\n  {"role": "user",, "content": "x"}]' },
        'badmeta-18': {
          'history.json': [{ role: 'user', content: header('2025-03-18 10:00:00', 'kept') }],
          'summary.json': SUMMARY,
          'summary.meta.json': '{broken',
        },
      },
      rows,
    );
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });

    // Assert
    const by = Object.fromEntries(report.sessions.map((s) => [s.session_id, s]));
    assert.deepEqual(
      report.sessions.map((s) => [s.session_id, s.status, s.imported, s.messages_skipped]),
      [
        ['badjson-17', 'failed', 0, 0],
        ['badmeta-18', 'imported', 1, 0],
        ['rows-16', 'imported', 2, 12],
      ],
    );
    const notes = by['rows-16']!.notes;
    assert.equal(notes.filter((n) => n.startsWith('skipped ')).length, 10);
    assert.ok(notes.includes('skipped history.db row 1: content is not text (a BLOB)'), notes.join('\n'));
    assert.ok(
      notes.some((n) => /^skipped history\.db row 2: role "function" is none of/.test(n)),
      'notes.some((n) => /^skipped history\\.db row 2: role "function" is none of/.test(n))',
    );
    assert.ok(notes.includes('… and 2 more skipped (12 in all)'), notes.join('\n'));
    assert.match(
      notes.join('\n'),
      /history\.db row 13: send_at "2025-03-16 09:30:00" \(text\) is not unix nanoseconds/,
    );
    assert.match(
      by['badjson-17']!.notes.join(' '),
      /^history\.json is not valid JSON at line 2, column \d+ \(/,
    );
    assert.match(
      by['badmeta-18']!.notes.join(' '),
      /summary\.meta\.json is not valid JSON at line 1, column 2/,
    );
    await eventually(async () => (await listed(t.api, 'rows-16')).length === 2, 15_000, 'rows-16');
    assert.deepEqual(
      (await listed(t.api, 'rows-16')).map((m) => m.content),
      ['a time as text', 'kept'],
    );
  });

  void test('a local time of the fall-back hour is read as the instant history.db holds, or the one after the header before it', async () => {
    // Setup: New York, 2025-11-02: "a" at 01:40 EDT, then "b" at 01:10 EST (the clock went back).
    // fb-db has history.db copies; fb-json is history.json alone.
    const json = [
      { role: 'user', content: header('2025-11-02 01:40:00', 'a') },
      { role: 'assistant', content: 'A' },
      { role: 'user', content: header('2025-11-02 01:10:00', 'b') },
      { role: 'assistant', content: 'B' },
    ];
    const ta = at('2025-11-02 01:40:00', '-04:00');
    const tb = at('2025-11-02 01:10:00', '-05:00');
    const dir = agenvoyDir({ 'fb-db': { 'history.json': json }, 'fb-json': { 'history.json': json } }, [
      { session: 'fb-db', sendAt: ta, role: 'user', content: json[0]!.content },
      { session: 'fb-db', sendAt: plus(ta, 2e9), role: 'assistant', content: 'A' },
      { session: 'fb-db', sendAt: tb, role: 'user', content: json[2]!.content },
      { session: 'fb-db', sendAt: plus(tb, 2e9), role: 'assistant', content: 'B' },
    ]);

    for (const sid of ['fb-db', 'fb-json']) {
      // Action
      const read = await readOne(dir, sid, 'America/New_York');

      // Assert: once each, in order, "b" at 06:10 UTC.
      assert.deepEqual(read.contents, ['a', 'A', 'b', 'B'], sid);
      assert.deepEqual(read.listing.map((m) => m.sent_at_ns).slice(0, 3), [ta, plus(ta, 1), tb], sid);
      assert.equal(read.stats.fromDb, 0, sid);
    }
  });

  void test('the zone that lines up every header wins over the given one that lines up only some', async () => {
    // Setup: Agenvoy ran in Europe/London; 6 winter turns (London = UTC) and 4 summer ones (BST).
    const days = [1, 2, 3, 4, 5, 6]
      .map((d) => `2025-02-0${d}`)
      .concat([1, 2, 3, 4].map((d) => `2025-06-0${d}`));
    const json: unknown[] = [];
    const rows: RawRow[] = [];
    days.forEach((day, i) => {
      const user = header(`${day} 10:00:00`, `q${i}`);
      const sendAt = at(`${day} 10:00:00`, day.startsWith('2025-06') ? '+01:00' : 'Z');
      json.push({ role: 'user', content: user }, { role: 'assistant', content: `a${i}` });
      rows.push(
        { session: 'london-19', sendAt, role: 'user', content: user },
        { session: 'london-19', sendAt: plus(sendAt, 3e9), role: 'assistant', content: `a${i}` },
      );
    });
    const dir = agenvoyDir({ 'london-19': { 'history.json': json } }, rows);
    const t = await svc.newTenant();

    // Action: --tz UTC, which is right for the winter half.
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: 'UTC' });
    const again = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: 'UTC' });

    // Assert: every message once, a warning naming London; the re-run's skip has no warning.
    const [s] = report.sessions;
    assert.deepEqual([s!.status, s!.imported, s!.duplicates_merged], ['imported', 20, 20]);
    assert.match(
      s!.notes.join(' '),
      /^WARNING: history\.json's times are not UTC time: read in UTC, 6 of the 10 .* read in Europe\/London, 10 do\. Imported them as Europe\/London time/,
    );
    assert.equal(again.sessions[0]!.status, 'skipped');
    assert.ok(
      !again.sessions[0]!.notes.some((n) => n.includes('WARNING')),
      again.sessions[0]!.notes.join('\n'),
    );
  });

  void test('a text repeated every ten minutes does not line history.json up in a wrong zone', async () => {
    // Setup: "status?" every 10 minutes for 24 h in Taipei, each answered "ok"; history.db holds all
    // 144 turns (sub-second times), history.json the last 100.
    const { dir, base } = heartbeat('beat-20', {
      start: '2025-03-01T00:00:00+08:00',
      offsetHours: 8,
      turns: 144,
      keep: 100,
    });

    // Action: without --tz (UTC here), and with the right one.
    const wrong = await readOne(dir, 'beat-20', 'UTC');
    const right = await readOne(dir, 'beat-20', TZ);

    // Assert: 288 messages either way, the first at Taipei midnight.
    for (const read of [wrong, right]) {
      assert.deepEqual([read.listing.length, read.stats.fromDb, read.stats.duplicates], [288, 88, 200]);
      assert.equal(read.listing[0]!.sent_at_ns, String(BigInt(base) * 1_000_000n + 200_000_000n));
    }
    assert.match(wrong.notes.join(' '), /^WARNING: .* read in Asia\/Taipei, 64 do\./);
    assert.deepEqual(right.notes, []);
  });

  void test('a few distinct turns among heartbeats decide the zone west of UTC', async () => {
    // Setup: an agent in New York; "status?" every 10 minutes for 1,000 turns, each answered "ok";
    // history.db holds all, history.json the last 600, six of which have a text of their own, at
    // positions an even spread of 64 samples skips.
    const keep = 600;
    const sampled = new Set(Array.from({ length: 64 }, (_, k) => Math.floor((k * keep) / 64)));
    const open = Array.from({ length: keep - 1 }, (_, j) => j + 1).filter((j) => !sampled.has(j));
    const distinct = new Set(
      open
        .filter((_, k) => k >= 5 && (k - 5) % 90 === 0)
        .slice(0, 6)
        .map((j) => 1000 - keep + j),
    );
    const { dir } = heartbeat('west-26', {
      start: '2025-03-01T00:00:00-05:00',
      offsetHours: -5,
      turns: 1000,
      keep,
      text: (i) => (distinct.has(i) ? `report ${i} please` : 'status?'),
    });

    // Action: read as UTC (the server's zone), and in New York.
    const wrong = await readOne(dir, 'west-26', 'UTC');
    const right = await readOne(dir, 'west-26', 'America/New_York');

    // Assert: 2,000 messages either way, each report once.
    for (const read of [wrong, right]) {
      assert.deepEqual([read.listing.length, read.stats.duplicates], [2000, 1200]);
    }
    assert.match(wrong.notes.join(' '), /WARNING: .*America\/New_York/);
  });

  void test('history.db rows without times merge with their copies however often a text repeats', async () => {
    // Setup: 200 turns, every reply "ok"; history.db holds them all with send_at 0 (u-21), or the
    // first 150 so and the rest timed (u-22); history.json holds them all, with headers.
    const json: unknown[] = [];
    const rows: RawRow[] = [];
    for (let i = 0; i < 200; i++) {
      const naive = `2025-03-21 ${String(Math.floor(i / 60)).padStart(2, '0')}:${String(i % 60).padStart(2, '0')}:00`;
      const user = header(naive, `q${i}`);
      json.push({ role: 'user', content: user }, { role: 'assistant', content: 'ok' });
      for (const sid of ['u-21', 'u-22']) {
        const sendAt = sid === 'u-22' && i >= 150 ? taipei(naive) : '0';
        rows.push(
          { session: sid, sendAt, role: 'user', content: user },
          { session: sid, sendAt: sendAt === '0' ? '0' : plus(sendAt, 1), role: 'assistant', content: 'ok' },
        );
      }
    }
    const dir = agenvoyDir({ 'u-21': { 'history.json': json }, 'u-22': { 'history.json': json } }, rows);

    for (const sid of ['u-21', 'u-22']) {
      // Action
      const read = await readOne(dir, sid, TZ);

      // Assert: each message once, in order.
      assert.deepEqual([read.listing.length, read.stats.fromDb, read.stats.duplicates], [400, 0, 400], sid);
      assert.deepEqual(read.contents.slice(0, 4), ['q0', 'ok', 'q1', 'ok'], sid);
    }
  });

  void test('a history.json without time headers merges every copy of a reply repeated a thousand times', async () => {
    // Setup: 1000 turns, replies all "ok"; history.json has no header at all, history.db has times.
    // (How long this takes is measured outside the tests: it was quadratic, 4,000 turns ~14 s.)
    const json: unknown[] = [];
    const rows: RawRow[] = [];
    const t0 = BigInt(taipei('2025-03-22 00:00:00'));
    for (let i = 0; i < 1000; i++) {
      json.push({ role: 'user', content: `q${i}` }, { role: 'assistant', content: 'ok' });
      const ns = t0 + BigInt(i) * 60_000_000_000n;
      rows.push(
        { session: 'nohdr-23', sendAt: String(ns), role: 'user', content: `q${i}` },
        { session: 'nohdr-23', sendAt: String(ns + 1_000_000_000n), role: 'assistant', content: 'ok' },
      );
    }
    const dir = agenvoyDir({ 'nohdr-23': { 'history.json': json } }, rows);

    // Action
    const read = await readOne(dir, 'nohdr-23', TZ);

    // Assert: every row merged with its own copy.
    assert.deepEqual([read.listing.length, read.stats.fromDb, read.stats.duplicates], [2000, 0, 2000]);
  });

  void test('a tool result of history.json without its call gets a synthesised call, and a rejected message leaves its copy to history.db', async () => {
    // Setup: cut-24: compaction cut between a call and its result (history.json starts with the
    // result); notid-25: the call has no id (rejected) and the result no tool_call_id.
    const t0 = taipei('2025-03-24 10:00:00');
    const dir = agenvoyDir(
      {
        'cut-24': {
          'history.json': [
            { role: 'tool', tool_call_id: 'call_9', content: 'OUT-CUT' },
            { role: 'assistant', content: 'so the answer is 42' },
            { role: 'user', content: header('2025-03-24 10:05:00', 'next') },
            { role: 'assistant', content: 'ok' },
          ],
        },
        'notid-25': {
          'history.json': [
            { role: 'user', content: header('2025-03-24 10:00:00', 'run it') },
            {
              role: 'assistant',
              content: '',
              tool_calls: [{ type: 'function', function: { name: 'sh', arguments: '{}' } }],
            },
            { role: 'tool', content: 'OUTPUT-1' },
            { role: 'assistant', content: 'done' },
          ],
        },
      },
      [
        { session: 'cut-24', sendAt: t0, role: 'user', content: header('2025-03-24 10:00:00', 'compute') },
        { session: 'cut-24', sendAt: plus(t0, 3e9), role: 'tool', content: 'OUT-CUT' },
        { session: 'cut-24', sendAt: plus(t0, 4e9), role: 'assistant', content: 'so the answer is 42' },
        {
          session: 'cut-24',
          sendAt: plus(t0, 300e9),
          role: 'user',
          content: header('2025-03-24 10:05:00', 'next'),
        },
        { session: 'cut-24', sendAt: '0', role: 'assistant', content: 'ok' },
        { session: 'notid-25', sendAt: t0, role: 'user', content: header('2025-03-24 10:00:00', 'run it') },
        { session: 'notid-25', sendAt: plus(t0, 5e9), role: 'tool', content: 'OUTPUT-1' },
        { session: 'notid-25', sendAt: plus(t0, 6e9), role: 'assistant', content: 'done' },
      ],
    );

    // Action
    const cut = await readOne(dir, 'cut-24', TZ);
    const notid = await readOne(dir, 'notid-25', TZ);

    // Assert: every tool output right after a call with its id (what the context window keeps).
    const shape = (read: typeof cut) =>
      read.listing.map((m) => [
        m.role,
        m.content,
        m.tool_call_id ?? (m.tool_calls as Array<{ id: string }> | null)?.map((c) => c.id) ?? null,
      ]);
    assert.deepEqual(shape(cut), [
      ['user', 'compute', null],
      ['assistant', null, ['call_9']],
      ['tool', 'OUT-CUT', 'call_9'],
      ['assistant', 'so the answer is 42', null],
      ['user', 'next', null],
      ['assistant', 'ok', null],
    ]);
    assert.deepEqual(shape(notid), [
      ['user', 'run it', null],
      ['assistant', null, ['agenvoy_json_2']],
      ['tool', 'OUTPUT-1', 'agenvoy_json_2'],
      ['assistant', 'done', null],
    ]);
    assert.deepEqual(notid.listing[1]!.metadata, { agenvoy_synthesised: 'tool_call' });
    assert.equal(notid.stats.skipped, 1);
    assert.match(notid.notes.join(' '), /skipped history\.json\[1\] \(assistant\): tool_calls\[0\]\.id/);
    assert.match(cut.notes.join(' '), /1 tool result\(s\) of history\.json had no call right before them/);
  });

  void test('messages cut apart by compaction within one second keep their order; no shared message is noted', async () => {
    // Setup: cut-26: ten messages 200 ms apart, history.json keeps the last three (whole-second
    // headers). apart-27: history.db and history.json share no message.
    const t0 = BigInt(taipei('2025-03-26 10:00:00'));
    const rows: RawRow[] = [];
    const json: unknown[] = [];
    for (let i = 0; i < 10; i++) {
      const ns = t0 + BigInt(i) * 200_000_000n;
      const content = header(`2025-03-26 10:00:0${Math.floor(i / 5)}`, `m${i}`);
      rows.push({ session: 'cut-26', sendAt: String(ns), role: 'user', content });
      if (i >= 7) json.push({ role: 'user', content });
    }
    rows.push({
      session: 'apart-27',
      sendAt: String(t0),
      role: 'user',
      content: header('2025-03-26 10:00:00', 'old'),
    });
    const dir = agenvoyDir(
      {
        'cut-26': { 'history.json': json },
        'apart-27': { 'history.json': [{ role: 'user', content: header('2025-03-26 11:00:00', 'new') }] },
      },
      rows,
    );

    // Action
    const cut = await readOne(dir, 'cut-26', TZ);
    const apart = await readOne(dir, 'apart-27', TZ);

    // Assert
    assert.deepEqual(cut.contents, ['m0', 'm1', 'm2', 'm3', 'm4', 'm5', 'm6', 'm7', 'm8', 'm9']);
    assert.equal(cut.listing[9]!.sent_at_ns, String(t0 + 1_800_000_000n));
    assert.deepEqual(apart.contents, ['old', 'new']);
    assert.match(
      apart.notes.join(' '),
      /history\.json and history\.db share no timed message: the zone \(Asia\/Taipei\) could not be checked/,
    );
  });

  void test('only user messages have their time header parsed: tool results and replies keep their text and place', async () => {
    // Setup: a compacted turn (history.db only) and a turn in both files whose tool result and
    // reply start with lines that look like a header; a system prompt that does too.
    const t0 = taipei('2025-06-01 09:00:00');
    const t1 = taipei('2025-06-01 10:00:00');
    const oldOut = 'sendAt: 2024-01-01 00:00:00\nold output';
    const out = 'send_at: 2024-01-01 00:00:00\nstatus: ok\nrows: 42';
    const echo = 'sendAt: 2025-06-01 10:00:05\nthat is the header you sent';
    const system = '當前時間: 2025-06-01 08:00:00\nyou are terse';
    const ask = header('2025-06-01 10:00:00', 'how many rows?');
    const dir = agenvoyDir(
      {
        'roles-28': {
          'history.json': [
            { role: 'system', content: system },
            { role: 'user', content: ask },
            {
              role: 'assistant',
              content: null,
              tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'sql', arguments: '{}' } }],
            },
            { role: 'tool', tool_call_id: 'call_1', content: [{ type: 'text', text: out }] },
            { role: 'assistant', content: echo },
          ],
        },
      },
      [
        {
          session: 'roles-28',
          sendAt: t0,
          role: 'user',
          content: header('2025-06-01 09:00:00', 'old question'),
        },
        { session: 'roles-28', sendAt: plus(t0, 1e9), role: 'tool', content: oldOut },
        { session: 'roles-28', sendAt: plus(t0, 2e9), role: 'assistant', content: 'old answer' },
        { session: 'roles-28', sendAt: t1, role: 'user', content: ask },
        { session: 'roles-28', sendAt: plus(t1, 2e9), role: 'tool', content: out },
        { session: 'roles-28', sendAt: plus(t1, 3e9), role: 'assistant', content: echo },
      ],
    );

    // Action
    const read = await readOne(dir, 'roles-28', TZ);

    // Assert: text as written, in conversation order, each reply after its user message.
    assert.deepEqual(
      read.listing.map((m) => [m.role, m.content]),
      [
        ['user', 'old question'],
        ['assistant', null],
        ['tool', oldOut],
        ['assistant', 'old answer'],
        ['system', system],
        ['user', 'how many rows?'],
        ['assistant', null],
        ['tool', out],
        ['assistant', echo],
      ],
    );
    assert.deepEqual([read.stats.fromJson, read.stats.fromDb, read.stats.duplicates], [5, 3, 3]);
    const times = read.listing.slice(5).map((m) => BigInt(m.sent_at_ns));
    assert.ok(
      times.every((ns, i) => i === 0 || ns > times[i - 1]!),
      times.join(' '),
    );
    assert.ok(BigInt(read.listing[4]!.sent_at_ns) < times[0]!, 'the system prompt precedes the user message');
  });

  void test('a bare time header ends at its second time line, which stays in the text', () => {
    assert.deepEqual(
      splitTimeHeader(
        'sendAt: 2025-06-02 09:10:00\nsend_at: 2019-01-01 00:00:00\nwhy does this record fail?',
      ),
      {
        text: 'send_at: 2019-01-01 00:00:00\nwhy does this record fail?',
        time: '2025-06-02 09:10:00',
        workDir: null,
      },
    );
    assert.deepEqual(
      splitTimeHeader(
        '工作目錄: /w\nsendAt: 2025-06-02 09:10:00\n工作目錄: /x\nsendAt: 2019-01-01 00:00:00\nhi',
      ),
      {
        text: 'sendAt: 2019-01-01 00:00:00\nhi',
        time: '2025-06-02 09:10:00',
        workDir: '/x',
      },
    );
    assert.deepEqual(splitTimeHeader('sendAt: 2025-06-02 09:10:00\n工作目錄: /w\nhi'), {
      text: 'hi',
      time: '2025-06-02 09:10:00',
      workDir: '/w',
    });
  });

  void test('content parts other than text and image_url are noted when dropped, and named when nothing is left', async () => {
    // Setup
    const dir = agenvoyDir(
      {
        'parts-29': {
          'history.json': [
            {
              role: 'user',
              content: [
                { type: 'text', text: 'sendAt: 2025-06-03 10:00:00\nwhat does this say?' },
                { type: 'input_audio', input_audio: { data: 'AAAA', format: 'wav' } },
                { type: 'file', file: { file_id: 'f1' } },
              ],
            },
            { role: 'assistant', content: 'hello' },
            {
              role: 'user',
              content: [{ type: 'input_audio', input_audio: { data: 'BBBB', format: 'mp3' } }],
            },
            { role: 'assistant', content: 'sorry?' },
          ],
        },
      },
      [],
    );

    // Action
    const read = await readOne(dir, 'parts-29', TZ);

    // Assert
    assert.deepEqual(read.contents, ['what does this say?', 'hello', 'sorry?']);
    assert.ok(
      read.notes.includes('history.json[0]: dropped 2 unsupported part(s) (input_audio, file)'),
      read.notes.join('\n'),
    );
    assert.equal(read.stats.skipped, 1);
    const skipped = read.notes.find((n) => n.startsWith('skipped history.json[2] (user): '));
    assert.ok(skipped, read.notes.join('\n'));
    assert.match(skipped, /input_audio/);
    assert.doesNotMatch(skipped, /only on an assistant message with tool_calls/);
  });

  void test('sessions that only history.db holds are reported, not imported', async () => {
    // Setup: one session directory; history.db also holds twelve sessions without one.
    const rows: RawRow[] = Array.from({ length: 12 }, (_, i) => ({
      session: `ghost-${String(i + 1).padStart(2, '0')}`,
      sendAt: taipei('2025-06-04 10:00:00'),
      role: 'user',
      content: 'hello',
    }));
    rows.push({ session: 'real-30', sendAt: taipei('2025-06-04 10:00:00'), role: 'user', content: 'hi' });
    const dir = agenvoyDir({ 'real-30': { 'history.json': [{ role: 'user', content: 'hi' }] } }, rows);
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });
    const only = await importAgenvoySessions(svc.deps, t.tenantId, dir, {
      timeZone: TZ,
      only: ['ghost-03', 'real-30'],
    });

    // Assert: named in the notes (the report --json prints), the full list beside them.
    assert.deepEqual(
      report.sessions.map((s) => [s.session_id, s.status]),
      [['real-30', 'imported']],
    );
    assert.deepEqual(report.notes, [
      'history.db holds 12 session(s) with no directory (ghost-01, ghost-02, ghost-03, ghost-04, ghost-05, ghost-06, ghost-07, ghost-08, ghost-09, ghost-10, and 2 more): not imported',
    ]);
    assert.equal(report.historyDbOnly.length, 12);
    assert.deepEqual(only.notes, [
      'history.db holds 1 session(s) with no directory (ghost-03): not imported',
    ]);
    assert.deepEqual(only.missing, ['ghost-03']);
  });

  void test("a history.json that is a directory, or a history.db that is not Agenvoy's, is named", async () => {
    // Setup
    const dir = agenvoyDir(
      { 'isdir-31': {}, 'fine-32': { 'history.json': [{ role: 'user', content: 'hi' }] } },
      [],
    );
    mkdirSync(path.join(dir, 'isdir-31', 'history.json'));
    const t = await svc.newTenant();
    const storeDb = path.join(dir, '..', '.store', 'history.db');

    // Action / Assert: a directory fails its session with the file named.
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });
    const isdir = report.sessions.find((s) => s.session_id === 'isdir-31')!;
    assert.equal(isdir.status, 'failed');
    assert.match(isdir.notes.join(' '), /^history\.json is a directory, not a file/);

    // A history.db that is no SQLite database, or has no messages table: the command fails, naming it.
    writeFileSync(storeDb, 'this is not a database, just some text that is long enough for a header');
    await assert.rejects(
      importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ }),
      (err: Error) => err.message.includes(path.resolve(storeDb)) && /not a database/.test(err.message),
    );
    rmSync(storeDb);
    const db = openSqlite(storeDb);
    db.exec('CREATE TABLE other (x INTEGER)');
    db.close();
    await assert.rejects(
      importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ }),
      (err: Error) =>
        err.message.includes(path.resolve(storeDb)) && /no such table: messages/.test(err.message),
    );
  });

  void test('a user message whose header is in a later text part is read, stored and merged once', async () => {
    // Setup: content arrays as Agenvoy's clients send them; history.db holds what Agenvoy writes
    // there (the non-empty text parts joined by newlines, the header kept).
    const fenced = (time: string) => `---\n當前時間: ${time}\n---`;
    const image = { type: 'image_url', image_url: { url: 'https://x/y.png' } };
    const audio = { type: 'input_audio', input_audio: { data: 'AAAA', format: 'wav' } };
    const t1 = taipei('2025-06-02 10:00:00');
    const t2 = taipei('2025-06-02 11:00:00');
    const t3 = taipei('2025-06-02 12:00:00');
    const dir = agenvoyDir(
      {
        'parts-33': {
          'history.json': [
            {
              role: 'user',
              content: [
                image,
                { type: 'text', text: `${fenced('2025-06-02 10:00:00')}\nwhat is in this image?` },
              ],
            },
            { role: 'assistant', content: 'a cat' },
            {
              role: 'user',
              content: [
                { type: 'text', text: fenced('2025-06-02 11:00:00') },
                { type: 'text', text: 'and this one?' },
              ],
            },
            { role: 'assistant', content: 'a dog' },
            {
              role: 'user',
              content: [audio, { type: 'text', text: `${fenced('2025-06-02 12:00:00')}\ntranscribe` }],
            },
            { role: 'assistant', content: 'hello world' },
          ],
        },
      },
      [
        {
          session: 'parts-33',
          sendAt: t1,
          role: 'user',
          content: `${fenced('2025-06-02 10:00:00')}\nwhat is in this image?`,
        },
        { session: 'parts-33', sendAt: plus(t1, 2e9), role: 'assistant', content: 'a cat' },
        {
          session: 'parts-33',
          sendAt: t2,
          role: 'user',
          content: `${fenced('2025-06-02 11:00:00')}\nand this one?`,
        },
        { session: 'parts-33', sendAt: plus(t2, 2e9), role: 'assistant', content: 'a dog' },
        {
          session: 'parts-33',
          sendAt: t3,
          role: 'user',
          content: `${fenced('2025-06-02 12:00:00')}\ntranscribe`,
        },
        { session: 'parts-33', sendAt: plus(t3, 2e9), role: 'assistant', content: 'hello world' },
      ],
    );

    // Action
    const read = await readOne(dir, 'parts-33', TZ);

    // Assert: headers stripped, the part a header filled dropped, each at its own time, once.
    assert.deepEqual(
      read.listing.map((m) => [m.role, m.content, m.parts]),
      [
        ['user', 'what is in this image?', [image, { type: 'text', text: 'what is in this image?' }]],
        ['assistant', 'a cat', null],
        ['user', 'and this one?', [{ type: 'text', text: 'and this one?' }]],
        ['assistant', 'a dog', null],
        ['user', 'transcribe', [{ type: 'text', text: 'transcribe' }]],
        ['assistant', 'hello world', null],
      ],
    );
    assert.deepEqual([read.stats.fromJson, read.stats.fromDb, read.stats.duplicates], [6, 0, 6]);
    const users = read.listing.filter((m) => m.role === 'user').map((m) => m.sent_at_ns);
    assert.deepEqual(users, [t1, t2, t3]);
    assert.ok(
      read.notes.includes('history.json[4]: dropped 1 unsupported part(s) (input_audio)'),
      read.notes.join('\n'),
    );
  });

  void test("a history.db whose messages table lacks Agenvoy's columns fails the command before any import, naming it", async () => {
    // Setup: a messages table without send_at.
    const dir = agenvoyDir({ 'cols-34': { 'history.json': [{ role: 'user', content: 'hi' }] } }, []);
    const storeDb = path.join(dir, '..', '.store', 'history.db');
    rmSync(storeDb);
    const db = openSqlite(storeDb);
    db.exec('CREATE TABLE messages (session_id TEXT, role TEXT, content TEXT)');
    db.exec("INSERT INTO messages VALUES ('cols-34', 'user', 'hi')");
    db.close();
    const t = await svc.newTenant();

    // Action / Assert
    await assert.rejects(
      importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ }),
      (err: Error) => err.message.includes(path.resolve(storeDb)) && /send_at/.test(err.message),
    );
    assert.equal((await t.api.get('/v1/sessions/cols-34/messages')).status, 404);
  });

  void test('an unreadable cursor costs only the cursor, and its note says the import sets it', async () => {
    // Setup: a cursor that is no time, one that is a directory, a summary.meta.json without a time.
    const hi = [{ role: 'user', content: header('2025-06-05 10:00:00', 'hi') }];
    const dir = agenvoyDir(
      {
        'badcur-35': { 'history.json': hi, 'summary.json': SUMMARY, '.summary_cursor': 'yesterday' },
        'dircur-36': { 'history.json': hi, 'summary.json': SUMMARY },
        'badmeta-37': { 'history.json': hi, 'summary.json': SUMMARY, 'summary.meta.json': {} },
        'metacur-39': {
          'history.json': hi,
          'summary.json': SUMMARY,
          '.summary_cursor': 'yesterday',
          'summary.meta.json': { last_message_time: '2025-06-05 10:00:00' },
        },
      },
      [],
    );
    mkdirSync(path.join(dir, 'dircur-36', '.summary_cursor'));

    // Action
    const reads = await Promise.all(
      ['badcur-35', 'dircur-36', 'badmeta-37'].map((sid) => readOne(dir, sid, TZ)),
    );

    // Assert: the summary is kept without a cursor; no note says the summary job sets it.
    for (const read of reads) {
      assert.deepEqual(read.input.summary?.cursor, { kind: 'none' }, read.sessionId);
      assert.equal(read.notes.length, 1, read.notes.join('\n'));
      assert.match(read.notes[0]!, /the cursor is the newest imported message/);
      assert.doesNotMatch(read.notes[0]!, /summary job/);
    }
    assert.match(reads[0]!.notes[0]!, /^\.summary_cursor /);
    assert.match(reads[1]!.notes[0]!, /^\.summary_cursor is a directory/);
    assert.match(reads[2]!.notes[0]!, /^summary\.meta\.json /);
    // summary.meta.json's time is the cursor when .summary_cursor holds none.
    const meta = await readOne(dir, 'metacur-39', TZ);
    assert.deepEqual(meta.input.summary?.cursor, {
      kind: 'sent_at',
      ns: BigInt(taipei('2025-06-05 10:00:00')),
      wholeSeconds: true,
    });
    assert.deepEqual(meta.notes, [
      '.summary_cursor holds no time ("yesterday"): no cursor from it; the cursor is summary.meta.json\'s "last_message_time"',
    ]);
  });

  void test('a session directory that is a symlink is imported', async () => {
    // Setup: sessions/link-38 points at a directory elsewhere; history.db holds its copy.
    const dir = agenvoyDir({}, [
      { session: 'link-38', sendAt: taipei('2025-06-06 10:00:00'), role: 'user', content: 'hi' },
    ]);
    const target = mkdtempSync(path.join(tmpdir(), 'agenvoy-target-'));
    roots.push(target);
    writeFileSync(
      path.join(target, 'history.json'),
      JSON.stringify([{ role: 'user', content: header('2025-06-06 10:00:00', 'hi') }]),
    );
    mkdirSync(dir, { recursive: true });
    symlinkSync(target, path.join(dir, 'link-38'));
    const t = await svc.newTenant();

    // Action
    const report = await importAgenvoySessions(svc.deps, t.tenantId, dir, { timeZone: TZ });

    // Assert
    assert.deepEqual(
      report.sessions.map((s) => [s.session_id, s.status, s.imported, s.duplicates_merged]),
      [['link-38', 'imported', 1, 1]],
    );
    assert.deepEqual(report.notes, []);
  });

  void test('local times around daylight-saving changes keep their order', () => {
    const utc = (naive: string, zone: string) => {
      const ns = parseSentAt(naive, zone);
      assert.equal(typeof ns, 'bigint', `${naive} ${zone}`);
      return new Date(Number((ns as bigint) / 1_000_000n)).toISOString();
    };
    // Spring forward: 02:00-02:59 never happened; such a time reads as if the clock had not moved
    // yet (02:30 EST = 03:30 EDT), never before the last time ahead of the gap.
    assert.equal(utc('2025-03-09 01:59:59', 'America/New_York'), '2025-03-09T06:59:59.000Z');
    assert.equal(utc('2025-03-09 02:30:00', 'America/New_York'), '2025-03-09T07:30:00.000Z');
    assert.equal(utc('2025-03-30 02:30:00', 'Europe/Berlin'), '2025-03-30T01:30:00.000Z');
    assert.equal(utc('2025-10-05 02:30:00', 'Australia/Sydney'), '2025-10-04T16:30:00.000Z');
    // Fall back: a time that happened twice is the first of the two, on both hemispheres.
    assert.equal(utc('2025-11-02 01:30:00', 'America/New_York'), '2025-11-02T05:30:00.000Z');
    assert.equal(utc('2025-10-26 02:30:00', 'Europe/Berlin'), '2025-10-26T00:30:00.000Z');
    assert.equal(utc('2025-04-06 02:30:00', 'Australia/Sydney'), '2025-04-05T15:30:00.000Z');
    assert.equal(utc('2026-01-02 11:04:05', TZ), '2026-01-02T03:04:05.000Z');
  });

  void test('time headers and cursor values', () => {
    assert.deepEqual(splitTimeHeader('---\n當前時間: 2025-01-02 03:04:05\n工作目錄: /w\n---\nhello\nworld'), {
      text: 'hello\nworld',
      time: '2025-01-02 03:04:05',
      workDir: '/w',
    });
    assert.deepEqual(splitTimeHeader('sendAt: 2025-01-02 03:04:05\nhi'), {
      text: 'hi',
      time: '2025-01-02 03:04:05',
      workDir: null,
    });
    assert.deepEqual(splitTimeHeader('當前時間：2025-01-02 03:04:05\r\n\r\nhi'), {
      text: 'hi',
      time: '2025-01-02 03:04:05',
      workDir: null,
    });
    // Not a header: text mentioning a time later on, or a fence without a time.
    assert.equal(splitTimeHeader('see sendAt: 2025-01-02 03:04:05').time, null);
    assert.equal(splitTimeHeader('---\ntitle: x\n---\nbody').text, '---\ntitle: x\n---\nbody');

    assert.deepEqual(parseCursorValue('2025-03-01 10:00:00', TZ), {
      kind: 'sent_at',
      ns: BigInt(taipei('2025-03-01 10:00:00')),
      wholeSeconds: true,
    });
    assert.deepEqual(parseCursorValue(' 1740794400000000123 ', TZ), {
      kind: 'sent_at',
      ns: 1740794400000000123n,
      wholeSeconds: false,
    });
    assert.deepEqual(parseCursorValue('1740794400', TZ), {
      kind: 'sent_at',
      ns: 1740794400000000000n,
      wholeSeconds: true,
    });
    assert.equal(parseCursorValue('yesterday', TZ), null);
  });
});
