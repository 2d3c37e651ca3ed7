import { z } from 'zod';

/**
 * What the routes answer on success, as zod schemas: `/openapi.json` shows them, and the test
 * suite checks every JSON answer it receives against them (`responseChecker` in app.ts, enabled by
 * MNEMOS_CHECK_RESPONSES), so the document cannot drift from what the server sends. Objects are
 * strict: a field the server sends and the document does not name is a mismatch too.
 */

const isoTime = z.string().meta({ format: 'date-time' });
const role = z.enum(['user', 'assistant', 'system', 'developer', 'tool']);

const contentPart = z.discriminatedUnion('type', [
  z.strictObject({ type: z.literal('text'), text: z.string() }),
  z.strictObject({
    type: z.literal('image_url'),
    image_url: z.strictObject({ url: z.string(), detail: z.enum(['auto', 'low', 'high']).optional() }),
  }),
]);
const content = z.union([z.string(), z.null(), z.array(contentPart)]);

const toolCall = z.strictObject({
  id: z.string(),
  type: z.literal('function'),
  function: z.strictObject({ name: z.string(), arguments: z.string() }),
});

const metadata = z.record(z.string(), z.unknown());

export const storedMessage = z.strictObject({
  id: z.string(),
  seq: z.number().int(),
  role,
  content,
  name: z.string().optional(),
  tool_call_id: z.string().optional(),
  tool_calls: z.array(toolCall).optional(),
  metadata: metadata.optional(),
  sent_at: isoTime.describe('RFC 3339 UTC with nanoseconds'),
  sent_at_ns: z.string().describe('unix nanoseconds as a decimal string'),
});

const nextCursor = (what: string) =>
  z.string().nullable().describe(`cursor of the next page of ${what}; null at the end`);

export const postMessagesAnswer = z.strictObject({
  session_id: z.string(),
  accepted: z.number().int().describe('messages stored by this call (idempotent repeats are not counted)'),
  messages: z.array(z.strictObject({ id: z.string(), seq: z.number().int() })),
});

export const messagePage = z.strictObject({
  messages: z.array(storedMessage),
  next: z
    .number()
    .int()
    .nullable()
    .describe('the seq to continue after (or before, with order=desc); null at the end'),
  generation: z
    .number()
    .int()
    .describe('the session generation the page was read from: pass it as ?generation= on the next pages'),
});

export const sessionList = z.strictObject({
  sessions: z.array(
    z.strictObject({
      id: z.string(),
      message_count: z.number().int(),
      created_at: isoTime,
      last_message_at: isoTime.nullable(),
    }),
  ),
  next: nextCursor('sessions'),
});

export const sessionInfo = z.strictObject({
  id: z.string(),
  message_count: z.number().int(),
  hot_bytes: z.number().int(),
  start_seq: z.number().int(),
  start_at: isoTime.nullable(),
  last_message_at: isoTime.nullable(),
  created_at: isoTime,
  summary: z
    .strictObject({ version: z.number().int(), cursor_seq: z.number().int().nullable(), status: z.string() })
    .nullable(),
  pending_jobs: z
    .number()
    .int()
    .nullable()
    .describe('messages accepted and not yet archived; null when Redis is unreachable'),
});

const pastDiscussion = z.strictObject({
  topic: z.string(),
  description: z.string(),
  direction: z.string(),
  last_discussed: z.string(),
});
const currentDiscussion = z.strictObject({
  topic: z.string(),
  description: z.string(),
  perspectives: z.string(),
  direction: z.string(),
});
export const summaryDocument = z.strictObject({
  key_decisions: z.array(z.string()).describe('"Do: …" / "Don\'t: …" rules'),
  past_discussions: z.array(pastDiscussion),
  current_discussion: currentDiscussion,
});

const summaryViewShape = {
  summary: summaryDocument.nullable(),
  version: z.number().int(),
  cursor_seq: z.number().int().nullable(),
  status: z.string(),
  updated_at: isoTime.nullable(),
  failures: z.number().int().optional(),
  last_error: z.string().nullable().optional(),
  next_attempt_at: isoTime.nullable().optional(),
};
export const summaryView = z.strictObject(summaryViewShape);

export const summarizeQueued = z.strictObject({ job_id: z.string() });
export const summarizeDone = z.strictObject({ job_id: z.string(), outcome: z.string(), ...summaryViewShape });

export const usageAnswer = z.strictObject({
  window: z.enum(['24h', '7d', '28d']),
  rows: z.array(
    z.strictObject({
      purpose: z.string(),
      model: z.string(),
      calls: z.number().int(),
      input_tokens: z.number().int(),
      output_tokens: z.number().int(),
    }),
  ),
});

export const resetAnswer = z.strictObject({
  session_id: z.string(),
  reset: z.literal(true),
  summary_kept: z.boolean(),
});

