import type { Queryable } from '../pool.js';
import { ARCHIVE_TSVECTOR_SQL } from './messages.js';

/** A position in the archive's primary-key order. */
export interface ArchiveKey {
  tenant_id: string;
  session_id: string;
  seq: string;
}

export interface PassState {
  cursor: ArchiveKey | null;
  done: boolean;
}

export async function loadPass(q: Queryable, name: string): Promise<PassState | null> {
  const r = await q.query<{ state: { cursor?: ArchiveKey }; done: boolean }>(
    'SELECT state, done_at IS NOT NULL AS done FROM maintenance_state WHERE name = $1',
    [name],
  );
  const row = r.rows[0];
  return row ? { cursor: row.state.cursor ?? null, done: row.done } : null;
}

export async function savePass(q: Queryable, name: string, cursor: ArchiveKey | null, done: boolean) {
  await q.query(
    `UPDATE maintenance_state SET state = jsonb_build_object('cursor', $2::jsonb),
       done_at = CASE WHEN $3::boolean THEN now() END
     WHERE name = $1`,
    [name, JSON.stringify(cursor), done],
  );
}

/** The keys of the next `limit` archive rows after `after` (all tenants), with their sizes. */
export async function archiveKeysAfter(
  q: Queryable,
  after: ArchiveKey | null,
  limit: number,
): Promise<Array<ArchiveKey & { bytes: number; calls: boolean }>> {
  // Two statements, not one with `$1 IS NULL OR …`: the row comparison alone lets the primary key
  // serve the range, so that each batch reads only its own rows.
  const cols = 'tenant_id, session_id, seq, bytes, tool_calls IS NOT NULL AS calls';
  const r = await q.query<ArchiveKey & { bytes: number; calls: boolean }>(
    after
      ? `SELECT ${cols} FROM messages WHERE (tenant_id, session_id, seq) > ($1, $2, $3::bigint)
         ORDER BY tenant_id, session_id, seq LIMIT $4`
      : `SELECT ${cols} FROM messages ORDER BY tenant_id, session_id, seq LIMIT $1`,
    after ? [after.tenant_id, after.session_id, after.seq, limit] : [limit],
  );
  return r.rows;
}

/** What the tsvector of these rows derives from (rows deleted meanwhile are left out). */
export async function archiveTexts(
  q: Queryable,
  keys: ArchiveKey[],
): Promise<
  Array<ArchiveKey & { name: string | null; content: string | null; tool_calls: unknown[] | null }>
> {
  const r = await q.query<
    ArchiveKey & { name: string | null; content: string | null; tool_calls: unknown[] | null }
  >(
    `SELECT m.tenant_id, m.session_id, m.seq, m.name, m.content, m.tool_calls
     FROM unnest($1::text[], $2::text[], $3::bigint[]) AS k(tenant_id, session_id, seq)
     JOIN messages m ON m.tenant_id = k.tenant_id AND m.session_id = k.session_id AND m.seq = k.seq`,
    [keys.map((k) => k.tenant_id), keys.map((k) => k.session_id), keys.map((k) => k.seq)],
  );
  return r.rows;
}

/** Sets the tsvector of these rows, derived exactly as insertArchiveBatch derives it. */
export async function rederiveTsvectors(
  q: Queryable,
  rows: Array<ArchiveKey & { content: string | null; fts_en: string | null; fts_cjk: string | null }>,
): Promise<number> {
  if (rows.length === 0) return 0;
  const r = await q.query(
    `UPDATE messages m SET search_tsv = ${ARCHIVE_TSVECTOR_SQL}
     FROM jsonb_to_recordset($1::jsonb) AS x(tenant_id text, session_id text, seq bigint, content text,
       fts_en text, fts_cjk text)
     WHERE m.tenant_id = x.tenant_id AND m.session_id = x.session_id AND m.seq = x.seq`,
    [JSON.stringify(rows)],
  );
  return r.rowCount ?? 0;
}
