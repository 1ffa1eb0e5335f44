#!/usr/bin/env bash
# The ceiling of a replay at many keys: the least a replay can send, a hand-written SELECT of
# the record by its key (select.sql), beside the store's claim (prepared, and as the store
# sends it by default), on a table of 10,000 completed keys and then of N, at the scale
# benchmark's concurrency. A lookup by key reads a leaf of the primary key and a heap page
# whatever sends it; this shows what that costs once they no longer fit in shared buffers.
#
#   benches/pgbench/keys.sh [-n ROWS] [-c CLIENTS] [-j THREADS] [-T SECONDS]
#
# Defaults: -n 10000000 (about 2.5 GiB of table and index while it runs; the schema is dropped
# at the end), -c 8, -j 2, -T 10. DATABASE_URL and PGSSLMODE as for run.sh. Prints each
# statement's median latency (from pgbench's per-transaction log) on both tables and the ratio.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

rows=10000000 clients=8 threads=2 seconds=10 keys=10000
while getopts "n:c:j:T:h" opt; do
    case "$opt" in
        n) rows="$OPTARG" ;;
        c) clients="$OPTARG" ;;
        j) threads="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        *) sed -n '2,9p' "$0"; exit 2 ;;
    esac
done

# shellcheck source=lib.sh
. "$here/lib.sh"
logs="$(mktemp -d)"
trap 'cleanup; rm -rf "$logs"' EXIT

ways=(
    "hand-written SELECT, prepared|select.sql|prepared"
    "store's claim, prepared|protocols/replay_call.sql|prepared"
    "store's claim as sent by default|protocols/replay_bounds.sql|simple"
)
declare -A p50
measure() {
    local size="$1" name script mode out
    psql_q -c "VACUUM ANALYZE tower_idempotency_keys" -c "CHECKPOINT"
    for way in "${ways[@]}"; do
        IFS='|' read -r name script mode <<<"$way"
        rm -f "$logs"/tx*
        out="$(cd "$logs" && pgbench "$url" -n -M "$mode" -c "$clients" -j "$threads" \
            -T "$seconds" -D nkeys="$keys" -l --log-prefix=tx -f "$here/$script" 2>&1)" \
            || { echo "$out" >&2; exit 1; }
        p50[$size/$name]="$(cat "$logs"/tx* | awk '{ print $3 }' | sort -n \
            | awk '{ v[NR] = $1 } END { printf "%.3f", v[int((NR + 1) / 2)] / 1000 }')"
        printf '%-10s %-36s p50 %s ms  %s\n' "$size" "$name" "${p50[$size/$name]}" \
            "$(echo "$out" | grep '^tps')"
    done
}

echo "pgbench: $clients clients, $threads threads, $seconds s per statement, schema $schema"
fill_replay_keys
measure small
keys="$rows"
started=$(date +%s)
fill_replay_keys
echo "filled $rows rows in $(( $(date +%s) - started )) s: $(psql_q -At -c \
    "SELECT pg_size_pretty(pg_table_size('tower_idempotency_keys')) || ' table, ' ||
            pg_size_pretty(pg_indexes_size('tower_idempotency_keys')) || ' indexes'")"
measure large

echo
echo "| statement | p50 ms, 10,000 keys | p50 ms, $rows keys | ratio |"
echo "|---|---:|---:|---:|"
for way in "${ways[@]}"; do
    IFS='|' read -r name _ _ <<<"$way"
    a="${p50[small/$name]}" b="${p50[large/$name]}"
    echo "| $name | $a | $b | $(awk -v a="$a" -v b="$b" 'BEGIN { printf "%.2f", b / a }') |"
done
