//! The purge under load (step 4): `--clients` tasks send first requests back to back, once
//! without purging and once while [`Store::purge_expired`] runs to completion, and the
//! windows compared ([`purge_run`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tower_idempotency::{IdempotencyKey, PostgresStore, Store};

use crate::BoxError;
use crate::db::Db;
use crate::keys::uuid_key;
use crate::ops::{Latencies, cores, first_request, micros};
use crate::runner::Args;

/// One timed request of the closed-loop load: when it started and ended, and whether the
/// store failed it (a bound it keeps, such as its 5 s statement timeout, ran out).
struct Sample {
    start: Instant,
    end: Instant,
    failed: bool,
}

/// `clients` tasks sending first requests back to back until `stop` is set.
fn start_load(
    store: &PostgresStore,
    clients: usize,
    tag: String,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Result<Vec<Sample>, BoxError>>> {
    (0..clients)
        .map(|c| {
            let (store, tag, stop) = (store.clone(), tag.clone(), stop.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                let mut seq = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    seq += 1;
                    let key = IdempotencyKey::parse(&uuid_key(&format!("{tag}-{c}-{seq}")))?;
                    let start = Instant::now();
                    let failed = match first_request(&store, &key).await {
                        Ok(()) => false,
                        Err(e) => {
                            eprintln!("  {tag}: a first request failed: {e}");
                            true
                        }
                    };
                    samples.push(Sample {
                        start,
                        end: Instant::now(),
                        failed,
                    });
                }
                Ok(samples)
            })
        })
        .collect()
}

async fn finish_load(
    tasks: Vec<tokio::task::JoinHandle<Result<Vec<Sample>, BoxError>>>,
) -> Result<Vec<Sample>, BoxError> {
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

/// The load in a window: throughput (requests that ended in it) and the latencies of the
/// requests that overlapped it.
pub(crate) struct Window {
    pub(crate) throughput: f64,
    pub(crate) lat: Latencies,
    /// How many cores the whole machine kept busy in the window.
    pub(crate) busy_cores: Option<f64>,
    /// Requests that ended in the window with an error from the store.
    pub(crate) failed: usize,
}

fn window(samples: &[Sample], from: Instant, to: Instant, busy: Option<Duration>) -> Window {
    let ended = samples
        .iter()
        .filter(|s| s.end >= from && s.end < to && !s.failed)
        .count();
    let failed = samples
        .iter()
        .filter(|s| s.end >= from && s.end < to && s.failed)
        .count();
    let overlapping: Vec<u32> = samples
        .iter()
        .filter(|s| s.start < to && s.end > from)
        .map(|s| micros(s.end - s.start))
        .collect();
    let span = to - from;
    Window {
        throughput: ended as f64 / span.as_secs_f64(),
        lat: Latencies::new(overlapping, span),
        busy_cores: busy.map(|b| b.as_secs_f64() / span.as_secs_f64()),
        failed,
    }
}

/// Busy time of the whole machine so far: `/proc/stat`'s `cpu` line less idle and iowait, in
/// clock ticks (taken as 100 per second, Linux's `USER_HZ`). `None` off Linux.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some(Duration::from_millis((total - idle) * 10))
}

/// CPU time a process has used so far (`/proc/PID/schedstat`). `None` off Linux.
fn process_cpu(pid: u32) -> Option<Duration> {
    let ns = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(Duration::from_nanos(ns))
}

fn since(after: Option<Duration>, before: Option<Duration>) -> Option<Duration> {
    Some(after?.saturating_sub(before?))
}

pub(crate) struct PurgeRun {
    pub(crate) batch: usize,
    pub(crate) baseline: Window,
    pub(crate) during: Window,
    pub(crate) took: Duration,
    /// CPU time of the purge's Postgres backend.
    pub(crate) purge_cpu: Option<Duration>,
    pub(crate) deleted: u64,
    pub(crate) expected: u64,
    pub(crate) left: u64,
}

pub(crate) async fn purge_run(
    db: &Db,
    store: &PostgresStore,
    args: &Args,
    batch: usize,
    expected: u64,
) -> Result<PurgeRun, BoxError> {
    // Without purging: `--seconds` after `--warmup`.
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = start_load(store, args.clients, format!("base{batch}"), stop.clone());
    tokio::time::sleep(args.warmup).await;
    let (from, busy_from) = (Instant::now(), machine_busy());
    tokio::time::sleep(args.seconds).await;
    let (to, busy_to) = (Instant::now(), machine_busy());
    stop.store(true, Ordering::Relaxed);
    let baseline = window(
        &finish_load(tasks).await?,
        from,
        to,
        since(busy_to, busy_from),
    );
    println!(
        "  batch {batch}: without purge: {:>7.0} req/s  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms; \
         {} failed; machine busy {} cores",
        baseline.throughput,
        baseline.lat.ms(0.5),
        baseline.lat.ms(0.99),
        baseline.lat.max_ms(),
        baseline.failed,
        cores(baseline.busy_cores)
    );

    // The same load while the purge runs to completion (its own connection).
    let purger = PostgresStore::new(db.purge_pool.clone()).with_purge_duty_cycle(args.purge_duty);
    let purge_pid = db.purge_backend_pid().await?;
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = start_load(store, args.clients, format!("purge{batch}"), stop.clone());
    tokio::time::sleep(args.warmup).await;
    let (from, busy_from, cpu_from) = (Instant::now(), machine_busy(), process_cpu(purge_pid));
    let deleted = purger
        .purge_expired(batch)
        .await
        .map_err(|e| format!("the purge (batch {batch}) failed: {e}"))?;
    let (to, busy_to, cpu_to) = (Instant::now(), machine_busy(), process_cpu(purge_pid));
    stop.store(true, Ordering::Relaxed);
    let during = window(
        &finish_load(tasks).await?,
        from,
        to,
        since(busy_to, busy_from),
    );
    let took = to - from;
    let purge_cpu = since(cpu_to, cpu_from);
    let left = db.expired_count().await?;
    println!(
        "  batch {batch}: during purge:  {:>7.0} req/s  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms; \
         {} failed; machine busy {} cores; purge {:.2} s using {} cores, {deleted} rows deleted (expected \
         {expected}, {left} expired left)",
        during.throughput,
        during.lat.ms(0.5),
        during.lat.ms(0.99),
        during.lat.max_ms(),
        during.failed,
        cores(during.busy_cores),
        took.as_secs_f64(),
        cores(purge_cpu.map(|c| c.as_secs_f64() / took.as_secs_f64())),
    );
    Ok(PurgeRun {
        batch,
        baseline,
        during,
        took,
        purge_cpu,
        deleted,
        expected,
        left,
    })
}
