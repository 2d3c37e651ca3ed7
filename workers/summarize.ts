import { randomUUID } from 'node:crypto';
import { DelayedError, RateLimitError, UnrecoverableError } from 'bullmq';
import type { Job } from 'bullmq';
import { withTransaction } from '../db/pool.js';
import { maxArchivedSeq } from '../db/queries/messages.js';
import { getSession } from '../db/queries/sessions.js';
import {
  acquireSummaryLease,
  getSummaryRow,
  hasMessagesAfter,
  insertSummary,
  lockForSummarySave,
  pageSummarySource,
  readSummaryLease,
  recordSummaryFailure,
  recordSummaryProviderError,
  releaseSummaryLease,
  renewSummaryLease,
  summaryRunCurrent,
  turnOpenerAt,
  updateSummaryGuarded,
} from '../db/queries/summaries.js';
import type { SummarySourceRow } from '../db/queries/summaries.js';
import type { CoreDeps } from '../services/deps.js';
import { LlmError } from '../services/llm/llm-client.js';
import type { LlmErrorKind } from '../services/llm/llm-client.js';
import { throttledWarn } from '../services/logger.js';
import { planChunks } from '../services/summary/chunking.js';
import {
  conversationChars,
  DECISION_CONVERSATIONS,
  DECISION_LOG_CHARS,
  findSuperseded,
  judgeNoise,
} from '../services/summary/decision.js';
import type { Conversation } from '../services/summary/decision.js';
import { summaryPrompt } from '../services/summary/prompts.js';
import { joinBlocks, renderBlock } from '../services/summary/render.js';
import type { Block, SourceMessage } from '../services/summary/render.js';
import { parseSummaryAnswer, pruneSummary, summaryEntries } from '../services/summary/summary-shape.js';
import type { ParseOutcome, Summary } from '../services/summary/summary-shape.js';
import type { SummaryMetrics } from '../services/summary/summary-metrics.js';
import { watchSession } from '../services/session-watch.js';
import { parsePayload } from './queues.js';
import { runSummarySweep, summaryConfigFingerprint } from './summary-sweep.js';

/**
 * The summarize job (SPEC §6): merges every archived message after the session's summary cursor
 * into its rolling summary, chunk by chunk, moving the cursor only past merged chunks.
 *
 * Once per session across processes: the run holds a lease row (summary_leases) that it renews
 * while it works; without it the run ends at once as `busy` (its job may then wait for the lease:
 * leaseWaitMs). Every save happens in a transaction that re-checks the lease and the session
 * generation and is guarded on the exact version and cursor the run last saw, so even a run that
 * lost its lease cannot overwrite newer work.
 */

export const STALL_AFTER_FAILURES = 5;
const BACKOFF_BASE_SECONDS = 600;
const BACKOFF_MAX_SECONDS = 6 * 3600;
/**
 * How long the whole summary queue waits after the LLM endpoint failed for its own reasons: its
 * `retry-after`, else PROVIDER_WAIT_MS, at least a second and at most PROVIDER_WAIT_MAX_MS (a
 * worker then retries sooner than asked, and is told again).
 */
export const PROVIDER_WAIT_MS = 30_000;
export const PROVIDER_WAIT_MAX_MS = 5 * 60_000;
const PROVIDER_WAIT_MIN_MS = 1000;
const PAGE_SIZE = 200;
/**
 * A work unit ends at a conversation boundary once it holds this many estimated code points (with
 * a decision model: as many conversations as one decision prompt takes, decision.ts)…
 */
const UNIT_CHUNKS = 4;
/** …and holds at most this many messages, even within a conversation. */
const UNIT_MAX_MESSAGES = 2000;
const TOOL_ARGUMENT_CHARS = 1000;

export type SummarizeOutcome =
  | 'summarized'
  | 'pruned'
  | 'cursor_set'
  | 'noop'
  | 'failed'
  | 'deferred'
  | 'busy'
  | 'lost_race'
  | 'gone'
  | 'disabled'
  | 'stopped';

