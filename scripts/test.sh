#!/usr/bin/env bash
# Runs the whole test suite, Postgres and RabbitMQ tests included, the Postgres suites at
# every default isolation level.
#
# The Postgres tests use DATABASE_URL (default: postgres://postgres@127.0.0.1:5432/postgres).
# When that default server is not running, this script starts a throwaway PostgreSQL
# cluster of its own (installing PostgreSQL first when run as root on Debian/Ubuntu), runs
# the tests against it and stops it. It never skips the Postgres tests: if it cannot get a
# server, it stops and says what to do.
#
# At the end, the Postgres behaviour suite, the payments example's end-to-end tests and
# tests/pooler.rs run once more through a PgBouncer in transaction pooling mode, which this
# script starts on a free loopback port in front of that server (installing PgBouncer first
# when run as root on Debian/Ubuntu). With TI_PGBOUNCER_URL set, they use that pooler instead:
# transaction mode, in front of DATABASE_URL's server, letting any of its roles log in without
# a password, and ignoring the startup parameter extra_float_digits.
#
# The consumer test uses RabbitMQ at AMQP_URL (default amqp://guest:guest@127.0.0.1:5672/%2f).
# When nothing listens there, the script starts the installed rabbitmq-server (installing it
# first when run as root on Debian/Ubuntu), or stops and says what to do.
set -euo pipefail
cd "$(dirname "$0")/.."

default_url="postgres://postgres@127.0.0.1:5432/postgres"
url="${DATABASE_URL:-$default_url}"

die() {
    echo "scripts/test.sh: $*" >&2
    exit 1
}

