#!/usr/bin/env bash
# Instructions per request in process, under valgrind's callgrind (repeatable on a busy
# machine): each scenario of benches/ir.rs runs for SMALL and LARGE requests, and the cost of
# one request is the difference of the two totals divided by LARGE − SMALL, free of the
# start-up.
#
#   bash benches/ir.sh [scenario...]        (default: none get new replay baseline)
#
# SMALL and LARGE (default 2000 and 12000) come from the environment. Under valgrind SHA-256
# runs in software (about 60,400 instructions of every keyed request). Needs valgrind
# (apt-get install valgrind).
set -euo pipefail
cd "$(dirname "$0")/.."
small=${SMALL:-2000}
large=${LARGE:-12000}
command -v valgrind > /dev/null || { echo "valgrind is missing: apt-get install valgrind" >&2; exit 2; }
bin=$(cargo bench --bench ir --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "could not build benches/ir.rs" >&2; exit 1; }
total() {
    valgrind --tool=callgrind --callgrind-out-file=/dev/null "$bin" "$1" "$2" 2>&1 \
        | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
echo "| scenario | instructions per request |"
echo "|---|---:|"
for s in "${@:-none get new replay baseline}"; do
    for scenario in $s; do
        a=$(total "$scenario" "$small")
        b=$(total "$scenario" "$large")
        echo "| $scenario | $(( (b - a) / (large - small) )) |"
    done
done
