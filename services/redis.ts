import { Redis, ReplyError } from 'ioredis';
import { throttledWarn, watchOutage } from './logger.js';
import type { Logger } from './logger.js';

export type { Redis };

/**
 * Producer connections (the API) fail fast: no offline queue, one retry, so a Redis outage turns
 * into a 503 instead of requests piling up in memory. Worker connections (BullMQ) retry forever.
 */
export function makeRedis(url: string, role: 'producer' | 'worker', logger?: Logger): Redis {
  const redis =
    role === 'producer'
      ? new Redis(url, {
          enableOfflineQueue: false,
          maxRetriesPerRequest: 1,
          // A command sent on a connection that broke before its answer fails (a 503) instead of
          // being sent again after the reconnect: Redis may have run it, and the accept script run
          // twice queued a message without a client id twice.
          autoResendUnfulfilledCommands: false,
          connectTimeout: 2000,
          commandTimeout: 5000,
          retryStrategy: (times) => Math.min(200 * times, 2000),
          lazyConnect: false,
        })
      : new Redis(url, {
          maxRetriesPerRequest: null,
          enableReadyCheck: true,
          retryStrategy: (times) => Math.min(100 * 2 ** Math.min(times, 6), 5000),
        });
  // Reconnect loops emit an error per attempt: one line per 5 s, with the count left out.
  const warnError = throttledWarn(logger, 'redis connection error');
  const outage = watchOutage(redis, logger, 'redis connection restored', { role });
  if (role === 'producer') watchStaleConnection(redis, logger, outage);
  redis.on('error', (err: Error) => {
    outage.failed();
    if (!refusedSelect(err)) warnError({ err: { message: err.message }, role });
  });
  refuseDatabaseZero(redis, throttledWarn(logger, DATABASE_REFUSED), role);
  return redis;
}

const DATABASE_REFUSED =
  "redis refused to select REDIS_URL's database: reconnecting (not using database 0 instead)";

/**
 * ioredis selects REDIS_URL's database as it connects and, when Redis refuses (`ERR DB index is
 * out of range`, an ACL user without SELECT), reports the error and goes on, ready, in database 0:
 * queues and inboxes went there, error memory (which fails on the refusal) answered 503, and two
 * deployments told apart by their database shared database 0. Such a connection is dropped before
 * its ready check instead, and retried as after an outage: no command runs on it, at start (where
 * waitForRedis reports the refusal) or after a reconnect. BullMQ's own connections (a worker's
 * blocking one) are duplicates of this one, and get the same.
 */
function refuseDatabaseZero(redis: Redis, warn: (fields: object) => void, role: string): void {
  redis.on('error', (err: Error) => {
    if (!refusedSelect(err)) return;
    refusals.set(redis, err);
    warn({ db: redis.options.db, err: { message: err.message }, role });
    redis.disconnect(true);
  });
  redis.on('ready', () => refusals.delete(redis));
  const duplicate = redis.duplicate.bind(redis);
  redis.duplicate = (...args: Parameters<Redis['duplicate']>) => {
    const copy = duplicate(...args);
    refuseDatabaseZero(copy, warn, role);
    return copy;
  };
}

/** A connection's last refused SELECT, until it is ready again (for waitForRedis). */
const refusals = new WeakMap<Redis, Error>();

/** ioredis names the command an error answered (`err.command`): here its handshake's SELECT. */
const refusedSelect = (err: Error) => (err as { command?: { name?: string } }).command?.name === 'select';

/** Redis refusing the connection's login (a wrong password or user, or none given). */
const refusedLogin = (err: Error) => /^(WRONGPASS|NOAUTH)\b/.test(err.message);

/**
 * What a start says of a refused login: Redis is running (a start said "cannot reach Redis … (is
 * it running?)" after 5 s of WRONGPASS warnings).
 */
const loginRefused = (err: Error) =>
  new Error(
    `Redis refused mnemos's login (${err.message.slice(0, 400)}): check the user and password in REDIS_URL ` +
      '(redis://user:password@host:port/db, percent-encoded)',
  );

/** What a start says of a refused SELECT: the database, Redis's answer, and what to check. */
const databaseRefused = (redis: Redis, err: Error) =>
  new Error(
    `Redis refused to select database ${redis.options.db} of REDIS_URL (${err.message}): ` +
      'mnemos will not use database 0 instead. The path of REDIS_URL is the database number ' +
      '(a Redis has databases 0-15 unless its "databases" setting says otherwise), and a Redis ' +
      'user needs SELECT for any database but 0',
  );

