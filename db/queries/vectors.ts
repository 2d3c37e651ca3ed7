import { float4ArrayParam, vectorArrayParam, vectorParam } from '../pool.js';
import type { Queryable } from '../pool.js';

/**
 * The recent index (tier 2): `message_vectors` rows for messages at or after a session's cutoff,
 * all made by the model and dimension recorded in `vector_index`. A session's vectors are written
 * as one binary `vector[]` parameter over node-postgres (vectorArrayParam); a reembed's, and
 * everything over PGlite, as one flat `float4[]` parameter (binary over node-postgres: see
 * float4ArrayParam) cut into rows in SQL (vectorOfRow); query vectors travel in pgvector's binary
 * format (vectorParam).
 */

/**
 * The vector of row `x.i` (1-based, from `unnest(…) WITH ORDINALITY`) in the flat `float4[]`
 * parameter `$flat`, whose rows are `$dims` long.
 */
const vectorOfRow = (flat: string, dims: string): string =>
  `(${flat}::float4[])[((x.i - 1) * ${dims})::int + 1 : (x.i * ${dims})::int]::vector`;

/** The common length of `vectors` (an embedder gives one length; anything else is a bug). */
function commonLength(vectors: ReadonlyArray<readonly number[]>): number {
  const n = vectors[0]?.length ?? 0;
  if (vectors.some((v) => v.length !== n)) throw new Error('vectors of one write must have one length');
  return n;
}

export interface VectorIndexRow {
  model: string;
  dimensions: number;
  state: 'ready' | 'reembedding';
  target_model: string | null;
  target_dimensions: number | null;
  reembed_id: string | null;
  reembed_started_at: Date | null;
  updated_at: Date;
  /**
   * How long ago `updated_at` was, by the database's clock: a reembed's lease is judged by it, since
   * the processes that compare it may have clocks minutes apart from the one that wrote it.
   */
  updated_ms_ago: number;
}

const VI_COLS =
  'model, dimensions, state, target_model, target_dimensions, reembed_id, reembed_started_at, updated_at, ' +
  '(extract(epoch FROM now() - updated_at) * 1000)::float8 AS updated_ms_ago';

export async function getVectorIndex(q: Queryable): Promise<VectorIndexRow | null> {
  const r = await q.query<VectorIndexRow>(`SELECT ${VI_COLS} FROM vector_index`);
  return r.rows[0] ?? null;
}

export async function lockVectorIndex(q: Queryable): Promise<VectorIndexRow | null> {
  const r = await q.query<VectorIndexRow>(`SELECT ${VI_COLS} FROM vector_index FOR UPDATE`);
  return r.rows[0] ?? null;
}

/** Records the embedder on first start; a no-op when a row exists (several processes may race). */
export async function initVectorIndex(q: Queryable, model: string, dimensions: number): Promise<void> {
  await q.query(
    `INSERT INTO vector_index (singleton, model, dimensions, state) VALUES (true, $1, $2, 'ready')
     ON CONFLICT DO NOTHING`,
    [model, dimensions],
  );
}

/** Dimension of some stored vector (null when the index is empty). */
export async function sampleVectorDims(q: Queryable): Promise<number | null> {
  const r = await q.query<{ d: number }>('SELECT vector_dims(embedding) AS d FROM message_vectors LIMIT 1');
  return r.rows[0]?.d ?? null;
}

export interface MissingVectorRow {
  seq: string;
  /** The content, cut to `maxChars` in SQL so a batch never pulls megabytes. */
  text: string;
}

/**
 * The condition on a messages row `m` that it still awaits a vector: in the session (given as SQL
 * expressions: parameters or columns), at or after the cutoff, after the session's highest vector
 * (see missingVectors), of an embedded role, with text, and not recorded as a skip for the model.
 * Embed jobs and the embed sweep test the same thing.
 */
function toEmbedSql(a: {
  tenant: string;
  session: string;
  startSeq: string;
  roles: string;
  model: string;
}): string {
  return `m.tenant_id = ${a.tenant} AND m.session_id = ${a.session} AND m.seq >= ${a.startSeq}
    AND m.seq > coalesce((SELECT max(v.seq) FROM message_vectors v
                          WHERE v.tenant_id = ${a.tenant} AND v.session_id = ${a.session}), -1)
    AND m.role = ANY(${a.roles}) AND m.content ~ '[^[:space:]]'
    AND NOT EXISTS (SELECT 1 FROM message_vector_skips k
                    WHERE k.tenant_id = m.tenant_id AND k.session_id = m.session_id AND k.seq = m.seq
                      AND k.model = ${a.model})`;
}

