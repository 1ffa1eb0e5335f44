#!/usr/bin/env bash
# What pooler safety costs plain mode, and what an unnamed statement over the extended protocol
# (the pooler-safe alternative to the simple protocol) would win back: the store's statements
# sent each way by pgbench, with no HTTP and no Rust, alternating the ways round by round.
#
#   benches/pgbench/protocols.sh [-c CLIENTS] [-j THREADS] [-T SECONDS] [-r ROUNDS] [-k KEYS]
#
# Defaults: -c 2 (the load harness's default pool), -j 1, -T 5, -r 3, -k 10000.
# DATABASE_URL and PGSSLMODE as for run.sh.
#
#   prepared      the calls bound to statements prepared once (`with_prepared_statements(true)`;
#                 unsafe behind a pooler in transaction mode)
#   extended      the calls as unnamed statements, Parse/Bind/Execute/Sync in one flight
#                 (pooler-safe; sqlx 0.9 sends Parse and waits for its answer before Bind)
#   simple        the calls alone, as simple-protocol messages with the values written in
#   store         what PostgresStore sends by default: simple, with its bounds in front
#                 (SET LOCAL transaction_isolation, statement_timeout) in the same message
#   pipeline      the bounds over the extended protocol in one flight (an explicit BEGIN …
#                 COMMIT: SET LOCAL has no transaction block there); replays only
#
# Sessions run with synchronous_commit = off. It prints each way's median transactions per second (one transaction = one request's SQL)
# and its ratio to prepared.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=2 threads=1 seconds=5 rounds=3 keys=10000
while getopts "c:j:T:r:k:h" opt; do
    case "$opt" in
        c) clients="$OPTARG" ;;
        j) threads="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        r) rounds="$OPTARG" ;;
        k) keys="$OPTARG" ;;
        *) sed -n '2,9p' "$0"; exit 2 ;;
    esac
done

# shellcheck source=lib.sh
. "$here/lib.sh"
# A first request commits twice: without this the disk's flushes, not the statements, would
# be measured.
export PGOPTIONS="$PGOPTIONS -c synchronous_commit=off"
fill_replay_keys

# name, script, pgbench mode
ways=(
    "replay prepared|replay_call.sql|prepared"
    "replay extended|replay_call.sql|extended"
    "replay simple|replay_call.sql|simple"
    "replay store|replay_bounds.sql|simple"
    "replay pipeline|replay_pipeline.sql|extended"
    "new key prepared|new_call.sql|prepared"
    "new key extended|new_call.sql|extended"
    "new key simple|new_call.sql|simple"
    "new key store|new_bounds.sql|simple"
)
echo "pgbench: $clients clients, $threads threads, $seconds s per way, $rounds rounds, schema $schema"
for round in $(seq "$rounds"); do
    for way in "${ways[@]}"; do
        IFS='|' read -r name script mode <<<"$way"
        run_way "$round" "$name" "$here/protocols/$script" "$mode"
    done
done

echo
echo "| way | replay tps | replay ÷ prepared | new key tps | new key ÷ prepared |"
echo "|---|---:|---:|---:|---:|"
rp="$(median "${runs[replay prepared]}")"
np="$(median "${runs[new key prepared]}")"
for w in prepared extended simple store pipeline; do
    r="$(median "${runs[replay $w]:-}")"
    n="$(median "${runs[new key $w]:-}")"
    rr="$(awk -v a="$r" -v b="$rp" 'BEGIN { printf "%.3f", a / b }')"
    nr="–"
    [ -n "$n" ] && nr="$(awk -v a="$n" -v b="$np" 'BEGIN { printf "%.3f", a / b }')"
    echo "| $w | $r | $rr | ${n:-–} | $nr |"
done
