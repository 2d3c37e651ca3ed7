/**
 * One complete agent turn over mnemos and any OpenAI-compatible chat API, with plain fetch (no
 * SDK), so it can be copied as is. Run it:
 *
 *   MNEMOS_URL=http://127.0.0.1:8080 MNEMOS_API_KEY=mn_… OPENAI_API_KEY=sk-… MODEL=gpt-4o-mini \
 *     node --import tsx examples/agent-loop.ts "What did we decide about the index?"
 *
 * Env: MNEMOS_URL, MNEMOS_API_KEY, OPENAI_BASE_URL (default https://api.openai.com/v1),
 * OPENAI_API_KEY, MODEL (default gpt-4o-mini), MNEMOS_SESSION (default agent-loop-demo).
 *
 * Order of a turn, and why: the new user message is not posted before the model call here. It goes
 * to `context` as `input`, which appends it after the history (and, with a DECISION_MODEL, uses it
 * to keep only the relevant part of the summary). (Posting it first also works: a last history
 * message equal to `input` is not repeated.) The turn is posted once it is over:
 * user message, assistant tool calls, tool results and the final answer, in ONE request, so the
 * turn lands as consecutive seqs (tool calls and their results stay together) and the summary
 * never sees half a turn. Each message carries the time it happened (`sent_at`) and an id made up
 * front, so the post can be retried without duplicates. The price: if the process dies mid-turn,
 * that turn is not stored; a caller that needs the user message durable at once can post it first
 * with its id and still pass its text as `input` (with `minSeq`): the context then leaves the
 * posted copy out of the history and puts it last, after the summary, where the `system_block`
 * says the new request is. (Without `input` the question would sit in the history, before the
 * summary, and the model would see the summary JSON last.)
 * For the next turn, pass the returned `lastSeq` as `minSeq` (read-your-writes after the 202).
 */
import { pathToFileURL } from 'node:url';
import { createMnemosClient, isMnemosError } from '../client/mnemos-client.js';
import type {
  ChatMessage,
  MessageInput,
  MnemosClient,
  ToolCall,
  ToolDefinition,
} from '../client/mnemos-client.js';

export interface LlmConfig {
  /** An OpenAI-compatible base URL ending in /v1. */
  baseUrl: string;
  apiKey?: string;
  model: string;
  fetch?: typeof fetch;
}

/** A tool of the agent's own (shell, http, …); its failures are looked up in error memory. */
export interface LocalTool {
  definition: ToolDefinition;
  run(args: string): Promise<string>;
}

export interface TurnOptions {
  mnemos: MnemosClient;
  llm: LlmConfig;
  sessionId: string;
  userText: string;
  systemPrompt?: string;
  /** The previous turn's `lastSeq`: the context waits until it is archived. */
  minSeq?: number;
  /** Tool-call rounds before the model must answer. Default 6. */
  maxToolRounds?: number;
  /** mnemos tool definitions, if already fetched (they do not change while a server runs). */
  mnemosTools?: ToolDefinition[];
  localTools?: Record<string, LocalTool>;
}

export interface TurnResult {
  answer: string;
  /** What was posted, in order (with ids and times). */
  posted: MessageInput[];
  /** Seq of the last message of the turn: pass it as the next turn's `minSeq`. */
  lastSeq: number;
  toolCalls: number;
}

const DEFAULT_SYSTEM_PROMPT =
  'You are a helpful assistant. Use chat_history when the user refers to something you do not see, and error_history before retrying a failed tool.';

export async function runTurn(opts: TurnOptions): Promise<TurnResult> {
  const { mnemos, sessionId: sid } = opts;
  const turn: MessageInput[] = [message({ role: 'user', content: opts.userText })];

  // History + relevant summary + the new input as the last user message.
  let history: ChatMessage[] = [{ role: 'user', content: opts.userText }];
  let systemBlock = '';
  try {
    const ctx = await mnemos.context(sid, { input: opts.userText, minSeq: opts.minSeq });
    history = ctx.messages;
    systemBlock = ctx.system_block;
  } catch (err) {
    // A session exists from its first message: the first turn has no context to load.
    if (!isMnemosError(err, 'not_found')) throw err;
  }
  const system = [opts.systemPrompt ?? DEFAULT_SYSTEM_PROMPT, systemBlock].filter(Boolean).join('\n\n');
  const convo: ChatMessage[] = [{ role: 'system', content: system }, ...history];

  const mnemosTools = opts.mnemosTools ?? (await mnemos.tools());
  const mnemosNames = new Set(mnemosTools.map((t) => t.function.name));
  const local = opts.localTools ?? {};
  const tools = [...mnemosTools, ...Object.values(local).map((t) => t.definition)];
  const maxRounds = opts.maxToolRounds ?? 6;

  let answer = '';
  let toolCalls = 0;
  for (let round = 0; ; round++) {
    // After the last round the model must answer in text.
    const reply = await chat(opts.llm, convo, tools, round < maxRounds ? 'auto' : 'none');
    const calls = reply.tool_calls ?? [];
    if (calls.length === 0 || round >= maxRounds) {
      answer = reply.content ?? '';
      turn.push(message({ role: 'assistant', content: answer }));
      break;
    }
    const assistant: ChatMessage = { role: 'assistant', content: reply.content ?? null, tool_calls: calls };
    convo.push(assistant);
    turn.push(message(assistant));
    for (const call of calls) {
      toolCalls++;
      const content = await runToolCall(mnemos, sid, call, mnemosNames, local);
      const result: ChatMessage = { role: 'tool', tool_call_id: call.id, content };
      convo.push(result);
      turn.push(message(result));
    }
  }

  const posted = await mnemos.postMessages(sid, turn);
  return {
    answer,
    posted: turn,
    lastSeq: Math.max(...posted.messages.map((m) => m.seq)),
    toolCalls,
  };
}

