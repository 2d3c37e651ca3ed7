import { QUEUE_NAMES, makeQueues } from '../../workers/queues.js';
import type { QueueName, QueueRegistry } from '../../workers/queues.js';
import { shownUrl } from '../config.js';
import type { Config } from '../config.js';
import { AppError } from '../errors.js';
import { makeRedis, waitForRedis } from '../redis.js';
import type { Redis } from '../redis.js';

/**
 * `mnemos after-restore`: after Postgres (or the embedded data directory) was restored from a
 * backup behind a Redis that kept its newer state. Redis's per-session state then remembers ids,
 * seq numbers and generations the restored database never saw: a re-post of such an id answered
 * with a seq that is not archived (`accepted: 0`, or a `503` "lost" on every `?wait=true`), and a
 * session whose Redis generation had already reached the one its next reset takes skipped that
 * reset's Redis step (compare-and-set), so the reset left the old ids behind.
 *
 * Removing that state is the case the service handles already when Redis comes back empty: the
 * next accept finds no `sess` hash and seeds it (counter, generation, deleted mark) from the
 * session's row under its row lock (accept-messages.ts seedSession, inbox.ts SEED), ids are
 * looked up in the archive first, and a `?wait=true` without an archived mark asks the archive.
 * What lives only in Redis and is not derived from the database stays: error memory
 * (`<p>:err:*`), dead letters (`<p>:dead:*`), rate-limit counters (`<p>:rl:*`) and BullMQ's
 * queues (`<p>:<queue>:*`; their jobs read the session's state from Postgres when they run).
 */

/** The per-session kinds of key (README "Redis key layout"), and `armed`, the flush list. */
export const RESTORE_KINDS = ['sess', 'ids', 'inbox', 'armed', 'ctxrel', 'impstage', 'impids'] as const;
export type RestoreKind = (typeof RESTORE_KINDS)[number];

export interface AfterRestoreCounts {
  /** Keys removed, per kind. */
  removed: Record<RestoreKind, number>;
  /** Accepted messages that waited in the removed inboxes: never archived, now dropped. */
  droppedMessages: number;
}

/** Keys per SCAN step, and so per UNLINK: small enough not to hold Redis for long. */
const SCAN_COUNT = 1000;

/**
 * Removes the per-session state Redis holds under `prefix` (MNEMOS_PREFIX, which cannot hold `:`
 * or glob characters), so that it is seeded again from the database. One SCAN over the prefix,
 * not one per kind: each SCAN walks the whole keyspace, which on a shared Redis may be large.
 */
export async function dropSessionState(redis: Redis, prefix: string): Promise<AfterRestoreCounts> {
  const removed = Object.fromEntries(RESTORE_KINDS.map((k) => [k, 0])) as Record<RestoreKind, number>;
  let droppedMessages = 0;
  const kindOf = (key: string): RestoreKind | null => {
    const rest = key.slice(prefix.length + 1);
    if (rest === 'armed') return 'armed';
    const kind = rest.slice(0, rest.indexOf(':'));
    // `armed` has no per-session keys; `:armed:…` would be some other program's.
    return kind !== 'armed' && (RESTORE_KINDS as readonly string[]).includes(kind)
      ? (kind as RestoreKind)
      : null;
  };
  let cursor = '0';
  do {
    const [next, keys] = await redis.scan(cursor, 'MATCH', `${prefix}:*`, 'COUNT', SCAN_COUNT);
    cursor = next;
    const byKind = new Map<RestoreKind, string[]>();
    for (const key of new Set(keys)) {
      const kind = kindOf(key);
      if (!kind) continue;
      const list = byKind.get(kind);
      if (list) list.push(key);
      else byKind.set(kind, [key]);
    }
    if (byKind.size === 0) continue;
    // The inboxes' lengths are read in the same MULTI as the removal: what is counted is what
    // went. SCAN may return a key again in a later step: its UNLINK then counts 0, its length 0.
    const inboxes = byKind.get('inbox') ?? [];
    const tx = redis.multi();
    for (const key of inboxes) tx.llen(key);
    const kinds = [...byKind.keys()];
    for (const kind of kinds) tx.unlink(...byKind.get(kind)!);
    const results = (await tx.exec()) ?? [];
    for (const [err] of results) if (err) throw err;
    const values = results.map(([, v]) => Number(v));
    droppedMessages += values.slice(0, inboxes.length).reduce((a, b) => a + b, 0);
    kinds.forEach((kind, i) => (removed[kind] += values[inboxes.length + i]!));
  } while (cursor !== '0');
  return { removed, droppedMessages };
}

