import { Router } from 'express';
import { searchAnswer } from '../openapi-responses.js';
import type { CoreDeps } from '../deps.js';
import { AppError } from '../errors.js';
import { assertSessionId } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { hasBadChars } from '../messages/message-input.js';
import { searchBodySchema, searchSession } from '../search/search-session.js';
import { noQuery, parseInput } from '../validate.js';

/** `/v1/sessions/:sid/search` (mounted with prefix `/v1/sessions`, behind tenant auth). */
export const searchRoutesMeta: Record<string, RouteMeta> = {
  'POST /:sid/search': {
    summary:
      'Search a session: keyword (archive full text + recent substring), semantic (recent vectors) or hybrid',
    body: searchBodySchema,
    responses: { 200: searchAnswer },
  },
};

export function makeSearchRoutes(deps: CoreDeps): Router {
  const router = Router();
  router.post('/:sid/search', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const body: unknown = req.body;
    // Same error as message bodies for characters Postgres cannot take.
    if (typeof body === 'object' && body !== null && 'query' in body) {
      const q = (body as { query: unknown }).query;
      if (typeof q === 'string' && hasBadChars(q)) {
        throw new AppError(
          400,
          'invalid_characters',
          'query: NUL characters and lone surrogates are not allowed',
          {
            problems: [{ path: 'query', message: 'NUL characters and lone surrogates are not allowed' }],
          },
        );
      }
    }
    const params = parseInput(searchBodySchema, body);
    res.json(await searchSession(deps, tenantId, sid, params));
  });
  return router;
}