/**
 * Hot messages of the embedded roles with text and no vector yet (nor a recorded skip for this
 * model), oldest first, after the session's highest embedded seq. Vectors are written oldest
 * first and a message that cannot be embedded is recorded as a skip, so nothing below that mark
 * is missing (a reembed rebuilds everything) and nothing above it has a vector (a concurrent
 * writer is absorbed by ON CONFLICT). Starting there keeps a job's cost proportional to its new
 * messages instead of the session's whole hot part (an anti-join against the session's vectors
 * took 3.6–5.8 ms for 200 new of 1,000 hot messages). A backlog left by an embedder outage still
 * drains with the next job.
 */
export async function missingVectors(
  q: Queryable,
  a: { tenantId: string; sessionId: string; roles: string[]; model: string; limit: number; maxChars: number },
): Promise<{ generation: number; rows: MissingVectorRow[] } | null> {
  const s = await q.query<{ generation: number; start_seq: string }>(
    'SELECT generation, start_seq FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL',
    [a.tenantId, a.sessionId],
  );
  const session = s.rows[0];
  if (!session) return null;
  const r = await q.query<MissingVectorRow>(
    `SELECT m.seq, left(m.content, $6) AS text
     FROM messages m
     WHERE ${toEmbedSql({ tenant: '$1', session: '$2', startSeq: '$3::bigint', roles: '$4::text[]', model: '$5' })}
     ORDER BY m.seq
     LIMIT $7`,
    [a.tenantId, a.sessionId, session.start_seq, a.roles, a.model, a.maxChars, a.limit],
  );
  return { generation: session.generation, rows: r.rows };
}

/**
 * Live sessions active in the last `withinMs` but not in the last `idleMs` that still have a
 * message awaiting its vector (toEmbedSql, as missingVectors): an embed job that failed for good
 * or was never enqueued (Redis down right after the commit) leaves such a session behind until its
 * next message. Activity is the newest message's time or, when later, the session's creation:
 * `last_message_at` is a client's `sent_at`, which an import sets in the past (its sessions were
 * never repaired) and a clock ahead in the future (left out then). Newest first, at most `limit`.
 */
export async function sessionsMissingVectors(
  q: Queryable,
  a: { roles: string[]; model: string; withinMs: number; idleMs: number; limit: number },
): Promise<Array<{ tenantId: string; sessionId: string; generation: number }>> {
  const r = await q.query<{ tenant_id: string; id: string; generation: number }>(
    `SELECT s.tenant_id, s.id, s.generation FROM sessions s,
       LATERAL (SELECT greatest(s.created_at,
                  CASE WHEN s.last_message_at <= now() THEN s.last_message_at END) AS at) active
     WHERE s.deleted_at IS NULL
       AND active.at > now() - make_interval(secs => $3::float8 / 1000)
       AND active.at <= now() - make_interval(secs => $4::float8 / 1000)
       AND EXISTS (
         SELECT 1 FROM messages m
         WHERE ${toEmbedSql({ tenant: 's.tenant_id', session: 's.id', startSeq: 's.start_seq', roles: '$1::text[]', model: '$2' })})
     ORDER BY active.at DESC
     LIMIT $5`,
    [a.roles, a.model, a.withinMs, a.idleMs, a.limit],
  );
  return r.rows.map((x) => ({ tenantId: x.tenant_id, sessionId: x.id, generation: x.generation }));
}

/**
 * Share-locks the session row for a vector write: it waits for (and then excludes) the ingest
 * drain, compaction and reset, which take the same row FOR UPDATE, so a vector can never land
 * below a cutoff that moved while it was being computed.
 */
export async function lockSessionForVectors(
  q: Queryable,
  tenantId: string,
  sessionId: string,
): Promise<{ generation: number; start_seq: string } | null> {
  const r = await q.query<{ generation: number; start_seq: string }>(
    `SELECT generation, start_seq FROM sessions WHERE tenant_id = $1 AND id = $2 AND deleted_at IS NULL FOR SHARE`,
    [tenantId, sessionId],
  );
  return r.rows[0] ?? null;
}

/**
 * Writes vectors of one session (caller holds lockSessionForVectors). Rows below the cutoff, of
 * vanished messages, or made by a model/dimension the index no longer records (a reembed swapped
 * it meanwhile) are left out; an existing vector wins.
 */
