import { randomUUID } from 'node:crypto';
import {
  summarizeDone,
  summarizeQueued,
  summaryView as summaryViewAnswer,
  usageAnswer,
} from '../openapi-responses.js';
import { Router } from 'express';
import type { Response } from 'express';
import { z } from 'zod';
import { getSession } from '../../db/queries/sessions.js';
import { getSummaryRow } from '../../db/queries/summaries.js';
import type { SummaryRow } from '../../db/queries/summaries.js';
import { usageByWindow } from '../../db/queries/usage.js';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound, unavailable } from '../errors.js';
import { waitSignal } from '../messages/accept-messages.js';
import { assertSessionId, sessionIdField } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { enqueueSummarize } from '../summary/enqueue-summarize.js';
import { assertNoBody, emptyAsAbsent, noQuery, parseInput } from '../validate.js';

/** How long `POST …/summarize?wait=true` waits before answering 202 with the job id. */
export const SUMMARIZE_WAIT_MS = 60_000;

/** Job states of a run that has not read the archive yet: joining it includes this request. */
const NOT_STARTED = new Set(['waiting', 'prioritized', 'delayed', 'waiting-children']);

const WINDOWS = { '24h': 24, '7d': 24 * 7, '28d': 24 * 28 } as const;

const summarizeQuery = z.object({ wait: z.enum(['true', 'false']).optional() }).strict();
// Empty is absent, as on the lists: README's `?window=24h&session_id=` typed as it reads.
const usageQuery = z
  .object({
    window: z.enum(['24h', '7d', '28d', '']).optional().transform(emptyAsAbsent),
    session_id: z
      .union([z.literal(''), sessionIdField])
      .optional()
      .transform(emptyAsAbsent),
  })
  .strict();

export const summaryRoutesMeta: Record<string, RouteMeta> = {
  'GET /:sid/summary': {
    summary: "The session's rolling summary, its version, cursor and status (404 when none)",
    responses: { 200: summaryViewAnswer },
  },
  'POST /:sid/summarize': {
    summary:
      'Summarise now (202 with the job id; ?wait=true waits for the result). 409 when no LLM is configured',
    query: summarizeQuery,
    success: [202, 200],
    responses: { 202: summarizeQueued, 200: summarizeDone },
  },
};

export const usageRoutesMeta: Record<string, RouteMeta> = {
  'GET /': {
    summary: 'LLM usage by purpose and model over a window (24h, 7d, 28d), optionally for one session',
    query: usageQuery,
    responses: { 200: usageAnswer },
  },
};

function tenantOf(res: Response): string {
  const t: unknown = res.locals.tenantId;
  if (typeof t !== 'string' || t === '') throw new Error('summary routes mounted without auth');
  return t;
}

/** The API view of a summary row. Version 0 is a placeholder: no summary text yet. */
export function summaryView(row: SummaryRow) {
  return {
    summary: row.version > 0 ? row.summary : null,
    version: row.version,
    cursor_seq: row.cursor_seq === null ? null : Number(row.cursor_seq),
    status: row.status,
    updated_at: row.updated_at.toISOString(),
    failures: row.failures,
    last_error: row.last_error,
    next_attempt_at: row.next_attempt_at?.toISOString() ?? null,
  };
}

const redisDown = () => unavailable('redis');

