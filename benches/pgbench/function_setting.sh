#!/usr/bin/env bash
# What a setting of the store's functions costs (Postgres sets it on each function's entry
# and puts it back on return). Runs a replay and a first request as the store sends them by
# default, alternating round by round between the functions as migrated and the same
# functions with the setting reset.
#
#   benches/pgbench/function_setting.sh -s SETTING [-c CLIENTS] [-j THREADS] [-T SECONDS] [-r ROUNDS]
#
# SETTING is a name the migrations give functions: enable_seqscan (lookups by key whatever
# the statistics say) or search_path (names resolved in the store's own schema). Defaults:
# -c 2, -j 1, -T 5, -r 5; 10,000 completed keys. Sessions run with synchronous_commit = off.
# Prints each way's median transactions per second and the ratio.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=2 threads=1 seconds=5 rounds=5 keys=10000 setting=""
while getopts "s:c:j:T:r:h" opt; do
    case "$opt" in
        s) setting="$OPTARG" ;;
        c) clients="$OPTARG" ;;
        j) threads="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        r) rounds="$OPTARG" ;;
        *) sed -n '2,12p' "$0"; exit 2 ;;
    esac
done
[[ "$setting" =~ ^[a-z_]+$ ]] || { sed -n '2,12p' "$0"; exit 2; }

# shellcheck source=lib.sh
. "$here/lib.sh"
export PGOPTIONS="$PGOPTIONS -c synchronous_commit=off"
fill_replay_keys

# Every function the migrations give the setting, each with its value as migrated.
declare -A migrated
while IFS='|' read -r f value; do
    [[ -n "$f" ]] && migrated[$f]="$value"
done < <(psql_q -At -F '|' -c "SELECT p.oid::regprocedure, substr(c, length('$setting') + 2)
    FROM pg_proc AS p, unnest(p.proconfig) AS c
    WHERE p.pronamespace = '$schema'::regnamespace AND c LIKE '$setting=%'")
apply() {
    local f
    for f in "${!migrated[@]}"; do
        if [[ "$1" == migrated ]]; then
            psql_q -c "ALTER FUNCTION $f SET $setting = ${migrated[$f]}" >/dev/null
        else
            psql_q -c "ALTER FUNCTION $f RESET $setting" >/dev/null
        fi
    done
}

echo "pgbench: $clients clients, $threads threads, $seconds s per way, $rounds rounds, schema $schema"
echo "functions with $setting: ${#migrated[@]}"
declare -A runs
for round in $(seq "$rounds"); do
    for way in migrated reset; do
        apply "$way"
        for script in replay_bounds.sql new_bounds.sql; do
            out="$(pgbench "$url" -n -M simple -c "$clients" -j "$threads" -T "$seconds" \
                -D nkeys="$keys" -f "$here/protocols/$script" 2>&1)" \
                || { echo "$out" >&2; exit 1; }
            tps="$(echo "$out" | sed -n 's/^tps = \([0-9]*\).*/\1/p' | head -1)"
            runs[$way/$script]="${runs[$way/$script]:-} $tps"
            printf 'round %s  %-9s %-18s %8s tps\n' "$round" "$way" "$script" "$tps"
        done
    done
done

echo
echo "| statement | with $setting tps | reset tps | ratio |"
echo "|---|---:|---:|---:|"
for script in replay_bounds.sql new_bounds.sql; do
    a="$(median "${runs[migrated/$script]}")" b="$(median "${runs[reset/$script]}")"
    echo "| $script | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.3f", a / b }') |"
done
