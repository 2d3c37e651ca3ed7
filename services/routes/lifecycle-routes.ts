import { Router } from 'express';
import { importAnswer, resetAnswer } from '../openapi-responses.js';
import type { Request, Response } from 'express';
import { z } from 'zod';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound } from '../errors.js';
import { recheckKey } from '../auth.js';
import { openSessionExport } from '../lifecycle/export-session.js';
import {
  MAX_IMPORT_BYTES,
  parseImportJson,
  parseImportLines,
  readJsonLines,
} from '../lifecycle/import-input.js';
import type { ImportInput } from '../lifecycle/import-input.js';
import { importSession, sortForImport } from '../lifecycle/import-session.js';
import { clearSession } from '../lifecycle/session-lifecycle.js';
import type { ExtensionList } from '../lifecycle/session-lifecycle.js';
import { confirmArchived, waitArchived, waitSignal } from '../messages/accept-messages.js';
import { assertSessionId, messageSchema } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { assertNoBody, noQuery, parseInput } from '../validate.js';

/**
 * The request's bytes, as the client sends them. A client that goes away mid-body makes the stream
 * fail with ECONNRESET, which the error handler would read as Postgres being down: it is the
 * client's doing, a 400 (that nobody receives) logged as such.
 */
async function* clientBody(req: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  try {
    for await (const chunk of req) yield chunk;
  } catch {
    throw new AppError(400, 'request_aborted', 'request aborted by the client');
  }
}

/** How long an import waits for its messages to be durable before answering 202 instead of 201. */
const IMPORT_WAIT_MS = 60_000;
/**
 * Imports at a time per API process. An import holds every message of its body, validated, until
 * they are staged in timestamp order: about seven times the body (a 200,000-line import of 39 MB
 * grew the process by 260 MB), so eight at once could take gigabytes. One more waits up to
 * IMPORT_SLOT_WAIT_MS for a slot, its body unread, then answers 503 `import_busy`.
 */
export const IMPORT_SLOTS = 2;
const IMPORT_SLOT_WAIT_MS = 10_000;

/** A counting semaphore whose `acquire` gives up after `waitMs` (false). */
function slots(size: number) {
  let used = 0;
  const waiting: Array<() => void> = [];
  return {
    acquire(waitMs: number): Promise<boolean> {
      if (used < size) {
        used++;
        return Promise.resolve(true);
      }
      return new Promise((resolve) => {
        const grant = () => {
          clearTimeout(timer);
          used++;
          resolve(true);
        };
        const timer = setTimeout(() => {
          waiting.splice(waiting.indexOf(grant), 1);
          resolve(false);
        }, waitMs);
        waiting.push(grant);
      });
    },
    release(): void {
      used--;
      waiting.shift()?.();
    },
  };
}
const JSON_LINES = ['application/x-ndjson', 'application/jsonl'];

const resetQuery = z.object({ keep_summary: z.enum(['true', 'false']).optional() }).strict();
const importQuery = z.object({ wait: z.enum(['true', 'false']).optional() }).strict();

export const lifecycleRoutesMeta: Record<string, RouteMeta> = {
  'POST /:sid/reset': {
    summary:
      'Clear the archive, recent vectors, cutoff and pending messages; the summary and its cursor survive unless ?keep_summary=false (seq continues)',
    query: resetQuery,
    responses: { 200: resetAnswer },
  },
  'DELETE /:sid': {
    summary:
      "Delete the session's messages, vectors, summary and queued work (Postgres and Redis); usage keeps its counts",
    success: 204,
  },
  'GET /:sid/export': {
    summary:
      'The whole session as JSON Lines (application/x-ndjson): message lines in seq order, then the summary line',
    produces: 'application/x-ndjson',
  },
  'POST /:sid/import': {
    summary:
      'Import past messages (JSON Lines with an optional summary line, or {"messages":[...]}) into an empty session, archived in sent_at order; 201 once durable (202 with ?wait=false or on timeout)',
    body: z.object({ messages: z.array(messageSchema) }),
    bodyTypes: ['application/json', 'application/x-ndjson', 'application/jsonl'],
    query: importQuery,
    responses: { 201: importAnswer, 202: importAnswer },
    success: [201, 202],
  },
};

async function drained(res: Response): Promise<void> {
  await new Promise<void>((resolve) => {
    const done = () => {
      res.off('drain', done);
      res.off('close', done);
      resolve();
    };
    res.on('drain', done);
    res.on('close', done);
  });
}

