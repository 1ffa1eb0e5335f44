#!/usr/bin/env bash
# The Postgres store's statements beside the fastest peers' on the same work, in the database
# alone (pgbench; no HTTP, no Rust), alternating the ways round by round:
#
#   new keys   PostgresStore as it sends by default (simple protocol, bounds in front), the
#              same calls prepared (`with_prepared_statements(true)`), and cratestack-sqlx
#              0.8's upsert + UPDATE prepared (as sqlx sends them) and over the simple protocol
#   replays    PostgresStore by default, prepared and with ClaimStrategy::ReadFirst (its read
#              prepared with SQL PREPARE), and rustango 0.62's DatabaseCache
#              lookup prepared and over the simple protocol
#
#   benches/pgbench/peers.sh [-c CLIENTS] [-T SECONDS] [-r ROUNDS] [-k KEYS] [-a]
#
# Defaults: -c 10 (sqlx's default pool), -T 5, -r 3, -k 1000 completed keys; -a runs the
# sessions with synchronous_commit = off (the statements' CPU, not the disk's flushes).
# DATABASE_URL and PGSSLMODE as for run.sh. Prints each way's median transactions per
# second (one transaction = one request's SQL) and its ratio to the default store's.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=10 threads=1 seconds=5 rounds=3 keys=1000 async=0
while getopts "c:T:r:k:ah" opt; do
    case "$opt" in
        c) clients="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        r) rounds="$OPTARG" ;;
        k) keys="$OPTARG" ;;
        a) async=1 ;;
        *) sed -n '2,17p' "$0"; exit 2 ;;
    esac
done

# shellcheck source=lib.sh
. "$here/lib.sh"
[[ "$async" == 1 ]] && export PGOPTIONS="$PGOPTIONS -c synchronous_commit=off"
fill_replay_keys
# The peers' tables, as their crates create them (rustango's cache table reduced to the
# columns its lookup reads), with the same number of completed keys.
psql_q <<SQL
CREATE TABLE cratestack_idempotency (
    principal_fingerprint TEXT NOT NULL,
    key TEXT NOT NULL,
    request_hash BYTEA NOT NULL,
    reservation_id UUID NOT NULL,
    response_status INT,
    response_headers BYTEA,
    response_body BYTEA,
    created_at TIMESTAMPTZ NOT NULL DEFAULT NOW(),
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (principal_fingerprint, key)
);
CREATE INDEX cratestack_idempotency_expires_idx ON cratestack_idempotency (expires_at);
CREATE TABLE rustango_cache (cache_key text PRIMARY KEY, value text NOT NULL, expires bigint NOT NULL);
CREATE INDEX rustango_cache_expires ON rustango_cache (expires);
INSERT INTO rustango_cache
SELECT 'idem_replay-' || i,
       '{"status":201,"headers":[["content-type","application/json"]],"body":"eyJpZCI6NDcxMSwic3RhdHVzIjoiY3JlYXRlZCJ9"}',
       9999999999
  FROM generate_series(0, $keys - 1) AS i;
ANALYZE;
SQL

# name, script, pgbench mode
ways=(
    "replay store|store_replay.sql|simple"
    "replay store prepared|prepared_replay.sql|prepared"
    "replay store read-first|store_read_first_replay.sql|simple"
    "replay rustango prepared|rustango_replay.sql|prepared"
    "replay rustango simple|rustango_replay.sql|simple"
    "new store|store_new.sql|simple"
    "new store prepared|prepared_new.sql|prepared"
    "new cratestack prepared|cratestack_new_bound.sql|prepared"
    "new cratestack simple|cratestack_new.sql|simple"
)
echo "pgbench: $clients clients, $seconds s per way, $rounds rounds, synchronous_commit $([[ $async == 1 ]] && echo off || echo on), schema $schema"
for round in $(seq "$rounds"); do
    # Rotate the order each round, so no way always runs first or after the same neighbour.
    n=${#ways[@]}
    for i in $(seq 0 $((n - 1))); do
        IFS='|' read -r name script mode <<<"${ways[$(( (i + round) % n ))]}"
        run_way "$round" "$name" "$here/peers/$script" "$mode"
    done
done

echo
echo "| way | median tps | rounds | ÷ the store's default |"
echo "|---|---:|---|---:|"
for kind in replay new; do
    base="$(median "${runs[$kind store]}")"
    for way in "${ways[@]}"; do
        IFS='|' read -r name _ _ <<<"$way"
        [[ "$name" == "$kind "* ]] || continue
        m="$(median "${runs[$name]}")"
        printf '| %s | %s | %s | %s |\n' "$name" "$m" "${runs[$name]# }" \
            "$(awk -v a="$m" -v b="$base" 'BEGIN { printf "%.2f", a / b }')"
    done
done