export const STALE_CHECK_EVERY_MS = 5000;

/**
 * A connection that dies without a reset (a partition, a failover behind a VIP, a proxy that keeps
 * acknowledging) stays "ready" in ioredis for ever: each command times out (a 503), none reconnects,
 * and a tester watched a process answer 503 for 6 minutes with Redis healthy. A PING every 5 s on
 * a ready connection that gets no answer within the command timeout reconnects it. (A busy or
 * loading Redis answers PING with an error at once: that is no reason to reconnect.)
 */
function watchStaleConnection(redis: Redis, logger: Logger | undefined, outage: { failed(): void }): void {
  const stop = watchSilence({
    ready: () => redis.status === 'ready',
    silent: () =>
      redis.ping().then(
        () => false,
        (err: Error) => /Command timed out/.test(err.message),
      ),
    reconnect: () => {
      logger?.warn('redis connection gave no answer to a ping: reconnecting');
      outage.failed();
      redis.disconnect(true);
    },
  });
  redis.once('end', stop);
}

/**
 * The ping loop of a connection watch, for any client: every STALE_CHECK_EVERY_MS, on a ready
 * connection and one ping at a time, `silent()` asks whether a ping went unanswered; if so and the
 * connection still claims to be ready, `reconnect()`. Returns the function that stops it.
 */
export function watchSilence(client: {
  ready(): boolean;
  silent(): Promise<boolean>;
  reconnect(): unknown;
}): () => void {
  let pinging = false;
  let stopped = false;
  const timer = setInterval(() => {
    if (pinging || stopped || !client.ready()) return;
    pinging = true;
    void client
      .silent()
      .then(async (silent) => {
        if (silent && !stopped && client.ready()) await client.reconnect();
      })
      .catch(() => undefined)
      .finally(() => (pinging = false));
  }, STALE_CHECK_EVERY_MS);
  timer.unref();
  return () => {
    stopped = true;
    clearInterval(timer);
  };
}

/**
 * Waits until the connection is ready or the deadline passes. A refused SELECT of REDIS_URL's
 * database throws at once, naming it: waiting would not change it, and "cannot reach Redis" would
 * send the operator to look for a Redis that is running.
 */
export async function waitForRedis(redis: Redis, timeoutMs: number): Promise<boolean> {
  if (redis.status === 'ready') return true;
  const refused = refusals.get(redis);
  if (refused) throw databaseRefused(redis, refused);
  return new Promise((resolve, reject) => {
    const done = () => {
      clearTimeout(t);
      redis.off('ready', onReady);
      redis.off('error', onError);
    };
    const t = setTimeout(() => {
      done();
      resolve(false);
    }, timeoutMs);
    const onReady = () => {
      done();
      resolve(true);
    };
    const onError = (err: Error) => {
      if (refusedLogin(err)) {
        done();
        reject(loginRefused(err));
        return;
      }
      if (!refusedSelect(err)) return;
      done();
      reject(databaseRefused(redis, err));
    };
    redis.once('ready', onReady);
    redis.on('error', onError);
  });
}

/**
 * The scripting commands every mnemos process needs: EVALSHA runs each script, EVAL is what
 * ioredis, BullMQ and error memory fall back to once Redis has lost its scripts (a restart, a
 * `SCRIPT FLUSH`). A user without EVAL worked until then, and then every post answered 500; so did
 * a Redis where EVAL is disabled or renamed for everyone (`rename-command`, as some managed Redis
 * do), at once. Tried once at start, with scripts that touch nothing; a refusal for permission
 * (NOPERM) or an unknown command stops it, anything else (a busy Redis) is left to later calls.
 */