export function makeSummaryRoutes(deps: CoreDeps): Router {
  const router = Router();
  const queue = deps.queues.summary;

  router.get('/:sid/summary', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    const tenantId = tenantOf(res);
    if (!(await getSession(deps.db, tenantId, sid))) throw notFound('summary');
    const row = await getSummaryRow(deps.db, tenantId, sid);
    if (!row) throw notFound('summary');
    if (row.version === 0) {
      // A placeholder (no summary text yet: first runs failed, or everything so far was noise) is
      // no summary (SPEC: 404 when none); its state stays visible in the error's details.
      const { summary: _, ...state } = summaryView(row);
      throw new AppError(404, 'not_found', 'summary not found (no summary text yet)', state);
    }
    res.json(summaryView(row));
  });

  /**
   * Polls a job until it completes or fails; null on deadline, or once `signal` fires (the process
   * is shutting down: the request answers its 202 before its connection is cut). A vanished job
   * (removed by an operator in Bull Board) ends the wait with no result. `deadline` is on the
   * performance.now() clock.
   */
  async function finished(
    id: string,
    deadline: number,
    signal: AbortSignal,
  ): Promise<{ state: string; result: unknown } | null> {
    let delay = 25;
    for (;;) {
      // State first, then the job: a job read before it completed has no return value yet.
      const state = await queue.getJobState(id).catch(() => {
        throw redisDown();
      });
      if (state === 'unknown') return { state, result: null };
      if (state === 'completed') {
        const job = await queue.getJob(id).catch(() => {
          throw redisDown();
        });
        return { state, result: job?.returnvalue ?? null };
      }
      if (state === 'failed') return { state, result: null };
      if (performance.now() + delay > deadline || signal.aborted) return null;
      await new Promise((r) => setTimeout(r, delay));
      delay = Math.min(delay * 2, 250);
    }
  }

  router.post('/:sid/summarize', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(summarizeQuery, req.query, 'query');
    assertNoBody(req.body, 'summarize takes no body: pass options in the query (?wait=true)');
    const tenantId = tenantOf(res);
    if (!(await getSession(deps.db, tenantId, sid))) throw notFound('session');
    if (!deps.llm) {
      throw new AppError(
        409,
        'llm_not_configured',
        'no LLM is configured (set OPENAI_API_KEY or OPENAI_BASE_URL): summaries are disabled',
      );
    }
    // A fresh id per add: the follow-up a join leaves is queued under the id of its add, and a
    // second add of this request (below) must not name a job that has already run.
    const enqueue = (requestId: string) =>
      enqueueSummarize(deps, tenantId, sid, 'api', requestId).catch(() => {
        throw redisDown();
      });
    const requestId = randomUUID();
    const first = await enqueue(requestId);
    let id = first.id;
    if (q.wait !== 'true') {
      res.status(202).json({ job_id: `summary.${id}` });
      return;
    }
    // Monotonic (performance.now()): a wall clock stepped back would hold the wait for as long.
    const deadline = performance.now() + SUMMARIZE_WAIT_MS;
    const signal = waitSignal(res);
    // Joined a run that had started: it may have read the archive before this request, so wait
    // for it and then run once more to include everything archived now (joining the follow-up
    // the first add left, when it has not started yet). One that has started
    // includes one that ended between the add and this look (only `active` was taken for started,
    // and that run's result came back as this request's answer), and one already gone.
    const existing = first.job;
    const joined = id !== requestId;
    const started =
      joined && !NOT_STARTED.has(existing ? await existing.getState().catch(() => 'unknown') : 'unknown');
    if (started) {
      if (!(await finished(id, deadline, signal))) {
        res.status(202).json({ job_id: `summary.${id}` });
        return;
      }
      id = (await enqueue(randomUUID())).id;
    }
    const done = await finished(id, deadline, signal);
    if (!done) {
      res.status(202).json({ job_id: `summary.${id}` });
      return;
    }
    const outcome =
      done.state === 'failed' ? 'failed' : (done.result as { outcome?: string } | null)?.outcome;
    // Deleted while it ran: the run's work was dropped and there is no session to describe.
    if (!(await getSession(deps.db, tenantId, sid))) throw notFound('session');
    // The job was removed (Bull Board's remove, clean, empty or obliterate) before it ended: there
    // is no result to report. Answered 200 `"outcome": "unknown"` with whatever summary was there,
    // which read as a run that had happened; the 202 says, as on timeout, that it is not known.
    if (outcome === undefined) {
      res.status(202).json({ job_id: `summary.${id}` });
      return;
    }
    const row = await getSummaryRow(deps.db, tenantId, sid);
    res.status(200).json({
      job_id: `summary.${id}`,
      outcome,
      ...(row
        ? summaryView(row)
        : { summary: null, version: 0, cursor_seq: null, status: 'ok', updated_at: null }),
    });
  });

  return router;
}

export function makeUsageRoutes(deps: CoreDeps): Router {
  const router = Router();
  router.get('/', async (req, res) => {
    const q = parseInput(usageQuery, req.query, 'query');
    const window = q.window ?? '24h';
    const rows = await usageByWindow(deps.db, tenantOf(res), WINDOWS[window], q.session_id ?? null);
    res.json({ window, rows });
  });
  return router;
}
