import type { Extension, ExtensionFactory } from '../extension.js';
import {
  errorListAnswer,
  errorLookupAnswer,
  errorPurgeAnswer,
  errorRecord,
  errorSearchAnswer,
  errorWriteAnswer,
} from '../openapi-responses.js';
import { localEmbed } from '../llm/local-embedder.js';
import type { RouteMeta } from '../openapi.js';
import {
  errorListQuery,
  errorLookupBody,
  errorPurgeQuery,
  errorSearchBody,
  errorWriteBody,
  makeErrorRoutes,
} from '../routes/error-routes.js';
import { openErrorMemory } from './error-store.js';
import type { ErrorMemory } from './types.js';
import { scheduleMaintenance } from '../../workers/queues.js';
import { existingTenants } from '../../db/queries/tenants.js';

const meta: Record<string, RouteMeta> = {
  'POST /': {
    summary: 'Record a tool error and its fix (merged into an existing record when the symptom matches)',
    body: errorWriteBody,
    success: [201, 200],
    responses: { 201: errorWriteAnswer, 200: errorWriteAnswer },
  },
  'POST /search': {
    summary: 'Search error memory by tool and terms (renews TTL of returned records)',
    body: errorSearchBody,
    responses: { 200: errorSearchAnswer },
  },
  'POST /lookup': {
    summary: 'The related_errors hint for a failed tool call (renews TTL)',
    body: errorLookupBody,
    responses: { 200: errorLookupAnswer },
  },
  'GET /:id': { summary: 'Read one record (renews TTL)', responses: { 200: errorRecord } },
  'GET /': {
    summary: 'List records for dashboards (does not renew TTL)',
    query: errorListQuery,
    responses: { 200: errorListAnswer },
  },
  'DELETE /:id': { summary: 'Delete one record', success: 204 },
  'DELETE /': {
    summary: 'Purge records (optionally of one tool_name)',
    query: errorPurgeQuery,
    responses: { 200: errorPurgeAnswer },
  },
};

const SWEEP_EVERY_MS = 15 * 60_000;

/**
 * Error memory: cross-session, per tenant, in Redis. Similarity uses the local lexical embedder at
 * write time (cheap, deterministic, no LLM call on the write path).
 */
export const errorMemoryExtension: ExtensionFactory = async (deps): Promise<Extension> => {
  const store = await openErrorMemory({
    redisUrl: deps.config.redisUrl,
    prefix: deps.config.prefix,
    ttlDays: deps.config.errorMemoryTtlDays,
    embed: (text) => localEmbed(text, 256),
    logger: deps.logger,
    onSkipped: (step) => deps.metrics.errorMemorySkipped.inc({ step }),
  });
  const hits = deps.metrics.errorMemoryHits;
  // Count hits where records are served, whichever path (REST or agent tools) asked.
  const errors: ErrorMemory = {
    ...store,
    search: async (tenantId, input) => {
      const r = await store.search(tenantId, input);
      hits.inc({ via: 'search' }, r.length);
      return r;
    },
    lookup: async (tenantId, input) => {
      const r = await store.lookup(tenantId, input);
      hits.inc({ via: 'lookup' }, r.records.length);
      return r;
    },
    get: async (tenantId, id) => {
      const r = await store.get(tenantId, id);
      if (r) hits.inc({ via: 'get' });
      return r;
    },
  };
  return {
    name: 'error-memory',
    routes: [{ prefix: '/v1/errors', router: makeErrorRoutes({ errors }), meta }],
    maintenance: { 'error-sweep': () => errors.sweepExpired((ids) => existingTenants(deps.db, ids)) },
    async schedule() {
      await scheduleMaintenance(deps.queues, 'error-sweep', SWEEP_EVERY_MS);
    },
    // Tenant erasure: the keys no index knows of go with its sweep of the tenant's namespace.
    purgeTenant: async (tenantId) => {
      await errors.purgeTenant(tenantId, { sweepUnindexed: false });
    },
    close: () => errors.close(),
    provides: { errors },
  };
};
