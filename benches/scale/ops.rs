//! Store operations, timed (steps 2 and 3): first requests (`claim` of a new key, then `complete`)
//! and replays (`claim` of a completed key) straight through the [`Store`] trait, on the
//! empty and the full table in alternating rounds ([`compare`]), their latencies
//! ([`Latencies`]), and what they cost the database ([`measure_costs`]).

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

    /// The latencies of several rounds together (their walls added up).
    fn pooled(parts: &[Latencies]) -> Self {
        Self::new(
            parts.iter().flat_map(|l| l.us.iter().copied()).collect(),
            parts.iter().map(|l| l.wall).sum(),
        )
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
}

/// A number of cores with two decimals, or `–`.
pub(crate) fn cores(c: Option<f64>) -> String {
    c.map_or_else(|| "–".to_owned(), |c| format!("{c:.2}"))
}

pub(crate) fn micros(d: Duration) -> u32 {
    u32::try_from(d.as_micros()).unwrap_or(u32::MAX)
}

/// Runs operations `op(base)`, `op(base + 1)` … on `concurrency` tasks: `warmup` untimed,
/// then `ops` timed (indices `base + warmup ..`).
async fn timed<F, Fut>(
    base: usize,
    ops: usize,
    warmup: usize,
    concurrency: usize,
    op: &Arc<F>,
) -> Result<Latencies, BoxError>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxError>> + Send,
{
    for (from, count, measured) in [(base, warmup, false), (base + warmup, ops, true)] {
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
                    op(from + i).await?;
                    us.push(micros(t.elapsed()));
                }
            }));
        }
        let mut all = Vec::with_capacity(count);
        for task in tasks {
            all.extend(task.await??);
        }
        if measured {
            return Ok(Latencies::new(all, started.elapsed()));
        }
    }
    unreachable!("the measured pass returns")
}

/// One table of the comparison: its schema, its store, and the bulk-loaded live records
/// its replays of old keys draw from (none on the empty table).
pub(crate) struct Side<'a> {
    pub(crate) name: &'static str,
    pub(crate) db: &'a Db,
    pub(crate) store: PostgresStore,
    pub(crate) live: Option<(u64, u64)>,
}

/// What a timed operation is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A first request: a new key claimed and completed.
    First,
    /// A replay of a key this side's first requests completed earlier in the run (a retry
    /// of a recent request).
    ReplayRecent,
    /// A replay of a bulk-loaded live key at random (a key from any time of the last day:
    /// most are not in Postgres's buffers).
    ReplayOld,
}

impl Kind {
    /// Distinct index ranges per kind, so no two phases draw the same operation index.
    fn offset(self) -> usize {
        match self {
            Kind::First => 0,
            Kind::ReplayRecent => 100_000_000,
            Kind::ReplayOld => 200_000_000,
        }
    }
}

/// The operation `i` of `kind` on a side; a replay of a recent key draws from the `count`
/// first requests with indices `from..`, all completed.
async fn operation(
    store: PostgresStore,
    name: &'static str,
    live: Option<(u64, u64)>,
    kind: Kind,
    (from, count): (usize, usize),
    i: usize,
) -> Result<(), BoxError> {
    match kind {
        Kind::First => {
            let key = IdempotencyKey::parse(&uuid_key(&format!("{name}-new-{i}")))?;
            first_request(&store, &key).await
        }
        Kind::ReplayRecent => {
            let j = from + pick(i, count);
            let key = IdempotencyKey::parse(&uuid_key(&format!("{name}-new-{j}")))?;
            replay(&store, &key).await
        }
        Kind::ReplayOld => {
            let (from, to) = live.ok_or("no bulk-loaded records to replay")?;
            let n = usize::try_from(to - from)?;
            replay(&store, &bulk_key(from + u64::try_from(pick(i, n))?)).await
        }
    }
}

/// One row of the comparison: the empty table's latencies against the full one's, pooled
/// over the rounds, and each round's p50 ratio.
pub(crate) struct Row {
    pub(crate) name: &'static str,
    pub(crate) empty: Latencies,
    pub(crate) full: Latencies,
    pub(crate) round_ratios: Vec<f64>,
}

