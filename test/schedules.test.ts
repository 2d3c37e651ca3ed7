// Maintenance schedules live in Redis and BullMQ times them by the clock of whichever process
// touches them: a worker with its clock ahead must not leave them far in the future.
import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { Worker } from 'bullmq';
import { makeQueues, scheduleMaintenance } from '../workers/queues.js';
import { deleteRedisPrefix, testPrefix } from './support/harness.js';

const REDIS_URL = process.env.TEST_REDIS_URL ?? 'redis://127.0.0.1:6379';
const prefix = testPrefix();
const queues = makeQueues({ url: REDIS_URL }, prefix);

after(async () => {
  await queues.close();
  await deleteRedisPrefix(prefix);
});

/** When the scheduler's pending job is due, from now (ms). */
async function dueIn(): Promise<number[]> {
  const jobs = await queues.maintenance.getJobs(['waiting', 'delayed', 'prioritized']);
  return jobs.filter((j) => j.name === 'ingest-sweep').map((j) => j.timestamp + (j.delay ?? 0) - Date.now());
}

void test('a schedule that a worker with its clock an hour ahead ran is brought back by the next re-assert', async () => {
  const hour = 3_600_000;
  const every = 30_000;
  await scheduleMaintenance(queues, 'ingest-sweep', every);
  // A worker an hour ahead takes the due job: BullMQ schedules the next one by its clock.
  const realNow = Date.now;
  Date.now = () => realNow() + hour;
  try {
    let ran!: () => void;
    const done = new Promise<void>((resolve) => (ran = resolve));
    const worker = new Worker('maintenance', () => Promise.resolve(ran()), {
      connection: { url: REDIS_URL },
      prefix,
    });
    await done;
    await new Promise((r) => setTimeout(r, 300));
    await worker.close();
  } finally {
    Date.now = realNow;
  }
  const far = await dueIn();
  assert.equal(far.length, 1);
  assert.ok(far[0]! > hour - every, `due in ${far[0]} ms`);
  // The next re-assert by a worker with the right time.
  await scheduleMaintenance(queues, 'ingest-sweep', every);
  const near = await dueIn();
  assert.equal(near.length, 1, JSON.stringify(near));
  assert.ok(near[0]! <= every, `due in ${near[0]} ms`);
  // A schedule within its interval is left as it is.
  const next = (await queues.maintenance.getJobScheduler('ingest-sweep'))?.next;
  await scheduleMaintenance(queues, 'ingest-sweep', every);
  assert.equal((await queues.maintenance.getJobScheduler('ingest-sweep'))?.next, next);
});
