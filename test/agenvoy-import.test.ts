import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { promisify } from 'node:util';
import { parseCursorValue, splitTimeHeader } from '../services/lifecycle/agenvoy-time.js';
import { importAgenvoySessions } from '../services/lifecycle/agenvoy-migrate.js';
import { openSqlite } from '../services/lifecycle/sqlite.js';
import { parseSentAt } from '../services/time.js';
import { REDIS_URL, deleteRedisPrefix, eventually, startTestService } from './support/harness.js';
import type { Api, TestService } from './support/harness.js';

const run = promisify(execFile);
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

async function listed(t: Api, sid: string): Promise<any[]> {
  const r = await t.get(`/v1/sessions/${sid}/messages?limit=500`);
  assert.equal(r.status, 200, `${sid}: ${r.text}`);
  return r.body.messages;
}

let svc: TestService;
const roots: string[] = [];

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
    assert.deepEqual(report.invalidDirs, ['not a session id']);
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
        'sumonly-8': ['imported', 0, 0, 0, 0, null],
        'bom-9': ['imported', 1, 1, 0, 0, null],
        'badsum-10': ['imported', 1, 1, 0, 0, null],
        'oddtime-11': ['imported', 2, 2, 0, 0, null],
      },
    );
    assert.match(by['badsum-10']!.notes.join(' '), /summary.json is not valid JSON: summary skipped/);
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
    assert.ok(times.every((ns, i) => i === 0 || ns > times[i - 1]!));
    assert.equal((await t.api.get('/v1/sessions/compacted-4/summary')).body.cursor_seq, 4);
    assert.equal((await t.api.get('/v1/sessions/empty-6')).status, 404);

    await eventually(async () => (await listed(t.api, 'subsec-7')).length === 5, 15_000, 'subsec-7 archived');
    assert.deepEqual(
      (await listed(t.api, 'subsec-7')).map((m) => [m.content, m.sent_at]),
      [
        ['first answer', '2025-03-07T00:00:00.000000000Z'],
        ['first question', '2025-03-07T02:00:00.000000000Z'],
        ['first answer', '2025-03-07T02:00:00.000000001Z'],
        ['second question', '2025-03-07T02:01:00.000000000Z'],
        ['first answer', '2025-03-07T02:01:00.000000001Z'],
      ],
    );
    const restored = (await t.api.get('/v1/sessions/sumonly-8/summary')).body;
    assert.deepEqual(restored.summary, SUMMARY);

    // Re-running skips sessions that already hold messages, or (holding none) a summary.
    const again = await importAgenvoySessions(svc.deps, t.tenantId, fx.sessions, { timeZone: TZ });
    assert.ok(again.sessions.filter((s) => s.session_id !== 'empty-6').every((s) => s.status === 'skipped'));
    assert.equal((await listed(t.api, 'compacted-4')).length, 8);
    assert.equal((await listed(t.api, 'subsec-7')).length, 5);
    assert.equal((await t.api.get('/v1/sessions/sumonly-8/summary')).body.version, restored.version);
  });

  void test('mnemos import agenvoy (CLI) finds .store inside the sessions dir and is durable when it returns', async () => {
    const fx = buildFixture({ dbInside: true });
    roots.push(fx.root);
    const name = `agenvoy-cli-${Date.now()}`;
    const t = await svc.newTenant(name);
    const env = {
      ...process.env,
      DATABASE_URL: svc.config.databaseUrl,
      MNEMOS_PREFIX: svc.config.prefix,
      REDIS_URL,
      TZ,
      LOG_LEVEL: 'silent',
    };
    const cli = path.resolve(import.meta.dirname, '..', 'bin', 'mnemos.js');
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
    assert.equal(nope.code, 1);
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
