/**
 * A stored summary seen as the three kinds of entries the per-turn relevance step judges. The
 * summarize job validates what it writes, but imported summaries may be partial, so nothing here
 * assumes more than "an object".
 */

export interface SummaryParts {
  keyDecisions: unknown[];
  pastDiscussions: unknown[];
  /** Undefined when the summary has no current discussion (absent, or all fields blank). */
  currentDiscussion: Record<string, unknown> | undefined;
}

export function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

const hasText = (v: unknown): boolean =>
  typeof v === 'string'
    ? v.trim() !== ''
    : Array.isArray(v)
      ? v.some(hasText)
      : isRecord(v) && Object.values(v).some(hasText);

export function summaryParts(summary: Record<string, unknown>): SummaryParts {
  const list = (v: unknown) => (Array.isArray(v) ? v.filter(hasText) : []);
  const current = summary['current_discussion'];
  return {
    keyDecisions: list(summary['key_decisions']),
    pastDiscussions: list(summary['past_discussions']),
    currentDiscussion: isRecord(current) && hasText(current) ? current : undefined,
  };
}

export const isEmptySummary = (p: SummaryParts): boolean =>
  p.keyDecisions.length === 0 && p.pastDiscussions.length === 0 && p.currentDiscussion === undefined;

/**
 * Rebuilds the summary with only the chosen entries; other fields are kept as stored. Null when
 * nothing of the three kinds remains (the turn-context message is then left out).
 */
export function pickParts(
  summary: Record<string, unknown>,
  parts: SummaryParts,
  keep: {
    keyDecisions: ReadonlySet<number>;
    pastDiscussions: ReadonlySet<number>;
    currentDiscussion: boolean;
  },
): Record<string, unknown> | null {
  const kd = parts.keyDecisions.filter((_, i) => keep.keyDecisions.has(i));
  const pd = parts.pastDiscussions.filter((_, i) => keep.pastDiscussions.has(i));
  const cd = keep.currentDiscussion ? parts.currentDiscussion : undefined;
  if (kd.length === 0 && pd.length === 0 && cd === undefined) return null;
  const out: Record<string, unknown> = { ...summary, key_decisions: kd, past_discussions: pd };
  if (cd === undefined) delete out['current_discussion'];
  else out['current_discussion'] = cd;
  return out;
}

/**
 * Rules about language, format, style or workflow apply to every turn, so they are kept whatever
 * the decision model says. A generous match costs a few tokens; a missed rule changes the answer.
 */
const GENERIC_RULE = new RegExp(
  [
    String.raw`\b(?:languages?|english|chinese|traditional|simplified|japanese|korean|spanish|french|german)\b`,
    String.raw`\b(?:reply|replies|respond|answer|write|speak)(?:ing)? in\b`,
    String.raw`\b(?:markdown|format(?:s|ting|ted)?|bullet(?: points?)?|tables|headings|emojis?|tone|step[- ]by[- ]step)\b`,
    // Length and brevity: "answer concisely", "keep answers short", "no long replies", "be brief".
    String.raw`\b(?:concise(?:ly|ness)?|succinct(?:ly)?|terse(?:ly)?|brief(?:ly)?|verbos(?:e|ity)|wordy|tl;?dr)\b`,
    String.raw`\b(?:short|long|brief)(?:er)? (?:answers?|replies|reply|responses?|explanations?|messages?)\b`,
    String.raw`\b(?:answers?|replies|reply|responses?|explanations?|it|them) (?:short|brief)\b`,
    String.raw`\b(?:workflow|code style|coding style|naming conventions?|commit messages?|time ?zones?|units)\b`,
    String.raw`\b(?:ask|check with) (?:me )?(?:first|before)|\bconfirm before\b`,
    '繁體|繁体|簡體|简体|中文|英文|日文|語言|语言|格式|回覆|回复|語氣|语气|風格|风格|簡潔|简洁|流程|步驟|步骤',
  ].join('|'),
  'i',
);

export function isGenericRule(entry: unknown): boolean {
  return typeof entry === 'string' && GENERIC_RULE.test(entry);
}
