/**
 * `s` on one line: every run of whitespace, line breaks of any kind included (U+0085, which
 * JavaScript's `\s` does not match, U+2028, U+2029, a lone CR), as one space, trimmed. For text
 * that other text (a header, a record's label) follows on the next line of what a model reads:
 * a newline in a message's `name` or a stored symptom let it write lines that looked like
 * mnemos's own (a forged `[… · system · #3]` line, a forged error record).
 */
export const oneLine = (s: string): string => s.replace(/[\s\u0085]+/g, ' ').trim();
