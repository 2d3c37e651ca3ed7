/**
 * Wire types of the mnemos HTTP API (SPEC §4), duplicated here on purpose: the client directory
 * must stay copyable into another project, so it imports nothing from the service.
 *
 * Terminology: a *session* is one conversation (a client-chosen id); every accepted message gets
 * a *seq*, strictly increasing per session but with possible gaps (page with `next`, never with
 * seq arithmetic). The *archive* keeps every message; the *hot window* is the recent part served
 * as context; the *summary* is the rolling structured summary of everything before its *cursor*.
 * *Error memory* is per tenant, across sessions. A *tenant* owns API keys and all data.
 *
 * Request options are camelCase (`afterSeq`); request documents and responses are the wire's
 * snake_case (`tool_call_id`, `sent_at`), exactly as the HTTP API sends them.
 */

export type Role = 'user' | 'assistant' | 'system' | 'developer' | 'tool';

export type ContentPart =
  | { type: 'text'; text: string }
  | { type: 'image_url'; image_url: { url: string; detail?: 'auto' | 'low' | 'high' } };

export interface ToolCall {
  id: string;
  type: 'function';
  function: { name: string; arguments: string };
}

/** A message to post. Without `id` the client assigns a UUID (that makes retries safe). */
export interface MessageInput {
  id?: string;
  role: Role;
  /** May be null or absent only on an assistant message with `tool_calls`. */
  content?: string | null | ContentPart[];
  name?: string;
  tool_call_id?: string;
  tool_calls?: ToolCall[];
  /** RFC 3339, unix nanoseconds as a decimal string, or "YYYY-MM-DD HH:MM:SS" (server TZ). */
  sent_at?: string;
  metadata?: Record<string, unknown>;
}

export interface StoredMessage {
  id: string;
  seq: number;
  role: Role;
  content: string | null | ContentPart[];
  name?: string;
  tool_call_id?: string;
  tool_calls?: ToolCall[];
  metadata?: Record<string, unknown>;
  /** RFC 3339 UTC with nanoseconds. */
  sent_at: string;
  /** Unix nanoseconds as a decimal string. */
  sent_at_ns: string;
}

export interface PostMessagesResult {
  session_id: string;
  /** Messages stored by this call (idempotent repeats are not counted). */
  accepted: number;
  /** In the order posted: the id (given or assigned) and its seq. */
  messages: Array<{ id: string; seq: number }>;
  /** True when the server answered 201: every message is in the archive (with `wait`). */
  durable: boolean;
}

export interface MessagePage {
  messages: StoredMessage[];
  next: number | null;
  /**
   * The session's generation, which a reset or delete changes: pass the first page's as
   * `generation` on the later pages, so that a listing cannot run on into a new session.
   */
  generation: number;
}

export interface SessionListItem {
  id: string;
  message_count: number;
  created_at: string;
  last_message_at: string | null;
}

export interface SessionInfo {
  id: string;
  message_count: number;
  hot_bytes: number;
  start_seq: number;
  start_at: string | null;
  last_message_at: string | null;
  created_at: string;
  summary: { version: number; cursor_seq: number | null; status: string } | null;
  pending_jobs: number | null;
}

export interface Summary {
  key_decisions: string[];
  past_discussions: Array<{ topic: string; description: string; direction: string; last_discussed: string }>;
  current_discussion: { topic: string; description: string; perspectives: string; direction: string };
}

/**
 * The summary a context call sent: with DECISION_MODEL, only the entries relevant to the turn, and
 * `current_discussion` left out when it is not (docs/context.md).
 */
export type ContextSummary = Omit<Summary, 'current_discussion'> & {
  current_discussion?: Summary['current_discussion'];
};

export interface SummaryView {
  summary: Summary | null;
  version: number;
  cursor_seq: number | null;
  /** "ok", "stalled", ... */
  status: string;
  updated_at: string | null;
  failures?: number;
  last_error?: string | null;
  next_attempt_at?: string | null;
}

/** 202: queued (poll `job(job_id)`); 200 with `wait`: finished, with the summary after the run. */
export type SummarizeResult =
  { done: false; job_id: string } | ({ done: true; job_id: string; outcome: string } & SummaryView);

