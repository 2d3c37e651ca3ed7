#!/usr/bin/env bash
# install-pgbouncer.sh — make Debian's pgbouncer binary available for the tests that run mnemos
# behind a pooler in transaction mode (test/pg-pooler.test.ts starts its own instance on a free
# port; the package's own service is never needed).
#
# Idempotent: exits at once when `pgbouncer` is on the PATH (or in /usr/sbin).
set -euo pipefail

log() { printf '[pgbouncer] %s\n' "$*"; }
die() { printf '[pgbouncer] ERROR: %s\n' "$*" >&2; exit 1; }

if command -v pgbouncer >/dev/null 2>&1 || [[ -x /usr/sbin/pgbouncer ]]; then
  log "OK: $( (command -v pgbouncer || echo /usr/sbin/pgbouncer) | head -1)"
  exit 0
fi

SUDO=()
if [[ ${EUID} -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || die "not installed and not running as root (and no sudo): apt-get install pgbouncer"
  SUDO=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
INSTALL=("${SUDO[@]}" apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=300 pgbouncer)
log "installing pgbouncer (Debian package)"
if ! "${INSTALL[@]}"; then
  log "apt-get install failed — running apt-get update and retrying"
  "${SUDO[@]}" apt-get update -o DPkg::Lock::Timeout=300
  "${INSTALL[@]}"
fi
[[ -x /usr/sbin/pgbouncer ]] || command -v pgbouncer >/dev/null 2>&1 || die "pgbouncer still missing after apt-get install"
log "OK: installed"
