#!/usr/bin/env bash
# Runs the whole test suite, Postgres tests included.
#
# The Postgres tests use DATABASE_URL (default: postgres://postgres@127.0.0.1:5432/postgres).
# When that default server is not running, this script starts a throwaway PostgreSQL
# cluster of its own (installing PostgreSQL first when run as root on Debian/Ubuntu), runs
# the tests against it and stops it. It never skips the Postgres tests: if it cannot get a
# server, it stops and says what to do.
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

start_throwaway_cluster() {
    local bin port=55432 run_as=()
    if ! bin="$(find_pg_bin)"; then
        if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
            echo "scripts/test.sh: PostgreSQL is not installed; installing it with apt-get" >&2
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
            bin="$(find_pg_bin)" || die "PostgreSQL was installed but initdb was not found"
        else
            die "no PostgreSQL server at $url and PostgreSQL is not installed.
Install it (Debian/Ubuntu: sudo apt-get install postgresql; macOS: brew install postgresql)
and run ./scripts/test.sh again, or set DATABASE_URL to a server you own."
        fi
    fi
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
    trap '"${run_as[@]}" "$bin/pg_ctl" -D "$data/db" -m fast stop >/dev/null 2>&1 || true' EXIT
    url="postgres://postgres@127.0.0.1:$port/postgres"
}

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

cargo test --all-features --all-targets
cargo test --all-features --doc
