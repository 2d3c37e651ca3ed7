/**
 * Where the CPU went during a bench phase (Linux /proc): core-seconds per labelled group of
 * processes, and how busy the whole machine was. On a 2-core machine shared with other work this
 * tells whether a phase was CPU-bound and which process spent it. A process that started and
 * ended inside the phase is missed; one that started inside it counts in full.
 */
import { readdir, readFile } from 'node:fs/promises';
import { availableParallelism } from 'node:os';

const TICKS_PER_SECOND = 100; // Linux USER_HZ

export interface CpuProbe {
  label: string;
  pids: () => Promise<number[]>;
}

export interface CpuSnapshot {
  at: number;
  machine: { busy: number; total: number };
  groups: Map<string, Map<number, number>>;
}

export interface CpuUsage {
  wallSeconds: number;
  /** Average busy cores of the whole machine (0..nproc). */
  machineCores: number;
  /** Core-seconds per group over the interval. */
  groups: Record<string, number>;
}

/** CPU seconds a process has used (utime + stime), from /proc; null once it is gone. */
export async function procCpuSeconds(pid: number): Promise<number | null> {
  try {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8');
    // Fields after the ")" that closes the command name; utime and stime are fields 14 and 15.
    const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
    return (Number(f[11]) + Number(f[12])) / TICKS_PER_SECOND;
  } catch {
    return null;
  }
}

async function machineTicks(): Promise<{ busy: number; total: number }> {
  const line = (await readFile('/proc/stat', 'utf8')).split('\n')[0]!;
  const v = line.trim().split(/\s+/).slice(1).map(Number);
  const total = v.slice(0, 8).reduce((a, b) => a + b, 0);
  const idle = (v[3] ?? 0) + (v[4] ?? 0);
  return { busy: total - idle, total };
}

/** Pids whose /proc/<pid>/comm equals `name` (e.g. redis-server). */
export async function pidsByName(name: string): Promise<number[]> {
  const out: number[] = [];
  for (const d of await readdir('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    try {
      if ((await readFile(`/proc/${d}/comm`, 'utf8')).trim() === name) out.push(Number(d));
    } catch {
      /* gone */
    }
  }
  return out;
}

export async function cpuSnapshot(probes: CpuProbe[]): Promise<CpuSnapshot> {
  const groups = new Map<string, Map<number, number>>();
  for (const p of probes) {
    const m = new Map<number, number>();
    for (const pid of await p.pids().catch(() => [])) {
      const s = await procCpuSeconds(pid);
      if (s !== null) m.set(pid, s);
    }
    groups.set(p.label, m);
  }
  return { at: Date.now(), machine: await machineTicks(), groups };
}

export function cpuDiff(a: CpuSnapshot, b: CpuSnapshot): CpuUsage {
  const groups: Record<string, number> = {};
  for (const [label, end] of b.groups) {
    const start = a.groups.get(label) ?? new Map<number, number>();
    let sum = 0;
    for (const [pid, s] of end) sum += s - (start.get(pid) ?? 0);
    groups[label] = sum;
  }
  const wallSeconds = (b.at - a.at) / 1000;
  const cores = (b.machine.busy - a.machine.busy) / Math.max(1, b.machine.total - a.machine.total);
  return { wallSeconds, machineCores: cores * availableParallelism(), groups };
}