export function makeLifecycleRoutes(deps: CoreDeps, ctx: { extensions: ExtensionList }): Router {
  const router = Router();

  router.post('/:sid/reset', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(resetQuery, req.query, 'query');
    // Its option is a query parameter: `{"keep_summary":false}` in a body would otherwise be
    // ignored and the summary kept against the caller's intent.
    assertNoBody(req.body, 'reset takes no body: pass options in the query (?keep_summary=false)');
    const tenantId = res.locals.tenantId as string;
    const keepSummary = q.keep_summary !== 'false';
    const r = await clearSession(deps, ctx.extensions, tenantId, sid, { kind: 'reset', keepSummary });
    if (r.kind !== 'done') throw notFound('session');
    res.json({ session_id: sid, reset: true, summary_kept: r.summaryKept });
  });

  router.delete('/:sid', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    // Options a client believes it sends (`{"keep_archive":true}`) are refused, not ignored: this
    // deletes everything.
    assertNoBody(req.body, 'delete takes no body and no options: it removes the whole session', {
      strict: true,
    });
    const tenantId = res.locals.tenantId as string;
    const r = await clearSession(deps, ctx.extensions, tenantId, sid, { kind: 'delete' });
    if (r.kind !== 'done') throw notFound('session');
    res.status(204).end();
  });

  router.get('/:sid/export', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const lines = await openSessionExport(deps.db, tenantId, sid);
    if (!lines) throw notFound('session');
    res.status(200);
    res.setHeader('content-type', 'application/x-ndjson; charset=utf-8');
    res.setHeader('content-disposition', `attachment; filename="${sid}.jsonl"`);
    try {
      for await (const line of lines) {
        if (res.destroyed) break;
        if (!res.write(line)) await drained(res);
      }
      if (!res.destroyed) res.end();
    } catch (err) {
      // Headers are out: a truncated body must not look complete, so the connection is cut.
      deps.logger.warn({ err: { message: (err as Error).message } }, 'export failed midway');
      res.destroy(err as Error);
    }
  });

  const importSlots = slots(IMPORT_SLOTS);
  router.post('/:sid/import', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(importQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    if (!(await importSlots.acquire(IMPORT_SLOT_WAIT_MS))) {
      if (!req.complete) res.setHeader('connection', 'close');
      throw new AppError(
        503,
        'import_busy',
        `${IMPORT_SLOTS} imports are running in this process: retry`,
        { limit: IMPORT_SLOTS },
        { 'retry-after': '5' },
      );
    }
    try {
      await importInSlot(req, res, sid, q, tenantId);
    } finally {
      importSlots.release();
    }
  });

  async function importInSlot(
    req: Request,
    res: Response,
    sid: string,
    q: z.output<typeof importQuery>,
    tenantId: string,
  ): Promise<void> {
    let input: ImportInput;
    if (req.is(JSON_LINES)) {
      const encoding = req.headers['content-encoding'];
      if (encoding && encoding !== 'identity') {
        throw new AppError(415, 'unsupported_encoding', 'send JSON Lines uncompressed');
      }
      try {
        input = await parseImportLines(
          readJsonLines(clientBody(req), MAX_IMPORT_BYTES),
          deps.config.timeZone,
        );
        // The body is read here, after the check that follows a JSON body (auth.ts).
        await recheckKey(res, tenantId);
      } catch (err) {
        // The rest of the body is not read: tell the client this connection is done.
        if (!req.complete) res.setHeader('connection', 'close');
        throw err;
      }
    } else {
      input = parseImportJson(req.body, deps.config.timeZone);
    }
    const outcome = await importSession(deps, tenantId, sid, input);
    let durable = true;
    if (outcome.last_seq !== null) {
      durable =
        q.wait === 'false'
          ? false
          : await waitArchived(deps, tenantId, sid, outcome.last_seq, IMPORT_WAIT_MS, waitSignal(res));
      // The seqs as importSession handed them out (its order), checked against the archive.
      const first = outcome.first_seq!;
      const acknowledged = sortForImport(input.messages).map((m, i) => ({
        id: m.message.id,
        seq: first + i,
      }));
      if (durable) await confirmArchived(deps, tenantId, sid, acknowledged);
    }
    res.status(durable ? 201 : 202).json(outcome);
  }

  return router;
}
