import { makePgDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import { insertUsage } from '../db/queries/usage.js';
import { makeQueues } from '../workers/queues.js';
import type { Config } from './config.js';
import type { CoreDeps } from './deps.js';
import { makeLlmClient } from './llm/llm-client.js';
import type { Logger } from './logger.js';
import { makeMetrics } from './metrics.js';
import { makeRedis } from './redis.js';

/**
 * Opens every connection a process needs. Called only by entry points (main files, CLI, tests);
 * the caller owns shutdown through `closeDeps`.
 */
export async function openDeps(
  config: Config,
  logger: Logger,
  opts: { db?: Db; defaultMetrics?: boolean; poolSize?: number } = {},
): Promise<CoreDeps> {
  const db =
    opts.db ??
    (config.databaseUrl
      ? makePgDb({ connectionString: config.databaseUrl, logger, max: opts.poolSize ?? 10 })
      : await openEmbedded(config, logger));
  const redis = makeRedis(config.redisUrl, 'producer', logger);
  // Queues share the fail-fast producer connection: enqueueing during an outage is a 503, not a hang.
  const queues = makeQueues(redis, config.prefix, logger);
  const metrics = makeMetrics({ defaultMetrics: opts.defaultMetrics ?? false });
  const llm = config.llm.configured
    ? makeLlmClient({
        ...(config.llm.apiKey ? { apiKey: config.llm.apiKey } : {}),
        ...(config.llm.baseURL ? { baseURL: config.llm.baseURL } : {}),
        timeoutMs: config.llmTimeoutMs,
        logger,
        onUsage: async (u) => {
          metrics.llmTokens.inc({ purpose: u.purpose, model: u.model, direction: 'input' }, u.inputTokens);
          metrics.llmTokens.inc({ purpose: u.purpose, model: u.model, direction: 'output' }, u.outputTokens);
          await insertUsage(db, u);
        },
        onCall: (e) =>
          metrics.llmCalls.inc({ purpose: e.purpose, model: e.model, outcome: e.outcome === 'ok' ? 'ok' : (e.kind ?? 'error') }),
      })
    : null;
  return { config, db, redis, queues, logger, metrics, llm };
}

async function openEmbedded(_config: Config, _logger: Logger): Promise<Db> {
  throw new Error(
    'DATABASE_URL is not set. Set DATABASE_URL=postgres://… (Postgres 15+ with pgvector). The embedded default is not available in this build.',
  );
}

export async function closeDeps(deps: CoreDeps): Promise<void> {
  await deps.queues.close();
  deps.redis.disconnect();
  await deps.db.close();
}