export async function insertSessionVectors(
  q: Queryable,
  a: {
    tenantId: string;
    sessionId: string;
    startSeq: string;
    model: string;
    dimensions: number;
    items: Array<{ seq: string; embedding: readonly number[] }>;
  },
): Promise<number> {
  if (a.items.length === 0) return 0;
  const vectors = a.items.map((i) => i.embedding);
  const dimensions = commonLength(vectors);
  // Over node-postgres the rows travel as one binary vector[] (vectorArrayParam); elsewhere as
  // one flat float4[], cut into rows in SQL.
  const binary = q.binaryParams === true;
  const r = await q.query(
    `INSERT INTO message_vectors (tenant_id, session_id, seq, embedding)
     SELECT $1, $2, x.seq, ${binary ? 'x.embedding' : vectorOfRow('$4', '$8::int')}
     FROM ${binary ? 'unnest($3::bigint[], $4::vector[]) AS x(seq, embedding)' : 'unnest($3::bigint[]) WITH ORDINALITY AS x(seq, i)'}
     WHERE x.seq >= $5::bigint
       AND EXISTS (SELECT 1 FROM messages m WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq = x.seq)
       AND EXISTS (SELECT 1 FROM vector_index vi WHERE vi.model = $6 AND vi.dimensions = $7)
     ON CONFLICT DO NOTHING`,
    [
      a.tenantId,
      a.sessionId,
      a.items.map((i) => i.seq),
      binary ? vectorArrayParam(vectors, await vectorTypeOid(q)) : float4ArrayParam(q, vectors),
      a.startSeq,
      a.model,
      a.dimensions,
      ...(binary ? [] : [dimensions]),
    ],
  );
  return r.rowCount ?? 0;
}

/**
 * The OID of pgvector's `vector` type in this database (as `$n::vector[]` resolves it), which a
 * binary vector[] parameter names (vectorArrayParam). Read in the writer's own transaction, so
 * that an extension dropped and created again (a new OID) never meets an OID read before.
 */
async function vectorTypeOid(q: Queryable): Promise<number> {
  const r = await q.query<{ oid: string | number }>(`SELECT 'vector'::regtype::oid AS oid`);
  return Number(r.rows[0]!.oid);
}

export async function insertVectorSkips(
  q: Queryable,
  a: { model: string; items: Array<{ tenantId: string; sessionId: string; seq: string; reason: string }> },
): Promise<void> {
  if (a.items.length === 0) return;
  await q.query(
    `INSERT INTO message_vector_skips (tenant_id, session_id, seq, model, reason)
     SELECT x.t, x.s, x.seq, $1, x.reason
     FROM unnest($2::text[], $3::text[], $4::bigint[], $5::text[]) AS x(t, s, seq, reason)
     WHERE EXISTS (SELECT 1 FROM sessions WHERE tenant_id = x.t AND id = x.s)
     ON CONFLICT DO NOTHING`,
    [
      a.model,
      a.items.map((i) => i.tenantId),
      a.items.map((i) => i.sessionId),
      a.items.map((i) => i.seq),
      a.items.map((i) => i.reason),
    ],
  );
}

/** Removes every skip mark of `model` (a rebuild for it starts afresh). */
export async function deleteVectorSkips(q: Queryable, model: string): Promise<void> {
  await q.query('DELETE FROM message_vector_skips WHERE model = $1', [model]);
}

/**
 * Removes a session's vectors and skip marks whose message is gone (purge after delete/reset),
 * in the live table and in a reembed's shadow table, if any (a page of the reembed that embedded
 * the session's messages while the delete ran lands after it). Rows of messages that still exist
 * are kept: a purge that runs after new messages of the next generation were already embedded
 * must not take their vectors.
 */
export async function deleteOrphanVectors(q: Queryable, tenantId: string, sessionId: string): Promise<void> {
  const shadow = (await shadowTableExists(q)) ? [SHADOW_TABLE] : [];
  for (const table of ['message_vectors', 'message_vector_skips', ...shadow]) {
    await q.query(
      `DELETE FROM ${table} x WHERE x.tenant_id = $1 AND x.session_id = $2
         AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.tenant_id = $1 AND m.session_id = $2 AND m.seq = x.seq)`,
      [tenantId, sessionId],
    );
  }
}