export const importAnswer = z.strictObject({
  session_id: z.string(),
  imported: z.number().int(),
  first_seq: z.number().int().nullable(),
  last_seq: z.number().int().nullable(),
  summary: z
    .strictObject({
      restored: z.literal(true),
      version: z.number().int(),
      cursor_seq: z.number().int().nullable(),
    })
    .nullable(),
});

const chatMessage = z.strictObject({
  role,
  content,
  name: z.string().optional(),
  tool_calls: z.array(toolCall).optional(),
  tool_call_id: z.string().optional(),
});

export const contextAnswer = z.strictObject({
  messages: z.array(chatMessage).describe('ready to send to an OpenAI-style chat API'),
  system_block: z.string().describe('append to your own system prompt (empty without a summary)'),
  summary: z
    .strictObject({
      key_decisions: z.array(z.string()),
      past_discussions: z.array(pastDiscussion),
      current_discussion: currentDiscussion.optional(),
    })
    .nullable(),
  summary_version: z.number().int(),
  window: z.strictObject({ from_seq: z.number().int().nullable(), to_seq: z.number().int().nullable() }),
  relevance: z.enum(['filtered', 'all', 'none']),
});

export const searchAnswer = z.strictObject({
  hits: z.array(
    z.strictObject({
      seq: z.number().int(),
      id: z.string(),
      role,
      content,
      sent_at: isoTime,
      score: z.number(),
      source: z.enum(['archive', 'recent', 'both']),
      context: z.array(storedMessage),
    }),
  ),
});

export const toolList = z.strictObject({
  tools: z.array(
    z.strictObject({
      type: z.literal('function'),
      function: z.strictObject({
        name: z.string(),
        description: z.string(),
        parameters: z.record(z.string(), z.unknown()),
        strict: z.boolean().optional(),
      }),
    }),
  ),
});

export const toolAnswer = z.strictObject({
  content: z.string().describe('the text to send back to the model as the tool message'),
});

const errorRecord = z.strictObject({
  id: z.string(),
  tool_name: z.string(),
  symptom: z.string(),
  cause: z.string().nullable(),
  action: z.string(),
  outcome: z.enum(['resolved', 'failed', 'abandoned']),
  keywords: z.array(z.string()),
  hits: z.number().int(),
  created_at: isoTime,
  last_hit_at: isoTime,
});
export { errorRecord };

export const errorWriteAnswer = z.strictObject({ id: z.string(), deduplicated: z.boolean() });
export const errorSearchAnswer = z.strictObject({ records: z.array(errorRecord) });
export const errorLookupAnswer = z.strictObject({
  related_errors: z.string(),
  records: z.array(errorRecord),
});
export const errorListAnswer = z.strictObject({ records: z.array(errorRecord), next: nextCursor('records') });
export const errorPurgeAnswer = z.strictObject({ deleted: z.number().int() });

export const tenantCreated = z.strictObject({
  tenant_id: z.string(),
  api_key: z.string().describe('shown once'),
});
export const tenantListAnswer = z.strictObject({
  tenants: z.array(
    z.strictObject({
      tenant_id: z.string(),
      name: z.string(),
      created_at: isoTime,
      erasing_at: isoTime
        .nullable()
        .describe('when its erasure started (unfinished: a worker resumes it); null for a live tenant'),
    }),
  ),
  next: nextCursor('tenants'),
});
export const summaryRetryAnswer = z.strictObject({
  sessions: z.number().int().describe('failed or stalled summaries now due at the next sweep'),
});
export const keyCreated = z.strictObject({
  key_id: z.string(),
  tenant_id: z.string(),
  api_key: z.string().describe('shown once'),
});
export const keyListAnswer = z.strictObject({
  keys: z.array(
    z.strictObject({
      key_id: z.string(),
      tenant_id: z.string(),
      name: z.string(),
      created_at: isoTime,
      last_used_at: isoTime.nullable(),
      revoked_at: isoTime.nullable(),
    }),
  ),
  next: nextCursor('keys'),
});

export const healthAnswer = z.strictObject({ status: z.literal('ok') });
export const readyAnswer = z.strictObject({
  status: z.enum(['ready', 'not_ready']),
  checks: z.record(z.string(), z.string()),
});
export const jobAnswer = z.strictObject({
  id: z.string(),
  queue: z.string(),
  name: z.string(),
  state: z.string(),
  attempts: z.number().int(),
  failed_reason: z.string().nullable(),
  created_at: isoTime,
  finished_at: isoTime.nullable(),
  result: z.unknown().describe("the job's result once completed, else null"),
});

export const errorAnswer = z.strictObject({
  error: z.strictObject({ code: z.string(), message: z.string(), details: z.unknown() }),
});

export const openapiDocument = z.record(z.string(), z.unknown()).describe('this OpenAPI 3.1 document');
