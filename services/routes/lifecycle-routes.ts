import { Router } from 'express';
import { importAnswer, resetAnswer } from '../openapi-responses.js';
import type { Request, Response } from 'express';
import { z } from 'zod';
import type { CoreDeps } from '../deps.js';
import { AppError, notFound } from '../errors.js';
import { recheckKey } from '../auth.js';
import { openSessionExport, SessionChangedError } from '../lifecycle/export-session.js';
import { MAX_BODY_BYTES } from '../app.js';
import { byteBudget } from '../byte-budget.js';
import type { ByteBudget } from '../byte-budget.js';
import {
  MAX_IMPORT_BYTES,
  clientBody,
  decodedBody,
  parseImportJson,
  parseImportLines,
  readJsonLines,
} from '../lifecycle/import-input.js';
import type { ImportInput } from '../lifecycle/import-input.js';
import { importSession, sortForImport } from '../lifecycle/import-session.js';
import type { ImportOutcome } from '../lifecycle/import-session.js';
import { clearSession } from '../lifecycle/session-lifecycle.js';
import type { ExtensionList } from '../lifecycle/session-lifecycle.js';
import { confirmArchived, waitArchived, waitSignal } from '../messages/accept-messages.js';
import { assertSessionId, messageSchema } from '../messages/message-input.js';
import type { RouteMeta } from '../openapi.js';
import { assertNoBody, noQuery, parseInput } from '../validate.js';

/** How long an import waits for its messages to be durable before answering 202 instead of 201. */
const IMPORT_WAIT_MS = 60_000;
/**
 * Import memory per API process, in imports' worth. An import holds every message of its body,
 * validated, until they are staged in timestamp order: about seven times the body (a
 * 200,000-line import of 39 MB grew the process by 260 MB). So the process holds at most
 * IMPORT_SLOTS × MAX_IMPORT_BYTES of import bodies at once, a tenant at most MAX_IMPORT_BYTES
 * of them. A JSON Lines import takes its share as its bytes arrive (decoded): taken before it
 * read its body, two slow senders held both of two slots for two minutes and every other
 * tenant's import got 503s. A JSON import takes a JSON body's limit once its body is read.
 * One that finds no room waits up to IMPORT_SLOT_WAIT_MS for it, then answers 503 `import_busy`.
 */
export const IMPORT_SLOTS = 2;
const IMPORT_SLOT_WAIT_MS = 10_000;
/**
 * Exports at a time per API process. Each reads the archive a page at a time (a pool connection,
 * up to 4 MiB and a message in memory): 600 at once took the whole Postgres pool (285 answered
 * 503 "postgres is unavailable") and the heap. A tenant holds at most half of them, as it does of
 * the import and body memory: one tenant's four slow readers held every slot for as long as they
 * liked, and every other tenant's export answered 503. One more waits up to EXPORT_SLOT_WAIT_MS
 * for a slot, then answers 503 `export_busy`.
 */
export const EXPORT_SLOTS = 4;
const EXPORT_SLOTS_PER_TENANT = EXPORT_SLOTS / 2;
const EXPORT_SLOT_WAIT_MS = 5_000;

/** No room came: the tenant's own share (one import's worth) or the whole process's was held. */
const importBusy = (full: 'key' | 'total') =>
  full === 'key'
    ? new AppError(
        503,
        'import_busy',
        "this tenant's other imports hold its share of this process's import memory (one import's " +
          'worth): retry when one ends',
        { limit: 1, scope: 'tenant' },
        { 'retry-after': '5' },
      )
    : new AppError(
        503,
        'import_busy',
        `imports hold this process's import memory (${IMPORT_SLOTS} imports' worth): retry`,
        { limit: IMPORT_SLOTS, scope: 'process' },
        { 'retry-after': '5' },
      );

/** No slot came: the tenant's own share of this process's exports, or every slot, was held. */
const exportBusy = (full: 'key' | 'total') =>
  full === 'key'
    ? new AppError(
        503,
        'export_busy',
        `${EXPORT_SLOTS_PER_TENANT} exports of this tenant are running in this process (its share): retry when one ends`,
        { limit: EXPORT_SLOTS_PER_TENANT, scope: 'tenant' },
        { 'retry-after': '5' },
      )
    : new AppError(
        503,
        'export_busy',
        `${EXPORT_SLOTS} exports are running in this process: retry`,
        { limit: EXPORT_SLOTS, scope: 'process' },
        { 'retry-after': '5' },
      );

