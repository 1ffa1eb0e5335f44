#!/usr/bin/env bash
# The Postgres store's statements beside the fastest peers' on the same work, in the database
# alone (pgbench; no HTTP, no Rust), alternating the ways round by round:
#
#   new keys   PostgresStore as it sends by default (the insert and the completion prepared
#              with SQL PREPARE, simple protocol, bounds in front), with ClaimStrategy::Combined
#              (the claim function), with prepared statements (`with_prepared_statements(true)`),
#              and cratestack-sqlx 0.8's upsert + UPDATE prepared (as sqlx sends them) and over
#              the simple protocol
#   replays    PostgresStore by default (the read prepared with SQL PREPARE), with Combined,
#              with prepared statements, and rustango 0.62's DatabaseCache lookup prepared and
#              over the simple protocol
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
create_peer_tables

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
