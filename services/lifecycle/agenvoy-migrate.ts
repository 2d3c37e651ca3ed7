import { existsSync } from 'node:fs';
import path from 'node:path';
import { getSummaryRow } from '../../db/queries/summaries.js';
import type { CoreDeps } from '../deps.js';
import { AppError, asDependencyError } from '../errors.js';
import { findHistoryDb, listAgenvoySessions, readAgenvoySession } from './agenvoy-import.js';
import { importSession } from './import-session.js';
import { openSqlite } from './sqlite.js';
import type { SqliteDb } from './sqlite.js';

/** `mnemos import agenvoy <sessions_dir> --tenant`: every session directory, one report each. */

export interface AgenvoySessionReport {
  session_id: string;
  status: 'imported' | 'skipped' | 'failed';
  /** Why a skipped session was: mnemos already holds it (a re-run), or its files hold nothing. */
  skip_reason: 'session_exists' | 'nothing_to_import' | null;
  imported: number;
  from_history_json: number;
  from_history_db: number;
  duplicates_merged: number;
  messages_skipped: number;
  summary: { cursor_seq: number | null } | null;
  first_seq: number | null;
  last_seq: number | null;
  notes: string[];
}

export async function importAgenvoySessions(
  deps: Pick<CoreDeps, 'db' | 'redis' | 'config' | 'queues' | 'logger' | 'metrics'>,
  tenantId: string,
  sessionsDir: string,
  opts: { timeZone?: string; only?: string[] } = {},
): Promise<{
  historyDb: string | null;
  /** Directories that hold a session's files (or `only` names) but no valid session id. */
  invalidDirs: string[];
  /** `only` ids with no session directory. */
  missing: string[];
  /** Sessions history.db holds rows of but no directory exists for (within `only`): not imported. */
  historyDbOnly: string[];
  /** About the whole import (not one session), e.g. the sessions only history.db holds. */
  notes: string[];
  sessions: AgenvoySessionReport[];
  /**
   * Why the run stopped early: Postgres or Redis refused or could not be reached (the 503 a
   * request would get), so the sessions after the one that met it were not tried.
   */
  unavailable: string | null;
}> {
  const timeZone = opts.timeZone ?? deps.config.timeZone;
  const dir = path.resolve(sessionsDir);
  const { ids, invalid } = await listAgenvoySessions(dir);
  // A directory whose name is no session id is a session not imported when it looks like one
  // (it holds a file the import reads) or `only` names it; other directories (a backup, notes)
  // are no sessions. Such a session was reported "skipped" and the run exited 0.
  const sessionLike = invalid.filter((d) => SESSION_FILES.some((f) => existsSync(path.join(dir, d, f))));
  const invalidDirs = opts.only ? invalid.filter((d) => opts.only?.includes(d)) : sessionLike;
  // Pointed at the wrong folder (an empty one, a config dir holding only .store), the import reported
  // "imported 0 of 0 sessions" and exited 0: a migration script believed it had worked.
  if (ids.length === 0 && sessionLike.length === 0 && invalidDirs.length === 0) {
    throw new AppError(
      400,
      'no_sessions',
      `${dir} holds no session directories (Agenvoy keeps one per session: <sessions_dir>/<session id>/history.json); nothing imported`,
    );
  }
  const historyDb = findHistoryDb(dir);
  const db = historyDb ? openHistoryDb(historyDb) : null;
  const reports: AgenvoySessionReport[] = [];
  const notes: string[] = [];
  let historyDbOnly: string[] = [];
  let unavailable: string | null = null;
  try {
    if (db && historyDb) {
      // A session is a directory (its history.json, summary and cursor); history.db rows of a
      // session without one are not imported, but named so they are not lost unnoticed.
      const dirs = new Set([...ids, ...invalid]);
      historyDbOnly = dbSessionIds(db, historyDb).filter(
        (sid) => !dirs.has(sid) && (!opts.only || opts.only.includes(sid)),
      );
      if (historyDbOnly.length > 0) {
        const named = historyDbOnly.slice(0, MAX_NAMED);
        const more = historyDbOnly.length - named.length;
        notes.push(
          `history.db holds ${historyDbOnly.length} session(s) with no directory (${named.join(', ')}${more > 0 ? `, and ${more} more` : ''}): not imported`,
        );
      }
    }
    for (const sid of ids) {
      if (opts.only && !opts.only.includes(sid)) continue;
      const report: AgenvoySessionReport = {
        session_id: sid,
        status: 'failed',
        skip_reason: null,
        imported: 0,
        from_history_json: 0,
        from_history_db: 0,
        duplicates_merged: 0,
        messages_skipped: 0,
        summary: null,
        first_seq: null,
        last_seq: null,
        notes: [],
      };
      reports.push(report);
      try {
        const read = await readAgenvoySession(path.join(dir, sid), sid, db, timeZone);
        report.from_history_json = read.stats.fromJson;
        report.from_history_db = read.stats.fromDb;
        report.duplicates_merged = read.stats.duplicates;
        report.messages_skipped = read.stats.skipped;
        report.notes.push(...read.notes);
        if (read.input.messages.length === 0 && !read.input.summary) {
          report.status = 'skipped';
          report.skip_reason = 'nothing_to_import';
          report.notes.push('nothing to import');
          continue;
        }
        // A session that only restores a summary is "not empty" once it has one: a re-run must
        // not overwrite a summary mnemos has moved on since (messages are guarded by the import).
        const existing =
          read.input.messages.length === 0 ? await getSummaryRow(deps.db, tenantId, sid) : null;
        if (existing && Number(existing.version) > 0) {
          report.status = 'skipped';
          report.skip_reason = 'session_exists';
          // What reading noted (the zone, skipped rows) is about an import that did not happen.
          report.notes = ['the session already has a summary'];
          continue;
        }
        const outcome = await importSession(deps, tenantId, sid, read.input);
        report.status = 'imported';
        report.imported = outcome.imported;
        report.first_seq = outcome.first_seq;
        report.last_seq = outcome.last_seq;
        report.summary = outcome.summary ? { cursor_seq: outcome.summary.cursor_seq } : null;
      } catch (err) {
        if (err instanceof AppError && err.code === 'session_not_empty') {
          report.status = 'skipped';
          report.skip_reason = 'session_exists';
          report.notes = [];
        }
        // A store refusing is no fault of the session: every session after it would fail the
        // same way, each counted as bad data (exit 3 or 2). Stop, so that it is told apart.
        const e = asDependencyError(err);
        report.notes.push(e instanceof Error ? e.message : String(e));
        if (e instanceof AppError && e.status === 503) {
          unavailable = e.message;
          break;
        }
      }
    }
  } finally {
    db?.close();
  }
  const missing = (opts.only ?? []).filter((sid) => !ids.includes(sid) && !invalid.includes(sid));
  return { historyDb, invalidDirs, missing, historyDbOnly, notes, sessions: reports, unavailable };
}

