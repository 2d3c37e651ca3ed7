/**
 * Archive rows built exactly as the ingest worker builds them (workers/ingest.ts, drainSession:
 * `searchableText` → `ftsDocument` → ArchiveInsertRow), from messages validated by the API's own
 * `parseMessages`. Keep in step with workers/ingest.ts: a bench that writes different rows
 * measures something else. (The worker's helper is module-private, hence this copy.)
 */
import type { ArchiveInsertRow } from '../../db/queries/messages.js';
import type { AcceptedMessage } from '../../services/messages/message-input.js';
import { ftsDocument } from '../../services/text/fts-text.js';

function searchableText(m: AcceptedMessage): string {
  const calls = (m.tool_calls ?? []) as Array<{ function?: { name?: string; arguments?: string } }>;
  const callText = calls.map((c) => `${c.function?.name ?? ''} ${c.function?.arguments ?? ''}`).join('\n');
  return [m.name ?? '', m.content ?? '', callText].filter(Boolean).join('\n');
}

/** Rows for messages that take seq numbers firstSeq, firstSeq + 1, … */
export function archiveRows(messages: AcceptedMessage[], firstSeq: number): ArchiveInsertRow[] {
  return messages.map((m, i) => {
    const fts = ftsDocument(searchableText(m));
    return {
      seq: firstSeq + i,
      id: m.id,
      role: m.role,
      content: m.content,
      parts: m.parts,
      name: m.name,
      tool_call_id: m.tool_call_id,
      tool_calls: m.tool_calls,
      metadata: m.metadata,
      sent_at_ns: m.sent_at_ns,
      sent_at_given: m.sent_at_given,
      bytes: m.bytes,
      fingerprint: m.fp,
      fts_en: fts.en,
      fts_cjk: fts.cjk,
    };
  });
}
