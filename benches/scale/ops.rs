//! Store operations, timed (steps 1 and 3): first requests (`claim` of a new key, then
//! `complete`) and replays (`claim` of a completed key) straight through the [`Store`] trait,
//! their latencies ([`Latencies`]) and what they cost the database ([`measure_ops`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tower_idempotency::{ClaimOutcome, ClaimRequest, IdempotencyKey, PostgresStore, Store};

use crate::BoxError;
use crate::db::{Db, PerOp};
use crate::keys::{bulk_key, the_answer, the_fingerprint, uuid_key};
use crate::runner::Args;

/// The layer's defaults: lease 30 s, TTL 24 h.
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(24 * 3600);

/// How long to wait for every backend's statistics to reach the shared counters: a backend
/// that went idle less than a second after its last report waits 10 s
/// (`PGSTAT_IDLE_INTERVAL`) before the next.
const STATS_FLUSH: Duration = Duration::from_secs(11);

/// The store's part of a first request through the layer: claim a new key, complete it.
pub(crate) async fn first_request(
    store: &PostgresStore,
    key: &IdempotencyKey,
) -> Result<(), BoxError> {
    let outcome = store
        .claim(ClaimRequest {
            scope: "",
            key,
            fingerprint: the_fingerprint(),
            lease: LEASE,
            ttl: TTL,
        })
        .await?;
    let ClaimOutcome::Acquired { token, .. } = outcome else {
        return Err(format!("claiming new key {key}: {outcome:?}").into());
    };
    if !store.complete("", key, token, &the_answer(), TTL).await? {
        return Err(format!("completing {key}: the token no longer holds it").into());
    }
    Ok(())
}

/// A replay: the claim of a completed key.
async fn replay(store: &PostgresStore, key: &IdempotencyKey) -> Result<(), BoxError> {
    let outcome = store
        .claim(ClaimRequest {
            scope: "",
            key,
            fingerprint: the_fingerprint(),
            lease: LEASE,
            ttl: TTL,
        })
        .await?;
    match outcome {
        ClaimOutcome::Completed(_) => Ok(()),
        other => Err(format!("replaying {key}: {other:?}").into()),
    }
}

/// Latencies of a batch of operations, in microseconds, sorted.
pub(crate) struct Latencies {
    us: Vec<u32>,
    wall: Duration,
}

impl Latencies {
    pub(crate) fn new(mut us: Vec<u32>, wall: Duration) -> Self {
        us.sort_unstable();
        Self { us, wall }
    }

    /// The latency at quantile `q` (nearest rank), in milliseconds.
    pub(crate) fn ms(&self, q: f64) -> f64 {
        let Some(last) = self.us.len().checked_sub(1) else {
            return f64::NAN;
        };
        // `q` is in [0, 1], so the rank is in [0, last].
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((last as f64) * q).round() as usize;
        f64::from(self.us[rank.min(last)]) / 1000.0
    }

    pub(crate) fn max_ms(&self) -> f64 {
        self.us
            .last()
            .map_or(f64::NAN, |us| f64::from(*us) / 1000.0)
    }

    pub(crate) fn per_second(&self) -> f64 {
        self.us.len() as f64 / self.wall.as_secs_f64()
    }

    fn line(&self) -> String {
        format!(
            "{:>7.0} ops/s  p50 {:>6.3} ms  p99 {:>6.3} ms  max {:>7.3} ms  ({} ops)",
            self.per_second(),
            self.ms(0.50),
            self.ms(0.99),
            self.max_ms(),
            self.us.len()
        )
    }
}

/// A number of cores with two decimals, or `–`.
pub(crate) fn cores(c: Option<f64>) -> String {
    c.map_or_else(|| "–".to_owned(), |c| format!("{c:.2}"))
}