export interface SummarizeResult {
  outcome: SummarizeOutcome;
  /** Chunks merged and saved by this run. */
  chunks: number;
  /** LLM calls made by this run (summary and decision). */
  calls: number;
  /** Conversations dropped as noise. */
  dropped: number;
  version: number | null;
  cursor_seq: number | null;
  /** For `failed` and `deferred`: what went wrong (never message content). */
  error?: string;
  status?: string;
  /**
   * The LLM endpoint failed for its own reasons (providerFault): how long the summary queue waits.
   * `deferred` (it pushed back) goes back to the queue with nothing recorded; `failed` with this
   * recorded its last_error without counting a failure.
   */
  waitMs?: number;
  /** For `busy`: the lease as the run found it (null: gone by the time it looked). */
  lease?: HeldLease | null;
}

/** A summary lease another run holds: its holder's token and expiry (Postgres's clock). */
export interface HeldLease {
  holder: string;
  expiresAtMs: number;
  /** Until the expiry, by Postgres's clock (≤ 0: expired). */
  remainingMs: number;
}

export interface SummarizeOptions {
  leaseTtlMs?: number;
  metrics?: SummaryMetrics;
  /** The worker is shutting down: no LLM call after it (outcome `stopped`). */
  stop?: AbortSignal;
  /** How often a call in flight looks for a delete or reset of its session (SESSION_WATCH_MS). */
  watchMs?: number;
}

type Deps = Pick<CoreDeps, 'db' | 'llm' | 'config' | 'logger'>;

export async function summarizeSession(
  deps: Deps,
  input: { tenantId: string; sessionId: string },
  opts: SummarizeOptions = {},
): Promise<SummarizeResult> {
  const { tenantId, sessionId } = input;
  const none = (outcome: SummarizeOutcome): SummarizeResult => ({
    outcome,
    chunks: 0,
    calls: 0,
    dropped: 0,
    version: null,
    cursor_seq: null,
  });
  if (!deps.llm) return none('disabled');
  const session = await getSession(deps.db, tenantId, sessionId);
  if (!session) return none('gone');
  const holder = randomUUID();
  const ttlMs = opts.leaseTtlMs ?? 60_000;
  const lease = { tenantId, sessionId, holder, ttlMs };
  if (!(await acquireSummaryLease(deps.db, lease))) {
    return { ...none('busy'), lease: await readSummaryLease(deps.db, tenantId, sessionId) };
  }
  const controller = new AbortController();
  const renewal = setInterval(
    () => {
      renewSummaryLease(deps.db, lease).then(
        (held) => {
          if (!held) controller.abort();
        },
        (err: unknown) =>
          deps.logger.warn({ err: { message: (err as Error).message } }, 'summary lease renewal failed'),
      );
    },
    Math.max(200, Math.floor(ttlMs / 3)),
  );
  renewal.unref();
  // A delete or reset stops the call at once, not at the next renewal (up to ttlMs / 3 later),
  // so that neither it nor its retries send the session's text after the delete was answered.
  const stopWatching = watchSession(
    deps.db,
    { tenantId, sessionId, generation: session.generation },
    controller,
    opts.watchMs,
  );
  try {
    return await runLocked(
      deps,
      { tenantId, sessionId, generation: session.generation, holder },
      controller.signal,
      opts,
    );
  } finally {
    clearInterval(renewal);
    stopWatching();
    await releaseSummaryLease(deps.db, lease).catch(() => undefined);
  }
}

interface RunContext {
  tenantId: string;
  sessionId: string;
  generation: number;
  holder: string;
}

