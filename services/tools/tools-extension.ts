import { Router } from 'express';
import { forRequests } from '../deps.js';
import { toolAnswer, toolList } from '../openapi-responses.js';
import { z } from 'zod';
import type { ErrorMemory } from '../error-memory/types.js';
import type { Extension, ExtensionFactory } from '../extension.js';
import { assertSessionId } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { parseInput } from '../validate.js';
import { runTool } from './run-tool.js';
import { strictToolDefinitions, toolDefinitions } from './tool-definitions.js';

/**
 * `?window_from_seq=`: the first seq of the agent's context window (`window.from_seq` of its
 * context answer), so that `chat_history` search leaves out the window the agent really has (a
 * context call with `max_messages` draws another one than the default MAX_HISTORY_MESSAGES).
 */
const runQuery = z
  .object({
    // Empty is absent (the default window), as on every other parameter.
    window_from_seq: z
      .string()
      .regex(/^\d*$/, 'must be a non-negative integer')
      .refine((v) => v === '' || Number(v) <= Number.MAX_SAFE_INTEGER, {
        message: `must be at most ${Number.MAX_SAFE_INTEGER}`,
      })
      .transform((v) => (v === '' ? undefined : Number(v)))
      .optional(),
  })
  .strict();

/** `?strict=true`: the definitions for OpenAI's structured outputs (strictToolDefinitions). */
const toolsQuery = z.object({ strict: z.enum(['true', 'false', '']).optional() }).strict();

const toolsMeta: Record<string, RouteMeta> = {
  'GET /': {
    summary:
      'OpenAI function-tool definitions: chat_history, error_history, write_error (strict=true: for structured outputs)',
    query: toolsQuery,
    responses: { 200: toolList },
  },
};
const runMeta: Record<string, RouteMeta> = {
  'POST /:sid/tools/:name': {
    summary:
      'Execute one tool call; the body is the arguments object (or the JSON string the model produced)',
    body: z.union([z.record(z.string(), z.unknown()), z.string()]),
    // No body is no arguments: `chat_history` then lists the last messages.
    bodyOptional: true,
    query: runQuery,
    responses: { 200: toolAnswer },
  },
};

/**
 * Agent tools: the same memory, shaped for an LLM's tool calls. Answers are always text for the
 * tool message; invalid arguments get guidance (HTTP 200) so the model can correct itself.
 */
export const toolsExtension: ExtensionFactory = async (deps, opened): Promise<Extension> => {
  const errors =
    (opened.find((e) => e.name === 'error-memory')?.provides?.errors as ErrorMemory | undefined) ?? null;
  const list = Router();
  const strictTools = strictToolDefinitions();
  list.get('/', (req, res) => {
    const q = parseInput(toolsQuery, req.query, 'query');
    res.json({ tools: q.strict === 'true' ? strictTools : toolDefinitions });
  });
  const core = forRequests(deps);
  const run = Router();
  run.post('/:sid/tools/:name', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(runQuery, req.query, 'query');
    // No body is no arguments; a JSON `null` is not an object, as on every other route.
    const args: unknown = req.body === undefined ? {} : req.body;
    const content = await runTool(
      { core, errors },
      res.locals.tenantId as string,
      sid,
      req.params.name!,
      args,
      { windowFromSeq: q.window_from_seq },
    );
    res.json({ content });
  });
  return {
    name: 'tools',
    routes: [
      { prefix: '/v1/tools', router: list, meta: toolsMeta },
      { prefix: '/v1/sessions', router: run, meta: runMeta },
    ],
  };
};
