#!/usr/bin/env bash
# The payments example end to end under wrk: IDEMPOTENCY=on against IDEMPOTENCY=off, in
# alternating rounds on the same machine, new keys (each payment passes two keyed layers:
# payments and provider). Prints each round and the ratio of the medians.
#
#   bash benches/wrk/payments.sh [rounds] [seconds]        (default 3 rounds of 6 s)
#
# Keep rounds short: the example's memory store holds 1,000,000 records (two per payment) and
# answers 503 when full; a round that got any answer other than 201 is reported and fails.
#
# Extra environment for the example (DATABASE_URL, REDIS_URL, ...) passes through.
# Needs wrk (apt-get install wrk). Traffic goes to 127.0.0.1 only; every run stops by itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
seconds=${2:-6}
connections=${WRK_CONNECTIONS:-32}
command -v wrk > /dev/null || { echo "wrk is missing: apt-get install wrk" >&2; exit 2; }
cargo build --release --all-features --example payments 2>&1 | tail -1
bin=target/release/examples/payments

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# One side: starts the example, warms it up, measures; prints req/s.
side() {
  local mode=$1 p log pid rps
  p=$(port)
  log=$(mktemp)
  BIND=127.0.0.1:$p IDEMPOTENCY=$mode RUST_LOG=${RUST_LOG:-warn} "$bin" > "$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do grep -q "listening on" "$log" && break; sleep 0.05; done
  grep -q "listening on" "$log" || { cat "$log" >&2; kill "$pid"; exit 1; }
  wrk -t2 -c"$connections" -d2s -s benches/wrk/payments.lua "http://127.0.0.1:$p" > /dev/null
  out=$(wrk -t2 -c"$connections" -d"${seconds}s" -s benches/wrk/payments.lua "http://127.0.0.1:$p" 2>&1)
  kill "$pid"; wait "$pid" 2> /dev/null || true
  rm -f "$log"
  if grep -q "Non-2xx" <<< "$out"; then
    echo "IDEMPOTENCY=$mode: answers other than 201 (shorten the rounds?):" >&2
    echo "$out" >&2
    exit 1
  fi
  awk '/Requests\/sec/ {print $2}' <<< "$out"
}

on=(); off=()
for r in $(seq 1 "$rounds"); do
  if (( r % 2 )); then order="off on"; else order="on off"; fi
  for mode in $order; do
    rps=$(side "$mode")
    echo "round $r IDEMPOTENCY=$mode: $rps req/s"
    if [[ $mode == on ]]; then on+=("$rps"); else off+=("$rps"); fi
  done
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
mon=$(median "${on[@]}"); moff=$(median "${off[@]}")
echo "median on $mon req/s, off $moff req/s, ratio $(awk -v a="$mon" -v b="$moff" 'BEGIN {printf "%.3f", a/b}')"
