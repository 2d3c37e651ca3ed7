import { Router } from 'express';
import { messagePage, postMessagesAnswer, sessionInfo, sessionList } from '../openapi-responses.js';
import { z } from 'zod';
import { pageSessionMessages } from '../../db/queries/messages.js';
import type { StoredMessageRow } from '../../db/queries/messages.js';
import { getSession, listSessions } from '../../db/queries/sessions.js';
import { getSummaryState } from '../../db/queries/summaries.js';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound } from '../errors.js';
import { acceptMessages, confirmArchived, waitArchived, waitSignal } from '../messages/accept-messages.js';
import { inboxKeys } from '../messages/inbox.js';
import {
  MAX_MESSAGES_PER_REQUEST,
  SESSION_ID_RE,
  assertSessionId,
  messageSchema,
  parseMessages,
} from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { nsToRfc3339 } from '../time.js';
import { emptyAsAbsent, limitParam, listQuery, noQuery, pageOf, parseInput } from '../validate.js';

/** The sessions list's cursor is the id of the previous page's last session (ids sort as text). */
const sessionListQuery = listQuery.refine((q) => q.cursor === undefined || SESSION_ID_RE.test(q.cursor), {
  message: 'cursor must be a session id (the `next` of the previous page)',
  path: ['cursor'],
});

const WAIT_TIMEOUT_MS = 10_000;

// Empty is absent, on every parameter of the list: README's `?after_seq=&before_seq=&limit=&order=`
// typed as it reads.
const seqParam = z
  .string()
  .regex(/^(\d{1,15})?$/, 'must be a non-negative integer of at most 15 digits')
  .transform((v) => (v === '' ? undefined : Number(v)));
const postQuery = z.object({ wait: z.enum(['true', 'false']).optional() }).strict();
const pageQuery = z
  .object({
    after_seq: seqParam.optional(),
    before_seq: seqParam.optional(),
    limit: limitParam.optional(),
    order: z.enum(['asc', 'desc', '']).optional().transform(emptyAsAbsent),
    // Read like a seq (empty is absent): a generation counts resets and deletes, far below 15 digits.
    generation: seqParam
      .optional()
      .describe(
        "the `generation` of the listing's first page: a page of a session reset or deleted since answers 409 session_changed",
      ),
  })
  .strict();

export interface StoredMessage {
  id: string;
  seq: number;
  role: string;
  content: unknown;
  name?: string;
  tool_call_id?: string;
  tool_calls?: unknown[];
  metadata?: Record<string, unknown>;
  sent_at: string;
  sent_at_ns: string;
}

/** Archive row → the API's StoredMessage (content in its original form: text or parts). */
export function toStoredMessage(r: StoredMessageRow): StoredMessage {
  const m: StoredMessage = {
    id: r.id,
    seq: Number(r.seq),
    role: r.role,
    content: r.parts ?? r.content,
    sent_at: nsToRfc3339(r.sent_at_ns),
    sent_at_ns: r.sent_at_ns,
  };
  if (r.name !== null) m.name = r.name;
  if (r.tool_call_id !== null) m.tool_call_id = r.tool_call_id;
  if (r.tool_calls !== null) m.tool_calls = r.tool_calls;
  if (r.metadata !== null) m.metadata = r.metadata;
  return m;
}

export const sessionRoutesMeta: Record<string, RouteMeta> = {
  'POST /:sid/messages': {
    summary: 'Append messages (202 accepted; 201 durable with ?wait=true)',
    body: z.object({ messages: z.array(messageSchema).min(1).max(MAX_MESSAGES_PER_REQUEST) }),
    query: postQuery,
    success: [202, 201],
    responses: { 202: postMessagesAnswer, 201: postMessagesAnswer },
  },
  'GET /:sid/messages': {
    summary: 'Page through the archive in seq order',
    query: pageQuery,
    responses: { 200: messagePage },
  },
  'GET /': { summary: 'List sessions', query: sessionListQuery, responses: { 200: sessionList } },
  'GET /:sid': { summary: 'Session counters, cutoff and summary state', responses: { 200: sessionInfo } },
};

