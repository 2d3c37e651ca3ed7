/**
 * OpenAI `function` tool definitions for the agent's own LLM. Descriptions are written for a
 * model: when to call, what each field means, and limits, kept short so they cost little context.
 */
export const TOOL_NAMES = ['chat_history', 'error_history', 'write_error'] as const;
export type ToolName = (typeof TOOL_NAMES)[number];

export const toolDefinitions = [
  {
    type: 'function',
    function: {
      name: 'chat_history',
      description:
        'Look up earlier messages of THIS conversation that are no longer in your context. Use it when the user refers to something said before ("as we discussed", "the error from yesterday", a name or id you do not see). mode "search" finds messages by keywords (best: distinctive nouns, names, ids, error text; any language, CJK included; "exact phrase", or, -exclude work: quote a term that starts with one dash, "-1", to find it; --flags are words); "read" returns a seq range around a search hit; "list" returns the latest messages. Results show [time · role · #seq] lines.',
      parameters: {
        type: 'object',
        properties: {
          mode: {
            type: 'string',
            enum: ['search', 'read', 'list'],
            description: 'Default: "search" when keyword is given, else "list".',
          },
          keyword: {
            type: 'string',
            description: 'What to search for, e.g. "pgvector index" or "部署 錯誤".',
          },
          match: {
            type: 'string',
            enum: ['hybrid', 'keyword', 'semantic'],
            description:
              'search only. hybrid (default) combines exact words and meaning (only words, without an embedding model).',
          },
          time_range: {
            type: 'string',
            enum: ['1d', '7d', '1m', '1y', 'all'],
            description: 'search only. Limit to the last day, week, month (30 days), year. Default all.',
          },
          limit: {
            type: 'integer',
            minimum: 1,
            maximum: 32,
            description: 'Max hits or messages. Default 8.',
          },
          from_seq: { type: 'integer', minimum: 0, description: 'read only: first seq (inclusive).' },
          to_seq: {
            type: 'integer',
            minimum: 0,
            description: 'read only: last seq (inclusive); at most 50 messages.',
          },
        },
        additionalProperties: false,
      },
    },
  },
  {
    type: 'function',
    function: {
      name: 'error_history',
      description:
        'Before retrying a failed tool call, check whether this error was seen before (in any conversation) and what fixed it. mode "search" (default) matches tool name and error terms; "read" returns one record by id.',
      parameters: {
        type: 'object',
        properties: {
          mode: { type: 'string', enum: ['search', 'read'] },
          keyword: { type: 'string', description: 'search: the error message or its key terms.' },
          tool_name: { type: 'string', description: 'search: only records of this tool.' },
          limit: { type: 'integer', minimum: 1, maximum: 16, description: 'Default 4.' },
          id: { type: 'string', description: 'read: a record id like err_abc…' },
        },
        additionalProperties: false,
      },
    },
  },
  {
    type: 'function',
    function: {
      name: 'write_error',
      description:
        'After you got past a tool error, record what happened so future runs can avoid it: the tool, the symptom (error text), the cause if known, the action that fixed it (or that you tried), and the outcome. Do not include secrets or personal data.',
      parameters: {
        type: 'object',
        properties: {
          tool_name: { type: 'string', description: 'The tool that failed, e.g. "shell" or "http_get".' },
          symptom: { type: 'string', description: 'The error as observed (message, status code).' },
          cause: { type: 'string', description: 'Why it happened, if known.' },
          action: { type: 'string', description: 'What you did about it.' },
          outcome: {
            type: 'string',
            enum: ['resolved', 'failed', 'abandoned'],
            description: 'resolved = the action fixed it.',
          },
          keywords: {
            type: 'array',
            items: { type: 'string' },
            maxItems: 32,
            description: 'Optional search terms.',
          },
        },
        required: ['tool_name', 'symptom', 'action', 'outcome'],
        additionalProperties: false,
      },
    },
  },
] as const;

type JsonSchema = { type?: string | string[]; enum?: readonly unknown[]; [k: string]: unknown };

/**
 * The definitions for OpenAI's structured outputs (`strict: true`, which the OpenAI Agents SDK
 * sets by default): every property required, the optional ones nullable (the tools read `null`
 * as absent), no other properties. A strict request with the plain definitions is a 400 at
 * OpenAI (`required` must list every property).
 */
export function strictToolDefinitions() {
  return toolDefinitions.map((t) => {
    const p = t.function.parameters as {
      properties: Record<string, JsonSchema>;
      required?: readonly string[];
    };
    const required = new Set(p.required ?? []);
    const properties = Object.fromEntries(
      Object.entries(p.properties).map(([k, v]) => {
        if (required.has(k)) return [k, v];
        const nullable: JsonSchema = { ...v, type: [v.type as string, 'null'] };
        if (v.enum) nullable.enum = [...v.enum, null];
        return [k, nullable];
      }),
    );
    return {
      type: t.type,
      function: {
        ...t.function,
        strict: true,
        parameters: { ...p, properties, required: Object.keys(p.properties), additionalProperties: false },
      },
    };
  });
}
