import { Router } from 'express';
import {
  keyCreated,
  keyListAnswer,
  summaryRetryAnswer,
  tenantCreated,
  tenantListAnswer,
} from '../openapi-responses.js';
import { z } from 'zod';
import type { Db } from '../../db/pool.js';
import { AppError, notFound } from '../errors.js';
import type { RouteMeta } from '../openapi.js';
import { MAX_NAME_CHARS, createKey, createTenant, keyList, revokeKey, tenantList } from '../tenants.js';
import { assertNoBody, listQuery, noQuery, parseInput } from '../validate.js';
import { clearSummaryBackoff } from '../../db/queries/summaries.js';
import { findTenant } from '../../db/queries/tenants.js';
import { hasBadChars } from '../messages/message-input.js';

// Names are checked by createTenant/createKey, with the CLI's rules: at most 128 characters counted
// in code points, as JSON Schema's maxLength counts them (zod's max counts UTF-16 units).
const name = () => z.string().meta({ maxLength: MAX_NAME_CHARS });
const tenantBody = z.object({ name: name().min(1) }).strict();
const keyBody = z.object({ name: name().optional() }).strict();
const summaryRetryBody = z
  .object({
    tenant_id: z.string().min(1).describe("a tenant's id or name; all tenants when left out").optional(),
  })
  .strict();
export const adminRoutesMeta: Record<string, RouteMeta> = {
  'POST /tenants': {
    summary: 'Create a tenant and its first API key',
    body: tenantBody,
    auth: 'admin',
    success: 201,
    responses: { 201: tenantCreated },
  },
  'GET /tenants': {
    summary: 'List tenants, oldest first',
    query: listQuery,
    auth: 'admin',
    responses: { 200: tenantListAnswer },
  },
  'DELETE /tenants/:id': {
    summary: 'Erase a tenant and all its data (Postgres and Redis)',
    auth: 'admin',
    success: 204,
  },
  'POST /tenants/:id/keys': {
    summary: 'Create an API key (shown once)',
    body: keyBody,
    bodyOptional: true,
    auth: 'admin',
    success: 201,
    responses: { 201: keyCreated },
  },
  'GET /tenants/:id/keys': {
    summary: "List a tenant's keys, oldest first (never the secret)",
    query: listQuery,
    auth: 'admin',
    responses: { 200: keyListAnswer },
  },
  'DELETE /keys/:key_id': { summary: 'Revoke an API key', auth: 'admin', success: 204 },
  'POST /summaries/retry': {
    summary:
      'Clear the back-off of every failed or stalled summary (of all tenants, or of one): the sweep retries them now',
    body: summaryRetryBody,
    bodyOptional: true,
    auth: 'admin',
    responses: { 200: summaryRetryAnswer },
  },
};

/** A tenant or key id (or tenant name) from the path: one Postgres text cannot hold is no id. */
function idParam(value: string | undefined): string {
  if (value === undefined || hasBadChars(value))
    throw new AppError(400, 'invalid_characters', 'NUL characters and lone surrogates are not allowed');
  return value;
}

export function makeAdminRoutes(deps: {
  db: Db;
  eraseTenant?: (tenantId: string) => Promise<boolean>;
  /** Called after a key is revoked or a tenant erased (drops cached key verifications). */
  onKeysChanged?: () => void;
  /** Queues a summary sweep now (absent without an LLM: there is no sweep). */
  sweepSummaries?: () => Promise<void>;
}): Router {
  const router = Router();

  router.post('/tenants', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(tenantBody, req.body === undefined ? {} : req.body);
    res.status(201).json(await createTenant(deps.db, body.name));
  });

  router.get('/tenants', async (req, res) => {
    const q = parseInput(listQuery, req.query, 'query');
    const page = await tenantList(deps.db, { cursor: q.cursor, limit: q.limit ?? 100 });
    res.json({ tenants: page.items, next: page.next });
  });

  router.delete('/tenants/:id', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    assertNoBody(req.body, 'tenant erasure takes no body', { strict: true });
    if (!deps.eraseTenant) throw new AppError(501, 'not_implemented', 'tenant erasure is not available');
    // An id or a name, as the key routes and the CLI take. An id no tenant has any more still goes
    // to eraseTenant: a retry after a failed erasure finishes its clean-up (and answers 404).
    const tenant = await findTenant(deps.db, idParam(req.params.id));
    const erased = await deps.eraseTenant(tenant?.id ?? idParam(req.params.id));
    deps.onKeysChanged?.();
    if (!erased) throw notFound('tenant');
    res.status(204).end();
  });

  router.post('/tenants/:id/keys', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(keyBody, req.body === undefined ? {} : req.body);
    const key = await createKey(deps.db, idParam(req.params.id), body.name ?? '');
    res.status(201).json({ key_id: key.key_id, tenant_id: key.tenant_id, api_key: key.api_key });
  });

  router.get('/tenants/:id/keys', async (req, res) => {
    const q = parseInput(listQuery, req.query, 'query');
    const page = await keyList(deps.db, idParam(req.params.id), { cursor: q.cursor, limit: q.limit ?? 100 });
    res.json({ keys: page.items, next: page.next });
  });

  router.delete('/keys/:key_id', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    assertNoBody(req.body, 'key revocation takes no body', { strict: true });
    const revoked = await revokeKey(deps.db, idParam(req.params.key_id));
    deps.onKeysChanged?.();
    if (!revoked) throw notFound('key');
    res.status(204).end();
  });

  router.post('/summaries/retry', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(summaryRetryBody, req.body === undefined ? {} : req.body);
    let tenantId: string | null = null;
    if (body.tenant_id !== undefined) {
      const tenant = await findTenant(deps.db, idParam(body.tenant_id));
      if (!tenant) throw notFound('tenant');
      tenantId = tenant.id;
    }
    const sessions = await clearSummaryBackoff(deps.db, tenantId);
    // The sweep retries them: now rather than at SUMMARY_CRON's next run (which still comes when
    // Redis does not take the job: the back-off is cleared in Postgres either way).
    if (sessions > 0) await deps.sweepSummaries?.().catch(() => undefined);
    res.json({ sessions });
  });

  return router;
}
