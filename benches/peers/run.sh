#!/usr/bin/env bash
# Builds the side-by-side benchmark in release mode and runs it; every option is passed on
# (`bash benches/peers/run.sh --help` lists them).
#
#   bash benches/peers/run.sh [--only a,b,c] [--workload new|replay|both] [--connections N]
#                             [--seconds S] [--warmup S] [--rounds R]
#
# DATABASE_URL defaults to postgres://postgres@127.0.0.1:5432/peers_bench; the database is
# created when missing. CARGO_BUILD_JOBS is honoured (set it to 1 on a shared machine).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

export DATABASE_URL="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/peers_bench}"
db="${DATABASE_URL##*/}"
db="${db%%\?*}"
server_url="${DATABASE_URL%/*}/postgres"

if ! command -v psql >/dev/null; then
    echo "run.sh: psql not found (needed to create the database $db)" >&2
    exit 1
fi
if ! psql "$server_url" -XAtqc "SELECT 1" >/dev/null; then
    echo "run.sh: cannot reach PostgreSQL at $server_url" >&2
    exit 1
fi
if [[ "$(psql "$server_url" -XAtqc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]]; then
    psql "$server_url" -XAtqc "CREATE DATABASE \"$db\"" >/dev/null
    echo "run.sh: created database $db"
fi

cargo build --release --manifest-path "$here/Cargo.toml"
# The checkout measured: its commit, and whether the crate's sources differ from it.
rev="$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
if [[ -n "$(git -C "$root" status --porcelain -- src migrations Cargo.toml 2>/dev/null)" ]]; then
    rev="$rev, with uncommitted changes in src/, migrations/ or Cargo.toml"
fi
PEERS_MAIN_REV="$rev" exec "$here/target/release/peers-bench" "$@"