/** An OpenAI chat message as the context endpoint returns it (ready to send). */
export interface ChatMessage {
  role: Role;
  content: string | null | ContentPart[];
  name?: string;
  tool_calls?: ToolCall[];
  tool_call_id?: string;
}

export interface ContextResult {
  messages: ChatMessage[];
  /** Append to your own system prompt (empty when there is no summary). */
  system_block: string;
  summary: ContextSummary | null;
  summary_version: number;
  window: { from_seq: number | null; to_seq: number | null };
  relevance: 'filtered' | 'all' | 'none';
  /** Client-side: `minSeq` was not archived within the server's wait (header x-mnemos-min-seq). */
  minSeqTimedOut: boolean;
}

export type MatchMode = 'keyword' | 'semantic' | 'hybrid';
export type TimeRange = '1d' | '7d' | '1m' | '1y' | 'all';

export interface SearchHit {
  seq: number;
  id: string;
  role: Role;
  content: string | null | ContentPart[];
  sent_at: string;
  score: number;
  source: 'archive' | 'recent' | 'both';
  context: StoredMessage[];
}

export interface ToolDefinition {
  type: 'function';
  /** `strict` is set (true) in the definitions for structured outputs: `tools({ strict: true })`. */
  function: { name: string; description: string; parameters: Record<string, unknown>; strict?: boolean };
}

export type ErrorOutcome = 'resolved' | 'failed' | 'abandoned';

/** Body of `POST /v1/errors` (also the `write_error` tool's arguments). */
export interface ErrorWriteInput {
  tool_name: string;
  symptom: string;
  action: string;
  outcome: ErrorOutcome;
  cause?: string | null;
  keywords?: string[];
  session_id?: string;
}

export interface ErrorRecord {
  id: string;
  tool_name: string;
  symptom: string;
  cause: string | null;
  action: string;
  outcome: ErrorOutcome;
  keywords: string[];
  hits: number;
  created_at: string;
  last_hit_at: string;
}

export interface UsageRow {
  purpose: string;
  model: string;
  calls: number;
  input_tokens: number;
  output_tokens: number;
}

export interface JobView {
  id: string;
  queue: string;
  name: string;
  state: string;
  attempts: number;
  failed_reason: string | null;
  created_at: string;
  finished_at: string | null;
  result: unknown;
}

/** One line of `GET …/export`: messages in seq order, then the summary (every field is sent). */
export type ExportLine = ({ type: 'message' } & StoredMessage) | ExportSummaryLine;

export interface ExportSummaryLine {
  type: 'summary';
  summary: Summary;
  version: number;
  cursor_seq: number | null;
  status: string;
  updated_at: string;
}

/** What an import accepts: export lines, or plain messages (with their `sent_at`). */
export type ImportLine =
  ExportLine | (MessageInput & { type?: 'message'; seq?: number; sent_at_ns?: string }) | ImportSummaryLine;

/** A summary line as an import takes it: `cursor_seq` places the cursor, the rest is informational. */
export interface ImportSummaryLine {
  type: 'summary';
  summary: Summary;
  cursor_seq?: number | null;
  version?: number;
  status?: string;
  updated_at?: string;
}

export interface ResetResult {
  session_id: string;
  reset: true;
  /** False when there was no summary, or with `keepSummary: false`. */
  summary_kept: boolean;
}

export interface ImportResult {
  /** True on 201: every imported message is in the archive. */
  durable: boolean;
  session_id: string;
  imported: number;
  first_seq: number | null;
  last_seq: number | null;
  summary: { restored: true; version: number; cursor_seq: number | null } | null;
}

export interface ReadyStatus {
  status: 'ready' | 'not_ready';
  checks: Record<string, string>;
}

export interface TenantView {
  tenant_id: string;
  name: string;
  created_at: string;
  /** When its erasure started; null for a tenant not under erasure. */
  erasing_at: string | null;
}

export interface KeyView {
  key_id: string;
  tenant_id: string;
  name: string;
  created_at: string;
  last_used_at: string | null;
  revoked_at: string | null;
}
