//! Completions that wait for replicas ([`RedisStore::with_wait_replicas`]), sharing their
//! `WAIT`s.
//!
//! `WAIT` blocks the connection it is sent on until the replicas have acknowledged every
//! write made on it, or its timeout passes; and every call of a store shares one
//! multiplexed connection per server. One `WAIT` per completion would queue each behind the
//! other: with a replica gone, `n` completions would take `n` timeouts, and every claim
//! behind them too. So the store keeps at most one `WAIT` in flight per server (a round),
//! and a round covers every completion that server had answered before the round began.
//!
//! # What a round proves
//!
//! `WAIT` counts the writes of its own connection only: on a connection that made none (the
//! client reconnected between a completion and its `WAIT`, or the server's address now leads
//! to another server) it returns at once, and says nothing of the completion. So a round does
//! not rely on the connection that carried the completions. It is one pipeline, on one
//! connection, to the master of a covered record's slot: a mark script, which writes (a key
//! set and deleted) and returns the server's replication ID, then `WAIT`. The mark puts the
//! connection's last write at the end of the server's stream, after every completion the
//! server ran before it; `WAIT` then counts the replicas that acknowledged the stream up to
//! the mark.
//!
//! A completion names the replication ID of the master that stored it (read in its script,
//! atomically with the write), and a round confirms it only when the round's mark ran under
//! the same ID. A master draws a new ID when it becomes a master and when it restarts, so the
//! same ID means the same master process and the same stream: the completion ran there before
//! the mark (its answer came before the round began), and a replica that acknowledged the
//! mark has it. A round answered under another ID (a failover, a restart, another node)
//! confirms nothing: the server that stored the completion may be gone with it.
//!
//! Rounds go to one node at a time, never to every master at once: a multi-node request
//! hides which node answered, and a client library may answer for a node that is down with
//! another's reply.
//!
//! [`RedisStore::with_wait_replicas`]: super::RedisStore::with_wait_replicas

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::Mutex;

use ::redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use ::redis::{RedisError, Value};

use super::wire::{millis, slot};
use super::{Conn, RedisStore};
use crate::error::StoreError;

/// The rounds of one store (and of its clones), per server.
#[derive(Debug)]
pub(super) struct Replication {
    /// How many replicas a completion waits for.
    pub(super) replicas: usize,
    /// `WAIT`'s own timeout.
    pub(super) timeout: Duration,
    /// By the replication ID of the master that stored the completions: one per master (a
    /// cluster has few), and a new one after each failover or restart. Entries no round uses
    /// are dropped when a new one comes.
    servers: std::sync::Mutex<HashMap<String, Arc<Rounds>>>,
}

/// The rounds of one server.
#[derive(Debug, Default)]
struct Rounds {
    /// Rounds begun so far. A round takes its number just before its `WAIT` is sent.
    begun: AtomicU64,
    /// The last round that ended, and what it gave; held while a round is in flight.
    last: Mutex<(u64, Round)>,
}

/// What a round's `WAIT` gave.
#[derive(Debug, Clone, Copy, Default)]
enum Round {
    /// The replicas that acknowledged.
    Acked(i64),
    /// The round ran under another replication ID: the server that stored the completions is
    /// no longer the master it reached (a failover, a restart, another node).
    Moved,
    /// The `WAIT` failed or timed out.
    #[default]
    Failed,
}

/// What one round was answered with: the replicas that acknowledged its mark (`WAIT`), and
/// the replication ID the mark ran under (`""` when the server was not a master).
pub(super) type Waited = (i64, String);

