import type { Extension, ExtensionFactory } from '../extension.js';
import { forRequests } from '../deps.js';
import { contextRoutesMeta, makeContextRoutes } from '../routes/context-routes.js';
import { makeContextBuilder } from './build-context.js';
import { relevanceCacheKey } from './relevance.js';

/**
 * Tier 1, the context window: `POST /v1/sessions/:sid/context`. Owns the per-session relevance
 * cache in Redis (<prefix>:ctxrel:<tenant>:<sid>), removed with the session or the tenant.
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
    purgeTenant: async (tenantId) => {
      const pattern = `${relevanceCacheKey(deps.config.prefix, tenantId, '')}*`;
      let cursor = '0';
      do {
        const [next, keys] = await deps.redis.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
        cursor = next;
        if (keys.length > 0) await deps.redis.unlink(...keys);
      } while (cursor !== '0');
    },
  };
};