/**
 * Exact k-NN inside one session (cosine distance), served by the primary-key btree: the filter
 * leaves one session's rows (hundreds to a few thousand) and they are all scored. Measured in
 * bench/vector-index.ts and docs/recent-index.md; the query vector must have the index's dimension.
 */
export async function nearestInSession(
  q: Queryable,
  a: { tenantId: string; sessionId: string; embedding: readonly number[]; limit: number },
): Promise<Array<{ seq: number; distance: number }>> {
  const r = await q.query<{ seq: string; distance: number }>(
    `SELECT seq, embedding <=> $3::vector AS distance
     FROM message_vectors
     WHERE tenant_id = $1 AND session_id = $2
     ORDER BY embedding <=> $3::vector, seq
     LIMIT $4`,
    [a.tenantId, a.sessionId, vectorParam(q, a.embedding), a.limit],
  );
  return r.rows.map((x) => ({ seq: Number(x.seq), distance: Number(x.distance) }));
}

// ---- reembed: a shadow table built beside the live one, swapped in one transaction ----

export const SHADOW_TABLE = 'message_vectors_next';

/** Creates the shadow table (primary key and session foreign key, like the live table). */
export async function createShadowTable(q: Queryable): Promise<void> {
  await q.query(
    `CREATE TABLE IF NOT EXISTS ${SHADOW_TABLE} (
       tenant_id   text NOT NULL,
       session_id  text NOT NULL,
       seq         bigint NOT NULL,
       embedding   vector NOT NULL,
       CONSTRAINT ${SHADOW_TABLE}_pkey PRIMARY KEY (tenant_id, session_id, seq),
       CONSTRAINT message_vectors_session_fk FOREIGN KEY (tenant_id, session_id)
         REFERENCES sessions (tenant_id, id) ON DELETE CASCADE
     )`,
  );
  // Same storage as the live table (migration 005): vectors inline, not TOASTed.
  await q.query(`ALTER TABLE ${SHADOW_TABLE} ALTER COLUMN embedding SET STORAGE MAIN`);
}

export async function dropShadowTable(q: Queryable): Promise<void> {
  await q.query(`DROP TABLE IF EXISTS ${SHADOW_TABLE}`);
}

export async function shadowTableExists(q: Queryable): Promise<boolean> {
  const r = await q.query<{ t: string | null }>(`SELECT to_regclass($1) AS t`, [SHADOW_TABLE]);
  return r.rows[0]?.t != null;
}

export interface ShadowPageRow {
  tenant_id: string;
  session_id: string;
  seq: string;
  text: string;
}

/**
 * The next page of hot messages to embed for the shadow table, in primary-key order after
 * `after` (keyset), leaving out those already there or skipped for `model`.
 */
export async function missingShadowPage(
  q: Queryable,
  a: {
    after: { tenantId: string; sessionId: string; seq: string } | null;
    roles: string[];
    model: string;
    limit: number;
    maxChars: number;
  },
): Promise<ShadowPageRow[]> {
  const r = await q.query<ShadowPageRow>(
    `SELECT m.tenant_id, m.session_id, m.seq, left(m.content, $6) AS text
     FROM messages m
     JOIN sessions s ON s.tenant_id = m.tenant_id AND s.id = m.session_id
     WHERE ($1::text IS NULL OR (m.tenant_id, m.session_id, m.seq) > ($1, $2, $3::bigint))
       AND s.deleted_at IS NULL AND m.seq >= s.start_seq
       AND m.role = ANY($4::text[]) AND m.content ~ '[^[:space:]]'
       AND NOT EXISTS (SELECT 1 FROM ${SHADOW_TABLE} v
                       WHERE v.tenant_id = m.tenant_id AND v.session_id = m.session_id AND v.seq = m.seq)
       AND NOT EXISTS (SELECT 1 FROM message_vector_skips k
                       WHERE k.tenant_id = m.tenant_id AND k.session_id = m.session_id AND k.seq = m.seq
                         AND k.model = $5)
     ORDER BY m.tenant_id, m.session_id, m.seq
     LIMIT $7`,
    [
      a.after?.tenantId ?? null,
      a.after?.sessionId ?? null,
      a.after?.seq ?? null,
      a.roles,
      a.model,
      a.maxChars,
      a.limit,
    ],
  );
  return r.rows;
}

