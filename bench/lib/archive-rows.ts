/**
 * Archive rows built exactly as the ingest worker builds them (`toArchiveRow` of
 * workers/ingest.ts), from messages validated by the API's own `parseMessages`.
 */
import type { ArchiveInsertRow } from '../../db/queries/messages.js';
import type { AcceptedMessage } from '../../services/messages/message-input.js';
import { toArchiveRow } from '../../workers/ingest.js';

/** Rows for messages that take seq numbers firstSeq, firstSeq + 1, … */
export function archiveRows(messages: AcceptedMessage[], firstSeq: number): ArchiveInsertRow[] {
  return messages.map((m, i) => toArchiveRow(firstSeq + i, m));
}
