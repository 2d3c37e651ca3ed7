import { PG, pgCode } from '../db/pool.js';
import type { Queryable } from '../db/pool.js';
import { getRedisNamespace, initRedisNamespace, setRedisNamespace } from '../db/queries/redis-namespace.js';
import type { RedisNamespace } from '../db/queries/redis-namespace.js';
import type { Config } from './config.js';
import { makeRedis, waitForRedis } from './redis.js';
import type { Redis } from './redis.js';

/**
 * The Redis namespace a process is configured with: MNEMOS_PREFIX and REDIS_URL's database number
 * (config allows only digits in its path). Not the host or the password, which change with a
 * failover or a managed endpoint while the keys stay where they were.
 */
export function configuredNamespace(config: Pick<Config, 'prefix' | 'redisUrl'>): RedisNamespace {
  return { prefix: config.prefix, db: Number(new URL(config.redisUrl).pathname.slice(1) || '0') };
}

const shown = (ns: RedisNamespace) => `prefix "${ns.prefix}" in Redis database ${ns.db}`;
const same = (a: RedisNamespace, b: RedisNamespace) => a.prefix === b.prefix && a.db === b.db;

export class RedisNamespaceMismatchError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'RedisNamespaceMismatchError';
  }
}

/**
 * The start-up guard of every process that uses Redis (serve, api, worker, the CLI commands that
 * do): the database records the namespace of its first start, and a process configured with
 * another one refuses. Under another prefix (or Redis database) the messages still waiting in the
 * old inboxes are not seen, their seqs are handed out again, and once the old prefix came back
 * its drain skipped them as replays: acknowledged messages lost, with no word. Refusing on every
 * difference is simpler than judging which one is harmless, and a move made on purpose costs one
 * command (`mnemos redis-namespace --accept`). On a database that takes no writes (a standby
 * after a failover) a first start goes on unrecorded, as migrate lets it.
 */
export async function refuseOtherNamespace(
  q: Queryable,
  config: Pick<Config, 'prefix' | 'redisUrl'>,
): Promise<void> {
  const want = configuredNamespace(config);
  let recorded = await getRedisNamespace(q);
  if (!recorded) {
    try {
      await initRedisNamespace(q, want);
    } catch (err) {
      if (pgCode(err) === PG.readOnlyTransaction) return;
      throw err;
    }
    recorded = await getRedisNamespace(q);
    if (!recorded) throw new Error('redis_namespace could not be recorded');
  }
  if (same(recorded, want)) return;
  throw new RedisNamespaceMismatchError(
    `this database is used with Redis ${shown(recorded)}, but this process is configured with ` +
      `${shown(want)} (MNEMOS_PREFIX, and the database number in REDIS_URL's path). Messages accepted ` +
      `under the recorded one and not yet archived would not be seen (and their seqs given again), nor ` +
      `its error memory and dead letters. If the setting changed by mistake, set it back. To move on ` +
      `purpose: stop the API processes, let the workers archive what waits under the old settings, stop ` +
      `every mnemos process, then run \`mnemos redis-namespace --accept\` with the new settings (README ` +
      `"Moving to another MNEMOS_PREFIX"). Every mnemos process refuses to start until they match.`,
  );
}

/** Keys per SCAN step: small enough not to hold Redis for long. */
const SCAN_COUNT = 1000;

/** Accepted messages waiting in the inboxes of `ns`, on `redis`'s server (in `ns`'s database). */
export async function messagesWaitingUnder(redis: Redis, ns: RedisNamespace): Promise<number> {
  const conn = redis.duplicate({ db: ns.db });
  try {
    if (!(await waitForRedis(conn, 5000))) throw new Error(`cannot reach Redis database ${ns.db}`);
    let waiting = 0;
    let cursor = '0';
    do {
      const [next, keys] = await conn.scan(cursor, 'MATCH', `${ns.prefix}:inbox:*`, 'COUNT', SCAN_COUNT);
      cursor = next;
      if (keys.length === 0) continue;
      const tx = conn.multi();
      for (const key of keys) tx.llen(key);
      for (const [err, n] of (await tx.exec()) ?? []) {
        if (err) throw err;
        waiting += Number(n);
      }
    } while (cursor !== '0');
    return waiting;
  } finally {
    conn.disconnect();
  }
}

/**
 * `mnemos redis-namespace`: prints what the database records and what is configured; with
 * `accept`, records the configured namespace, once no message waits in the recorded one's inboxes
 * on the configured Redis (unless `force`: the old namespace was on another Redis, say).
 */
export async function redisNamespaceCommand(
  q: Queryable,
  config: Pick<Config, 'prefix' | 'redisUrl'>,
  opts: { accept: boolean; force: boolean; print: (line: string) => void },
): Promise<void> {
  const want = configuredNamespace(config);
  const recorded = await getRedisNamespace(q);
  opts.print(`recorded:   ${recorded ? shown(recorded) : 'nothing yet (the first start records it)'}`);
  opts.print(`configured: ${shown(want)}`);
  if (!opts.accept) {
    if (recorded && !same(recorded, want))
      opts.print('they differ: services refuse to start (see `mnemos redis-namespace --help`)');
    return;
  }
  if (recorded && !same(recorded, want) && !opts.force) {
    const redis = makeRedis(config.redisUrl, 'producer');
    try {
      if (!(await waitForRedis(redis, 5000))) throw new Error('cannot reach Redis (REDIS_URL)');
      const waiting = await messagesWaitingUnder(redis, recorded);
      if (waiting > 0)
        throw new RedisNamespaceMismatchError(
          `${waiting} accepted message${waiting === 1 ? '' : 's'} still wait${waiting === 1 ? 's' : ''} to be ` +
            `archived under ${shown(recorded)}: run a worker with those settings until none is left, ` +
            `then run this again (--force records the new namespace anyway, and those messages are lost)`,
        );
    } finally {
      redis.disconnect();
    }
  }
  await setRedisNamespace(q, want);
  opts.print(`recorded ${shown(want)}`);
}