impl Replication {
    pub(super) fn new(replicas: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            replicas,
            timeout,
            servers: std::sync::Mutex::default(),
        })
    }

    /// Waits, after a completion stored by the master whose replication ID is `server` (as
    /// the completion script named it), until a round begun after that answer has ended, and
    /// tells whether enough replicas have the write. `wait` sends one round (the mark, then
    /// `WAIT`) to the server and tells what it gave.
    pub(super) async fn acknowledged<F, Fut>(&self, server: &str, wait: F) -> Result<(), StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Waited, StoreError>>,
    {
        if server.is_empty() {
            // Stored by a server that is not a master (a writable replica): no replica gets it.
            return Err(StoreError::backend(Moved));
        }
        let rounds = {
            let mut servers = self.servers.lock().unwrap_or_else(PoisonError::into_inner);
            match servers.get(server) {
                Some(rounds) => rounds.clone(),
                None => {
                    // A new master (or history): forget those no completion waits on.
                    servers.retain(|_, rounds| Arc::strong_count(rounds) > 1);
                    servers.entry(server.to_owned()).or_default().clone()
                }
            }
        };
        // Any round numbered above this one begins after the write was answered.
        let needed = rounds.begun.load(Ordering::SeqCst) + 1;
        let mut last = rounds.last.lock().await;
        let round = if last.0 >= needed {
            last.1
        } else {
            // No round is in flight (this task holds the lock), so this one is numbered
            // `needed` or above.
            let number = rounds.begun.fetch_add(1, Ordering::SeqCst) + 1;
            let round = match wait().await {
                // The same master process, in the same history: the mark followed the
                // completions this round covers in its stream.
                Ok((acked, history)) if history == server => Round::Acked(acked),
                Ok(_) => Round::Moved,
                Err(e) => {
                    // The waiters this round covered fail with it, rather than each
                    // sending a `WAIT` of its own to a server that does not answer.
                    *last = (number, Round::Failed);
                    return Err(e);
                }
            };
            *last = (number, round);
            round
        };
        drop(last);
        match round {
            Round::Acked(acked) if usize::try_from(acked).unwrap_or(0) >= self.replicas => Ok(()),
            Round::Acked(acked) => Err(StoreError::backend(NotReplicated {
                acked,
                wanted: self.replicas,
            })),
            Round::Moved => Err(StoreError::backend(Moved)),
            Round::Failed => Err(StoreError::backend(WaitFailed)),
        }
    }
}

impl RedisStore {
    /// Waits until the replicas of `server` (the replication ID of the master that stored
    /// the completion, as its script named it) have the completion of `record`, when asked
    /// to ([`with_wait_replicas`](Self::with_wait_replicas)); concurrent completions share
    /// their rounds (see `replicate.rs`).
    pub(super) async fn wait_replicas(&self, server: &str, record: &str) -> Result<(), StoreError> {
        let Some(replication) = &self.wait else {
            return Ok(());
        };
        replication
            .acknowledged(server, || async {
                // One pipeline, so one connection: the mark (a write, which tells the
                // replication ID it ran under), then WAIT, which counts the replicas that
                // acknowledged that connection's writes, the mark's included. The mark's key
                // shares the record's hash tag: in a cluster, the round reaches the master of
                // the record's slot.
                let stem = record.strip_suffix(":r").unwrap_or(record);
                let mut pipe = ::redis::pipe();
                pipe.cmd("EVAL")
                    .arg(&self.scripts.mark)
                    .arg(1)
                    .arg(format!("{stem}:w"))
                    .cmd("WAIT")
                    .arg(replication.replicas)
                    .arg(millis(replication.timeout));
                let mut conn = self.conn.clone();
                let (history, acked): (String, i64) = self
                    .bounded(async {
                        match &mut conn {
                            Conn::Single(c) => pipe.query_async(c).await,
                            Conn::Cluster(c) => {
                                let route = Route::new(slot(record), SlotAddr::Master);
                                let replies = c
                                    .route_pipeline(
                                        pipe,
                                        0,
                                        2,
                                        SingleNodeRoutingInfo::SpecificNode(route),
                                    )
                                    .await?;
                                ::redis::from_redis_value(Value::Array(replies))
                                    .map_err(RedisError::from)
                            }
                        }
                    })
                    .await?;
                Ok((acked, history))
            })
            .await
    }
}

/// A completion that fewer replicas acknowledged than
/// [`with_wait_replicas`](super::RedisStore::with_wait_replicas) asked for.
#[derive(Debug, thiserror::Error)]
#[error("the completion reached {acked} replicas of the {wanted} waited for")]
struct NotReplicated {
    acked: i64,
    wanted: usize,
}

