import { Router } from 'express';
import { contextAnswer } from '../openapi-responses.js';
import { z } from 'zod';
import type { ContextBuilder } from '../context/build-context.js';
import { AppError } from '../errors.js';
import { waitSignal } from '../messages/accept-messages.js';
import { assertSessionId, hasBadChars, MAX_CONTENT_BYTES } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { noQuery, parseInput } from '../validate.js';

/** Set on a 200 whose `min_seq` was not archived within the wait (the window is what there is). */
export const MIN_SEQ_HEADER = 'x-mnemos-min-seq';

export const contextBody = z
  .object({
    input: z
      .string()
      .refine((s) => !hasBadChars(s), 'NUL characters and lone surrogates are not allowed')
      .optional(),
    max_messages: z.number().min(1).max(1000).int().optional(),
    min_seq: z.number().int().min(0).max(Number.MAX_SAFE_INTEGER).optional(),
  })
  .strict();

export const contextRoutesMeta: Record<string, RouteMeta> = {
  'POST /:sid/context': {
    summary: 'The next turn: hot window, relevant summary as turn context, input; system block to append',
    body: contextBody,
    bodyOptional: true,
    responses: { 200: contextAnswer },
    headers: {
      200: {
        [MIN_SEQ_HEADER]: {
          description:
            'timeout: min_seq was not archived within the wait, and the answer is built from what was',
          enum: ['timeout'],
        },
      },
    },
  },
};

/** `/v1/sessions/:sid/context`, mounted after the auth middleware sets `res.locals.tenantId`. */
export function makeContextRoutes(build: ContextBuilder): Router {
  const router = Router();
  router.post('/:sid/context', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    // No body is `{}`; a JSON `null` is not an object, as on every other route.
    const body = parseInput(contextBody, req.body === undefined ? {} : req.body);
    if (body.input !== undefined && Buffer.byteLength(body.input, 'utf8') > MAX_CONTENT_BYTES) {
      throw new AppError(
        413,
        'message_too_large',
        `input is larger than ${MAX_CONTENT_BYTES} bytes of UTF-8`,
        {
          path: 'input',
        },
      );
    }
    const tenantId = res.locals.tenantId as string;
    const out = await build(tenantId, sid, body, waitSignal(res));
    if (out.minSeqTimedOut) res.setHeader(MIN_SEQ_HEADER, 'timeout');
    res.json(out.body);
  });
  return router;
}
