import type { Queryable } from '../../db/pool.js';
import { pageMessagesWithin } from '../../db/queries/messages.js';
import { getSession } from '../../db/queries/sessions.js';
import { getSummaryRow } from '../../db/queries/summaries.js';
import { toStoredMessage } from '../routes/session-routes.js';

/**
 * A session as JSON Lines (SPEC §4 export): one `{"type":"message", ...StoredMessage}` line per
 * archived message in seq order, then one `{"type":"summary", ...}` line when the session has a
 * summary. Pages through the archive by seq (keyset), at most EXPORT_PAGE messages and about
 * EXPORT_PAGE_BYTES of them a page, so memory stays flat for any session size and message size.
 * The export covers what was archived when it started; messages archived meanwhile are left out.
 * A reset or delete of the session while it runs removes rows not yet read: the pages would just
 * end early, and the body look complete. So the generation is checked after every page and after
 * the summary, and a change throws (the route then cuts the connection).
 */

export const EXPORT_PAGE = 500;

/**
 * A page ends at the message that takes its stored `bytes` to this (at least one message, so a page
 * holds under this plus one message of at most 1 MiB). By rows alone, a page of 500 messages of
 * 1 MiB held 500 MiB: 8 parallel exports of 500 messages of 100 KB grew the API by 316 MB. The
 * cut is decided on the `bytes` column; the content of messages past it is not read.
 */
export const EXPORT_PAGE_BYTES = 4 * 1024 * 1024;

export class SessionChangedError extends Error {}

export interface SummaryLine {
  type: 'summary';
  summary: unknown;
  version: number;
  cursor_seq: number | null;
  status: string;
  updated_at: string;
}

/** Null when the session does not exist for this tenant (or is deleted). */
export async function openSessionExport(
  db: Queryable,
  tenantId: string,
  sessionId: string,
  pageSize = EXPORT_PAGE,
  pageBytes = EXPORT_PAGE_BYTES,
): Promise<AsyncGenerator<string> | null> {
  const session = await getSession(db, tenantId, sessionId);
  if (!session) return null;
  const bound = Number(session.next_seq);
  const unchanged = async () => {
    const now = await getSession(db, tenantId, sessionId);
    if (now?.generation !== session.generation) {
      throw new SessionChangedError('the session was reset or deleted during the export');
    }
  };
  return (async function* lines() {
    let after: number | null = null;
    for (;;) {
      const { rows, cut } = await pageMessagesWithin(db, {
        tenantId,
        sessionId,
        afterSeq: after,
        beforeSeq: bound,
        limit: pageSize,
        desc: false,
        maxBytes: pageBytes,
      });
      await unchanged();
      for (const r of rows) yield `${JSON.stringify({ type: 'message', ...toStoredMessage(r) })}\n`;
      if (rows.length === 0 || (rows.length < pageSize && !cut)) break;
      after = Number(rows[rows.length - 1]!.seq);
    }
    const s = await getSummaryRow(db, tenantId, sessionId);
    await unchanged();
    // A version-0 row is a placeholder (cursor and failures, no summary yet): nothing to export.
    if (s && s.summary !== null && s.version > 0) {
      const line: SummaryLine = {
        type: 'summary',
        summary: s.summary,
        version: s.version,
        cursor_seq: s.cursor_seq === null ? null : Number(s.cursor_seq),
        status: s.status,
        updated_at: s.updated_at.toISOString(),
      };
      yield `${JSON.stringify(line)}\n`;
    }
  })();
}
