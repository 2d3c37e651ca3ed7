/**
 * `p`'s value, or null when it fails or takes longer than `ms` (it is then left to settle on its
 * own): for reads whose answer is optional, a cache or a metric, that must not hold their caller.
 */
export async function orNull<T>(p: Promise<T>, ms: number): Promise<T | null> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<null>((resolve) => {
    timer = setTimeout(() => resolve(null), ms);
  });
  try {
    return await Promise.race([p.catch(() => null), late]);
  } finally {
    clearTimeout(timer);
  }
}