async function runLocked(
  deps: Deps,
  ctx: RunContext,
  signal: AbortSignal,
  opts: SummarizeOptions,
): Promise<SummarizeResult> {
  const { db, config } = deps;
  const { tenantId, sessionId } = ctx;
  const row = await getSummaryRow(db, tenantId, sessionId);

  // What this run last saw in the row; every save is guarded on it.
  const state = {
    exists: row !== null,
    version: row?.version ?? 0,
    cursor: row === null ? 0 : row.cursor_seq === null ? null : Number(row.cursor_seq),
    summary: row !== null && row.version > 0 ? row.summary : null,
  };
  let chunks = 0;
  let calls = 0;
  let dropped = 0;
  const result = (outcome: SummarizeOutcome, extra: Partial<SummarizeResult> = {}): SummarizeResult => ({
    outcome,
    chunks,
    calls,
    dropped,
    version: state.exists ? state.version : null,
    cursor_seq: state.cursor,
    ...extra,
  });

  const save = async (summary: unknown, version: number, cursor: number): Promise<boolean> => {
    const ok = await withTransaction(db, async (tx) => {
      if (!(await lockForSummarySave(tx, ctx))) return false;
      if (!state.exists) {
        return insertSummary(tx, { tenantId, sessionId, summary, version, cursorSeq: cursor });
      }
      return updateSummaryGuarded(tx, {
        tenantId,
        sessionId,
        expectVersion: state.version,
        expectCursor: state.cursor,
        summary,
        version,
        cursorSeq: cursor,
      });
    });
    if (ok) Object.assign(state, { exists: true, version, cursor, summary });
    return ok;
  };

  // 1. An imported summary without a cursor: the cursor goes to the newest message, no LLM call.
  if (row !== null && state.cursor === null) {
    const newest = await maxArchivedSeq(db, tenantId, sessionId);
    if (newest === 0) return result('noop');
    return (await save(row.summary, row.version, newest)) ? result('cursor_set') : result('lost_race');
  }
  const startCursor = state.cursor ?? 0;
  if (!(await hasMessagesAfter(db, tenantId, sessionId, startCursor))) return result('noop');

  const budget = config.summaryRunes;
  const tz = config.timeZone;
  const decisionModel = config.decisionModel;
  const render = (m: SourceMessage, max: number) => renderBlock(m, tz, max);
  const reader = makeReader(deps, tenantId, sessionId, startCursor, budget);
  const readUnit =
    decisionModel === undefined
      ? makeUnitReader(reader, budget, undefined)
      : makeUnitReader(reader, budget, tz, await turnSoFar(deps, ctx, startCursor, reader, budget));
  const loaded: number[] = [];
  let pending: SourceMessage[] = [];
  let working: unknown = state.summary;
  let pruned = false;
  const lostLease = () => (signal.aborted ? result('lost_race') : null);
  // The worker is shutting down: no new LLM call. What is merged is saved, and the job goes back
  // to the queue (makeSummaryProcessor); a call sent now would be cut at the shutdown deadline,
  // paid for and thrown away, and its lease would hold the session for a minute.
  const halted = () => (opts.stop?.aborted ? result('stopped') : null);
  // Before each LLM call: the worker's shutdown, the lease, and the session as it was (a delete,
  // reset or tenant erasure since would refuse the save; the call would be paid for nothing).
  const stale = async () =>
    halted() ?? lostLease() ?? ((await summaryRunCurrent(db, ctx)) ? null : result('lost_race'));

  /**
   * Messages the endpoint refused for their content, one at a time, not yet left out. They are
   * left out once a later chunk of this run merges: that proves the endpoint takes the summary and
   * the other messages, so it was these. Without one (an endpoint or gateway that refuses every
   * request, or a previous summary it refuses) nothing is left out: the run fails and says why.
   */
  let refused: number[] = [];
  let refusal = '';
  const failed = async (error: string): Promise<SummarizeResult> => {
    opts.metrics?.chunks.inc({ outcome: 'failed' });
    const recorded = await recordSummaryFailure(db, {
      tenantId,
      sessionId,
      generation: ctx.generation,
      error,
      config: summaryConfigFingerprint(config),
      stallAfter: STALL_AFTER_FAILURES,
      backoffBaseSeconds: BACKOFF_BASE_SECONDS,
      backoffMaxSeconds: BACKOFF_MAX_SECONDS,
    });
    return result('failed', { error, ...(recorded ? { status: recorded.status } : {}) });
  };
  /**
   * The endpoint's fault, not the session's: nothing counts toward a stall. Pushed back (429, or a
   * retry-after), the run is deferred and records nothing; down or failing, last_error says so.
   */
  const providerFailed = async (error: string, fault: ProviderFault): Promise<SummarizeResult> => {
    if (fault.pushback) return result('deferred', { error, waitMs: fault.waitMs });
    opts.metrics?.chunks.inc({ outcome: 'failed' });
    const noted = await recordSummaryProviderError(db, {
      tenantId,
      sessionId,
      generation: ctx.generation,
      error,
    });
    return result('failed', { error, waitMs: fault.waitMs, ...(noted ? { status: noted.status } : {}) });
  };

  /**
   * Merges a chunk into the working summary and saves it with the cursor at `coverEnd`: null when
   * done, else the run's result. A chunk the endpoint refuses for what it says (a content filter)
   * or for its size (the model's context) is split in two and the halves merged in turn, so one
   * message cannot hold back the session's summaries for good: a single message refused for what
   * it says waits in `refused` (above). Any other failure is recorded, and the next run retries.
   */
  const mergeChunk = async (chunk: Block[], coverEnd: number): Promise<SummarizeResult | null> => {
    const gone = await stale();
    if (gone) return gone;
    const answer = await summarizeChunk(deps, ctx, working, chunk, signal);
    calls++;
    if (answer.ok) {
      if (!(await save(answer.value, state.version + 1, coverEnd))) return result('lost_race');
      opts.metrics?.chunks.inc({ outcome: 'merged' });
      chunks++;
      working = answer.value;
      pruned = false;
      for (const seq of refused) {
        opts.metrics?.chunks.inc({ outcome: 'skipped' });
        deps.logger.warn(
          { tenantId, sessionId, seq, error: refusal },
          'summary left out a message the LLM endpoint refuses for its content',
        );
      }
      refused = [];
      return null;
    }
    const lost = lostLease();
    if (lost) return lost;
    if (answer.provider) return providerFailed(answer.error, answer.provider);
    if (answer.refused && chunk.length > 1) {
      opts.metrics?.chunks.inc({ outcome: 'refused' });
      const half = Math.ceil(chunk.length / 2);
      const rest = chunk.slice(half);
      const first = await mergeChunk(chunk.slice(0, half), largestBelow(loaded, rest[0]!.seq));
      return first ?? (await mergeChunk(rest, coverEnd));
    }
    if (answer.refused === 'content' && refused.length < MAX_UNCONFIRMED_REFUSALS) {
      opts.metrics?.chunks.inc({ outcome: 'refused' });
      refused.push(chunk[0]!.seq);
      refusal = answer.error;
      return null;
    }
    return failed(answer.error);
  };

  for (;;) {
    const { messages: unit, conversations } = await readUnit();
    const atEnd = (await reader.peek()) === null;
    if (unit.length === 0) break;
    for (const m of unit) loaded.push(m.seq);
    const unitLast = unit[unit.length - 1]!.seq;

    // 3. The decision model: drop noise, then prune what the kept conversations overturn.
    let survivors = unit;
    if (decisionModel) {
      // An endpoint that pushes back (429, retry-after) defers the run as a summary call's does:
      // each step keeping everything on it sent the summary call at once, and summarised the
      // noise it could not judge for good.
      const call = {
        tenantId,
        sessionId,
        model: decisionModel,
        timeZone: tz,
        signal,
        rethrow: (err: unknown) => providerFault(err)?.pushback === true,
      };
      const pushedBack = (err: unknown) => {
        calls++;
        const fault = providerFault(err);
        if (!fault?.pushback) throw err;
        return lostLease() ?? providerFailed(describeLlmFailure(err), fault);
      };
      const before = await stale();
      if (before) return before;
      let noise: Set<string> | null;
      try {
        noise = await judgeNoise(deps, call, conversations);
      } catch (err) {
        return pushedBack(err);
      }
      calls++;
      const kept = noise ? conversations.filter((c) => !noise.has(c.id)) : conversations;
      if (noise && noise.size > 0) {
        dropped += noise.size;
        opts.metrics?.noiseDropped.inc(noise.size);
        survivors = kept.flatMap((c) => c.messages);
      }
      const entries = summaryEntries(working);
      if (kept.length > 0 && entries.keyDecisions.length + entries.pastDiscussions.length > 0) {
        const between = await stale();
        if (between) return between;
        let overturned: Awaited<ReturnType<typeof findSuperseded>>;
        try {
          overturned = await findSuperseded(deps, call, working, kept);
        } catch (err) {
          return pushedBack(err);
        }
        calls++;
        if (overturned && overturned.keyDecisions.length + overturned.pastDiscussions.length > 0) {
          working = pruneSummary(working, overturned);
          pruned = true;
        }
      }
      const lost = lostLease();
      if (lost) return lost;
    }

    // 4–6. Chunk what is pending; the last chunk waits for more messages unless this is the end.
    pending = pending.concat(survivors);
    const planned = planChunks(
      pending.map((m) => render(m, budget)),
      budget,
      (b: Block, max: number) => render(b.source, max),
    );
    const send = atEnd ? planned : planned.slice(0, -1);
    for (const [k, chunk] of send.entries()) {
      const next = planned[k + 1]?.[0];
      // Past this chunk and any noise dropped after it, up to the next pending message.
      const coverEnd = next ? largestBelow(loaded, next.seq) : unitLast;
      const stop = await mergeChunk(chunk, coverEnd);
      if (stop) return stop;
    }
    pending = atEnd ? [] : (planned[planned.length - 1] ?? []).map((b) => b.source);

    // Nothing left to send from what was read: save the pruned summary and the cursor, no call
    // (not past a refused message: only a merge after it may leave it out).
    if (pending.length === 0 && unitLast > (state.cursor ?? 0) && refused.length === 0) {
      const version = pruned ? state.version + 1 : state.version;
      if (!(await save(working, version, unitLast))) return result('lost_race');
      pruned = false;
    }
    if (atEnd) break;
  }
  // Refused messages with nothing merged after them: the run fails with the refusal; a later run,
  // with more messages, may leave them out.
  if (refused.length > 0) return failed(refusal);
  if (chunks > 0) return result('summarized', { status: 'ok' });
  return (state.cursor ?? 0) > startCursor ? result('pruned', { status: 'ok' }) : result('noop');
}

