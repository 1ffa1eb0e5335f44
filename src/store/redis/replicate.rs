//! Completions that wait for replicas ([`RedisStore::with_wait_replicas`]), sharing their
//! `WAIT`s.
//!
//! `WAIT` blocks the connection it is sent on until the replicas have acknowledged every
//! write made on it, or its timeout passes; and every call of a store shares one
//! multiplexed connection per server. One `WAIT` per completion would queue each behind the
//! other: with a replica gone, `n` completions would take `n` timeouts, and every claim
//! behind them too. So the store keeps at most one `WAIT` in flight per server (a round),
//! and a round covers every completion whose write that server had answered before the round
//! began: `WAIT` counts the writes of its connection, which include them.
//!
//! In a cluster, a round goes to the master of a covered record's slot, together with
//! `CLUSTER MYID`; the completion script names the node that stored the record. A round
//! answered by another node (the slot moved: a failover) covers nothing, since the node that
//! stored the records may be gone with them. Rounds never go to every master at once: a
//! multi-node request hides which node answered, and a client library may answer for a node
//! that is down with another's reply.
//!
//! [`RedisStore::with_wait_replicas`]: super::RedisStore::with_wait_replicas

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use tokio::sync::Mutex;

use crate::error::StoreError;

/// The rounds of one store (and of its clones), per server.
#[derive(Debug)]
pub(super) struct Replication {
    /// How many replicas a completion waits for.
    pub(super) replicas: usize,
    /// `WAIT`'s own timeout.
    pub(super) timeout: Duration,
    /// By cluster node ID (one entry, `""`, off a cluster). A cluster has few nodes, and a
    /// node's ID lasts as long as the node.
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
    /// Another node answered: the records' server is no longer the slot's master.
    Moved,
    /// The `WAIT` failed or timed out.
    #[default]
    Failed,
}

/// What one `WAIT` was answered with: the replicas that acknowledged, and the cluster node ID
/// of the server that answered (`""` off a cluster).
pub(super) type Waited = (i64, String);

impl Replication {
    pub(super) fn new(replicas: usize, timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            replicas,
            timeout,
            servers: std::sync::Mutex::default(),
        })
    }

    /// Waits, after a completion that `server` (a cluster node ID, or `""`) has answered,
    /// until a round begun after that answer has ended, and tells whether enough replicas
    /// have the write. `wait` sends one `WAIT` to the server and tells who answered.
    pub(super) async fn acknowledged<F, Fut>(&self, server: &str, wait: F) -> Result<(), StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Waited, StoreError>>,
    {
        let rounds = {
            let mut servers = self.servers.lock().unwrap_or_else(PoisonError::into_inner);
            match servers.get(server) {
                Some(rounds) => rounds.clone(),
                None => servers.entry(server.to_owned()).or_default().clone(),
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
                Ok((acked, answered_by)) if answered_by == server => Round::Acked(acked),
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

/// A completion that fewer replicas acknowledged than
/// [`with_wait_replicas`](super::RedisStore::with_wait_replicas) asked for.
#[derive(Debug, thiserror::Error)]
#[error("the completion reached {acked} replicas of the {wanted} waited for")]
struct NotReplicated {
    acked: i64,
    wanted: usize,
}

/// The `WAIT` covering a completion was answered by another node than the one that stored
/// it.
#[derive(Debug, thiserror::Error)]
#[error("the completion's server is no longer its slot's master (a failover?)")]
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
        // The slot's master is now another node: its replicas say nothing of n1's writes.
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
    }
}
