import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';

// No Docker engine here: docker-compose 1.29 (Debian) validates and normalises the compose file
// offline, and python3-yaml (its own dependency) turns the normalised YAML into JSON for asserts.
const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const composeFile = path.join(root, 'docker-compose.yml');
const hasCompose = spawnSync('docker-compose', ['version'], { encoding: 'utf8' }).status === 0;
const skipCompose = hasCompose
  ? false
  : 'docker-compose is not installed (apt-get install -y docker-compose; .ci/run installs it)';

// Empty environment for interpolation, so defaults in the file are what is checked.
const composeEnv = { PATH: process.env.PATH ?? '/usr/bin:/bin', HOME: process.env.HOME ?? '/tmp' };

function compose(args: string[]) {
  return spawnSync('docker-compose', ['-f', composeFile, ...args], {
    encoding: 'utf8',
    cwd: root,
    env: composeEnv,
  });
}

interface Service {
  image?: string;
  build?: unknown;
  command?: string[];
  environment?: Record<string, string>;
  depends_on?: Record<string, { condition: string }>;
  healthcheck?: { test?: string[]; disable?: boolean };
  restart?: string;
  ports?: unknown[];
}

function normalisedCompose(): { services: Record<string, Service>; volumes?: Record<string, unknown> } {
  const out = compose(['config']);
  assert.equal(out.status, 0, out.stderr);
  const py = spawnSync(
    'python3',
    ['-c', 'import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)'],
    { input: out.stdout, encoding: 'utf8' },
  );
  assert.equal(py.status, 0, `python3-yaml could not parse docker-compose config output: ${py.stderr}`);
  return JSON.parse(py.stdout) as ReturnType<typeof normalisedCompose>;
}