/**
 * The `summary` queue's processor: sweeps and per-session summarize jobs. A failed chunk is
 * already recorded on the summary row (failures, last_error, stall); the job then fails without
 * BullMQ retries (the next sweep retries from the cursor), so it shows as failed in Bull Board
 * and GET /v1/jobs. Infrastructure errors (Postgres down) throw normally and are retried.
 *
 * A run the LLM endpoint failed for its own reasons (`waitMs`) makes the whole queue wait, in
 * every worker process (BullMQ's manual rate limit; the worker's limiter, workers/main.ts): each
 * worker slot moving on to the next session met the same 429, and counted it as that session's
 * failure. A deferred job goes back to the queue, its attempts and the session untouched; its
 * lease is released already (summarizeSession's finally), so its next run is not `busy`.
 */
export function makeSummaryProcessor(deps: CoreDeps, opts: SummarizeOptions = {}) {
  const warnWait = throttledWarn(deps.logger, 'LLM endpoint failed or pushed back: the summary queue waits');
  return async (job: Job, token?: string, stop?: AbortSignal): Promise<unknown> => {
    const p = parsePayload('summary', job.data);
    if (p.kind === 'sweep') return runSummarySweep(deps);
    let found: SummarizeResult;
    try {
      found = await summarizeSession(deps, p, { ...opts, ...(stop ? { stop } : {}) });
    } catch (err) {
      opts.metrics?.jobs.inc({ outcome: 'error' });
      throw err;
    }
    // The lease's holder is not shown (the job's result is, in GET /v1/jobs).
    const { lease, ...r } = found;
    opts.metrics?.jobs.inc({ outcome: r.outcome });
    if (r.waitMs !== undefined) {
      // Never shortened: a job in flight when another set a longer wait may be told less.
      const queue = deps.queues.summary;
      if ((await queue.getRateLimitTtl()) < r.waitMs) await queue.rateLimit(r.waitMs);
      warnWait({ error: r.error, waitMs: r.waitMs, outcome: r.outcome });
      if (r.outcome === 'deferred') throw new RateLimitError();
    }
    const wait = r.outcome === 'busy' && token ? leaseWaitMs(p.leaseSeen, lease ?? null) : null;
    if (wait !== null && token) {
      // Back to the queue until the lease expires, remembering the lease it waits for.
      const leaseSeen = lease ? { holder: lease.holder, expiresAtMs: lease.expiresAtMs } : undefined;
      await job.updateData({ ...p, leaseSeen });
      await job.moveToDelayed(Date.now() + wait, token);
      throw new DelayedError();
    }
    if (r.outcome === 'stopped' && token) {
      // Back to the queue (not failed, not retried against its attempts): another worker, or this
      // one's successor, goes on from the saved cursor a second from now.
      await job.moveToDelayed(Date.now() + 1000, token);
      throw new DelayedError();
    }
    if (r.outcome === 'failed') throw new UnrecoverableError(r.error ?? 'summary chunk failed');
    return r;
  };
}