/** A message of this turn, with its id and the time it happened. */
function message(m: ChatMessage): MessageInput {
  const out: MessageInput = { id: crypto.randomUUID(), role: m.role, content: m.content };
  if (m.tool_calls) out.tool_calls = m.tool_calls;
  if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
  out.sent_at = new Date().toISOString();
  return out;
}

async function runToolCall(
  mnemos: MnemosClient,
  sid: string,
  call: ToolCall,
  mnemosNames: Set<string>,
  local: Record<string, LocalTool>,
): Promise<string> {
  const name = call.function.name;
  if (mnemosNames.has(name)) {
    try {
      // Bad arguments come back as guidance text for the model (HTTP 200), not as errors.
      return await mnemos.runTool(sid, name, call.function.arguments);
    } catch (err) {
      return `The ${name} tool is unavailable right now (${(err as Error).message}).`;
    }
  }
  const tool = local[name];
  if (!tool) return `There is no tool named ${name}.`;
  try {
    return await tool.run(call.function.arguments);
  } catch (err) {
    // Error memory: how this failure was fixed before, in any session of this tenant.
    const error = (err as Error).message;
    const hint = await mnemos.lookupError({ toolName: name, error }).catch(() => null);
    const related =
      hint && hint.related_errors !== 'NONE' ? `\n\nRelated past errors:\n${hint.related_errors}` : '';
    return `Error: ${error}${related}`;
  }
}

interface AssistantReply {
  content: string | null;
  tool_calls?: ToolCall[];
}

/** One chat completion over plain fetch (the OpenAI wire format). */
async function chat(
  llm: LlmConfig,
  messages: ChatMessage[],
  tools: ToolDefinition[],
  toolChoice: 'auto' | 'none',
): Promise<AssistantReply> {
  const doFetch = llm.fetch ?? fetch;
  const res = await doFetch(`${llm.baseUrl.replace(/\/+$/, '')}/chat/completions`, {
    method: 'POST',
    headers: {
      'content-type': 'application/json',
      ...(llm.apiKey ? { authorization: `Bearer ${llm.apiKey}` } : {}),
    },
    body: JSON.stringify({
      model: llm.model,
      messages,
      ...(tools.length > 0 ? { tools, tool_choice: toolChoice } : {}),
    }),
    signal: AbortSignal.timeout(120_000),
  });
  const text = await res.text();
  if (!res.ok) throw new Error(`chat completion failed: HTTP ${res.status}: ${text.slice(0, 300)}`);
  const body = JSON.parse(text) as { choices?: Array<{ message?: AssistantReply }> };
  const reply = body.choices?.[0]?.message;
  if (!reply) throw new Error('chat completion without a message');
  // Keep only what the next request and the archive accept (drops refusal, audio, …).
  const out: AssistantReply = { content: reply.content ?? null };
  if (reply.tool_calls?.length) {
    out.tool_calls = reply.tool_calls.map((c) => ({
      id: c.id,
      type: 'function',
      function: { name: c.function.name, arguments: c.function.arguments },
    }));
  }
  return out;
}

async function main(): Promise<void> {
  const env = process.env;
  const userText = process.argv.slice(2).join(' ').trim();
  if (!env.MNEMOS_URL || !env.MNEMOS_API_KEY || !userText) {
    console.error('usage: MNEMOS_URL=… MNEMOS_API_KEY=… [OPENAI_*, MODEL] agent-loop.ts "your message"');
    process.exit(2);
  }
  const mnemos = createMnemosClient({ baseUrl: env.MNEMOS_URL, apiKey: env.MNEMOS_API_KEY });
  const result = await runTurn({
    mnemos,
    llm: {
      baseUrl: env.OPENAI_BASE_URL ?? 'https://api.openai.com/v1',
      apiKey: env.OPENAI_API_KEY,
      model: env.MODEL ?? 'gpt-4o-mini',
    },
    sessionId: env.MNEMOS_SESSION ?? 'agent-loop-demo',
    userText,
  });
  console.log(result.answer);
  console.error(`(${result.toolCalls} tool calls; turn stored up to seq ${result.lastSeq})`);
}

if (process.argv[1] && import.meta.url === pathToFileURL(process.argv[1]).href) {
  main().catch((err: unknown) => {
    console.error(err);
    process.exit(1);
  });
}
