//! Scale benchmark of [`PostgresStore`]: does a big table slow the store down, and does
//! purging expired keys hurt the requests running meanwhile?
//!
//! ```text
//! cargo bench --bench scale -- [--rows 10000000] [--expired 1000000] [--ops 20000]
//!                              [--rounds 5] [--concurrency 8] [--clients 16] [--seconds 20]
//!                              [--warmup 2] [--batches 1000,5000] [--purge-duty 1.0]
//!                              [--prewarm]
//! ```
//!
//! In two fresh schemas (migrated with [`PostgresStore::migrate`], dropped at the end), one
//! for the empty table and one for the full table, straight through the [`Store`] trait (no
//! HTTP):
//!
//! 1. **Bulk load** of the full table: `--rows` completed records with small bodies,
//!    `--expired` of them expired (`expires_at` 1 to 2 hours ago), the others live (expiring
//!    2 to 24 hours from now, as records written over the last day with a 24 h TTL; none
//!    expires during the run), with UUID-shaped keys in random order, loaded by
//!    `INSERT … SELECT … FROM generate_series` in chunks of a million; then `VACUUM ANALYZE`
//!    and `CHECKPOINT` of both tables.
//! 2. **Empty against full, in alternating rounds.** `--ops` operations of each kind per
//!    table, by `--concurrency` tasks, each timed, split into `--rounds` rounds in which the
//!    two tables take turns phase by phase (so both are measured through the same windows of
//!    a noisy machine): first requests (`claim` of a new key, then `complete`: the store's
//!    part of a first request through the layer), replays of recent keys (`claim` of a key
//!    this table's first requests completed earlier in the run: a retry), and on the full
//!    table replays of old keys (bulk-loaded live keys at random, as a retry a day late:
//!    most are not in Postgres's buffers), compared with the empty table's replays. Each
//!    row gives both tables' p50 and p99 over all rounds, the ratio, and each round's p50
//!    ratio.
//! 3. **What an operation costs the database**, a tenth as many operations again on each
//!    table: WAL records, full-page images and bytes (`pg_stat_wal`, the whole cluster) and
//!    the keys table's buffer reads and hits (`pg_statio_all_tables`), read after an 11 s
//!    pause so every backend has reported. With `--prewarm`, both tables and their primary
//!    keys are loaded into shared buffers (`pg_prewarm`) before step 2: on a server whose
//!    `shared_buffers` holds them, this measures the table's size alone, without the cold
//!    reads of a fresh load.
//! 4. **Purge.** For each `--batches` size: `--clients` tasks send first requests back to
//!    back; once for `--seconds` without purging (the baseline), then while
//!    [`Store::purge_expired`] runs to completion on a connection of its own. Reported: the
//!    throughput during the purge against the baseline, the longest single request that
//!    overlapped the purge, how long the purge took and how many rows it deleted (checked
//!    against `--expired`), the CPU its Postgres backend used and how busy the machine was
//!    (`/proc`), and how many requests the store failed (a failed request is counted, the
//!    load goes on, and the run ends with an error). Before the second and later batch sizes, `--expired` new expired
//!    records are loaded (after a `VACUUM` of the first purge's dead rows).
//!
//! Run without `--bench` (as `cargo test --all-targets` does), it makes a smoke run of about a
//! second on a few thousand rows. `DATABASE_URL` selects the server (default the local one).
//!
//! The code, under `benches/scale/`:
//!
//! - `runner.rs`: the command line, the four steps in order, the report;
//! - `keys.rs`: what every request carries (UUID-shaped keys, the one fingerprint, the stored
//!   answer);
//! - `db.rs`: a fresh schema, the bulk load, Postgres's WAL and buffer counters;
//! - `ops.rs`: first requests and replays through the store, timed, on both tables in
//!   alternating rounds (step 2), and their cost to the database (step 3);
//! - `purge.rs`: the closed-loop load without and during a purge (step 4).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

#[path = "scale/db.rs"]
mod db;
#[path = "scale/keys.rs"]
mod keys;
#[path = "scale/ops.rs"]
mod ops;
#[path = "scale/purge.rs"]
mod purge;
#[path = "scale/runner.rs"]
mod runner;

use crate::db::Db;
use crate::runner::{parse_args, print_report, run};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let result = rt.block_on(async {
        let size = u32::try_from(args.concurrency.max(args.clients))?;
        let small = Db::new(u32::try_from(args.concurrency)?).await?;
        let db = Db::new(size).await?;
        println!(
            "schemas {} (empty table), {} (full table)",
            small.schema, db.schema
        );
        let report = run(&small, &db, &args).await;
        small.drop_schema().await;
        db.drop_schema().await;
        report
    });
    match result {
        Ok(report) => {
            print_report(&args, &report);
            let wrong: Vec<_> = report
                .purges
                .iter()
                .filter(|p| {
                    p.deleted != p.expected
                        || p.left != 0
                        || p.baseline.failed + p.during.failed > 0
                })
                .collect();
            if wrong.is_empty() {
                std::process::ExitCode::SUCCESS
            } else {
                for p in wrong {
                    eprintln!(
                        "batch {}: the purge deleted {} rows, expected {}; {} expired left; \
                         {} + {} first requests failed (without / during the purge)",
                        p.batch, p.deleted, p.expected, p.left, p.baseline.failed, p.during.failed
                    );
                }
                std::process::ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("scale: failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
