#!/usr/bin/env bash
# install-pgvector.sh — make the pgvector extension available to the local
# PostgreSQL 15 (Debian 12 / bookworm).
#
# bookworm does not package pgvector, so we build Debian's *own* source
# package from trixie (fetched with `apt-get source` through a private,
# throw-away apt configuration — the system's /etc/apt, lists and caches are
# never modified) against bookworm's postgresql-server-dev-15, and
# `make install` it into PostgreSQL 15's directories.
#
# Idempotent: exits immediately when vector.control (and vector.so) are already
# installed. Safe to run concurrently: a flock serialises the slow path and the
# waiting copy re-checks after acquiring the lock.
#
# Environment knobs:
#   PGVECTOR_ALLOW_UNSIGNED=1   last-resort fallback, see "Signing key" below.
#   PGHOST/PGPORT/PGUSER        for the final check (default 127.0.0.1:5432, postgres).
set -euo pipefail

log() { printf '[pgvector] %s\n' "$*"; }
die() { printf '[pgvector] ERROR: %s\n' "$*" >&2; exit 1; }

PG_MAJOR=15
MIN_VERSION=0.7

# --- locate pg_config for PG 15 (the Debian wrapper /usr/bin/pg_config may
#     point at another major version, so prefer the versioned one) ------------
if [[ -x /usr/lib/postgresql/${PG_MAJOR}/bin/pg_config ]]; then
  PG_CONFIG=/usr/lib/postgresql/${PG_MAJOR}/bin/pg_config
elif command -v pg_config >/dev/null 2>&1; then
  PG_CONFIG=$(command -v pg_config)
else
  die "pg_config not found (is PostgreSQL ${PG_MAJOR} installed?)"
fi

# One pg_config call prints both lines, in the order asked for.
{ read -r SHAREDIR && read -r PKGLIBDIR; } < <("$PG_CONFIG" --sharedir --pkglibdir) ||
  die "$PG_CONFIG --sharedir --pkglibdir failed"
EXT_DIR="${SHAREDIR}/extension"

is_installed() {
  # vector.control is the documented marker; also require the shared library
  # so a half-finished `make install` is not mistaken for success.
  [[ -f "${EXT_DIR}/vector.control" && -f "${PKGLIBDIR}/vector.so" ]]
}

control_version() {
  sed -n "s/^default_version *= *'\([^']*\)'.*/\1/p" "${EXT_DIR}/vector.control" 2>/dev/null || true
}

# --- fast path ----------------------------------------------------------------
if is_installed; then
  log "already installed: ${EXT_DIR}/vector.control (default_version $(control_version)) — nothing to do"
  exit 0
fi

# --- slow path: needs root (apt-get install, make install) --------------------
SUDO=()
if [[ ${EUID} -ne 0 ]]; then
  command -v sudo >/dev/null 2>&1 || die "not installed and not running as root (and no sudo) — rerun as root"
  SUDO=(sudo)
fi

# --- serialise concurrent runs --------------------------------------------------
LOCK_FILE=/tmp/mnemos-install-pgvector.lock
exec 9>>"$LOCK_FILE"
if ! flock -n 9; then
  log "another install is in progress (lock ${LOCK_FILE}); waiting up to 30 min…"
  flock -w 1800 9 || die "timed out waiting for ${LOCK_FILE}"
fi
if is_installed; then
  log "installed by a concurrent run while we waited (default_version $(control_version)) — nothing to do"
  exit 0
fi