/** After a lease's expiry, the wait before trying again: Postgres's and BullMQ's clocks differ. */
const LEASE_WAIT_SLACK_MS = 1000;

/**
 * How long a job that found the session's lease held (`busy`) waits in the queue before it tries
 * again, or null when it ends as `busy`. A run killed mid-way (kill -9, a lost machine) leaves its
 * lease for up to its TTL (60 s), and BullMQ re-runs its stalled job once the job's lock lapses
 * (30 s), usually before that: ended as `busy`, the session waited for the next sweep (15 min by
 * default). One look cannot tell a dead holder from a live one (a live one renews every 20 s), so:
 * - a holder the job has not seen before (`seen`): it waits until that lease's expiry;
 * - the holder it waited for, whose lease was not renewed since (the job woke early): the same;
 * - the holder it waited for, with its lease renewed since: a live run is doing the work: `busy`;
 * - no lease any more (released as the job looked): it tries again a second later.
 * A dead holder's job thus runs once the lease lapses, and a live one's ends as `busy` after one
 * wait of at most the TTL.
 */
export function leaseWaitMs(
  seen: { holder: string; expiresAtMs: number } | undefined,
  held: HeldLease | null,
): number | null {
  if (!held) return LEASE_WAIT_SLACK_MS;
  if (seen && seen.holder === held.holder && held.expiresAtMs > seen.expiresAtMs) return null;
  return Math.max(0, held.remainingMs) + LEASE_WAIT_SLACK_MS;
}

