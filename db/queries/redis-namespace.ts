import type { Queryable } from '../pool.js';

export interface RedisNamespace {
  prefix: string;
  /** REDIS_URL's database number. */
  db: number;
}

export async function getRedisNamespace(q: Queryable): Promise<RedisNamespace | null> {
  const r = await q.query<RedisNamespace>(`SELECT prefix, redis_db AS db FROM redis_namespace`);
  return r.rows[0] ?? null;
}

/** Records the namespace on first start; a no-op when a row exists (several processes may race). */
export async function initRedisNamespace(q: Queryable, ns: RedisNamespace): Promise<void> {
  await q.query(
    `INSERT INTO redis_namespace (singleton, prefix, redis_db) VALUES (true, $1, $2::integer)
     ON CONFLICT DO NOTHING`,
    [ns.prefix, ns.db],
  );
}

export async function setRedisNamespace(q: Queryable, ns: RedisNamespace): Promise<void> {
  await q.query(
    `INSERT INTO redis_namespace (singleton, prefix, redis_db) VALUES (true, $1, $2::integer)
     ON CONFLICT (singleton) DO UPDATE SET prefix = $1, redis_db = $2::integer, recorded_at = now()`,
    [ns.prefix, ns.db],
  );
}
