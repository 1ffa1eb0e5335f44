#!/usr/bin/env bash
# The database's own ceiling for the load harness's Postgres scenarios: the same SQL, run by
# pgbench at the same database concurrency (the harness's pool size), with no HTTP and no Rust.
#
#   benches/pgbench/run.sh [-c CLIENTS] [-j THREADS] [-T SECONDS] [-k KEYS]
#
# Defaults: -c 16 (the harness's default --pool), -j 2, -T 10, -k 10000 (--replay-keys).
# DATABASE_URL selects the server (default postgres://postgres@127.0.0.1:5432/postgres);
# PGSSLMODE defaults to disable, like the harness's sqlx (built without TLS).
#
# It creates a schema of its own (dropped at the end), applies the crate's migrations there,
# completes KEYS keys (replay-0 ...), then runs, each for SECONDS:
#
#   replay.sql               the store's CLAIM on a completed key (a replay, ClaimStrategy::
#                            Combined, the default)
#   insert_read.sql          the store's INSERT (conflicts), then its READ (a replay,
#                            ClaimStrategy::InsertFirst)
#   select.sql               the store's READ alone: the pg-replay baseline, and all that
#                            ClaimStrategy::ReadFirst sends for a replay
#   claim_complete.sql       the store's CLAIM + COMPLETE on a new key (a first request,
#                            Combined)
#   read_insert_complete.sql the store's READ (finds nothing), INSERT, COMPLETE (a first
#                            request, ReadFirst)
#   plain_insert_update.sql  the store's INSERT + COMPLETE: the pg-plain-new baseline, and
#                            exactly what ClaimStrategy::InsertFirst sends for a first request
#   tx_claim_insert_complete.sql  transactional mode, a new key: the claim with BEGIN, a
#                            payment INSERT, the completion with COMMIT (then BEGIN, ROLLBACK
#                            of the empty transaction); these four in simple mode
#   tx_insert.sql            the pg-tx baseline: BEGIN, the same payment INSERT, COMMIT
#   tx_claim_insert.sql      (to decompose pg-tx) the transactional path without the completion
#   tx_insert_complete.sql   (to decompose pg-tx) the transactional path without the claim
#
# and prints each one's transactions per second (one transaction = one request's SQL).
#
# The tx_claim_* scripts claim through tower_idempotency_claim_in_tx, a function of the
# benchmark's own (claim_in_tx.sql), created in the schema after the crate's migrations.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=16 threads=2 seconds=10 keys=10000
while getopts "c:j:T:k:h" opt; do
    case "$opt" in
        c) clients="$OPTARG" ;;
        j) threads="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        k) keys="$OPTARG" ;;
        *) sed -n '2,9p' "$0"; exit 2 ;;
    esac
done

# shellcheck source=lib.sh
. "$here/lib.sh"
psql_q -f "$here/claim_in_tx.sql"

echo "pgbench: $clients clients, $threads threads, $seconds s each, $keys replay keys, schema $schema"
fill_replay_keys
bench replay.sql
bench insert_read.sql
bench select.sql
psql_q -c "TRUNCATE tower_idempotency_keys"
bench claim_complete.sql
psql_q -c "TRUNCATE tower_idempotency_keys"
bench read_insert_complete.sql
psql_q -c "TRUNCATE tower_idempotency_keys"
bench plain_insert_update.sql
psql_q -c "TRUNCATE tower_idempotency_keys, payments"
# Transactional mode sends its claim and completion as simple-query batches (several
# statements in one message), which only pgbench's simple mode can send; its baseline runs
# in the same mode, so that both pay the same parsing.
bench tx_claim_insert_complete.sql simple
psql_q -c "TRUNCATE tower_idempotency_keys, payments"
bench tx_insert.sql simple
psql_q -c "TRUNCATE tower_idempotency_keys, payments"
bench tx_claim_insert.sql simple
psql_q -c "TRUNCATE tower_idempotency_keys, payments"
bench tx_insert_complete.sql simple

ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", a / b }'; }
echo
echo "| SQL (pgbench, -c $clients) | crate's statements tps | hand-written tps | ratio |"
echo "|---|---:|---:|---:|"
row() { echo "| $1 | ${tps[$2]} | ${tps[$3]} | $(ratio "${tps[$2]}" "${tps[$3]}") |"; }
row "replay, Combined: CLAIM vs READ" replay.sql select.sql
row "replay, InsertFirst: INSERT + READ vs READ" insert_read.sql select.sql
row "replay, ReadFirst: READ vs READ (the same SQL)" select.sql select.sql
row "new key, Combined: CLAIM + COMPLETE vs INSERT + COMPLETE" claim_complete.sql plain_insert_update.sql
row "new key, ReadFirst: READ + INSERT + COMPLETE vs INSERT + COMPLETE" read_insert_complete.sql plain_insert_update.sql
row "new key, InsertFirst: INSERT + COMPLETE vs INSERT + COMPLETE (the same SQL)" plain_insert_update.sql plain_insert_update.sql
row "transactional: claim;BEGIN + INSERT + completion;COMMIT;BEGIN + ROLLBACK vs BEGIN + INSERT + COMMIT" tx_claim_insert_complete.sql tx_insert.sql
row "(transactional, the claim alone: BEGIN + claim + INSERT + COMMIT vs BEGIN + INSERT + COMMIT)" tx_claim_insert.sql tx_insert.sql
row "(transactional, the completion alone: BEGIN + INSERT + completion + COMMIT vs BEGIN + INSERT + COMMIT)" tx_insert_complete.sql tx_insert.sql
