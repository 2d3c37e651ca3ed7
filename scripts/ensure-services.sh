#!/usr/bin/env bash
# ensure-services.sh — make sure the local PostgreSQL 15 (127.0.0.1:5432) and
# Redis (127.0.0.1:6379) are up. Idempotent: does nothing if both already
# answer. Exits non-zero if either cannot be brought up.
set -euo pipefail

log() { printf '[services] %s\n' "$*"; }
err() { printf '[services] ERROR: %s\n' "$*" >&2; }

PG_HOST=127.0.0.1 PG_PORT=5432 PG_VERSION=15 PG_CLUSTER=main PG_WAIT=30
REDIS_HOST=127.0.0.1 REDIS_PORT=6379 REDIS_WAIT=10

pg_up()    { pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 2 >/dev/null 2>&1; }
redis_up() { [[ $(redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null) == PONG ]]; }

# wait_for <seconds> <check-function>: polls every 0.5 s.
wait_for() {
  local secs=$1 check=$2 i
  for ((i = 0; i < secs * 2; i++)); do
    "$check" && return 0
    sleep 0.5
  done
  "$check"
}

ensure_postgres() {
  if pg_up; then
    log "PostgreSQL ${PG_VERSION} already accepting connections on ${PG_HOST}:${PG_PORT}"
    return 0
  fi
  log "PostgreSQL not accepting connections on ${PG_HOST}:${PG_PORT}; starting cluster ${PG_VERSION}/${PG_CLUSTER}"
  # A failed start may simply mean another caller started it concurrently;
  # the wait below is what decides.
  if ! pg_ctlcluster --skip-systemctl-redirect "$PG_VERSION" "$PG_CLUSTER" start; then
    log "pg_ctlcluster start returned non-zero (may already be starting); waiting anyway"
  fi
  if wait_for "$PG_WAIT" pg_up; then
    log "PostgreSQL ${PG_VERSION} is up on ${PG_HOST}:${PG_PORT}"
  else
    err "PostgreSQL did not accept connections on ${PG_HOST}:${PG_PORT} within ${PG_WAIT}s"
    err "see: pg_lsclusters; /var/log/postgresql/postgresql-${PG_VERSION}-${PG_CLUSTER}.log"
    return 1
  fi
}

ensure_redis() {
  if redis_up; then
    log "Redis already answering PING on ${REDIS_HOST}:${REDIS_PORT}"
    return 0
  fi
  command -v redis-server >/dev/null 2>&1 || { err "redis-server not installed"; return 1; }
  log "Redis not answering on ${REDIS_HOST}:${REDIS_PORT}; starting redis-server (no persistence)"
  if ! redis-server --daemonize yes --bind "$REDIS_HOST" --port "$REDIS_PORT" --save "" --appendonly no; then
    log "redis-server returned non-zero (port may be taken by a starting instance); waiting anyway"
  fi
  if wait_for "$REDIS_WAIT" redis_up; then
    log "Redis is up on ${REDIS_HOST}:${REDIS_PORT}"
  else
    err "Redis did not answer PING on ${REDIS_HOST}:${REDIS_PORT} within ${REDIS_WAIT}s"
    return 1
  fi
}

# Try both even if the first fails, so one run reports every problem.
rc=0
ensure_postgres || rc=1
ensure_redis || rc=1
if ((rc == 0)); then
  log "all services up"
else
  err "one or more services could not be brought up"
fi
exit "$rc"
