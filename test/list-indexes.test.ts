// The list endpoints read about what they return, however many deleted sessions or tenants the
// database holds (migration 018). Checked on Postgres's own count of rows each page read.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { listSessions } from '../db/queries/sessions.js';
import { listApiKeys, listTenants } from '../db/queries/tenants.js';
import type { Db } from '../db/pool.js';
import { startTestService } from './support/harness.js';
import type { TestService } from './support/harness.js';

let svc: TestService;
let tenantId: string;

before(async () => {
  svc = await startTestService();
  ({ tenantId } = await svc.newTenant());
  const db = svc.deps.db;
  // 3,000 tombstones shaped as a delete leaves them (ids sorting before the live ones), 20 live
  // sessions, 3,000 more tenants and keys.
  await db.query(
    `INSERT INTO sessions (tenant_id, id, generation, redis_generation, next_seq, deleted_at)
     SELECT $1, 'a-gone-' || lpad(g::text, 5, '0'), 2, 2, 5, now() FROM generate_series(1, 3000) g`,
    [tenantId],
  );
  await db.query(
    `INSERT INTO sessions (tenant_id, id) SELECT $1, 'b-live-' || lpad(g::text, 3, '0') FROM generate_series(1, 20) g`,
    [tenantId],
  );
  await db.query(
    `INSERT INTO tenants (id, name, created_at)
     SELECT 'tx' || g, 'bulk-' || g, now() - g * interval '1 second' FROM generate_series(1, 3000) g`,
  );
  await db.query(
    `INSERT INTO api_keys (id, tenant_id, secret_hash, created_at)
     SELECT 'kx' || g, 'tx' || g, '\\x00', now() - g * interval '1 second' FROM generate_series(1, 3000) g`,
  );
  await db.query('ANALYZE sessions; ANALYZE tenants; ANALYZE api_keys');
});

after(async () => {
  await svc?.stop();
});

/**
 * `run` against a Db that runs each statement as EXPLAIN ANALYZE: the rows every plan node read,
 * summed (what a page costs whatever its size).
 */
async function rowsRead(run: (db: Db) => Promise<unknown>): Promise<number> {
  let read = 0;
  const db = svc.deps.db;
  const explaining: Db = {
    ...db,
    query: (async (text: string, params?: unknown[]) => {
      const r = await db.query<{ 'QUERY PLAN': Array<{ Plan: PlanNode }> }>(
        `EXPLAIN (ANALYZE, FORMAT JSON) ${text}`,
        params,
      );
      read += nodeRows(r.rows[0]!['QUERY PLAN'][0]!.Plan);
      return { rows: [], rowCount: 0 };
    }) as Db['query'],
  };
  await run(explaining);
  return read;
}

interface PlanNode {
  'Actual Rows': number;
  'Actual Loops': number;
  'Rows Removed by Filter'?: number;
  Plans?: PlanNode[];
}
const nodeRows = (n: PlanNode): number =>
  (n['Actual Rows'] + (n['Rows Removed by Filter'] ?? 0)) * n['Actual Loops'] +
  (n.Plans ?? []).reduce((s, c) => s + nodeRows(c), 0);

void test('a page of live sessions does not read the tenant’s tombstones', async () => {
  const page = await listSessions(svc.deps.db, tenantId, null, 10);
  assert.deepEqual(
    page.map((s) => s.id),
    Array.from({ length: 10 }, (_, i) => `b-live-${String(i + 1).padStart(3, '0')}`),
  );
  const read = await rowsRead((db) => listSessions(db, tenantId, null, 10));
  assert.ok(read < 100, `read ${read} rows for a page of 10`);
});

void test('a page of tenants or keys reads about the page, not the table', async () => {
  const tenants = await rowsRead((db) => listTenants(db, null, 10));
  assert.ok(tenants < 100, `tenants: read ${tenants} rows for a page of 10`);
  const keys = await rowsRead((db) => listApiKeys(db, undefined, null, 10));
  assert.ok(keys < 100, `keys: read ${keys} rows for a page of 10`);
  const first = await listTenants(svc.deps.db, null, 10);
  const last = first[first.length - 1]!;
  const next = await rowsRead((db) => listTenants(db, { createdUs: last.created_us, id: last.id }, 10));
  assert.ok(next < 100, `tenants after a cursor: read ${next} rows for a page of 10`);
});