WORK=$(mktemp -d /tmp/pgvector-build.XXXXXX)
cleanup() { rm -rf -- "$WORK"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
log "pgvector not found in ${EXT_DIR}; building from Debian trixie source (workdir ${WORK})"

export DEBIAN_FRONTEND=noninteractive

# --- 1. build dependencies from bookworm ---------------------------------------
# Server headers (postgres.h) come from postgresql-server-dev-15 — note that
# pgxs.mk alone is NOT a usable marker: on Debian it ships in
# postgresql-client-15. gcc/make/dpkg-source (needed by `apt-get source` to
# unpack) come from build-essential (-> dpkg-dev).
have_deps() {
  [[ -f "$("$PG_CONFIG" --pgxs)" && -f "$("$PG_CONFIG" --includedir-server)/postgres.h" ]] &&
    command -v gcc >/dev/null && command -v make >/dev/null && command -v dpkg-source >/dev/null
}
if have_deps; then
  log "build dependencies already present"
else
  DEPS=(postgresql-server-dev-${PG_MAJOR} build-essential)
  APT_INSTALL=("${SUDO[@]}" apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=300 "${DEPS[@]}")
  log "installing build dependencies: ${DEPS[*]}"
  if ! "${APT_INSTALL[@]}"; then
    log "apt-get install failed — running apt-get update and retrying"
    "${SUDO[@]}" apt-get update -o DPkg::Lock::Timeout=300
    "${APT_INSTALL[@]}"
  fi
  have_deps || die "build dependencies still missing after apt-get install"
fi

# --- 2. private apt configuration for fetching the trixie source ---------------
# Signing key: bookworm's debian-archive-keyring (>= 2023.3+deb12u1) already
# ships the trixie archive keys, merged into debian-archive-keyring.gpg, so
# the trixie InRelease is verified normally via signed-by. Only if that key is
# missing AND the caller explicitly sets PGVECTOR_ALLOW_UNSIGNED=1 do we fall
# back to [trusted=yes] — a last resort that disables signature checking of
# the Sources index (and hence of the downloaded source). Not automatic: an
# automatic fallback would turn any signature failure (e.g. a tampered mirror)
# into a silent unsigned install.
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
if [[ -f "$KEYRING" ]] && { [[ -f /usr/share/keyrings/debian-archive-trixie-stable.gpg ]] ||
                            [[ -f /usr/share/keyrings/debian-archive-trixie-automatic.gpg ]]; }; then
  SRC_OPTS="[signed-by=${KEYRING}]"
  log "using signing keyring ${KEYRING} (contains the trixie archive keys)"
elif [[ ${PGVECTOR_ALLOW_UNSIGNED:-0} == 1 ]]; then
  SRC_OPTS="[trusted=yes]"
  log "WARNING: trixie archive key not found; PGVECTOR_ALLOW_UNSIGNED=1 so using [trusted=yes] (NO signature check)"
else
  die "trixie archive key not in /usr/share/keyrings (upgrade debian-archive-keyring from bookworm-updates/security, or set PGVECTOR_ALLOW_UNSIGNED=1 as a last resort)"
fi

APT_DIR="${WORK}/apt"
mkdir -p "${APT_DIR}/sources.list.d" "${APT_DIR}/lists/partial" "${APT_DIR}/cache/archives/partial" "${WORK}/src"
SOURCES_LINE="deb-src ${SRC_OPTS} http://deb.debian.org/debian trixie main"
printf '%s\n' "$SOURCES_LINE" > "${APT_DIR}/sources.list"
# Read after all system config (-c is processed after /etc/apt/apt.conf.d), so
# these override it: private sources/lists/caches, and no update hooks (the
# system's APT::Update::Post-Invoke-Success would e.g. refresh appstream's
# system cache).
cat > "${APT_DIR}/apt.conf" <<EOF
Dir::Etc::SourceList "${APT_DIR}/sources.list";
Dir::Etc::SourceParts "${APT_DIR}/sources.list.d";
Dir::State::Lists "${APT_DIR}/lists";
Dir::Cache "${APT_DIR}/cache";
Dir::Cache::archives "${APT_DIR}/cache/archives";
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
#clear APT::Update::Pre-Invoke;
#clear APT::Update::Post-Invoke;
#clear APT::Update::Post-Invoke-Success;
EOF
# apt downloads as the unprivileged _apt user; let it write into our dirs so
# it does not fall back to (and warn about) unsandboxed downloads.
chmod 755 "$WORK" "$APT_DIR"
if [[ ${EUID} -eq 0 ]] && id _apt >/dev/null 2>&1; then
  chown _apt "${APT_DIR}/lists/partial" "${APT_DIR}/cache/archives/partial" "${WORK}/src"
fi
PAPT=(apt-get -c "${APT_DIR}/apt.conf")

log "sources line: ${SOURCES_LINE}"
log "fetching trixie Sources index (private lists dir ${APT_DIR}/lists)"
"${PAPT[@]}" -q update || die "apt-get update against trixie failed (network? key?)"

log "apt-get source pgvector (trixie)"
( cd "${WORK}/src" && "${PAPT[@]}" -q source pgvector ) || die "apt-get source pgvector failed"

SRC_DIR=$(find "${WORK}/src" -mindepth 1 -maxdepth 1 -type d -name 'pgvector-*' | head -n1)
[[ -n "$SRC_DIR" && -f "${SRC_DIR}/Makefile" ]] || die "unpacked pgvector source not found under ${WORK}/src"
log "source unpacked: $(basename "$SRC_DIR")"

# --- 3. build & install --------------------------------------------------------
# OPTFLAGS="": pgvector's Makefile defaults to -march=native. The binary is
# installed system-wide and this environment may be snapshotted/moved to a
# host with a different CPU, where -march=native code can die with SIGILL.
# pgvector >= 0.7 dispatches its hot distance loops to AVX/FMA at runtime
# anyway, so the generic build loses little. (Debian's own package does the
# same: trixie's source carries a `no-native` patch that drops -march=native.)
MAKE_ARGS=(PG_CONFIG="$PG_CONFIG" OPTFLAGS="")
log "building (make ${MAKE_ARGS[*]})"
make -C "$SRC_DIR" -j"$(nproc)" "${MAKE_ARGS[@]}"
log "installing (make install)"
"${SUDO[@]}" make -C "$SRC_DIR" "${MAKE_ARGS[@]}" install

is_installed || die "make install finished but ${EXT_DIR}/vector.control or ${PKGLIBDIR}/vector.so is missing"
log "installed files: ${EXT_DIR}/vector.control, ${PKGLIBDIR}/vector.so"

# --- 4. verify through the running server --------------------------------------
PGHOST=${PGHOST:-127.0.0.1} PGPORT=${PGPORT:-5432} PGUSER=${PGUSER:-postgres}
VERSION=$(psql -h "$PGHOST" -p "$PGPORT" -U "$PGUSER" -d postgres -Atc \
  "select default_version from pg_available_extensions where name='vector'") ||
  die "could not query PostgreSQL at ${PGHOST}:${PGPORT} (is it running? see scripts/ensure-services.sh)"
[[ -n "$VERSION" ]] || die "PostgreSQL does not list 'vector' in pg_available_extensions"
if [[ $(printf '%s\n%s\n' "$MIN_VERSION" "$VERSION" | sort -V | head -n1) != "$MIN_VERSION" ]]; then
  die "pgvector ${VERSION} is older than required ${MIN_VERSION}"
fi
log "OK: pgvector ${VERSION} available to PostgreSQL ${PG_MAJOR} (>= ${MIN_VERSION})"