export interface ConnectedWorkers {
  /** One entry per BullMQ worker connection found (a process has one per queue it works). */
  workers: Array<{ queue: QueueName; addr: string }>;
  /** Why nothing could be told (CLIENT LIST refused or disabled), or null. */
  unknown: string | null;
}

/**
 * The BullMQ workers connected to this prefix's queues (they name their connections after the
 * queue: CLIENT LIST). API-only processes hold no worker connection and are not found.
 */
export async function connectedWorkers(queues: QueueRegistry): Promise<ConnectedWorkers> {
  const found: ConnectedWorkers = { workers: [], unknown: null };
  for (const queue of QUEUE_NAMES) {
    let clients: Array<Record<string, string>>;
    try {
      clients = await queues[queue].getWorkers();
    } catch (err) {
      // An ACL without CLIENT (NOPERM), for one.
      return { workers: [], unknown: (err as Error).message };
    }
    for (const client of clients) {
      // BullMQ answers a CLIENT command renamed away with one entry that has a name only.
      if (!client.addr) return { workers: [], unknown: 'CLIENT LIST is not available' };
      found.workers.push({ queue, addr: client.addr });
    }
  }
  return found;
}

function refusal(prefix: string, found: ConnectedWorkers): AppError {
  if (found.unknown !== null)
    return new AppError(
      409,
      'cannot_check',
      `cannot tell whether mnemos workers are running: this Redis does not list its clients ` +
        `(${found.unknown}). Stop every mnemos process of prefix "${prefix}", then run again with --force`,
    );
  // Hosts, not host:port: every worker holds one connection per queue.
  const hosts = [...new Set(found.workers.map((w) => w.addr.slice(0, w.addr.lastIndexOf(':'))))];
  const queues = [...new Set(found.workers.map((w) => w.queue))];
  const n = found.workers.length;
  return new AppError(
    409,
    'workers_running',
    `mnemos workers are connected to this Redis under prefix "${prefix}" (${n} connection${n === 1 ? '' : 's'} ` +
      `from ${hosts.slice(0, 5).join(', ')}${hosts.length > 5 ? ` and ${hosts.length - 5} more hosts` : ''}; ` +
      `queues ${queues.join(', ')}): stop every mnemos process (serve, worker and api) first; ` +
      '--force skips this check',
  );
}

/** The CLI command: refuse while workers run (unless `force`), drop the state, print the counts. */
export async function afterRestoreCommand(
  config: Pick<Config, 'redisUrl' | 'prefix'>,
  opts: { force: boolean; json: boolean; print: (line: string) => void },
): Promise<void> {
  const redis = makeRedis(config.redisUrl, 'producer');
  try {
    if (!(await waitForRedis(redis, 5000)))
      throw new Error(`cannot reach Redis at ${shownUrl(config.redisUrl)}`);
    if (!opts.force) {
      const queues = makeQueues(redis, config.prefix);
      const found = await connectedWorkers(queues).finally(() => queues.close());
      if (found.unknown !== null || found.workers.length > 0) throw refusal(config.prefix, found);
    }
    const counts = await dropSessionState(redis, config.prefix);
    if (opts.json) {
      opts.print(
        JSON.stringify({
          prefix: config.prefix,
          removed: counts.removed,
          dropped_messages: counts.droppedMessages,
        }),
      );
    } else {
      const r = counts.removed;
      opts.print(
        `after-restore (prefix ${config.prefix}): removed the Redis state of ${r.sess} sessions; ` +
          'each is seeded again from the database at its next message',
      );
      opts.print(`  keys removed: ${RESTORE_KINDS.map((k) => `${k} ${r[k]}`).join(', ')}`);
      opts.print(
        counts.droppedMessages > 0
          ? `  dropped ${counts.droppedMessages} accepted messages that waited in inboxes and were ` +
              'never archived: post them again'
          : '  no accepted message was waiting to be archived',
      );
      opts.print('  kept: error memory (err), dead letters (dead), rate-limit counters (rl), job queues');
    }
  } finally {
    redis.disconnect();
  }
}
