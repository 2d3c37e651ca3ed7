import { requestDb } from '../db/pool.js';
import type { Db } from '../db/pool.js';
import type { QueueRegistry } from '../workers/queues.js';
import type { Config } from './config.js';
import type { LlmClient } from './llm/llm-client.js';
import type { Logger } from './logger.js';
import type { Metrics } from './metrics.js';
import type { Redis } from './redis.js';

/** What the API and the workers are built from; entry points create it, everything else receives it. */
export interface CoreDeps {
  config: Config;
  db: Db;
  /** Fail-fast connection for the request path. */
  redis: Redis;
  queues: QueueRegistry;
  logger: Logger;
  metrics: Metrics;
  /** Null when no LLM is configured (summaries and the decision model report `disabled`). */
  llm: LlmClient | null;
}

/** The deps of HTTP routes: their Postgres statements get PG_REQUEST_TIMEOUT_MS to answer. */
export const forRequests = <D extends { db: Db }>(deps: D): D => ({ ...deps, db: requestDb(deps.db) });