void describe('docker-compose.yml', () => {
  void it('validates with docker-compose 1.29 (offline)', { skip: skipCompose }, () => {
    const r = compose(['config', '-q']);
    assert.equal(r.status, 0, `docker-compose config -q failed:\n${r.stderr}`);
  });

  void it('avoids keys that docker-compose 1.29 or Compose v2 reject', () => {
    const text = readFileSync(composeFile, 'utf8')
      .split('\n')
      .filter((l) => !/^\s*#/.test(l))
      .join('\n');
    assert.doesNotMatch(text, /^name:/m, 'top-level name');
    assert.doesNotMatch(text, /start_interval/, 'healthcheck start_interval');
    assert.doesNotMatch(text, /^\s+restart:\s*(true|false)\s*$/m, 'depends_on.restart');
  });

  void it('runs Redis with AOF and noeviction', { skip: skipCompose }, () => {
    const { services } = normalisedCompose();
    const cmd = (services.redis?.command ?? []).join(' ');
    assert.match(cmd, /--appendonly yes/);
    assert.match(cmd, /--appendfsync (everysec|always)/);
    assert.match(cmd, /--maxmemory-policy noeviction/);
    assert.match(services.redis?.image ?? '', /^redis:7/);
  });

  void it('runs Postgres with pgvector', { skip: skipCompose }, () => {
    const { services } = normalisedCompose();
    assert.match(services.postgres?.image ?? '', /^pgvector\/pgvector:pg1[5-9]$/);
  });

  void it(
    'starts api and two workers only after the one-shot migrate service completed',
    { skip: skipCompose },
    () => {
      const { services } = normalisedCompose();
      assert.deepEqual(services.migrate?.command, ['node', 'bin/mnemos.js', 'migrate']);
      assert.notEqual(services.migrate?.restart, 'always');
      const workers = Object.entries(services).filter(
        ([, s]) => s.command?.join(' ') === 'node bin/mnemos.js worker',
      );
      assert.equal(
        workers.length,
        2,
        `expected two worker services, got ${workers.map(([n]) => n).join(', ')}`,
      );
      for (const [name, s] of [['api', services.api!] as const, ...workers]) {
        assert.ok(s, `${name} exists`);
        assert.equal(
          s.depends_on?.migrate?.condition,
          'service_completed_successfully',
          `${name} waits for migrate`,
        );
        assert.equal(s.depends_on?.postgres?.condition, 'service_healthy', `${name} waits for postgres`);
        assert.equal(s.depends_on?.redis?.condition, 'service_healthy', `${name} waits for redis`);
        assert.match(
          s.environment?.DATABASE_URL ?? '',
          /^postgres:\/\/[^@]+@postgres:5432\//,
          `${name} DATABASE_URL`,
        );
        assert.equal(s.environment?.REDIS_URL, 'redis://redis:6379', `${name} REDIS_URL`);
        assert.ok(
          s.environment && 'MNEMOS_ADMIN_TOKEN' in s.environment,
          `${name} passes MNEMOS_ADMIN_TOKEN`,
        );
      }
      assert.deepEqual(services.api?.command, ['node', 'bin/mnemos.js', 'api']);
      assert.equal(services.api?.environment?.HOST, '0.0.0.0');
    },
  );

  void it('has health checks on postgres, redis, the api and the workers', { skip: skipCompose }, () => {
    const { services } = normalisedCompose();
    assert.match((services.postgres?.healthcheck?.test ?? []).join(' '), /pg_isready/);
    assert.match((services.redis?.healthcheck?.test ?? []).join(' '), /redis-cli ping/);
    assert.match((services.api?.healthcheck?.test ?? []).join(' '), /\/readyz/);
    for (const w of ['worker-1', 'worker-2']) {
      assert.match((services[w]?.healthcheck?.test ?? []).join(' '), /\/healthz/, w);
    }
  });

  void it('runs a Prometheus that scrapes the api and both workers', { skip: skipCompose }, () => {
    const { services } = normalisedCompose();
    assert.ok(services.prometheus, 'a prometheus service');
    const scrape = readFileSync(path.join(root, 'deploy/prometheus.yml'), 'utf8');
    for (const target of ['api:8080', 'worker-1:8080', 'worker-2:8080'])
      assert.ok(scrape.includes(target), target);
  });
});

void describe('Dockerfile', () => {
  const dockerfile = readFileSync(path.join(root, 'Dockerfile'), 'utf8');
  const lines = dockerfile.split('\n').filter((l) => !/^\s*#/.test(l));

  void it('is multi-stage on a current Node LTS and runs as a non-root user', () => {
    const froms = lines.filter((l) => /^FROM\s/i.test(l));
    assert.ok(froms.length >= 2, 'at least two FROM stages');
    for (const f of froms) assert.match(f, /^FROM node:(22|24)[.\w-]*\s+AS\s+\w+/i);
    assert.match(dockerfile, /COPY --from=\w+/);
    const users = lines.filter((l) => /^USER\s/i.test(l));
    assert.ok(users.length > 0, 'a USER instruction');
    assert.doesNotMatch(users.at(-1)!, /^USER\s+(root|0)(\s|:|$)/i);
  });

  void it('installs production dependencies only, and the runtime needs nothing else', () => {
    assert.match(dockerfile, /npm ci --omit=dev/);
    const pkg = JSON.parse(readFileSync(path.join(root, 'package.json'), 'utf8')) as {
      dependencies: Record<string, string>;
    };
    // bin/mnemos.js runs TypeScript through tsx; the embedded default needs PGlite and pgvector.
    for (const dep of ['tsx', '@electric-sql/pglite', '@electric-sql/pglite-pgvector']) {
      assert.ok(pkg.dependencies[dep], `${dep} must be a runtime dependency`);
    }
  });

  void it('copies every source directory it needs, none of which .dockerignore excludes', () => {
    const ignored = readFileSync(path.join(root, '.dockerignore'), 'utf8')
      .split('\n')
      .map((l) => l.trim())
      .filter((l) => l && !l.startsWith('#'));
    const copied = lines
      .filter((l) => /^COPY\s/i.test(l) && !/--from=/.test(l))
      .flatMap((l) => l.trim().split(/\s+/).slice(1, -1))
      .filter((a) => !a.startsWith('--'));
    for (const need of ['bin', 'db', 'services', 'workers', 'package.json', 'package-lock.json']) {
      assert.ok(copied.includes(need), `COPY ${need}`);
    }
    for (const c of copied) {
      assert.ok(existsSync(path.join(root, c)), `${c} exists`);
      assert.ok(!ignored.includes(c), `${c} is not in .dockerignore`);
    }
  });

  void it('checks /healthz and starts "mnemos serve" by default', () => {
    assert.match(dockerfile, /^HEALTHCHECK[\s\S]*\/healthz/m);
    assert.match(dockerfile, /^CMD \["node", ?"bin\/mnemos\.js", ?"serve"\]$/m);
    assert.match(dockerfile, /HOST=0\.0\.0\.0/);
  });
});