export async function refuseMissingScripting(redis: Redis): Promise<void> {
  const refusal = (name: string) => (err: Error) =>
    /^NOPERM\b/.test(err.message)
      ? { name, why: 'noperm', message: err.message }
      : /^ERR unknown command\b/.test(err.message)
        ? { name, why: 'unknown', message: err.message }
        : null;
  const refused = (
    await Promise.all([
      redis.eval('return 1', 0).then(() => null, refusal('EVAL')),
      // No script has this digest: NOSCRIPT, once the user may run EVALSHA at all.
      redis.evalsha('0'.repeat(40), 0).then(() => null, refusal('EVALSHA')),
    ])
  ).filter((r) => r !== null);
  const names = (rs: typeof refused) => rs.map((r) => `${r.name} (${r.message.trim()})`).join(', ');
  const s = (rs: typeof refused, one: string, many: string) => (rs.length > 1 ? many : one);
  const unknown = refused.filter((r) => r.why === 'unknown');
  if (unknown.length > 0) {
    throw new Error(
      `Redis has no command ${names(unknown)}: ${s(unknown, 'it is', 'they are')} disabled or renamed ` +
        '(rename-command, as some managed Redis do), and mnemos runs its scripts with EVALSHA and EVAL: ' +
        'use a Redis that allows them; the README\'s "Redis users and managed Redis" lists what mnemos needs',
    );
  }
  if (refused.length === 0) return;
  throw new Error(
    `Redis refused mnemos's user the command${s(refused, '', 's')} ${names(refused)}: ` +
      `grant ${s(refused, 'it', 'them')} to the user of REDIS_URL (ACL SETUSER <user> +eval +evalsha); the README's ` +
      '"Redis users and managed Redis" lists what that user needs',
  );
}

/**
 * Why a Redis that answers may still take no writes, by the first word of its refusal: out of
 * memory under `noeviction`, a replica (as the old primary's address may lead to after a
 * failover), a failing RDB snapshot with `stop-writes-on-bgsave-error`. /readyz pinged, and said
 * ok to the first two (`down` to the third, which refuses PING too) while every post answered 503:
 * a load balancer kept sending traffic there.
 */
const WRITE_REFUSALS: Record<string, string> = { OOM: 'full', READONLY: 'read_only', MISCONF: 'misconf' };

/**
 * Redis's state for /readyz: `ok`, a WRITE_REFUSALS state, another refusal's first word in lower
 * case (`loading`, `busy`, `noperm`), or `down` (no connection, no answer). The probe is a write,
 * so that it meets what a write meets: one SET of a key under the prefix that expires in 10 s,
 * shared by the deployment's processes, as cheap as the PING it replaced.
 */
export async function redisWriteState(redis: Redis, prefix: string): Promise<string> {
  try {
    await redis.set(`${prefix}:readyz`, '1', 'PX', 10_000);
    return 'ok';
  } catch (err) {
    const word = err instanceof ReplyError ? /^[A-Z]+\b/.exec((err as Error).message)?.[0] : undefined;
    return word ? (WRITE_REFUSALS[word] ?? word.toLowerCase()) : 'down';
  }
}

/** SPEC §1: production Redis should persist (AOF) and never evict queue keys. */
export async function redisDurabilityWarnings(redis: Redis): Promise<string[]> {
  const settings = await durabilitySettings(redis);
  if (!settings) return ['could not read Redis persistence settings (CONFIG GET and INFO refused)'];
  const warnings: string[] = [];
  if (!settings.aof)
    warnings.push(
      'Redis runs without AOF (appendonly no): a Redis restart can lose accepted messages not yet archived',
    );
  if (settings.policy !== 'noeviction')
    warnings.push(
      `Redis maxmemory-policy is ${settings.policy}: set noeviction so queue keys are never evicted`,
    );
  return warnings;
}

/**
 * AOF on, and the eviction policy: from CONFIG GET, or where managed services refuse CONFIG
 * (ElastiCache, Memorystore, an ACL user without it) from INFO, which BullMQ needs anyway. The
 * check once said only "could not read" there, and an `allkeys-lru` Redis went unreported.
 */
async function durabilitySettings(redis: Redis): Promise<{ aof: boolean; policy: string } | null> {
  try {
    const aof = (await redis.config('GET', 'appendonly')) as string[];
    const policy = (await redis.config('GET', 'maxmemory-policy')) as string[];
    return { aof: aof[1] === 'yes', policy: policy[1] ?? 'unknown' };
  } catch {
    try {
      const info = `${await redis.info('persistence')}\n${await redis.info('memory')}`;
      const field = (name: string) => new RegExp(`^${name}:(.*)$`, 'm').exec(info)?.[1]?.trim();
      const aof = field('aof_enabled');
      const policy = field('maxmemory_policy');
      return aof === undefined || policy === undefined ? null : { aof: aof === '1', policy };
    } catch {
      return null;
    }
  }
}