async function summarizeChunk(
  deps: Deps,
  ctx: RunContext,
  previous: unknown,
  chunk: Block[],
  signal: AbortSignal,
): Promise<ParseOutcome<Summary> & { refused?: Refusal; provider?: ProviderFault }> {
  const { config } = deps;
  const messages = summaryPrompt({
    previous,
    transcript: joinBlocks(chunk),
    messageCount: chunk.length,
    timeZone: config.timeZone,
    replyLang: config.replyLang,
  });
  try {
    const res = await deps.llm!.chat({
      purpose: 'summary',
      model: config.summaryModel,
      messages,
      json: true,
      temperature: 0.2,
      tenantId: ctx.tenantId,
      sessionId: ctx.sessionId,
      signal,
    });
    const parsed = parseSummaryAnswer(res.content);
    if (!parsed.ok && res.finishReason === 'length') {
      return { ok: false, error: "invalid summary: the answer was cut at the model's output token limit" };
    }
    // Azure stops an answer it filters midway: what came before the filter is no summary.
    if (!parsed.ok && res.finishReason === 'content_filter') {
      return { ok: false, error: 'llm invalid_response (content_filter)', refused: 'content' };
    }
    return parsed;
  } catch (err) {
    const refused = refusalOf(err);
    const provider = providerFault(err);
    return {
      ok: false,
      error: describeLlmFailure(err),
      ...(refused ? { refused } : {}),
      ...(provider ? { provider } : {}),
    };
  }
}

/**
 * A failure of the LLM endpoint, not of this session's input, left after the client's retries:
 * it pushed back (`pushback`: 429 rate_limited, or a 5xx that said when to come back), or it is
 * down, failing or slow (network, 5xx, timeout). The queue waits `waitMs`; the session's summary
 * is not backed off and cannot stall for it. Everything else is the session's (an invalid or
 * refused answer, bad_request) or the configuration's (auth, a wrong model name): counted, and
 * stalled after STALL_AFTER_FAILURES.
 */
interface ProviderFault {
  pushback: boolean;
  waitMs: number;
}

const PROVIDER_KINDS = new Set<LlmErrorKind>(['rate_limited', 'server', 'network', 'timeout']);