export function makeSessionRoutes(deps: CoreDeps): Router {
  const router = Router();

  router.post('/:sid/messages', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(postQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const messages = parseMessages(req.body, deps.config.timeZone);
    const { outcome, archived } = await acceptMessages(deps, tenantId, sid, messages);
    if (q.wait === 'true') {
      // A re-post of archived ids is durable already: after Redis lost its state no archived mark
      // would ever reach them (nothing seeds it for a request that never touches the inbox), and
      // the recovery re-post the README recommends waited 10 s for a 202.
      const maxSeq = Math.max(...outcome.messages.map((m) => m.seq));
      const durable =
        archived ||
        ((await waitArchived(deps, tenantId, sid, maxSeq, WAIT_TIMEOUT_MS, waitSignal(res))) &&
          (await confirmArchived(deps, tenantId, sid, outcome.messages)));
      res.status(durable ? 201 : 202).json(outcome);
      return;
    }
    res.status(202).json(outcome);
  });

  router.get('/:sid/messages', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(pageQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const limit = q.limit ?? 100;
    const desc = q.order === 'desc';
    const read = await pageSessionMessages(deps.db, {
      tenantId,
      sessionId: sid,
      afterSeq: q.after_seq ?? null,
      beforeSeq: q.before_seq ?? null,
      limit: limit + 1,
      desc,
    });
    if (!read) throw notFound('session');
    // Seqs have gaps, so a listing that crossed a reset or delete (and re-creation) read on into
    // the new session's messages with nothing to tell it: the generation its first page carried
    // tells it, as export does.
    if (q.generation !== undefined && q.generation !== read.generation) {
      throw new AppError(
        409,
        'session_changed',
        `the session is at generation ${read.generation}, not ${q.generation}: it was reset or deleted since ` +
          'the first page of this listing (or never had that generation); list it again from the start',
      );
    }
    // A page also ends at PAGE_MAX_BYTES of messages: `next` then continues after the last shown.
    const page = pageOf(read.rows, limit);
    const messages = page.items.map(toStoredMessage);
    const last = messages[messages.length - 1];
    res.json({
      messages,
      next: (page.more || read.cut) && last ? last.seq : null,
      generation: read.generation,
    });
  });

  router.get('/', async (req, res) => {
    const q = parseInput(sessionListQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const limit = q.limit ?? 100;
    const page = pageOf(await listSessions(deps.db, tenantId, q.cursor ?? null, limit + 1), limit);
    const rows = page.items;
    const last = rows[rows.length - 1];
    res.json({
      sessions: rows.map((s) => ({
        id: s.id,
        message_count: s.message_count,
        created_at: s.created_at.toISOString(),
        last_message_at: s.last_message_at?.toISOString() ?? null,
      })),
      next: page.more && last ? last.id : null,
    });
  });

  router.get('/:sid', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    // The inbox first: a drain trims it only after its commit, so when `pending_jobs` reads 0 the
    // counters read next include every message accepted before this request. (Read the other way
    // round, a drain committing in between showed 0 pending and 0 archived.)
    const pending = await deps.redis
      .llen(inboxKeys(deps.config.prefix, tenantId, sid).inbox)
      .catch(() => null);
    const s = await getSession(deps.db, tenantId, sid);
    if (!s) throw notFound('session');
    const sum = await getSummaryState(deps.db, tenantId, sid);
    res.json({
      id: s.id,
      message_count: s.message_count,
      hot_bytes: Number(s.hot_bytes),
      start_seq: Number(s.start_seq),
      start_at: s.start_at_ns ? nsToRfc3339(s.start_at_ns) : null,
      last_message_at: s.last_message_at?.toISOString() ?? null,
      created_at: s.created_at.toISOString(),
      summary: sum
        ? {
            version: sum.version,
            cursor_seq: sum.cursor_seq === null ? null : Number(sum.cursor_seq),
            status: sum.status,
          }
        : null,
      pending_jobs: pending,
    });
  });

  return router;
}
