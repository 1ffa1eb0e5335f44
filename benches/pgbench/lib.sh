# What the pgbench scripts share: a schema of their own with the crate's migrations
# (dropped on exit), the replay keys, `bench SCRIPT [MODE]`, which runs one pgbench script
# and keeps its transactions per second in tps[SCRIPT], and `median LIST`. Sourced after
# `here`, `root`, `clients`, `threads`, `seconds` and `keys` are set.
url="${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}"
# The crate's sqlx is built without TLS, so the harness talks to Postgres in plaintext; so
# does pgbench here (libpq would otherwise negotiate TLS with a server that has ssl = on).
export PGSSLMODE="${PGSSLMODE:-disable}"
schema="pgbench_$$_$(date +%s)"
export PGOPTIONS="-c search_path=$schema"

psql_q() { psql "$url" -v ON_ERROR_STOP=1 -q -X "$@"; }

cleanup() { PGOPTIONS="" psql_q -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true; }
trap cleanup EXIT

PGOPTIONS="" psql_q -c "CREATE SCHEMA $schema"
for m in "$root"/migrations/*.sql; do
    psql_q -f "$m"
done
# The pg-tx handler's table (the same as in benches/load/transactional.rs).
psql_q -c "CREATE TABLE payments (
    id           bigserial   PRIMARY KEY,
    order_id     bigint      NOT NULL,
    amount_cents bigint      NOT NULL,
    currency     text        NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
)"

fill_replay_keys() {
    # The same record the layer leaves for a completed 201: fingerprint, one header, the body.
    psql_q <<SQL
TRUNCATE tower_idempotency_keys;
INSERT INTO tower_idempotency_keys
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at, completed_at,
        response_status, response_headers, response_body)
SELECT '', 'replay-' || i,
       '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea,
       NULL, NULL, now() + interval '1 day', now(), 201,
       '\x000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
       convert_to('{"id":4711,"status":"created","received":1024}', 'UTF8')
  FROM generate_series(0, $keys - 1) AS i;
ANALYZE tower_idempotency_keys;
SQL
}

# The peers' tables, as their crates create them (rustango's cache table reduced to the
# columns its lookup reads), with the same number of completed keys.
create_peer_tables() {
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
}

# The ways peers.sh and statements.sh run (scripts under peers/): name, script, pgbench mode.
ways=(
    "replay store|store_replay.sql|simple"
    "replay store combined|store_combined_replay.sql|simple"
    "replay store prepared|prepared_replay.sql|prepared"
    "replay rustango prepared|rustango_replay.sql|prepared"
    "replay rustango simple|rustango_replay.sql|simple"
    "new store|store_new.sql|simple"
    "new store combined|store_combined_new.sql|simple"
    "new store prepared|prepared_new.sql|prepared"
    "new cratestack prepared|cratestack_new_bound.sql|prepared"
    "new cratestack simple|cratestack_new.sql|simple"
)

declare -A tps
bench() {
    local script="$1" mode="${2:-prepared}" out
    out="$(pgbench "$url" -n -M "$mode" -c "$clients" -j "$threads" -T "$seconds" \
        -D nkeys="$keys" -f "$here/$script" 2>&1)" || { echo "$out" >&2; exit 1; }
    tps[$script]="$(echo "$out" | sed -n 's/^tps = \([0-9]*\).*/\1/p' | head -1)"
    local lat
    lat="$(echo "$out" | sed -n 's/^latency average = \(.*\)$/\1/p')"
    printf '%-30s %10s tps   latency average %s\n' "$script" "${tps[$script]}" "$lat"
}

# `run_way ROUND NAME SCRIPT MODE`: one pgbench run of SCRIPT (a path) in MODE; its
# transactions per second are appended to runs[NAME] and printed with the round. A script
# sees `:schema`, and `:prepared` at 0 until it sets it (per client) once it has run its
# `PREPARE`s.
declare -A runs
run_way() {
    local round="$1" name="$2" script="$3" mode="$4" out t
    out="$(pgbench "$url" -n -M "$mode" -c "$clients" -j "$threads" -T "$seconds" \
        -D nkeys="$keys" -D prepared=0 -D schema="$schema" -f "$script" 2>&1)" \
        || { echo "$out" >&2; exit 1; }
    t="$(echo "$out" | sed -n 's/^tps = \([0-9]*\).*/\1/p' | head -1)"
    runs[$name]="${runs[$name]:-} $t"
    printf 'round %s  %-26s %8s tps\n' "$round" "$name" "$t"
}

# The median of a space-separated list of numbers (empty when there are none).
median() { tr ' ' '\n' <<<"$1" | { grep . || true; } | sort -n | awk 'NF { v[++n] = $1 } END { if (n) print v[int((n + 1) / 2)] }'; }
