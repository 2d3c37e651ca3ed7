import { idleTempSessions, isTempSessionIdle } from '../../db/queries/lifecycle.js';
import { inboxKeys } from '../messages/inbox.js';
import { clearSession } from './session-lifecycle.js';
import type { ExtensionList, LifecycleDeps } from './session-lifecycle.js';

/** SPEC §6: `temp-` sessions idle longer than this are deleted, with all their data. */
export const TEMP_IDLE_MS = 30 * 60_000;
export const TEMP_REAPER_EVERY_MS = 30 * 60_000;
const BATCH = 200;
const MAX_ROUNDS = 25;

/**
 * Deletes idle `temp-` sessions through the same path as DELETE /v1/sessions/{sid}. Idle = no
 * message sent, archived or waiting in the inbox, and no creation, within `idleMs` before now;
 * re-checked under the session's row lock, so a session that becomes active meanwhile is kept.
 * Now is Postgres's clock, which stamped the times compared (this process's clock an hour ahead
 * deleted a session posted a minute earlier); `now` stands in for it in tests.
 */
export async function reapTempSessions(
  deps: LifecycleDeps,
  extensions: ExtensionList,
  opts: { now?: Date; idleMs?: number } = {},
): Promise<{ deleted: number; kept: number }> {
  const now = opts.now ?? null;
  const idleMs = opts.idleMs ?? TEMP_IDLE_MS;
  const seen = new Set<string>();
  let deleted = 0;
  let kept = 0;
  for (let round = 0; round < MAX_ROUNDS; round++) {
    const fresh = (await idleTempSessions(deps.db, idleMs, now, BATCH + seen.size)).filter(
      (s) => !seen.has(`${s.tenant_id} ${s.id}`),
    );
    if (fresh.length === 0) break;
    for (const s of fresh) {
      seen.add(`${s.tenant_id} ${s.id}`);
      const outcome = await clearSession(
        deps,
        extensions,
        s.tenant_id,
        s.id,
        { kind: 'delete' },
        {
          jobScan: 0,
          guard: async (_row, tx) =>
            (await isTempSessionIdle(tx, s.tenant_id, s.id, idleMs, now)) &&
            (await deps.redis.llen(inboxKeys(deps.config.prefix, s.tenant_id, s.id).inbox)) === 0,
        },
      ).catch((err: unknown) => {
        deps.logger.warn(
          { err: { message: (err as Error).message } },
          'temp reaper could not delete a session',
        );
        return { kind: 'skipped' as const };
      });
      if (outcome.kind === 'done') deleted++;
      else kept++;
    }
  }
  if (deleted > 0) deps.logger.info({ deleted }, 'temp reaper deleted idle temp- sessions');
  return { deleted, kept };
}
