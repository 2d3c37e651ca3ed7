/**
 * `s` on one line: every run of whitespace, line breaks of any kind included (U+0085, which
 * JavaScript's `\s` does not match, U+2028, U+2029, a lone CR), as one space, trimmed. For text
 * that other text (a header, a record's label) follows on the next line of what a model reads:
 * a newline in a message's `name` or a stored symptom let it write lines that looked like
 * mnemos's own (a forged `[… · system · #3]` line, a forged error record).
 */
export const oneLine = (s: string): string => s.replace(/[\s\u0085]+/g, ' ').trim();

/**
 * True for the UTF-16 units oneLine turns into a space (`[\s\u0085]`, spelled out), for a loop
 * that has to know what oneLine would do without running it over a whole message.
 */
export const isOneLineSpace = (c: number): boolean =>
  (c >= 0x09 && c <= 0x0d) ||
  c === 0x20 ||
  c === 0x85 ||
  c === 0xa0 ||
  c === 0x1680 ||
  (c >= 0x2000 && c <= 0x200a) ||
  c === 0x2028 ||
  c === 0x2029 ||
  c === 0x202f ||
  c === 0x205f ||
  c === 0x3000 ||
  c === 0xfeff;