# Commands to run when the script exits, the last registered first (the throwaway cluster,
# the PgBouncer): one EXIT trap runs them all.
on_exit=()
run_on_exit() {
    local i
    for ((i = ${#on_exit[@]} - 1; i >= 0; i--)); do
        eval "${on_exit[i]}" || true
    done
}
trap run_on_exit EXIT

# Is a server answering at host:port? (bash's /dev/tcp; no client tools needed)
port_open() {
    (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

host_port() {
    # postgres://user@host:port/db -> "host port"
    local rest="${1#*://}"
    rest="${rest#*@}"
    rest="${rest%%/*}"
    local host="${rest%%:*}" port="5432"
    [[ "$rest" == *:* ]] && port="${rest##*:}"
    echo "$host $port"
}

find_pg_bin() {
    local dir
    for dir in /usr/lib/postgresql/*/bin /usr/local/pgsql/bin /opt/homebrew/bin /usr/local/bin /usr/bin; do
        if [[ -x "$dir/initdb" && -x "$dir/pg_ctl" ]]; then
            echo "$dir"
            return 0
        fi
    done
    return 1
}

# PostgreSQL's programs (initdb, pg_ctl, pg_basebackup, psql): for the throwaway cluster
# below, and for the fault tests (tests/failover.rs, tests/connection_loss.rs), which start
# private clusters of their own even when DATABASE_URL names a server elsewhere.
ensure_pg_binaries() {
    find_pg_bin >/dev/null && return 0
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: PostgreSQL is not installed; installing it with apt-get" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        find_pg_bin >/dev/null || die "PostgreSQL was installed but initdb was not found"
    else
        die "PostgreSQL's programs (initdb, pg_ctl, pg_basebackup) are not installed; the
fault tests start private clusters with them. Install PostgreSQL (Debian/Ubuntu: sudo apt-get
install postgresql; macOS: brew install postgresql) and run ./scripts/test.sh again."
    fi
}

start_throwaway_cluster() {
    local bin port=55432 run_as=()
    ensure_pg_binaries
    bin="$(find_pg_bin)"
    local data="${TMPDIR:-/tmp}/tower-idempotency-pg-$EUID"
    if [[ $EUID -eq 0 ]]; then
        # PostgreSQL refuses to run as root: run the cluster as the postgres system user.
        id postgres >/dev/null 2>&1 || die "running as root, but there is no 'postgres' user to run PostgreSQL as"
        run_as=(runuser -u postgres --)
    fi
    rm -rf "$data"
    mkdir -p "$data"
    [[ $EUID -eq 0 ]] && chown postgres "$data"
    port_open 127.0.0.1 "$port" && die "port $port is taken; stop what runs there or set DATABASE_URL"
    echo "scripts/test.sh: starting a throwaway PostgreSQL ($bin) on 127.0.0.1:$port" >&2
    "${run_as[@]}" "$bin/initdb" -D "$data/db" -U postgres --auth=trust -E UTF8 >/dev/null
    "${run_as[@]}" "$bin/pg_ctl" -D "$data/db" -l "$data/log" -w \
        -o "-p $port -k $data -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off" start >/dev/null
    # Stop it when the script exits (the command is expanded now: the locals are gone then).
    on_exit+=("$(printf '%q ' "${run_as[@]}" "$bin/pg_ctl" -D "$data/db" -m fast stop) >/dev/null 2>&1")
    url="postgres://postgres@127.0.0.1:$port/postgres"
}

ensure_pg_binaries
read -r host port < <(host_port "$url")
if ! port_open "$host" "$port"; then
    if [[ -n "${DATABASE_URL:-}" && "$DATABASE_URL" != "$default_url" ]]; then
        die "DATABASE_URL=$DATABASE_URL does not answer. Start that server, or unset DATABASE_URL
to let this script start a local one."
    fi
    start_throwaway_cluster
fi
export DATABASE_URL="$url"
echo "scripts/test.sh: Postgres tests use $DATABASE_URL" >&2

ensure_rabbitmq() {
    local amqp="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}" host port
    read -r host port < <(host_port "$amqp")
    # host_port defaults to Postgres's port; AMQP's is 5672.
    [[ "${amqp#*://}" =~ ^([^@/]*@)?[^:/]+:[0-9]+ ]] || port=5672
    port_open "$host" "$port" && return 0
    if [[ -n "${AMQP_URL:-}" ]]; then
        die "AMQP_URL=$AMQP_URL does not answer. Start that broker, or unset AMQP_URL to let
this script start a local RabbitMQ."
    fi
    if ! command -v rabbitmq-server >/dev/null && [[ ! -x /usr/sbin/rabbitmq-server ]]; then
        if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "scripts/test.sh: RabbitMQ is not installed; installing it with apt-get" >&2
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
        else
            die "no RabbitMQ at 127.0.0.1:5672 and RabbitMQ is not installed.
Install it (Debian/Ubuntu: sudo apt-get install rabbitmq-server; macOS: brew install rabbitmq),
start it, and run ./scripts/test.sh again, or set AMQP_URL to a broker you own."
        fi
    fi
    echo "scripts/test.sh: starting RabbitMQ" >&2
    if [[ $EUID -eq 0 ]]; then
        PATH="/usr/sbin:$PATH" rabbitmq-server -detached >/dev/null 2>&1 || true
    else
        die "RabbitMQ is installed but not running; start it (sudo systemctl start rabbitmq-server,
or sudo rabbitmq-server -detached) and run ./scripts/test.sh again."
    fi
    for _ in $(seq 1 120); do
        port_open 127.0.0.1 5672 && return 0
        sleep 1
    done
    die "RabbitMQ did not start within 120 s (see /var/log/rabbitmq)"
}
ensure_rabbitmq

# Redis (feature redis): the single server at REDIS_URL (default redis://127.0.0.1:6379) and a
# Redis Cluster of three masters and three replicas on 127.0.0.1:21001-21006
# (TI_REDIS_CLUSTER_URLS). Whatever is not running is started here (installing redis-server
# first when run as root on Debian/Ubuntu) and stopped on exit; the Redis tests never skip.
ensure_redis_binaries() {
    command -v redis-server >/dev/null && command -v redis-cli >/dev/null && return 0
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: Redis is not installed; installing it with apt-get" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
        die "redis-server and redis-cli are not installed; the Redis tests need them.
Install Redis (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)
and run ./scripts/test.sh again, or set REDIS_URL and TI_REDIS_CLUSTER_URLS to servers you run."
    fi
}

ensure_redis() {
    local redis="${REDIS_URL:-redis://127.0.0.1:6379}" host port rest dir
    rest="${redis#*://}"
    rest="${rest#*@}"
    rest="${rest%%/*}"
    host="${rest%%:*}"
    port=6379
    [[ "$rest" == *:* ]] && port="${rest##*:}"
    if ! port_open "$host" "$port"; then
        [[ -n "${REDIS_URL:-}" ]] && die "REDIS_URL=$REDIS_URL does not answer. Start that server, or unset
REDIS_URL to let this script start a local one."
        dir="$(mktemp -d "${TMPDIR:-/tmp}/tower-idempotency-redis.XXXXXX")"
        echo "scripts/test.sh: starting redis-server on 127.0.0.1:$port" >&2
        redis-server --port "$port" --bind 127.0.0.1 --daemonize yes --dir "$dir" \
            --save "" --appendonly no --logfile "$dir/log" --pidfile "$dir/pid" >/dev/null
        on_exit+=("$(printf 'redis-cli -p %q shutdown nosave >/dev/null 2>&1; rm -rf %q' "$port" "$dir")")
        for _ in $(seq 1 50); do port_open 127.0.0.1 "$port" && break; sleep 0.1; done
        port_open 127.0.0.1 "$port" || die "redis-server did not start (see $dir/log)"
    fi
    export REDIS_URL="$redis"

    [[ -n "${TI_REDIS_CLUSTER_URLS:-}" ]] && return 0
    local ports=(21001 21002 21003 21004 21005 21006) p up=1
    for p in "${ports[@]}"; do port_open 127.0.0.1 "$p" || up=0; done
    if [[ $up -eq 0 ]]; then
        for p in "${ports[@]}"; do
            port_open 127.0.0.1 "$p" && die "port $p is taken but the cluster is not complete; stop what runs there or set TI_REDIS_CLUSTER_URLS"
        done
        dir="$(mktemp -d "${TMPDIR:-/tmp}/tower-idempotency-redis-cluster.XXXXXX")"
        echo "scripts/test.sh: starting a Redis Cluster on 127.0.0.1:21001-21006" >&2
        for p in "${ports[@]}"; do
            mkdir -p "$dir/$p"
            redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes \
                --cluster-config-file "$dir/$p/nodes.conf" --cluster-node-timeout 2000 \
                --daemonize yes --dir "$dir/$p" --save "" --appendonly no \
                --logfile "$dir/$p/log" >/dev/null
            on_exit+=("$(printf 'redis-cli -p %q shutdown nosave >/dev/null 2>&1' "$p")")
        done
        on_exit+=("$(printf 'rm -rf %q' "$dir")")
        for p in "${ports[@]}"; do
            for _ in $(seq 1 50); do port_open 127.0.0.1 "$p" && break; sleep 0.1; done
        done
        # shellcheck disable=SC2046
        redis-cli --cluster create $(printf '127.0.0.1:%s ' "${ports[@]}") \
            --cluster-replicas 1 --cluster-yes >"$dir/create.log" 2>&1 ||
            die "redis-cli --cluster create failed (see $dir/create.log)"
        for _ in $(seq 1 100); do
            redis-cli -p 21001 cluster info 2>/dev/null | grep -q 'cluster_state:ok' && break
            sleep 0.1
        done
    fi
    TI_REDIS_CLUSTER_URLS="$(printf 'redis://127.0.0.1:%s,' "${ports[@]}")"
    export TI_REDIS_CLUSTER_URLS="${TI_REDIS_CLUSTER_URLS%,}"
}
ensure_redis_binaries
ensure_redis
echo "scripts/test.sh: Redis tests use $REDIS_URL and the cluster at $TI_REDIS_CLUSTER_URLS" >&2

ensure_nats() {
    local nats="${NATS_URL:-nats://127.0.0.1:4222}" host port dir
    read -r host port < <(host_port "$nats")
    # host_port defaults to Postgres's port; NATS's is 4222.
    [[ "${nats#*://}" =~ ^([^@/]*@)?[^:/]+:[0-9]+ ]] || port=4222
    if ! port_open "$host" "$port"; then
        [[ -n "${NATS_URL:-}" ]] && die "NATS_URL=$NATS_URL does not answer. Start that server (with JetStream:
nats-server -js), or unset NATS_URL to let this script start a local one."
        if ! command -v nats-server >/dev/null; then
            if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
                echo "scripts/test.sh: NATS is not installed; installing nats-server with apt-get" >&2
                apt-get update -qq
                DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nats-server >/dev/null
            else
                die "nats-server is not installed; the JetStream tests need it.
Install it (Debian/Ubuntu: sudo apt-get install nats-server; macOS: brew install nats-server;
or a release from https://github.com/nats-io/nats-server) and run ./scripts/test.sh again,
or set NATS_URL to a server with JetStream."
            fi
        fi
        dir="$(mktemp -d "${TMPDIR:-/tmp}/tower-idempotency-nats.XXXXXX")"
        echo "scripts/test.sh: starting nats-server -js on 127.0.0.1:$port" >&2
        nats-server -js -a 127.0.0.1 -p "$port" -sd "$dir" -l "$dir/log" -P "$dir/pid" &
        on_exit+=("$(printf 'kill "$(cat %q/pid 2>/dev/null)" 2>/dev/null; rm -rf %q' "$dir" "$dir")")
        for _ in $(seq 1 50); do port_open 127.0.0.1 "$port" && break; sleep 0.1; done
        port_open 127.0.0.1 "$port" || die "nats-server did not start (see $dir/log)"
    fi
    export NATS_URL="$nats"
}

ensure_nats
echo "scripts/test.sh: JetStream tests use $NATS_URL" >&2

find_pgbouncer() {
    local p
    for p in "$(command -v pgbouncer 2>/dev/null)" /usr/sbin/pgbouncer /usr/local/bin/pgbouncer /opt/homebrew/bin/pgbouncer; do
        if [[ -n "$p" && -x "$p" ]]; then
            echo "$p"
            return 0
        fi
    done
    return 1
}

ensure_pgbouncer() {
    local bin
    if ! bin="$(find_pgbouncer)"; then
        if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "scripts/test.sh: PgBouncer is not installed; installing it with apt-get" >&2
            apt-get update -qq >&2
            # The package's own service stays off (policy or no init system); the tests and
            # this script start PgBouncer with configurations of their own.
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null
            bin="$(find_pgbouncer)" || die "PgBouncer was installed but pgbouncer was not found"
        else
            die "PgBouncer is not installed; tests/payments_e2e.rs and the last test run go through it.
Install it (Debian/Ubuntu: sudo apt-get install pgbouncer; macOS: brew install pgbouncer)
and run ./scripts/test.sh again."
        fi
    fi
    echo "$bin"
}
# tests/payments_e2e.rs starts a PgBouncer of its own (transaction pooling, 10 server
# connections), so PgBouncer is needed from the first test run on.
ensure_pgbouncer >/dev/null

# Most tests wait far more than they compute (leases and TTLs running out, a provider's delay,
# a server restarting): eight at a time keep two cores busy. RUST_TEST_THREADS overrides it.
export RUST_TEST_THREADS="${RUST_TEST_THREADS:-8}"
# The examples are built as the programs the end-to-end tests start (they hold no tests of
# their own), then the tests and the benches' smoke runs.
cargo build --all-features --examples
cargo test --all-features --lib --bins --tests --benches --no-run
tests_started=$SECONDS
took() { echo "scripts/test.sh: $1 took $((SECONDS - $2)) s" >&2; }
# The suites that start servers of their own (Postgres clusters, a Redis cluster, processes to
# kill) run beside the others: they mostly wait for those servers. Their output is shown when
# they end.
apart=(failover redis_failover redis database_crash consumer_e2e)
together=()
for file in tests/*.rs; do
    name="$(basename "$file" .rs)"
    [[ " ${apart[*]} " == *" $name "* ]] || together+=(--test "$name")
done
apart_log="$(mktemp "${TMPDIR:-/tmp}/tower-idempotency-apart.XXXXXX")"
on_exit+=("rm -f '$apart_log'")
cargo test --all-features "${apart[@]/#/--test=}" >"$apart_log" 2>&1 &
apart_pid=$!
# Stopped with the script, should it stop first (a failure, an interrupt).
on_exit+=("pkill -TERM -P $apart_pid 2>/dev/null; kill $apart_pid 2>/dev/null")
cargo test --all-features --lib --bins --benches "${together[@]}"
apart_failed=0
wait "$apart_pid" || apart_failed=1
cat "$apart_log"
((apart_failed == 0)) || die "a suite with servers of its own failed (its output is above)"
cargo test --all-features --doc
took "the tests and the benches' smoke runs" "$tests_started"

# The Postgres suites once more at each stricter default isolation level: many payment
# services set default_transaction_isolation to 'repeatable read' or 'serializable' (on the
# role, the database or the connection), and the layer must keep its promise at each.
# (tests/isolation.rs covers all three levels by itself.)
levels_started=$SECONDS
# The two levels run at once, each with half the test threads: the suites mostly wait, and
# one level's slowest tests overlap the other's. Each level's output is shown when it ends.
run_level() {
    # The behaviour suite's Postgres stores only: its memory and Redis stores do not read the
    # database's isolation level.
    TI_ISOLATION="$1" cargo test --all-features --test behaviour -- postgres &&
        TI_ISOLATION="$1" cargo test --all-features \
            --test transactional --test postgres --test inbox --test model \
            --test cancellation --test round_trips --test payments_e2e --test scope --test consumer --test inbox_daily \
            --test connection_loss --test stalls --test wait --test phased --test jetstream_e2e \
            --test migrations --test fault_matrix
}
levels_log="$(mktemp -d "${TMPDIR:-/tmp}/tower-idempotency-levels.XXXXXX")"
on_exit+=("rm -rf '$levels_log'")
pids=()
for level in "repeatable read" "serializable"; do
    echo "scripts/test.sh: the Postgres suites again at default_transaction_isolation = $level" >&2
    RUST_TEST_THREADS=$(( (RUST_TEST_THREADS + 1) / 2 )) run_level "$level" >"$levels_log/${level// /_}.log" 2>&1 &
    pids+=($!)
    on_exit+=("pkill -TERM -P $! 2>/dev/null; kill $! 2>/dev/null")
done
failed=0
for i in 0 1; do
    wait "${pids[i]}" || failed=1
done
cat "$levels_log"/*.log
((failed == 0)) || die "a Postgres suite failed at a stricter isolation level (its output is above)"
took "the Postgres suites at the two stricter levels" "$levels_started"

# The behaviour suite's Postgres stores, the example's end-to-end tests and the pooler's own
# tests once more, through a PgBouncer in transaction pooling mode: many deployments put one between the
# services and Postgres, and there a client's statements reach whichever server connection
# is free, so nothing may rely on a server session (prepared statements, session settings,
# session advisory locks) outside a transaction.
start_pgbouncer() {
    local bin pg_host pg_port user rest db dir port run_as=()
    bin="$(ensure_pgbouncer)"
    read -r pg_host pg_port < <(host_port "$DATABASE_URL")
    # postgres://user[:password]@host:port/db?params -> user and db
    rest="${DATABASE_URL#*://}"
    user="postgres"
    if [[ "$rest" == *@* ]]; then
        user="${rest%%@*}"
        user="${user%%:*}"
    fi
    db="postgres"
    rest="${rest%%\?*}"
    [[ "$rest" == */* && -n "${rest#*/}" ]] && db="${rest#*/}"
    port=6432
    while port_open 127.0.0.1 "$port"; do
        port=$((port + 1))
        ((port < 6532)) || die "no free port for PgBouncer in 6432-6531"
    done
    dir="$(mktemp -d "${TMPDIR:-/tmp}/tower-idempotency-pgbouncer.XXXXXX")"
    # Clients log in without a password (trust). Roles the file does not list (the tests'
    # per-test roles) are looked up in the server with auth_query, as auth_user.
    printf '"%s" ""\n' "$user" >"$dir/users.txt"
    cat >"$dir/pgbouncer.ini" <<INI
[databases]
* = host=$pg_host port=$pg_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $dir/users.txt
auth_user = $user
auth_query = SELECT usename, passwd FROM pg_shadow WHERE usename = \$1
; Fewer server connections per database and user than a test has clients (a store's pool
; has 16, a test often runs two stores, tests/pooler.rs many more): clients really share them.
default_pool_size = 20
reserve_pool_size = 0
max_client_conn = 2000
; Idle server connections go soon: every test has a role of its own, so a pool of its own.
server_idle_timeout = 10
; sqlx sends extra_float_digits at startup, and PgBouncer refuses parameters it does not know.
; (Not options: PgBouncer 1.18 would drop it silently; the tests do not send it.)
ignore_startup_parameters = extra_float_digits
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
    if [[ $EUID -eq 0 ]]; then
        # PgBouncer refuses to run as root: run it as the postgres system user.
        id postgres >/dev/null 2>&1 || die "running as root, but there is no 'postgres' user to run PgBouncer as"
        chown -R postgres "$dir"
        run_as=(runuser -u postgres --)
    fi
    echo "scripts/test.sh: starting PgBouncer ($bin, transaction pooling) on 127.0.0.1:$port" >&2
    "${run_as[@]}" "$bin" -d "$dir/pgbouncer.ini" >/dev/null ||
        die "PgBouncer did not start (see $dir/pgbouncer.log)"
    # Stop it when the script exits (expanded now: the locals are gone then).
    on_exit+=("$(printf 'kill -TERM "$(cat %q 2>/dev/null)" 2>/dev/null; sleep 0.2; rm -rf %q' "$dir/pgbouncer.pid" "$dir")")
    for _ in $(seq 1 100); do
        port_open 127.0.0.1 "$port" && break
        sleep 0.1
    done
    port_open 127.0.0.1 "$port" || die "PgBouncer does not answer on 127.0.0.1:$port (see $dir/pgbouncer.log)"
    TI_PGBOUNCER_URL="postgres://$user@127.0.0.1:$port/$db"
}

if [[ -z "${TI_PGBOUNCER_URL:-}" ]]; then
    start_pgbouncer
fi
export TI_PGBOUNCER_URL
echo "scripts/test.sh: the behaviour suite's Postgres stores, the example's end-to-end tests and tests/pooler.rs through PgBouncer at $TI_PGBOUNCER_URL" >&2
pooler_started=$SECONDS
cargo test --all-features --test behaviour -- postgres
cargo test --all-features --test payments_e2e
cargo test --all-features --test pooler -- --include-ignored
took "the runs through PgBouncer" "$pooler_started"
took "every test run" "$tests_started"
