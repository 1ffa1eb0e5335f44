#!/usr/bin/env bash
# Where each statement's time goes, for the ways of peers.sh: each way runs once on a Postgres
# server of this script's own (a temporary cluster on a free loopback port, so that
# pg_stat_statements is preloaded without restarting a shared server), and for each way the
# server tells, per request (one pgbench transaction):
#
#   statements  calls, the share of calls that planned the statement, planning and
#               execution time (µs), WAL bytes, shared buffers touched and dirtied per call,
#               from pg_stat_statements (track = all: the statements inside the store's
#               functions too, marked "in a function"; the SET statements in front of a call
#               as well). Parsing and analysis are not counted: over the simple protocol
#               they come on top of every statement's planning.
#   functions   calls, self and total time (µs) per call, from pg_stat_user_functions
#   WAL         bytes per request, from pg_current_wal_lsn()
#
#   benches/pgbench/statements.sh [-c CLIENTS] [-T SECONDS] [-k KEYS] [-w WAY]
#
# Defaults: -c 10, -T 5, -k 1000 completed keys, every way (-w names one, e.g. "new store").
# Needs PostgreSQL's server binaries (initdb, pg_ctl) and pg_stat_statements (Debian's
# postgresql package has both); as root the server runs as the postgres system user.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"

clients=10 threads=1 seconds=5 keys=1000 only=""
while getopts "c:T:k:w:h" opt; do
    case "$opt" in
        c) clients="$OPTARG" ;;
        T) seconds="$OPTARG" ;;
        k) keys="$OPTARG" ;;
        w) only="$OPTARG" ;;
        *) sed -n '2,21p' "$0"; exit 2 ;;
    esac
done

bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)"
if [[ -z "$bin" || ! -x "$bin/initdb" ]]; then
    echo "PostgreSQL's initdb was not found under /usr/lib/postgresql/*/bin: install the server (Debian: apt-get install postgresql)" >&2
    exit 1
fi
as_server() { if [[ "$(id -u)" == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }
dir="$(mktemp -d /tmp/ti-statements.XXXXXX)"
[[ "$(id -u)" == 0 ]] && chown postgres "$dir"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
stop_server() {
    as_server "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf "$dir"
}
trap stop_server EXIT
as_server "$bin/initdb" -D "$dir/data" -U postgres --auth=trust --no-sync >/dev/null
as_server "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w start -o "-p $port -k $dir \
    -c listen_addresses=127.0.0.1 -c shared_preload_libraries=pg_stat_statements \
    -c pg_stat_statements.track=all -c pg_stat_statements.track_planning=on \
    -c track_functions=all" >/dev/null
export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"

# shellcheck source=lib.sh
. "$here/lib.sh"
# lib.sh's exit trap drops its schema; the server goes with it.
trap 'cleanup; stop_server' EXIT
PGOPTIONS="" psql_q -c "CREATE EXTENSION pg_stat_statements"
fill_replay_keys
create_peer_tables

echo "pgbench: $clients clients, $seconds s per way, a server of its own (PostgreSQL $("$bin/postgres" --version | awk '{print $3}'), synchronous_commit on)"
for way in "${ways[@]}"; do
    IFS='|' read -r name script mode <<<"$way"
    [[ -z "$only" || "$only" == "$name" ]] || continue
    psql_q -c "SELECT public.pg_stat_statements_reset(), pg_stat_reset()" >/dev/null
    lsn="$(psql_q -At -c "SELECT pg_current_wal_lsn()")"
    out="$(pgbench "$url" -n -M "$mode" -c "$clients" -j "$threads" -T "$seconds" \
        -D nkeys="$keys" -D prepared=0 -D schema="$schema" -f "$here/peers/$script" 2>&1)" \
        || { echo "$out" >&2; exit 1; }
    n="$(echo "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')"
    tps="$(echo "$out" | sed -n 's/^tps = \([0-9]*\).*/\1/p' | head -1)"
    echo
    echo "### $name ($script, $mode protocol): $tps tps, $n requests"
    echo
    psql_q -At -F ' | ' <<SQL
SELECT 'WAL per request: ' || round(pg_wal_lsn_diff(pg_current_wal_lsn(), '$lsn') / $n) || ' bytes';
SELECT '';
SELECT '| per request | planned | plan µs | exec µs | WAL bytes | buffers | dirtied | statement |';
SELECT '|---:|---:|---:|---:|---:|---:|---:|---|';
SELECT '', round(calls::numeric / $n, 2), round(plans::numeric / calls, 2),
       round((total_plan_time * 1000 / calls)::numeric, 1),
       round((mean_exec_time * 1000)::numeric, 1), round(wal_bytes / calls),
       round((shared_blks_hit + shared_blks_read)::numeric / calls, 1),
       round(shared_blks_dirtied::numeric / calls, 2),
       CASE WHEN toplevel THEN '' ELSE '(in a function) ' END
       || left(regexp_replace(query, '\s+', ' ', 'g'), 90) || ' |'
  FROM public.pg_stat_statements
 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND calls >= $n / 2
   AND query NOT LIKE '%pg_stat%'
 ORDER BY toplevel DESC, total_plan_time + total_exec_time DESC;
SELECT '';
SELECT '| function | per request | self µs | total µs |';
SELECT '|---|---:|---:|---:|';
SELECT '', funcname, round(calls::numeric / $n, 2), round((self_time * 1000 / calls)::numeric, 1),
       round((total_time * 1000 / calls)::numeric, 1) || ' |'
  FROM pg_stat_user_functions WHERE calls >= $n / 2 ORDER BY total_time DESC;
SQL
done
