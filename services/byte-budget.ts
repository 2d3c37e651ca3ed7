/**
 * A budget of bytes (or any units), `total` in all and `perKey` for one key; `take` waits up to
 * `waitMs` for room (true), else says which bound left none: the key's own share, or the total.
 * Room that comes back goes to waiters in order, skipping those that still do not fit.
 */
export function byteBudget(total: number, perKey: number) {
  let used = 0;
  const usedBy = new Map<string, number>();
  const waiting: Array<{ key: string; bytes: number; grant: () => void }> = [];
  const fits = (key: string, bytes: number) =>
    used + bytes <= total && (usedBy.get(key) ?? 0) + bytes <= perKey;
  const add = (key: string, bytes: number) => {
    used += bytes;
    usedBy.set(key, (usedBy.get(key) ?? 0) + bytes);
  };
  return {
    take(key: string, bytes: number, waitMs: number): Promise<true | 'key' | 'total'> {
      // Not behind the waiters: one waiting on its tenant's room must not hold up other tenants.
      if (fits(key, bytes)) {
        add(key, bytes);
        return Promise.resolve(true);
      }
      return new Promise((resolve) => {
        const w = {
          key,
          bytes,
          grant: () => {
            clearTimeout(timer);
            add(key, bytes);
            resolve(true);
          },
        };
        const timer = setTimeout(() => {
          waiting.splice(waiting.indexOf(w), 1);
          resolve((usedBy.get(key) ?? 0) + bytes > perKey ? 'key' : 'total');
        }, waitMs);
        waiting.push(w);
      });
    },
    give(key: string, bytes: number): void {
      used -= bytes;
      const left = (usedBy.get(key) ?? 0) - bytes;
      if (left > 0) usedBy.set(key, left);
      else usedBy.delete(key);
      for (const w of [...waiting]) {
        if (!fits(w.key, w.bytes)) continue;
        waiting.splice(waiting.indexOf(w), 1);
        w.grant();
      }
    },
  };
}
export type ByteBudget = ReturnType<typeof byteBudget>;