function providerFault(err: unknown): ProviderFault | undefined {
  if (!(err instanceof LlmError) || !PROVIDER_KINDS.has(err.kind)) return undefined;
  const asked = err.retryAfterMs;
  // OpenAI's 429 `insufficient_quota` (billing) is no pushback: waiting will not end it, so it is
  // recorded on the session, yet still not counted.
  const pushback = err.code !== 'insufficient_quota' && (err.kind === 'rate_limited' || asked !== undefined);
  return {
    pushback,
    waitMs: Math.min(PROVIDER_WAIT_MAX_MS, Math.max(PROVIDER_WAIT_MIN_MS, asked ?? PROVIDER_WAIT_MS)),
  };
}

/**
 * Refused single messages a run holds before it gives up without a merge: an endpoint that refuses
 * everything costs about log₂ n + 4 calls per run, not 2n.
 */
const MAX_UNCONFIRMED_REFUSALS = 3;

/**
 * Why the endpoint refuses this input, when it is the input: `content` for a content filter or a
 * refusal (Azure's HTTP 400 `content_filter`, OpenAI's `refusal`), `size` for the model's context
 * (`context_length_exceeded`, HTTP 413). A wrong model name, a bad key or a parameter the endpoint
 * does not know fails every input alike: those are not refusals, and splitting would not help.
 */
type Refusal = 'content' | 'size';

const CONTENT_CODES = new Set(['content_filter', 'content_policy_violation', 'refusal']);
const SIZE_CODES = new Set(['context_length_exceeded', 'string_above_max_length']);

function refusalOf(err: unknown): Refusal | undefined {
  if (!(err instanceof LlmError) || (err.kind !== 'bad_request' && err.kind !== 'invalid_response')) {
    return undefined;
  }
  if (err.code !== undefined && CONTENT_CODES.has(err.code)) return 'content';
  if (err.status === 413 || (err.code !== undefined && SIZE_CODES.has(err.code))) return 'size';
  return undefined;
}

/**
 * A failure for last_error: kind, status and the endpoint's error code only (its error text may
 * quote the prompt): `llm bad_request (HTTP 404: model_not_found)` says what to change.
 */
export function describeLlmFailure(err: unknown): string {
  if (!(err instanceof LlmError)) return 'llm call failed';
  const detail = [err.status ? `HTTP ${err.status}` : '', err.code ?? ''].filter(Boolean).join(': ');
  return `llm ${err.kind}${detail ? ` (${detail})` : ''}`;
}

function largestBelow(sorted: number[], bound: number): number {
  let lo = 0;
  let hi = sorted.length - 1;
  let best = 0;
  while (lo <= hi) {
    const mid = (lo + hi) >> 1;
    const v = sorted[mid]!;
    if (v < bound) {
      best = v;
      lo = mid + 1;
    } else hi = mid - 1;
  }
  return best;
}

interface Reader {
  peek(): Promise<SourceMessage | null>;
  next(): Promise<SourceMessage | null>;
  /** Puts messages just read back in front, to be read again. */
  unread(messages: SourceMessage[]): void;
}

/** Streams the archive after `afterSeq` in pages (a backlog never has to fit in memory at once). */
function makeReader(
  deps: Deps,
  tenantId: string,
  sessionId: string,
  afterSeq: number,
  budget: number,
): Reader {
  let buffer: SourceMessage[] = [];
  let at = 0;
  let after = afterSeq;
  let done = false;
  const fill = async () => {
    const rows = await pageSummarySource(deps.db, {
      tenantId,
      sessionId,
      afterSeq: after,
      limit: PAGE_SIZE,
      maxChars: budget,
      maxArgChars: TOOL_ARGUMENT_CHARS,
    });
    buffer = rows.map(sourceOf);
    at = 0;
    if (rows.length < PAGE_SIZE) done = true;
    const last = buffer[buffer.length - 1];
    if (last) after = last.seq;
  };
  const peek = async () => {
    if (at >= buffer.length && !done) await fill();
    return buffer[at] ?? null;
  };
  return {
    peek,
    async next() {
      const m = await peek();
      if (m) at++;
      return m;
    },
    unread(messages) {
      buffer = messages.concat(buffer.slice(at));
      at = 0;
    },
  };
}

