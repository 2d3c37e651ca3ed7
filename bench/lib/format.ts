/** Plain-text output of the benches: aligned tables that paste into Markdown as they are. */

export const fmtInt = (n: number): string =>
  Number.isFinite(n) ? Math.round(n).toLocaleString('en-US') : 'n/a';

export const fmtMs = (n: number): string =>
  !Number.isFinite(n)
    ? 'n/a'
    : n >= 100
      ? `${n.toFixed(0)} ms`
      : n >= 10
        ? `${n.toFixed(1)} ms`
        : `${n.toFixed(2)} ms`;

export const fmtRatio = (n: number): string => (Number.isFinite(n) ? `${n.toFixed(2)}×` : 'n/a');

export const fmtPct = (n: number): string => (Number.isFinite(n) ? `${(n * 100).toFixed(0)} %` : 'n/a');

export const fmtSec = (ms: number): string => (Number.isFinite(ms) ? `${(ms / 1000).toFixed(1)} s` : 'n/a');

/** A Markdown table (pipes aligned so it also reads well in a terminal). */
export function markdownTable(headers: string[], rows: string[][]): string {
  const widths = headers.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? '').length)));
  const line = (cells: string[]) => `| ${cells.map((c, i) => c.padEnd(widths[i]!)).join(' | ')} |`;
  return [line(headers), `|${widths.map((w) => '-'.repeat(w + 2)).join('|')}|`, ...rows.map(line)].join('\n');
}

/** A progress or section line on stderr, so stdout keeps only the results. */
export function note(text: string): void {
  process.stderr.write(`[bench] ${text}\n`);
}