/// The round covering a completion ran under another replication ID than the completion
/// (or the completion's server was not a master).
#[derive(Debug, thiserror::Error)]
#[error(
    "the master that stored the completion is not the one the WAIT reached, or it restarted \
     (a failover?): its replicas may not have the completion"
)]
struct Moved;

/// The `WAIT` that would have covered a completion failed (for the task that sent it, with
/// its own error).
#[derive(Debug, thiserror::Error)]
#[error("the WAIT for replicas covering this completion failed")]
struct WaitFailed;

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio::sync::oneshot;

    use super::*;

    /// A `WAIT` answered at once by `server` with `acked`, counted in `sent`.
    async fn answer(sent: &AtomicUsize, acked: i64, server: &str) -> Result<Waited, StoreError> {
        sent.fetch_add(1, Ordering::SeqCst);
        Ok((acked, server.to_owned()))
    }

    #[tokio::test]
    async fn a_round_covers_only_completions_answered_before_it_began() {
        let replication = Replication::new(1, Duration::from_millis(100));
        let sent = Arc::new(AtomicUsize::new(0));
        // Round 1 in flight, held open.
        let (release, held) = oneshot::channel::<()>();
        let first = tokio::spawn({
            let (replication, sent) = (replication.clone(), sent.clone());
            async move {
                replication
                    .acknowledged("n1", || async {
                        sent.fetch_add(1, Ordering::SeqCst);
                        held.await.ok();
                        Ok((1, "n1".to_owned()))
                    })
                    .await
            }
        });
        while sent.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // Two completions answered while round 1 is in flight: round 1 may have been sent
        // before their writes, so they share round 2.
        let later: Vec<_> = (0..2)
            .map(|_| {
                let (replication, sent) = (replication.clone(), sent.clone());
                tokio::spawn(async move {
                    replication
                        .acknowledged("n1", || answer(&sent, 1, "n1"))
                        .await
                })
            })
            .collect();
        // Let both reach the round's lock (a current-thread runtime runs them in turn).
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        release.send(()).unwrap();
        first.await.unwrap().unwrap();
        for t in later {
            t.await.unwrap().unwrap();
        }
        assert_eq!(sent.load(Ordering::SeqCst), 2);
        // Servers have rounds of their own.
        replication
            .acknowledged("n2", || answer(&sent, 1, "n2"))
            .await
            .unwrap();
        assert_eq!(sent.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_round_short_of_replicas_answered_elsewhere_or_failed_acknowledges_nothing() {
        let replication = Replication::new(2, Duration::from_millis(100));
        let sent = AtomicUsize::new(0);
        let short = replication
            .acknowledged("n1", || answer(&sent, 1, "n1"))
            .await;
        assert!(matches!(short, Err(StoreError::Backend(_))), "{short:?}");
        // The round ran under another replication ID (another master, or n1 promoted anew or
        // restarted): its replicas say nothing of the writes made under n1.
        let moved = replication
            .acknowledged("n1", || answer(&sent, 2, "n3"))
            .await;
        assert!(matches!(moved, Err(StoreError::Backend(_))), "{moved:?}");
        let failed = replication
            .acknowledged("n1", || async {
                Err(StoreError::Timeout(Duration::from_secs(1)))
            })
            .await;
        assert!(matches!(failed, Err(StoreError::Timeout(_))), "{failed:?}");
        replication
            .acknowledged("n1", || answer(&sent, 2, "n1"))
            .await
            .unwrap();
        // A completion stored by a server that is not a master is never confirmed, not even by
        // a round that comes back without a replication ID, and sends no round.
        let before = sent.load(Ordering::SeqCst);
        let replica = replication.acknowledged("", || answer(&sent, 2, "")).await;
        assert!(
            matches!(replica, Err(StoreError::Backend(_))),
            "{replica:?}"
        );
        assert_eq!(sent.load(Ordering::SeqCst), before);
    }
}
