/** The `retry-after` header of a 429 or 503, read for the client's retries (client/transport.ts). */

/**
 * `retry-after` as milliseconds: delta-seconds (decimals tolerated) or an HTTP date (RFC 9110:
 * IMF-fixdate, RFC 850 or asctime), else null (the caller's backoff). Only those forms: `-5`
 * went to Date.parse, which reads it as a date in the past, and the retry came at once.
 */
export function parseRetryAfter(value: string | null): number | null {
  if (value === null) return null;
  const v = value.trim();
  if (/^\d+(\.\d+)?$/.test(v)) return Math.round(Number(v) * 1000);
  const at = httpDate(v);
  return at === null ? null : Math.max(0, at - Date.now());
}

const MONTHS = ['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun', 'Jul', 'Aug', 'Sep', 'Oct', 'Nov', 'Dec'];
const MONTH = `(${MONTHS.join('|')})`;
const TIME = '(\\d{2}):(\\d{2}):(\\d{2})';
const WEEKDAY = '(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)';
// Sun, 06 Nov 1994 08:49:37 GMT
const IMF_FIXDATE = new RegExp(`^${WEEKDAY}, (\\d{2}) ${MONTH} (\\d{4}) ${TIME} GMT$`);
// Sunday, 06-Nov-94 08:49:37 GMT
const RFC_850 = new RegExp(
  `^(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday), (\\d{2})-${MONTH}-(\\d{2}) ${TIME} GMT$`,
);
// Sun Nov  6 08:49:37 1994 (GMT, although it does not say so)
const ASCTIME = new RegExp(`^${WEEKDAY} ${MONTH} ( \\d|\\d{2}) ${TIME} (\\d{4})$`);

/** An HTTP date as epoch milliseconds, read by its grammar (Date.parse takes almost anything). */
function httpDate(v: string): number | null {
  let m = IMF_FIXDATE.exec(v);
  let parts: { day: string; month: string; year: number; time: string[] } | null = null;
  if (m) parts = { day: m[1]!, month: m[2]!, year: Number(m[3]), time: m.slice(4) };
  else if ((m = RFC_850.exec(v))) {
    // A two-digit year more than 50 years ahead is the last century's (RFC 9110 §5.6.7).
    let year = 2000 + Number(m[3]);
    if (year > new Date().getUTCFullYear() + 50) year -= 100;
    parts = { day: m[1]!, month: m[2]!, year, time: m.slice(4) };
  } else if ((m = ASCTIME.exec(v))) {
    parts = { day: m[2]!, month: m[1]!, year: Number(m[6]), time: m.slice(3, 6) };
  }
  if (!parts) return null;
  const day = Number(parts.day);
  const [h, min, sec] = parts.time.map(Number) as [number, number, number];
  if (day < 1 || day > 31 || h > 23 || min > 59 || sec > 60) return null;
  return Date.UTC(parts.year, MONTHS.indexOf(parts.month), day, h, min, sec);
}
