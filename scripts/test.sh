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
    # shellcheck disable=SC2064
    trap "$(printf '%q ' "${run_as[@]}" "$bin/pg_ctl" -D "$data/db" -m fast stop) >/dev/null 2>&1 || true" EXIT
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

cargo test --all-features --all-targets
cargo test --all-features --doc

# The Postgres suites once more at each stricter default isolation level: many payment
# services set default_transaction_isolation to 'repeatable read' or 'serializable' (on the
# role, the database or the connection), and the layer must keep its promise at each.
# (tests/isolation.rs covers all three levels by itself.)
for level in "repeatable read" "serializable"; do
    echo "scripts/test.sh: the Postgres suites again at default_transaction_isolation = $level" >&2
    TI_ISOLATION="$level" cargo test --all-features \
        --test behaviour --test transactional --test postgres --test inbox --test model \
        --test cancellation --test round_trips --test payments_e2e --test scope \
        --test connection_loss --test stalls
done