pub(crate) fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs `ops` operations (`op(i)` for i in `0..ops`) on `concurrency` tasks, each timed,
/// after `warmup` untimed ones (`op(ops..ops + warmup)`).
async fn timed<F, Fut>(
    ops: usize,
    warmup: usize,
    concurrency: usize,
    op: F,
) -> Result<Latencies, BoxError>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    let op = Arc::new(op);
    for phase in [Phase::Warmup, Phase::Measured] {
        let (range, count) = match phase {
            Phase::Warmup => (ops, warmup),
            Phase::Measured => (0, ops),
        };
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = Vec::with_capacity(concurrency);
        for _ in 0..concurrency {
            let (op, next) = (op.clone(), next.clone());
            tasks.push(tokio::spawn(async move {
                let mut us = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        return Ok::<_, BoxError>(us);
                    }
                    let t = Instant::now();
                    op(range + i).await?;
                    us.push(micros(t.elapsed()));
                }
            }));
        }
        let mut all = Vec::with_capacity(count);
        for task in tasks {
            all.extend(task.await??);
        }
        if matches!(phase, Phase::Measured) {
            return Ok(Latencies::new(all, started.elapsed()));
        }
    }
    unreachable!("the measured phase returns")
}

#[derive(Clone, Copy)]
enum Phase {
    Warmup,
    Measured,
}

/// First requests and replays, timed.
pub(crate) struct OpStats {
    pub(crate) first: Latencies,
    pub(crate) replay: Latencies,
    pub(crate) first_db: PerOp,
    pub(crate) replay_db: PerOp,
}

pub(crate) async fn measure_ops(
    db: &Db,
    store: &PostgresStore,
    args: &Args,
    tag: &'static str,
    replay_keys: ReplayKeys,
) -> Result<OpStats, BoxError> {
    let warmup = (args.ops / 20).max(10);
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let before = flushed.await?;
    let s = store.clone();
    let first = timed(args.ops, warmup, args.concurrency, move |i| {
        let s = s.clone();
        async move {
            let key = IdempotencyKey::parse(&uuid_key(&format!("{tag}-new-{i}")))?;
            first_request(&s, &key).await
        }
    })
    .await?;
    println!("  first requests: {}", first.line());
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let middle = flushed.await?;
    let first_db = middle.per_op(&before, args.ops + warmup);
    println!("    {}", first_db.line());
    let s = store.clone();
    let replay = timed(args.ops, warmup, args.concurrency, move |i| {
        let s = s.clone();
        async move {
            let key = match replay_keys {
                // One of the keys the first requests above completed (measured or warm-up).
                ReplayKeys::JustCompleted { count } => {
                    let j = pick(i, count);
                    IdempotencyKey::parse(&uuid_key(&format!("{tag}-new-{j}")))?
                }
                ReplayKeys::Bulk { from, to } => {
                    let n = usize::try_from(to - from)?;
                    bulk_key(from + u64::try_from(pick(i, n))?)
                }
            };
            replay(&s, &key).await
        }
    })
    .await?;
    println!("  replays:        {}", replay.line());
    let flushed = async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        db.counters().await
    };
    let replay_db = flushed.await?.per_op(&middle, args.ops + warmup);
    println!("    {}", replay_db.line());
    Ok(OpStats {
        first,
        replay,
        first_db,
        replay_db,
    })
}

/// Which completed keys the replays pick from.
#[derive(Clone, Copy)]
pub(crate) enum ReplayKeys {
    /// `{tag}-new-0 …`: the first requests' keys.
    JustCompleted { count: usize },
    /// Bulk-loaded live records `from..to`.
    Bulk { from: u64, to: u64 },
}

/// A pseudo-random index below `n` for operation `i` (a multiplicative hash).
fn pick(i: usize, n: usize) -> usize {
    let h = u64::try_from(i)
        .unwrap_or(0)
        .wrapping_add(1)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let h = h ^ (h >> 29);
    usize::try_from(h % u64::try_from(n.max(1)).unwrap_or(1)).unwrap_or(0)
}
