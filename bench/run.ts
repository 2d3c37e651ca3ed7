/**
 * `npm run bench -- <name> [<name> …] [--flags …]`: runs bench/<name>.ts for each name, in the
 * order given, each as its own process (`node --import tsx bench/<name>.ts <flags>`), so one
 * bench's pools, servers and heap never skew the next. Names are the leading arguments; everything
 * from the first argument that starts with "-" on is passed to every bench unchanged.
 * With no name it lists the benches and runs none (each takes minutes and loads the machine).
 */
import { spawnSync } from 'node:child_process';
import { existsSync, readdirSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const BENCH_DIR = fileURLToPath(new URL('./', import.meta.url));
const ROOT = fileURLToPath(new URL('../', import.meta.url));

function available(): Array<{ name: string; about: string }> {
  return readdirSync(BENCH_DIR)
    .filter((f) => f.endsWith('.ts') && f !== 'run.ts')
    .sort()
    .map((f) => {
      const text = readFileSync(`${BENCH_DIR}${f}`, 'utf8');
      // First sentence of the file's opening comment.
      const about = /\/\*\*?\s*\n?\s*\*?\s*([^\n]*)/.exec(text)?.[1]?.replace(/\s+/g, ' ').trim() ?? '';
      return { name: f.slice(0, -3), about };
    });
}

const argv = process.argv.slice(2);
const firstFlag = argv.findIndex((a) => a.startsWith('-'));
const names = firstFlag === -1 ? argv : argv.slice(0, firstFlag);
const flags = firstFlag === -1 ? [] : argv.slice(firstFlag).filter((a, i) => !(i === 0 && a === '--'));

if (names.length === 0) {
  const list = available();
  process.stdout.write(
    `usage: npm run bench -- <name> [<name> …] [--flags passed to each bench]\n\navailable benches:\n${list
      .map((b) => `  ${b.name.padEnd(12)} ${b.about}`)
      .join('\n')}\n\nNo bench named: nothing run.\n`,
  );
  process.exit(0);
}

const unknown = names.filter(
  (n) => !/^[a-z0-9-]+$/.test(n) || !existsSync(`${BENCH_DIR}${n}.ts`) || n === 'run',
);
if (unknown.length > 0) {
  process.stderr.write(
    `unknown bench ${unknown.map((n) => `"${n}"`).join(', ')}; available: ${available()
      .map((b) => b.name)
      .join(', ')}\n`,
  );
  process.exit(2);
}

const outcomes: Array<{ name: string; status: number | null; seconds: number }> = [];
for (const name of names) {
  process.stdout.write(`\n=== bench ${name}${flags.length ? ` ${flags.join(' ')}` : ''}\n`);
  const t0 = Date.now();
  const r = spawnSync(process.execPath, ['--import', 'tsx', `bench/${name}.ts`, ...flags], {
    cwd: ROOT,
    stdio: 'inherit',
  });
  outcomes.push({ name, status: r.status ?? (r.signal ? 128 : 1), seconds: (Date.now() - t0) / 1000 });
  if (r.signal === 'SIGINT') break; // Ctrl-C stops the whole run, not just this bench
}
if (outcomes.length > 1 || outcomes.some((o) => o.status !== 0)) {
  process.stdout.write(
    `\n=== benches: ${outcomes.map((o) => `${o.name} ${o.status === 0 ? 'ok' : `FAILED (exit ${o.status})`} in ${o.seconds.toFixed(0)} s`).join(', ')}\n`,
  );
}
process.exit(outcomes.every((o) => o.status === 0) ? 0 : 1);