const sourceOf = (r: SummarySourceRow): SourceMessage => ({
  seq: Number(r.seq),
  role: r.role,
  name: r.name,
  sentAtNs: r.sent_at_ns,
  content: r.content,
  contentChars: r.content_chars,
  toolCalls: r.tool_calls_text,
});

/**
 * A run that starts within a turn (the cursor is past its request, and replies came after the
 * previous run): the turn's request and how many of its messages the cursor has passed, so the
 * decision model judges the new replies with the request they answer, as after a cut by the
 * unit's message cap. Undefined when the next message opens a turn, or no request precedes it.
 */
async function turnSoFar(
  deps: Deps,
  ctx: RunContext,
  cursor: number,
  reader: Reader,
  budget: number,
): Promise<Conversation['continues']> {
  const next = await reader.peek();
  if (cursor === 0 || next === null || next.role === 'user') return undefined;
  const row = await turnOpenerAt(deps.db, {
    tenantId: ctx.tenantId,
    sessionId: ctx.sessionId,
    atSeq: cursor,
    maxChars: budget,
    maxArgChars: TOOL_ARGUMENT_CHARS,
  });
  return row ? { opener: sourceOf(row), earlier: Number(row.turn_messages) } : undefined;
}

interface Unit {
  messages: SourceMessage[];
  /** With a decision model: the unit's conversations, their prompts within DECISION_LOG_CHARS. */
  conversations: Conversation[];
}

/**
 * Work units: whole conversations (a unit ends just before a user message) up to a size that
 * keeps memory and decision prompts bounded. `timeZone` is set when a decision model judges them;
 * `startsWithin` is the turn the run's cursor is in (turnSoFar).
 */
function makeUnitReader(
  reader: Reader,
  budget: number,
  timeZone: string | undefined,
  startsWithin?: Conversation['continues'],
): () => Promise<Unit> {
  if (timeZone === undefined) {
    return async () => ({ messages: await readUnit(reader, budget), conversations: [] });
  }
  // The conversation the message cap cut (or the run's cursor), carried into the next unit.
  let carried = startsWithin;
  return async () => {
    const messages: SourceMessage[] = [];
    const conversations: Conversation[] = [];
    let chars = 0;
    while (conversations.length < DECISION_CONVERSATIONS) {
      const room = UNIT_MAX_MESSAGES - messages.length;
      const part: SourceMessage[] = [];
      for (let m = await reader.peek(); m && part.length < room; m = await reader.peek()) {
        if (part.length > 0 && m.role === 'user') break;
        await reader.next();
        part.push(m);
      }
      if (part.length === 0) break;
      const next = await reader.peek();
      const cut = next !== null && next.role !== 'user';
      const first = conversations.length === 0;
      const c: Conversation = {
        id: `c${conversations.length + 1}`,
        messages: part,
        ...(first && carried ? { continues: carried } : {}),
      };
      const size = conversationChars(c, timeZone) + (first ? 0 : 2);
      // What does not fit, and a conversation the cap would cut, start the next unit.
      if (!first && (cut || chars + size > DECISION_LOG_CHARS)) {
        reader.unread(part);
        break;
      }
      messages.push(...part);
      conversations.push(c);
      chars += size;
      carried = cut
        ? { opener: carried?.opener ?? part[0]!, earlier: (carried?.earlier ?? 0) + part.length }
        : undefined;
      if (cut) break;
    }
    return { messages, conversations };
  };
}

/** A unit without a decision model: up to UNIT_CHUNKS chunks' worth of messages. */
async function readUnit(reader: Reader, budget: number): Promise<SourceMessage[]> {
  const unit: SourceMessage[] = [];
  let estimate = 0;
  let full = false;
  for (;;) {
    const m = await reader.peek();
    if (!m || unit.length >= UNIT_MAX_MESSAGES) break;
    if (full && m.role === 'user') break;
    await reader.next();
    unit.push(m);
    estimate += Math.min(m.contentChars + (m.toolCalls?.length ?? 0), budget) + 48;
    full = estimate >= UNIT_CHUNKS * budget;
  }
  return unit;
}
