//! Load harness: an axum server in process, driven over loopback by many keep-alive HTTP/1.1
//! connections, each scenario against its baseline in the same run.
//!
//! ```text
//! cargo bench --bench load -- [scenario...] [--connections 64] [--seconds 10] [--warmup 2]
//!                             [--pool 16] [--rounds 1] [--replay-keys 10000]
//!                             [--server-threads 2] [--client-threads 2] [--side both]
//! ```
//!
//! Without a scenario name, every scenario runs. Each scenario starts a server twice on
//! `127.0.0.1:0` (in its own multi-thread runtime): once with the route behind the layer and
//! once with the same route *without* the layer, whose handler does by hand the work the layer
//! would do (the baseline; for `pg-tx`, the handler's own transaction with no idempotency at
//! all). The Postgres scenarios exist once per `ClaimStrategy` (`pg-plain-new`, `pg-replay`:
//! the default, `Adaptive`; `-insert-first`, `-read-first`; `pg-replay-combined`).
//! `pg-plain-new-same-sql` sets a `Combined` store against its own SQL by hand (the claim
//! function's call; `pg-plain-new`'s baseline sends the bare insert). Two references have no layer on either side: `pg-tx-by-hand` sends the
//! layer's transactional SQL by hand around `pg-tx`'s handler (what the layer adds beyond
//! its SQL), `pg-tx-record-only` the same without the claim (no look, no lock, no placeholder,
//! no savepoint: the completed record inserted with the commit; the ceiling of any design that
//! keeps the record in the handler's transaction). A client in a second runtime opens
//! `--connections` keep-alive connections, sends requests on each back to back for
//! `--warmup` seconds (not counted), then for `--seconds` seconds, and reports requests per
//! second and the p50/p99 latency of the requests completed in that window. The ratio is
//! layer ÷ baseline requests per second.
//! With `--rounds N` the sides run N times each, alternating which goes first, and the
//! figures are over all rounds.
//!
//! Client and server share the machine, so requests per second also move with whatever else
//! runs. The harness therefore also reports, from Linux's `/proc`, the CPU time per request of
//! the server's threads (`app`) and of the pool's Postgres backends (`db`, found by their
//! `application_name`), and how many cores the rest of the machine used meanwhile (`others`):
//! the cost ratio (baseline CPU ÷ layer CPU per request) does not depend on a neighbour.
//! `--side layer` or `--side baseline` runs one side alone, to profile it
//! (`perf record -- target/release/deps/load-… memory-new --side layer`).
//!
//! The Postgres scenarios use `DATABASE_URL` (default the local server) and a fresh schema per
//! scenario, dropped at the end; new-key scenarios empty the tables before each side runs, so
//! both start from the same state. The pool is sqlx's default apart from its size.
//!
//! The code, under `benches/load/`:
//!
//! - `runner.rs`: the command line, a scenario's sides run round by round, the summary
//!   tables;
//! - `server.rs`, `client.rs`, `cpu.rs`: the server a side runs on, the client that drives it
//!   (and its figures), the CPU accounting from `/proc`;
//! - `scenario.rs`: what a scenario is and returns, every scenario in run order, what the
//!   scenarios share (the create handler, the replay keys); `pg_schema.rs`: the fresh schema
//!   each Postgres scenario works in;
//! - the scenario groups, each with its own `SCENARIOS` table: `realistic.rs`
//!   (`realistic-plain`, `realistic-tx`: a payment handler with three statements and a 2 ms
//!   provider call, the figure that leads BENCHMARKS.md), `memory.rs` (`memory-new`), `memory_full.rs`
//!   (`memory-new-full`, `memory-replay-full`: the store holding a million records;
//!   `memory-replay-full-by-hand`: a map by hand as big), `two_hops.rs` (`memory-two-hops`: the payments example's
//!   keyed path, against no layer at all; `memory-two-hops-by-hand`: its ceiling),
//!   `postgres_plain.rs` (`pg-plain-new*`, `pg-replay*`), `transactional.rs` (`pg-tx*`),
//!   `waiting.rs` (`memory-new-wait`, `*-notify`), `redis.rs` (`redis-*`, feature `redis`).
//!
//! Adding a scenario: in its group's file, write a `build_*` function that returns the two
//! routers and the key plan ([`scenario::Built`]), and add a line to that file's `SCENARIOS`.
//! A new group is a new file with its own `SCENARIOS`, declared below and chained in
//! [`scenario::all_scenarios`].
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

// The shared runner.
#[path = "load/client.rs"]
mod client;
#[path = "load/cpu.rs"]
mod cpu;
#[path = "load/runner.rs"]
mod runner;
#[path = "load/server.rs"]
mod server;

// What the scenarios share.
#[path = "load/pg_schema.rs"]
mod pg_schema;
#[path = "load/scenario.rs"]
mod scenario;

// The scenario groups, each with its `SCENARIOS` table.
#[path = "load/memory.rs"]
mod memory;
#[path = "load/memory_full.rs"]
mod memory_full;
#[path = "load/postgres_plain.rs"]
mod postgres_plain;
#[path = "load/realistic.rs"]
mod realistic;
#[cfg(feature = "redis")]
#[path = "load/redis.rs"]
mod redis_scenarios;
#[path = "load/transactional.rs"]
mod transactional;
#[path = "load/two_hops.rs"]
mod two_hops;
#[path = "load/waiting.rs"]
mod waiting;

use std::time::Duration;

use crate::runner::{parse_args, print_table, run_scenario};
use crate::scenario::Ctx;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = |threads: usize, name: &str| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name(name)
            .enable_all()
            .build()
            .unwrap()
    };
    let server_rt = runtime(args.server_threads, "server");
    let client_rt = runtime(args.client_threads, "client");
    let ctx = Ctx { args };
    let mut outcomes = Vec::new();
    let mut failed = false;
    for &scenario in &ctx.args.scenarios {
        match run_scenario(&ctx, scenario, &server_rt, &client_rt) {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                eprintln!("{}: failed: {e}", scenario.name);
                failed = true;
            }
        }
    }
    print_table(&ctx.args, &outcomes);
    // Stop the runtimes without waiting for stray tasks (closed connections end anyway).
    server_rt.shutdown_timeout(Duration::from_secs(1));
    client_rt.shutdown_timeout(Duration::from_secs(1));
    if failed {
        std::process::ExitCode::FAILURE
    } else {
        std::process::ExitCode::SUCCESS
    }
}