/**
 * The command's exit status (README "Agenvoy import"): 0 when every session given is in mnemos
 * (imported now, or before: a re-run) or had nothing to import, and at least one is; 2 when some
 * are and others failed (a partial import: fix those and run again); 3 when none is (every session
 * failed, held nothing, or had no valid id). 1 stays what every command's error exits with, and
 * is what a store that refused or went away mid-run gives (try again later, not "bad data").
 * `problem` says why for 1, 2 and 3.
 */
export function agenvoyExitStatus(report: {
  invalidDirs: string[];
  missing: string[];
  sessions: AgenvoySessionReport[];
  unavailable: string | null;
}): { code: 0 | 1 | 2 | 3; problem: string | null } {
  const count = (f: (s: AgenvoySessionReport) => boolean) => report.sessions.filter(f).length;
  const imported = count((s) => s.status === 'imported');
  if (report.unavailable !== null) {
    return {
      code: 1,
      problem:
        `stopped after ${report.sessions.length} session(s), imported ${imported}: ${report.unavailable}; ` +
        'run it again later (sessions already imported are skipped)',
    };
  }
  const present = imported + count((s) => s.skip_reason === 'session_exists');
  const failed = count((s) => s.status === 'failed') + report.missing.length + report.invalidDirs.length;
  const given = report.sessions.length + report.missing.length + report.invalidDirs.length;
  if (present === 0) {
    const why = [
      failed > report.invalidDirs.length ? `${failed - report.invalidDirs.length} failed` : '',
      count((s) => s.skip_reason === 'nothing_to_import') > 0
        ? `${count((s) => s.skip_reason === 'nothing_to_import')} had nothing to import`
        : '',
      report.invalidDirs.length > 0 ? `${report.invalidDirs.length} not a valid session id` : '',
    ].filter(Boolean);
    return { code: 3, problem: `no session imported of ${given} (${why.join(', ')})` };
  }
  if (failed > 0) {
    return {
      code: 2,
      problem:
        `${failed} of ${given} sessions failed (imported ${imported}` +
        `${report.invalidDirs.length > 0 ? `; ${report.invalidDirs.length} not a valid session id` : ''}); see their notes`,
    };
  }
  return { code: 0, problem: null };
}

/** What makes a directory a session (the files a session's import reads first). */
const SESSION_FILES = ['history.json', 'summary.json'];

/** Session ids named in the report's note on sessions only history.db holds (the rest counted). */
const MAX_NAMED = 10;

/** The columns of Agenvoy's `messages` table the import reads. */
const DB_COLUMNS = ['session_id', 'send_at', 'role', 'content'];

/** A failure to read history.db, naming the file (SQLite's own messages do not). */
function historyDbError(file: string, err: unknown): AppError {
  const why = err instanceof Error ? err.message : String(err);
  return new AppError(
    400,
    'invalid_file',
    `${file} is not a readable Agenvoy history.db (${why}): it must be an SQLite database with a messages(${DB_COLUMNS.join(', ')}) table`,
    { file },
  );
}

function openHistoryDb(file: string): SqliteDb {
  try {
    return openSqlite(file, { readonly: true });
  } catch (err) {
    throw historyDbError(file, err);
  }
}

/**
 * The sessions history.db holds rows of, sorted; reading them also checks the file is Agenvoy's
 * (an SQLite database with a `messages` table of Agenvoy's columns), before anything is imported.
 */
function dbSessionIds(db: SqliteDb, file: string): string[] {
  try {
    const columns = new Set(
      (db.prepare("SELECT name FROM pragma_table_info('messages')").all() as Array<{ name: string }>).map(
        (c) => c.name.toLowerCase(),
      ),
    );
    const missing = DB_COLUMNS.filter((c) => !columns.has(c));
    if (columns.size === 0) throw new Error('no such table: messages');
    if (missing.length > 0) {
      throw new Error(`its messages table has no column ${missing.join(', ')}`);
    }
    const rows = db.prepare('SELECT DISTINCT session_id AS sid FROM messages').all() as Array<{
      sid: unknown;
    }>;
    return rows
      .map((r) => r.sid)
      .filter((sid): sid is string => typeof sid === 'string')
      .sort();
  } catch (err) {
    throw historyDbError(file, err);
  }
}