/** One import's part of the budget: taken as it grows, all given back by `release`. */
function importShare(budget: ByteBudget, tenantId: string) {
  let held = 0;
  const take = async (bytes: number) => {
    // Past MAX_IMPORT_BYTES the reader refuses the import (413): no room is asked for that.
    const n = Math.min(bytes, MAX_IMPORT_BYTES - held);
    if (n <= 0) return;
    const got = await budget.take(tenantId, n, IMPORT_SLOT_WAIT_MS);
    if (got !== true) throw importBusy(got);
    held += n;
  };
  return {
    take,
    /** The body, each chunk passed on once its room is taken. */
    async *metered(body: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
      for await (const chunk of body) {
        await take(chunk.length);
        yield chunk;
      }
    },
    release(): void {
      budget.give(tenantId, held);
      held = 0;
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
    body: z.object({ messages: z.array(messageSchema).min(1) }).strict(),
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

  // A counting semaphore: a budget of EXPORT_SLOTS units, one per export, a tenant's own key.
  const exportSlots = byteBudget(EXPORT_SLOTS, EXPORT_SLOTS_PER_TENANT);
  router.get('/:sid/export', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    parseInput(noQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const got = await exportSlots.take(tenantId, 1, EXPORT_SLOT_WAIT_MS);
    if (got !== true) throw exportBusy(got);
    try {
      await exportInSlot(res, tenantId, sid);
    } finally {
      exportSlots.give(tenantId, 1);
    }
  });

  async function exportInSlot(res: Response, tenantId: string, sid: string): Promise<void> {
    const lines = await openSessionExport(deps.db, tenantId, sid);
    if (!lines) throw notFound('session');
    // The first page is read before the status line: its failure (Postgres down, a lock held
    // past PG_REQUEST_TIMEOUT_MS) is answered like any other error, where cutting the connection
    // left the client an empty reply. A reset or delete that lands while that page is read is
    // the client's to retry, not a fault of the service.
    let next = await lines.next().catch((err: unknown) => {
      if (!(err instanceof SessionChangedError)) throw err;
      throw new AppError(
        409,
        'session_changed',
        'the session was reset or deleted while its export began: export it again',
      );
    });
    res.status(200);
    res.setHeader('content-type', 'application/x-ndjson; charset=utf-8');
    res.setHeader('content-disposition', `attachment; filename="${sid}.jsonl"`);
    try {
      for (; !next.done && !res.destroyed; next = await lines.next()) {
        if (!res.write(next.value)) await drained(res);
      }
      if (!res.destroyed) res.end();
    } catch (err) {
      // Headers are out: a truncated body must not look complete, so the connection is cut.
      deps.logger.warn({ err: { message: (err as Error).message } }, 'export failed midway');
      res.destroy(err as Error);
    } finally {
      await lines.return(undefined).catch(() => undefined);
    }
  }

  const importMemory = byteBudget(IMPORT_SLOTS * MAX_IMPORT_BYTES, MAX_IMPORT_BYTES);
  router.post('/:sid/import', async (req, res) => {
    const sid = assertSessionId(req.params.sid!);
    const q = parseInput(importQuery, req.query, 'query');
    const tenantId = res.locals.tenantId as string;
    const share = importShare(importMemory, tenantId);
    let imported: Awaited<ReturnType<typeof importHeld>>;
    try {
      imported = await importHeld(req, res, sid, tenantId, share);
    } finally {
      // The messages are staged: waiting for them to be archived holds none of them.
      share.release();
    }
    const { outcome, acknowledged } = imported;
    let durable = true;
    if (outcome.last_seq !== null) {
      durable =
        q.wait === 'false'
          ? false
          : await waitArchived(deps, tenantId, sid, outcome.last_seq, IMPORT_WAIT_MS, waitSignal(res));
      if (durable) await confirmArchived(deps, tenantId, sid, acknowledged);
    }
    res.status(durable ? 201 : 202).json(outcome);
  });

  /** Reads, validates and stages the import within its share of the import memory. */
  async function importHeld(
    req: Request,
    res: Response,
    sid: string,
    tenantId: string,
    share: ReturnType<typeof importShare>,
  ): Promise<{ outcome: ImportOutcome; acknowledged: Array<{ id: string; seq: number }> }> {
    let input: ImportInput;
    if (req.is(JSON_LINES)) {
      try {
        // Left as it is when the reading stops (a refused line, past the limit): destroying the
        // request destroyed its connection, the client's bytes unread (a reset), where the error's
        // answer closes it once the client has it (sendError).
        const unread = req.iterator({ destroyOnReturn: false }) as AsyncIterable<Buffer>;
        const body = decodedBody(clientBody(unread), req.headers['content-encoding']);
        input = await parseImportLines(
          readJsonLines(share.metered(body), MAX_IMPORT_BYTES),
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
      await share.take(MAX_BODY_BYTES);
      input = await parseImportJson(req.body, deps.config.timeZone);
    }
    const outcome = await importSession(deps, tenantId, sid, input);
    // The seqs as importSession handed them out (its order), checked against the archive.
    const first = outcome.first_seq;
    const acknowledged =
      first === null
        ? []
        : sortForImport(input.messages).map((m, i) => ({ id: m.message.id, seq: first + i }));
    return { outcome, acknowledged };
  }

  return router;
}
