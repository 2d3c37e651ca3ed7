import express from 'express';
import type { Response } from 'express';
import { z } from 'zod';
import { notFound } from '../errors.js';
import { hasBadChars, sessionIdField } from '../messages/message-input.js';
import { assertNoBody, emptyAsAbsent, limitParam, noQuery, parseInput } from '../validate.js';
import { ERROR_ID_RE, LIST_CURSOR_RE, OUTCOMES } from '../error-memory/types.js';
import type { ErrorMemory } from '../error-memory/types.js';

/** `/v1/errors`: error memory over HTTP. Mounted after the auth middleware sets `res.locals.tenantId`. */

// As for messages: NUL and lone surrogates are refused (Redis would get a lone surrogate as U+FFFD).
const noBadChars = [
  (s: string) => !hasBadChars(s),
  'NUL characters and lone surrogates are not allowed',
] as const;
const cleanText = (max: number) =>
  z
    .string()
    .max(max)
    .refine(...noBadChars);
const text = (max: number) =>
  z
    .string()
    .trim()
    .min(1, 'must not be blank')
    .max(max)
    .refine(...noBadChars);

const toolName = text(128);

/** Also the arguments of the `write_error` agent tool. */
export const errorWriteBody = z
  .object({
    tool_name: toolName,
    symptom: text(4000),
    action: text(4000),
    outcome: z.enum(OUTCOMES),
    cause: cleanText(4000).nullable().optional(),
    keywords: z.array(cleanText(64)).max(32).optional(),
    session_id: sessionIdField.optional(),
  })
  .strict();

export const errorSearchBody = z
  .object({
    tool_name: toolName.optional(),
    query: text(4000),
    limit: z.number().min(1).max(16).int().default(4),
  })
  .strict();

export const errorLookupBody = z.object({ tool_name: toolName, error: text(16_000) }).strict();

export const errorListQuery = z
  .object({
    cursor: z
      .union([z.literal(''), z.string().regex(LIST_CURSOR_RE, 'invalid cursor')])
      .optional()
      .transform(emptyAsAbsent),
    limit: limitParam.optional().transform((v) => v ?? 100),
  })
  .strict();

export const errorPurgeQuery = z.object({ tool_name: toolName.optional() }).strict();

function tenantOf(res: Response): string {
  const tenantId: unknown = res.locals.tenantId;
  if (typeof tenantId !== 'string' || tenantId === '') throw new Error('error routes mounted without auth');
  return tenantId;
}

/** Ids are checked by shape before any Redis access; a bad one is as unknown as a missing one. */
function idParam(raw: string | string[] | undefined): string {
  if (typeof raw !== 'string' || !ERROR_ID_RE.test(raw)) throw notFound('error record');
  return raw;
}

export function makeErrorRoutes(deps: { errors: ErrorMemory }): express.Router {
  const { errors } = deps;
  const router = express.Router();

  router.post('/', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(errorWriteBody, req.body);
    const result = await errors.write(tenantOf(res), body);
    res.status(result.deduplicated ? 200 : 201).json({ id: result.id, deduplicated: result.deduplicated });
  });

  router.post('/search', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(errorSearchBody, req.body);
    res.json({ records: await errors.search(tenantOf(res), body) });
  });

  router.post('/lookup', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const body = parseInput(errorLookupBody, req.body);
    res.json(await errors.lookup(tenantOf(res), body));
  });

  router.get('/', async (req, res) => {
    const query = parseInput(errorListQuery, req.query, 'query');
    res.json(await errors.list(tenantOf(res), query));
  });

  router.get('/:id', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    const record = await errors.get(tenantOf(res), idParam(req.params.id));
    if (!record) throw notFound('error record');
    res.json(record);
  });

  router.delete('/', async (req, res) => {
    // `DELETE /v1/errors/` is what a client sends for `DELETE /v1/errors/{id}` with an empty or
    // "." id (dot segments are resolved before sending): a record that does not exist, never
    // the purge of every record.
    if (req.originalUrl.split('?')[0]!.endsWith('/')) throw notFound('error record');
    // Its filter is a query parameter: `{"tool_name":"psql"}` in a body would otherwise be ignored,
    // and every record of the tenant purged instead of one tool's.
    assertNoBody(req.body, 'the purge takes no body: pass the filter in the query (?tool_name=)', {
      strict: true,
    });
    const query = parseInput(errorPurgeQuery, req.query, 'query');
    res.json({ deleted: await errors.purge(tenantOf(res), query) });
  });

  router.delete('/:id', async (req, res) => {
    parseInput(noQuery, req.query, 'query');
    assertNoBody(req.body, 'delete takes no body', { strict: true });
    if (!(await errors.remove(tenantOf(res), idParam(req.params.id)))) throw notFound('error record');
    res.status(204).end();
  });

  return router;
}
