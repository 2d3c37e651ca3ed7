import { withTransaction } from '../../db/pool.js';
import { deleteTenant, deleteTenantBatch, getTenantById } from '../../db/queries/lifecycle.js';
import { markTenantErasing, revokeTenantKeys, stalledErasures } from '../../db/queries/tenants.js';
import { SHADOW_TABLE, shadowTableExists } from '../../db/queries/vectors.js';
import { KEY_CACHE_MS } from '../tenants.js';
import type { Redis } from '../redis.js';
import { PENDING_STATES, removeQueuedJobs, tenantJobs } from './queued-jobs.js';
import { purgeFailure } from './session-lifecycle.js';
import type { ExtensionList, LifecycleDeps } from './session-lifecycle.js';

/**
 * Tenant erasure (DELETE /v1/admin/tenants/{id}, `mnemos tenant delete`): everything of the tenant,
 * in an order that can be re-run after any failure, because the tenants row goes last:
 *   1. mark the tenant as erasing (no new key, no summary sweep), revoke every key and wait out
 *      the API processes' key cache (KEY_CACHE_MS, 5 s), so no new request of the tenant is
 *      authenticated;
 *   2. each module's purgeTenant (error memory, through its indexes);
 *   3. queued jobs of the tenant that would still run, and its sessions in the ingest sweeper's
 *      armed set, so that no work of it starts during the deletes;
 *   4. Postgres: bulk tables in batches, then the tenants row (the rest cascades), the tenant
 *      listed in `<prefix>:erasures` first;
 *   5. every Redis key in the tenant's namespace, its members of shared sets and every job of it
 *      (records of jobs that ran included), then it leaves `<prefix>:erasures`.
 * Step 5 runs once, after the row, so that it also takes what in-flight requests and jobs wrote
 * meanwhile: SCAN walks the whole keyspace, whatever the pattern, and every erasure used to walk it
 * four times (the context cache's purge, error memory's, and this sweep before and after the row)
 * and to read every kept job in full twice: 50 concurrent erasures on a deployment of 5,000
 * tenants made the API answer 503 and other tenants' posts wait 9 s.
 * An erasure that stopped before the tenants row went (its API process killed, a purge failed) is
 * finished by a worker (resumeTenantErasures, maintenance task `tenant-erasures`); one that
 * stopped after it, by the same task through `<prefix>:erasures`, or by a retried DELETE.
 */

const DELETE_BATCH = 5000;
// Tenant ids as services/tenants.ts makes them, standing as a token of a key name.
const TENANT_ID = /^t_[a-z2-7]{16}$/;
const TENANT_TOKEN = /(?<=[:-])t_[a-z2-7]{16}(?=[:-]|$)/;

const globEscape = (s: string) => s.replace(/[*?[\]\\]/g, (c) => `\\${c}`);

/**
 * True when `key` belongs to `tenantId`: the first tenant id in the name (after the prefix) is
 * this one. Session ids may hold `:` and text that looks like another tenant's id, but the owner's
 * id always comes before the session id (`<prefix>:<kind>:<tenant>:<sid>…`).
 */
export function keyBelongsTo(key: string, prefix: string, tenantId: string): boolean {
  if (!key.startsWith(`${prefix}:`)) return false;
  const rest = key.slice(prefix.length);
  if (TENANT_ID.test(tenantId)) return TENANT_TOKEN.exec(rest)?.[0] === tenantId;
  const segments = rest.split(':');
  return segments[2] === tenantId || segments[3] === tenantId;
}

/** Tenants whose erasure deleted (or is deleting) their tenants row and has step 5 to do. */
export const erasuresKey = (prefix: string) => `${prefix}:erasures`;

/** Every key of the tenant's namespace, in one SCAN pass, and its members of shared sets. */
export async function sweepTenantRedis(redis: Redis, prefix: string, tenantId: string): Promise<number> {
  let removed = 0;
  let cursor = '0';
  do {
    const [next, keys] = await redis.scan(
      cursor,
      'MATCH',
      `${globEscape(prefix)}:*${globEscape(tenantId)}*`,
      'COUNT',
      1000,
    );
    cursor = next;
    const mine = keys.filter((k) => keyBelongsTo(k, prefix, tenantId));
    if (mine.length > 0) removed += await redis.unlink(...mine);
  } while (cursor !== '0');
  return removed + (await dropSharedMembers(redis, prefix, tenantId));
}

/**
 * The tenant's members of shared structures: the ingest sweeper's armed set (its sessions waiting
 * for a flush, which the sweeper would queue again) and the error-memory tenant registry.
 */
async function dropSharedMembers(redis: Redis, prefix: string, tenantId: string): Promise<number> {
  let removed = 0;
  const armed = `${prefix}:armed`;
  let cursor = '0';
  do {
    const [next, flat] = await redis.zscan(
      armed,
      cursor,
      'MATCH',
      `${globEscape(tenantId)} *`,
      'COUNT',
      1000,
    );
    cursor = next;
    const members = flat.filter((_, i) => i % 2 === 0);
    if (members.length > 0) removed += await redis.zrem(armed, ...members);
  } while (cursor !== '0');
  removed += await redis.srem(`${prefix}:err:tenants`, tenantId);
  return removed;
}

