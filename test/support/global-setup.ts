// Run once per `npm test` (setup, then teardown) by scripts/run-tests.js.
import { Redis } from 'ioredis';
import { migrate } from '../../db/migrate.js';
import { makePgDb } from '../../db/pool.js';

const adminUrl = process.env.TEST_DATABASE_ADMIN_URL!;
const template = process.env.MNEMOS_TEST_TEMPLATE!;
const runId = process.env.MNEMOS_TEST_RUN!;
// The services are shared: teardown drops what carries this run's id, so a missing id would match
// every run's databases (a helper's stray teardown once dropped other runs' databases mid-test).
for (const [name, value] of Object.entries({
  TEST_DATABASE_ADMIN_URL: adminUrl,
  MNEMOS_TEST_TEMPLATE: template,
  MNEMOS_TEST_RUN: runId,
})) {
  if (!value) throw new Error(`global-setup: ${name} is not set (scripts/run-tests.js sets it)`);
}
const STALE_SECONDS = 3 * 3600;

const dbUrl = (name: string) => {
  const u = new URL(adminUrl);
  u.pathname = `/${name}`;
  return u.toString();
};

async function dropDatabases(filter: (name: string) => boolean) {
  const admin = makePgDb({ connectionString: adminUrl, max: 1 });
  try {
    const r = await admin.query<{ datname: string }>(
      `SELECT datname FROM pg_database WHERE datname LIKE 'mnemos\\_t%'`,
    );
    for (const { datname } of r.rows) {
      if (!filter(datname)) continue;
      await admin.query(`DROP DATABASE IF EXISTS "${datname}" WITH (FORCE)`).catch(() => undefined);
    }
  } finally {
    await admin.close();
  }
}

async function deleteRedisKeys(match: (key: string) => boolean, pattern: string) {
  const redis = new Redis(process.env.TEST_REDIS_URL ?? 'redis://127.0.0.1:6379');
  try {
    let cursor = '0';
    do {
      const [next, keys] = await redis.scan(cursor, 'MATCH', pattern, 'COUNT', 1000);
      cursor = next;
      const doomed = keys.filter(match);
      if (doomed.length) await redis.unlink(...doomed);
    } while (cursor !== '0');
  } finally {
    redis.disconnect();
  }
}

// Names carry the run's start time: mnemos_t{pl}_<epoch>_<hex>[_<file>]; prefixes mt_<epoch>_<hex>_….
const ageOf = (name: string) => {
  const m = /_(\d{10})_/.exec(name);
  return m ? Date.now() / 1000 - Number(m[1]) : 0;
};

if (process.argv[2] === 'setup') {
  await dropDatabases((n) => ageOf(n) > STALE_SECONDS);
  await deleteRedisKeys((k) => ageOf(k) > STALE_SECONDS, 'mt_*');
  const admin = makePgDb({ connectionString: adminUrl, max: 1 });
  await admin.query(`CREATE DATABASE "${template}"`);
  await admin.close();
  const db = makePgDb({ connectionString: dbUrl(template), max: 1 });
  await migrate(db);
  await db.close();
  process.stdout.write(`[test] template database ${template} migrated\n`);
} else {
  await dropDatabases((n) => n === template || n.startsWith(`mnemos_t_${runId}_`));
  await deleteRedisKeys(() => true, `mt_${runId}_*`);
}