/** Hot messages of the embedded roles with text: the size of a full rebuild (for progress). */
export async function countEmbeddable(q: Queryable, roles: string[]): Promise<number> {
  const r = await q.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM messages m
     JOIN sessions s ON s.tenant_id = m.tenant_id AND s.id = m.session_id
     WHERE s.deleted_at IS NULL AND m.seq >= s.start_seq AND m.role = ANY($1::text[])
       AND m.content ~ '[^[:space:]]'`,
    [roles],
  );
  return r.rows[0]?.n ?? 0;
}

export async function insertShadowVectors(
  q: Queryable,
  items: Array<{ tenantId: string; sessionId: string; seq: string; embedding: readonly number[] }>,
): Promise<number> {
  if (items.length === 0) return 0;
  const vectors = items.map((i) => i.embedding);
  const r = await q.query(
    `INSERT INTO ${SHADOW_TABLE} (tenant_id, session_id, seq, embedding)
     SELECT x.t, x.s, x.seq, ${vectorOfRow('$4', '$5::int')}
     FROM unnest($1::text[], $2::text[], $3::bigint[]) WITH ORDINALITY AS x(t, s, seq, i)
     JOIN sessions s ON s.tenant_id = x.t AND s.id = x.s AND x.seq >= s.start_seq
     WHERE EXISTS (SELECT 1 FROM messages m WHERE m.tenant_id = x.t AND m.session_id = x.s AND m.seq = x.seq)
     ON CONFLICT DO NOTHING`,
    [
      items.map((i) => i.tenantId),
      items.map((i) => i.sessionId),
      items.map((i) => i.seq),
      float4ArrayParam(q, vectors),
      commonLength(vectors),
    ],
  );
  return r.rowCount ?? 0;
}

/** Marks a reembed as running for `target` under lease `id` (caller holds lockVectorIndex). */
export async function markReembedding(
  q: Queryable,
  a: { model: string; dimensions: number; id: string; keepStartedAt: boolean },
): Promise<void> {
  await q.query(
    `UPDATE vector_index SET state = 'reembedding', target_model = $1, target_dimensions = $2, reembed_id = $3,
       reembed_started_at = CASE WHEN $4::boolean THEN reembed_started_at ELSE now() END, updated_at = now()`,
    [a.model, a.dimensions, a.id, a.keepStartedAt],
  );
}

/** Heartbeat of a running reembed; false when another run took the lease over. */
export async function touchReembed(q: Queryable, id: string): Promise<boolean> {
  const r = await q.query(
    `UPDATE vector_index SET updated_at = now() WHERE reembed_id = $1 AND state = 'reembedding'`,
    [id],
  );
  return (r.rowCount ?? 0) > 0;
}

/**
 * The swap (caller holds lockVectorIndex in the same transaction): the shadow table replaces the
 * live one, skip marks of other models go, and the index records the new embedder.
 *
 * Deletes, resets and tenant erasure purge the shadow table too (a reembed stopped for good never
 * swaps, and its rows of a deleted session would stay), but a page of the rebuild whose statement
 * raced such a purge, and every compaction, can still leave vectors in it: of a deleted session,
 * of a reset history, below a moved cutoff. They go here, after the DROP: it waits for every
 * transaction that purged the live table to commit, so this statement sees what they removed;
 * one that purges later finds the renamed table under the live name.
 */
export async function swapShadowTable(q: Queryable, a: { model: string; dimensions: number }): Promise<void> {
  await q.query('DROP TABLE message_vectors');
  await q.query(
    `DELETE FROM ${SHADOW_TABLE} v
     WHERE NOT EXISTS (
       SELECT 1 FROM sessions s
       JOIN messages m ON m.tenant_id = s.tenant_id AND m.session_id = s.id AND m.seq = v.seq
       WHERE s.tenant_id = v.tenant_id AND s.id = v.session_id AND s.deleted_at IS NULL
         AND v.seq >= s.start_seq)`,
  );
  await q.query(`ALTER TABLE ${SHADOW_TABLE} RENAME TO message_vectors`);
  await q.query(`ALTER TABLE message_vectors RENAME CONSTRAINT ${SHADOW_TABLE}_pkey TO message_vectors_pkey`);
  await q.query('DELETE FROM message_vector_skips WHERE model <> $1', [a.model]);
  await q.query(
    `UPDATE vector_index SET model = $1, dimensions = $2, state = 'ready', target_model = NULL,
       target_dimensions = NULL, reembed_id = NULL, reembed_started_at = NULL, updated_at = now()`,
    [a.model, a.dimensions],
  );
}
