import type { Extension, ExtensionFactory } from '../extension.js';
import { forRequests } from '../deps.js';
import { contextRoutesMeta, makeContextRoutes } from '../routes/context-routes.js';
import { makeContextBuilder } from './build-context.js';
import { relevanceCacheKey } from './relevance.js';

/**
 * Tier 1, the context window: `POST /v1/sessions/:sid/context`. Owns the per-session relevance
 * cache in Redis (<prefix>:ctxrel:<tenant>:<sid>), removed with the session, and with the tenant by
 * the erasure's sweep of its namespace (services/lifecycle/tenant-erasure.ts): a purge of its own
 * walked the whole keyspace once more per erasure.
 */
export const contextExtension: ExtensionFactory = async (deps): Promise<Extension> => {
  return {
    name: 'context',
    routes: [
      {
        prefix: '/v1/sessions',
        router: makeContextRoutes(makeContextBuilder(forRequests(deps))),
        meta: contextRoutesMeta,
      },
    ],
    purgeSession: async (tenantId, sessionId) => {
      await deps.redis.del(relevanceCacheKey(deps.config.prefix, tenantId, sessionId));
    },
  };
};