/// First requests and replays on the empty and the full table, in `args.rounds` alternating
/// rounds of `args.ops / args.rounds` timed operations each (after a twentieth as many
/// untimed), so that both tables are measured through the same windows of a noisy machine.
/// In a round each table makes its first requests, then its replays of recent keys, then
/// (the full table) of old ones, the two tables taking turns phase by phase; even rounds
/// start with the empty table, odd ones with the full one.
///
/// Three rows: first requests; replays of recent keys on both tables; and replays of old
/// keys on the full table against the empty table's replays (on the empty table every key
/// is recent).
pub(crate) async fn compare(
    empty: &Side<'_>,
    full: &Side<'_>,
    args: &Args,
) -> Result<Vec<Row>, BoxError> {
    let per = (args.ops / args.rounds).max(1);
    let warmup = (per / 20).max(10);
    let kinds = [Kind::First, Kind::ReplayRecent, Kind::ReplayOld];
    // Latencies per (side, kind), a part per round.
    let mut parts: Vec<[Vec<Latencies>; 3]> = vec![Default::default(), Default::default()];
    for round in 0..args.rounds {
        let sides = if round % 2 == 0 {
            [(0, empty), (1, full)]
        } else {
            [(1, full), (0, empty)]
        };
        let base = round * (per + warmup);
        for (k, &kind) in kinds.iter().enumerate() {
            for &(s, side) in &sides {
                if kind == Kind::ReplayOld && side.live.is_none() {
                    continue;
                }
                let (store, name, live) = (side.store.clone(), side.name, side.live);
                // This side's first requests so far, this round's included.
                let recent = (0, base + per + warmup);
                let op = Arc::new(move |i| operation(store.clone(), name, live, kind, recent, i));
                let l = timed(kind.offset() + base, per, warmup, args.concurrency, &op).await?;
                parts[s][k].push(l);
            }
        }
        let p50 = |s: usize, k: usize| parts[s][k].last().map_or(f64::NAN, |l| l.ms(0.5));
        println!(
            "  round {}: p50 ms, empty / full: first requests {:.3} / {:.3}, replays of recent \
             keys {:.3} / {:.3}, of old keys (full) {:.3}",
            round + 1,
            p50(0, 0),
            p50(1, 0),
            p50(0, 1),
            p50(1, 1),
            p50(1, 2)
        );
    }
    let row = |name, (es, ek): (usize, usize), (fs, fk): (usize, usize)| {
        let (e, f): (&[Latencies], &[Latencies]) = (&parts[es][ek], &parts[fs][fk]);
        Row {
            name,
            empty: Latencies::pooled(e),
            full: Latencies::pooled(f),
            round_ratios: e
                .iter()
                .zip(f)
                .map(|(e, f)| f.ms(0.5) / e.ms(0.5))
                .collect(),
        }
    };
    Ok(vec![
        row("first request (claim + complete)", (0, 0), (1, 0)),
        row("replay of a recent key (claim)", (0, 1), (1, 1)),
        row("replay of an old key (claim)", (0, 1), (1, 2)),
    ])
}

/// What an operation cost the database on one side: `ops` first requests, then as many
/// replays (of old keys where the side has them, else of the keys just completed), each
/// phase between two readings of Postgres's counters (after a pause so that every backend
/// has reported, in a measuring run).
pub(crate) async fn measure_costs(
    side: &Side<'_>,
    args: &Args,
    ops: usize,
) -> Result<(PerOp, PerOp), BoxError> {
    let flushed = || async {
        if args.measuring {
            tokio::time::sleep(STATS_FLUSH).await;
        }
        side.db.counters().await
    };
    // Operation indices past those of `compare`.
    let base = 50_000_000;
    let (store, name, live) = (side.store.clone(), side.name, side.live);
    let before = flushed().await?;
    let recent = (base, ops);
    let op = Arc::new(move |i| operation(store.clone(), name, live, Kind::First, recent, i));
    timed(base, ops, 0, args.concurrency, &op).await?;
    let middle = flushed().await?;
    let store = side.store.clone();
    let kind = if live.is_some() {
        Kind::ReplayOld
    } else {
        Kind::ReplayRecent
    };
    let op = Arc::new(move |i| operation(store.clone(), name, live, kind, recent, i));
    timed(kind.offset() + base, ops, 0, args.concurrency, &op).await?;
    let after = flushed().await?;
    Ok((middle.per_op(&before, ops), after.per_op(&middle, ops)))
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
