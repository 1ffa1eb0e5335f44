#!/usr/bin/env bash
# What migration 8 costs: the store's functions run with `enable_seqscan = off` as a setting
# of their own (Postgres sets it on entry and puts it back on return). Runs a replay and a
# first request as the store sends them by default, alternating round by round between the
# functions as migrated and the same functions with the setting reset (migrations 1–7).
#
#   benches/pgbench/seqscan_off.sh [-c CLIENTS] [-j THREADS] [-T SECONDS] [-r ROUNDS]
#
# Defaults: -c 2, -j 1, -T 5, -r 5; 10,000 completed keys. Sessions run with
# synchronous_commit = off. Prints each way's median transactions per second and the ratio.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=2 threads=1 seconds=5 rounds=5 keys=10000
while getopts "c:j:T:r:h" opt; do
    case "$opt" in
        c) clients="$OPTARG" ;;
        j) threads="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        r) rounds="$OPTARG" ;;
        *) sed -n '2,10p' "$0"; exit 2 ;;
    esac
done

# shellcheck source=lib.sh
. "$here/lib.sh"
export PGOPTIONS="$PGOPTIONS -c synchronous_commit=off"
fill_replay_keys

# Every function migration 8 gives the setting: (re)set it on all of them.
functions="$(psql_q -At -c "SELECT p.oid::regprocedure FROM pg_proc AS p
    WHERE p.pronamespace = '$schema'::regnamespace
      AND 'enable_seqscan=off' = ANY (p.proconfig)")"
setting() {
    local f
    while read -r f; do
        psql_q -c "ALTER FUNCTION $f $1" >/dev/null
    done <<<"$functions"
}

echo "pgbench: $clients clients, $threads threads, $seconds s per way, $rounds rounds, schema $schema"
echo "functions with the setting: $(wc -l <<<"$functions")"
declare -A runs
for round in $(seq "$rounds"); do
    for variant in "migration 8|SET enable_seqscan = off" "without|RESET enable_seqscan"; do
        IFS='|' read -r name clause <<<"$variant"
        setting "$clause"
        for script in replay_bounds.sql new_bounds.sql; do
            out="$(pgbench "$url" -n -M simple -c "$clients" -j "$threads" -T "$seconds" \
                -D nkeys="$keys" -f "$here/protocols/$script" 2>&1)" \
                || { echo "$out" >&2; exit 1; }
            tps="$(echo "$out" | sed -n 's/^tps = \([0-9]*\).*/\1/p' | head -1)"
            runs[$name/$script]="${runs[$name/$script]:-} $tps"
            printf 'round %s  %-12s %-18s %8s tps\n' "$round" "$name" "$script" "$tps"
        done
    done
done

echo
echo "| statement | with migration 8 tps | without tps | ratio |"
echo "|---|---:|---:|---:|"
for script in replay_bounds.sql new_bounds.sql; do
    a="$(median "${runs[migration 8/$script]}")" b="$(median "${runs[without/$script]}")"
    echo "| $script | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", a / b }') |"
done