export async function eraseTenant(
  deps: LifecycleDeps,
  extensions: ExtensionList,
  tenantId: string,
  opts: { revocationGraceMs?: number } = {},
): Promise<boolean> {
  const tenant = await getTenantById(deps.db, tenantId);
  if (!tenant) {
    // Gone: never existed, or an erasure whose last steps (after the tenants row) failed. Those
    // are re-run, so the retry the failure's 503 asked for finishes them; the answer is 404. Only
    // for a tenant listed as such: a DELETE of any other id walked the keyspace for nothing.
    if (await deps.redis.sismember(erasuresKey(deps.config.prefix), tenantId))
      await sweepAfterRow(deps, tenantId);
    return false;
  }
  const log = deps.logger.child({ tenantId });
  // The mark first: no key can be created for the tenant from here on, and the summary sweep
  // leaves its sessions alone. Then every key it has is revoked.
  await withTransaction(deps.db, async (tx) => {
    await markTenantErasing(tx, tenantId);
    await revokeTenantKeys(tx, tenantId);
  });
  // API processes trust a verified key for KEY_CACHE_MS: wait that out, so no request of the
  // tenant can start writing after the purge below.
  await new Promise((r) => setTimeout(r, opts.revocationGraceMs ?? KEY_CACHE_MS + 250));

  const failures: string[] = [];
  const errors: unknown[] = [];
  for (const e of extensions()) {
    if (!e.purgeTenant) continue;
    try {
      await e.purgeTenant(tenantId);
    } catch (err) {
      failures.push(e.name);
      errors.push(err);
      log.warn({ module: e.name, err: { message: (err as Error).message } }, 'purgeTenant failed');
    }
  }
  // The tenants row stays until every module has purged, so a retried erasure can finish.
  if (failures.length > 0) throw purgeFailure(`tenant purge failed in: ${failures.join(', ')}`, errors);

  const jobs = await removeQueuedJobs(
    deps.redis,
    deps.queues,
    tenantJobs(tenantId),
    Number.MAX_SAFE_INTEGER,
    PENDING_STATES,
  );
  await dropSharedMembers(deps.redis, deps.config.prefix, tenantId);

  let rows = 0;
  // A reembed's shadow table (db/queries/vectors.ts) would go with the sessions through its
  // foreign key, in one statement: in batches like the live table instead.
  const shadow = (await shadowTableExists(deps.db)) ? ([SHADOW_TABLE] as const) : ([] as const);
  for (const table of [
    'message_vectors',
    ...shadow,
    'message_vector_skips',
    'messages',
    'llm_usage',
  ] as const) {
    for (;;) {
      const n = await deleteTenantBatch(deps.db, table, tenantId, DELETE_BATCH);
      rows += n;
      // Until a batch finds nothing: another erasure of the tenant deleting beside this one (a
      // resume joining a long request) made batches come back short, and this one then left
      // the rest to the tenants row's cascade, one statement for every remaining row.
      if (n === 0) break;
    }
  }
  // Listed before the row goes: from then on nothing in Postgres says that step 5 is owed.
  await deps.redis.sadd(erasuresKey(deps.config.prefix), tenantId);
  await withTransaction(deps.db, (tx) => deleteTenant(tx, tenantId));
  const late = await sweepAfterRow(deps, tenantId);
  log.info({ jobs: jobs + late.jobs, redisKeys: late.keys, bulkRows: rows }, 'tenant erased');
  return true;
}

/**
 * The step after the tenants row (5.), also what a retry re-runs once the row is gone: the
 * tenant's Redis keys, including those an in-flight request wrote meanwhile, and its jobs, including
 * the records of jobs that were running during the steps before (a summary the sweep queued just
 * before the mark finishes against the deleted tenant and leaves its completed or failed record).
 */
async function sweepAfterRow(deps: LifecycleDeps, tenantId: string): Promise<{ keys: number; jobs: number }> {
  const keys = await sweepTenantRedis(deps.redis, deps.config.prefix, tenantId);
  const jobs = await removeQueuedJobs(deps.redis, deps.queues, tenantJobs(tenantId), Number.MAX_SAFE_INTEGER);
  await deps.redis.srem(erasuresKey(deps.config.prefix), tenantId);
  return { keys, jobs };
}

/**
 * How long after its mark an erasure counts as abandoned. A request's own erasure waits out the
 * key cache (5 s) and then only deletes; one still running past this is joined, which is safe
 * because every step is idempotent (a batch the other deleted first comes back short, and each goes
 * on until one finds nothing; the tenants row goes once).
 */
export const ERASURE_STALLED_MS = 2 * 60_000;

/**
 * Finishes erasures that were started and never finished: the process that ran one was killed, or
 * a module's purge failed and no admin retried. Without this the tenant stayed marked, its keys
 * revoked, and its messages, error records and session keys stayed, unseen.
 */
export async function resumeTenantErasures(
  deps: LifecycleDeps,
  extensions: ExtensionList,
  opts: { olderThanMs?: number; limit?: number } = {},
): Promise<{ resumed: number; failed: number }> {
  let resumed = 0;
  let failed = 0;
  const limit = opts.limit ?? 100;
  const stalled = await stalledErasures(deps.db, opts.olderThanMs ?? ERASURE_STALLED_MS, limit);
  // Those that stopped after their tenants row went, with step 5 owed, are listed in Redis only
  // (one whose request is in step 5 right now is joined: every step is idempotent).
  const pastRow: string[] = [];
  for (const tenantId of (await deps.redis.smembers(erasuresKey(deps.config.prefix))).slice(0, limit)) {
    if (!(await getTenantById(deps.db, tenantId))) pastRow.push(tenantId);
  }
  for (const tenantId of [...stalled, ...pastRow]) {
    try {
      // The mark and the revocation were committed together minutes ago: every API process's
      // cached verification of the tenant's keys has expired since, so there is nothing to wait out.
      await eraseTenant(deps, extensions, tenantId, { revocationGraceMs: 0 });
      resumed++;
    } catch (err) {
      failed++;
      deps.logger.warn(
        { tenantId, err: { message: (err as Error).message } },
        'could not finish an interrupted tenant erasure',
      );
    }
  }
  return { resumed, failed };
}
