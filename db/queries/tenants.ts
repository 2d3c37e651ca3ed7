import type { Queryable } from '../pool.js';

export interface TenantRow {
  id: string;
  name: string;
  created_at: Date;
}

export interface ApiKeyRow {
  id: string;
  tenant_id: string;
  name: string;
  secret_hash: Buffer;
  created_at: Date;
  last_used_at: Date | null;
  revoked_at: Date | null;
}

export async function insertTenant(q: Queryable, id: string, name: string): Promise<TenantRow | null> {
  const r = await q.query<TenantRow>(
    `INSERT INTO tenants (id, name) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING RETURNING id, name, created_at`,
    [id, name],
  );
  return r.rows[0] ?? null;
}

/**
 * A page of a list in creation order: rows after `after` (the last row of the previous page, by
 * its creation time in microseconds since the epoch and its id), at most `limit` (all when null).
 */
export interface PageAfter {
  createdUs: string;
  id: string;
}

const AFTER_SQL = (ts: string, id: string) =>
  `($${ts}::bigint IS NULL OR (created_at, id) > ('epoch'::timestamptz + $${ts}::bigint * interval '1 microsecond', $${id}::text))`;

/** The cursor fields of a row: its creation time in whole microseconds, exactly. */
const CREATED_US = `(extract(epoch from created_at) * 1000000)::bigint::text AS created_us`;

export async function listTenants(
  q: Queryable,
  after: PageAfter | null = null,
  limit: number | null = null,
): Promise<Array<TenantRow & { erasing_at: Date | null; created_us: string }>> {
  const r = await q.query<TenantRow & { erasing_at: Date | null; created_us: string }>(
    `SELECT id, name, created_at, erasing_at, ${CREATED_US} FROM tenants
     WHERE ${AFTER_SQL('1', '2')} ORDER BY created_at, id LIMIT $3`,
    [after?.createdUs ?? null, after?.id ?? null, limit],
  );
  return r.rows;
}

export async function findTenant(q: Queryable, idOrName: string): Promise<TenantRow | null> {
  const r = await q.query<TenantRow>(
    'SELECT id, name, created_at FROM tenants WHERE id = $1 OR name = $1 ORDER BY (id = $1) DESC LIMIT 1',
    [idOrName],
  );
  return r.rows[0] ?? null;
}

/** Which of these tenant ids have a tenants row (one under erasure too). */
export async function existingTenants(q: Queryable, ids: string[]): Promise<Set<string>> {
  const r = await q.query<{ id: string }>('SELECT id FROM tenants WHERE id = ANY($1::text[])', [ids]);
  return new Set(r.rows.map((row) => row.id));
}

export async function deleteTenantRow(q: Queryable, id: string): Promise<boolean> {
  const r = await q.query('DELETE FROM tenants WHERE id = $1', [id]);
  return (r.rowCount ?? 0) > 0;
}

/**
 * Null when the tenant is gone or under erasure. FOR SHARE orders this against the erasure's mark
 * (markTenantErasing): a key inserted first is revoked by it, one inserted after sees the mark.
 */
export async function insertApiKey(
  q: Queryable,
  key: { id: string; tenantId: string; name: string; secretHash: Buffer },
): Promise<ApiKeyRow | null> {
  const r = await q.query<ApiKeyRow>(
    `INSERT INTO api_keys (id, tenant_id, name, secret_hash)
     SELECT $1, $2, $3, $4
     WHERE EXISTS (SELECT 1 FROM tenants WHERE id = $2 AND erasing_at IS NULL FOR SHARE)
     RETURNING id, tenant_id, name, secret_hash, created_at, last_used_at, revoked_at`,
    [key.id, key.tenantId, key.name, key.secretHash],
  );
  return r.rows[0] ?? null;
}

/**
 * Marks the tenant as under erasure (caller's transaction); then revokeTenantKeys, as a statement
 * of its own: the mark waits for a key insert holding the tenant row, and only a later statement's
 * snapshot sees that key.
 */
export async function markTenantErasing(q: Queryable, tenantId: string): Promise<boolean> {
  const r = await q.query('UPDATE tenants SET erasing_at = coalesce(erasing_at, now()) WHERE id = $1', [
    tenantId,
  ]);
  return (r.rowCount ?? 0) > 0;
}

/**
 * Tenants whose erasure started over `olderThanMs` ago (by Postgres's clock, which set the mark)
 * and has not finished, oldest first.
 */
export async function stalledErasures(q: Queryable, olderThanMs: number, limit: number): Promise<string[]> {
  const r = await q.query<{ id: string }>(
    `SELECT id FROM tenants WHERE erasing_at < now() - $1::bigint * interval '1 millisecond'
     ORDER BY erasing_at, id LIMIT $2`,
    [olderThanMs, limit],
  );
  return r.rows.map((row) => row.id);
}

/**
 * What authenticating a key needs. Revocation is decided in SQL: a timestamp read into JavaScript
 * depends on how the connection prints it, and a `revoked_at` that did not parse (DateStyle `SQL,
 * DMY`, before db/pool.ts fixed the format) read as null, i.e. not revoked.
 */
export async function findApiKey(
  q: Queryable,
  id: string,
): Promise<{ tenant_id: string; secret_hash: Buffer; revoked: boolean } | null> {
  const r = await q.query<{ tenant_id: string; secret_hash: Buffer; revoked: boolean }>(
    `SELECT tenant_id, secret_hash, revoked_at IS NOT NULL AS revoked FROM api_keys WHERE id = $1`,
    [id],
  );
  return r.rows[0] ?? null;
}

export async function listApiKeys(
  q: Queryable,
  tenantId?: string,
  after: PageAfter | null = null,
  limit: number | null = null,
): Promise<Array<ApiKeyRow & { created_us: string }>> {
  const r = await q.query<ApiKeyRow & { created_us: string }>(
    `SELECT id, tenant_id, name, secret_hash, created_at, last_used_at, revoked_at, ${CREATED_US} FROM api_keys
     WHERE ($1::text IS NULL OR tenant_id = $1) AND ${AFTER_SQL('2', '3')} ORDER BY created_at, id LIMIT $4`,
    [tenantId ?? null, after?.createdUs ?? null, after?.id ?? null, limit],
  );
  return r.rows;
}

export async function revokeApiKey(q: Queryable, id: string): Promise<boolean> {
  const r = await q.query('UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL', [
    id,
  ]);
  return (r.rowCount ?? 0) > 0;
}

export async function revokeTenantKeys(q: Queryable, tenantId: string): Promise<number> {
  const r = await q.query(
    'UPDATE api_keys SET revoked_at = now() WHERE tenant_id = $1 AND revoked_at IS NULL',
    [tenantId],
  );
  return r.rowCount ?? 0;
}

/** Throttled to once a minute per key so authentication stays a read on the hot path. */
export async function touchApiKey(q: Queryable, id: string): Promise<void> {
  await q.query(
    `UPDATE api_keys SET last_used_at = now()
     WHERE id = $1 AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')`,
    [id],
  );
}
