//! [`KeyNotifier`] and [`KeyWatch`]: how a store tells waiting duplicates that a key changed
//! ([`Store::watch`](super::Store::watch)(super::Store::watch)).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use sha2::{Digest, Sha256};
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

use crate::key::IdempotencyKey;

/// How many slots a [`KeyNotifier`] spreads keys over. Keys that share a slot wake each
/// other's waiters, who claim again, find their own key still in flight, and sleep on.
const SLOTS: usize = 256;

/// Wakes the waiters of keys whose records changed, for a store's [`Store::watch`](super::Store::watch).
///
/// Keys are spread over a fixed number of slots (no allocation per key, nothing to clean
/// up); a wake-up wakes every waiter of its slot, and each of them claims its key again.
/// [`notify`](Self::notify) costs one atomic load while nobody waits. Clones share their
/// slots.
///
/// A store that keeps its records in one process calls [`notify`](Self::notify) when a key
/// is completed or released; one shared by several processes carries
/// [`key_hash`](Self::key_hash) to the other processes (Postgres: `NOTIFY`), whose
/// listeners call [`notify_hash`](Self::notify_hash).
#[derive(Clone)]
pub struct KeyNotifier {
    inner: Arc<Slots>,
}

struct Slots {
    slots: Box<[Arc<Notify>]>,
    /// How many [`KeyWatch`]es are alive: while none is, nothing needs waking.
    watching: AtomicUsize,
}

impl Default for KeyNotifier {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for KeyNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyNotifier")
            .field("watching", &self.inner.watching.load(Ordering::Relaxed))
            .finish()
    }
}

impl KeyNotifier {
    /// A notifier with nobody waiting.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Slots {
                slots: (0..SLOTS).map(|_| Arc::new(Notify::new())).collect(),
                watching: AtomicUsize::new(0),
            }),
        }
    }

    /// A stable 64-bit hash of a (scope, key): the same in every process and every build, so
    /// it can travel between processes.
    pub fn key_hash(scope: &str, key: &IdempotencyKey) -> u64 {
        let mut h = Sha256::new();
        h.update(b"tower-idempotency key change\0");
        h.update((scope.len() as u64).to_be_bytes());
        h.update(scope.as_bytes());
        h.update(key.as_str().as_bytes());
        let digest = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        u64::from_be_bytes(first)
    }

    /// Waits for the next change of the key (a [`notify`](Self::notify) after this call).
    pub fn watch(&self, scope: &str, key: &IdempotencyKey) -> KeyWatch {
        self.watch_hash(Self::key_hash(scope, key))
    }

    /// [`watch`](Self::watch) by the key's [`key_hash`](Self::key_hash).
    pub fn watch_hash(&self, hash: u64) -> KeyWatch {
        // Counted before the wait is registered, and the store's change is made before
        // `notify` reads the count: a change that `notify` skips (count zero) happened before
        // this watch existed, so the claim that follows it sees the change.
        self.inner.watching.fetch_add(1, Ordering::SeqCst);
        let mut notified = Box::pin(self.slot(hash).clone().notified_owned());
        // Registered now, so a wake-up before the first poll is not missed.
        notified.as_mut().enable();
        KeyWatch {
            notified,
            slots: Some(self.inner.clone()),
        }
    }

    /// Wakes the waiters of a key whose record changed (completed, released).
    pub fn notify(&self, scope: &str, key: &IdempotencyKey) {
        if self.inner.watching.load(Ordering::SeqCst) > 0 {
            self.notify_hash(Self::key_hash(scope, key));
        }
    }

    /// [`notify`](Self::notify) by the key's [`key_hash`](Self::key_hash).
    pub fn notify_hash(&self, hash: u64) {
        if self.inner.watching.load(Ordering::SeqCst) > 0 {
            self.slot(hash).notify_waiters();
        }
    }

    /// Wakes every waiter (a listener that may have missed wake-ups, after a reconnect).
    pub fn notify_all(&self) {
        if self.inner.watching.load(Ordering::SeqCst) > 0 {
            for slot in &self.inner.slots {
                slot.notify_waiters();
            }
        }
    }

    fn slot(&self, hash: u64) -> &Arc<Notify> {
        // The remainder is below SLOTS, which fits in usize.
        let index = usize::try_from(hash % SLOTS as u64).unwrap_or(0);
        &self.inner.slots[index]
    }
}

/// A subscription to the changes of one key ([`Store::watch`](super::Store::watch)): a future that finishes when
/// the key's record may have changed. Wake-ups may be spurious (keys share slots); a waiter
/// always claims the key again to see what changed.
pub struct KeyWatch {
    notified: Pin<Box<OwnedNotified>>,
    /// The notifier's count of live watches, decremented on drop.
    slots: Option<Arc<Slots>>,
}

impl std::fmt::Debug for KeyWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyWatch").finish_non_exhaustive()
    }
}

impl Future for KeyWatch {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.notified.as_mut().poll(cx)
    }
}

impl Drop for KeyWatch {
    fn drop(&mut self) {
        if let Some(slots) = self.slots.take() {
            slots.watching.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey::parse(k).unwrap()
    }

    #[tokio::test]
    async fn a_watch_wakes_on_its_keys_change_made_after_it() {
        let n = KeyNotifier::new();
        let w = n.watch("s", &key("a"));
        n.notify("s", &key("a"));
        tokio::time::timeout(Duration::from_secs(1), w)
            .await
            .expect("woken");
    }

    #[tokio::test]
    async fn a_watch_sleeps_through_other_slots_changes() {
        let n = KeyNotifier::new();
        let a = key("a");
        // A key in another slot than "a"'s.
        let other = (0..1000)
            .map(|i| key(&format!("k{i}")))
            .find(|k| KeyNotifier::key_hash("s", k) % 256 != KeyNotifier::key_hash("s", &a) % 256)
            .unwrap();
        let w = n.watch("s", &a);
        n.notify("s", &other);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), w)
                .await
                .is_err()
        );
    }

    #[test]
    fn nobody_watching_is_counted_and_drops_uncount() {
        let n = KeyNotifier::new();
        let w = n.watch("s", &key("a"));
        assert_eq!(n.inner.watching.load(Ordering::SeqCst), 1);
        drop(w);
        assert_eq!(n.inner.watching.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn key_hashes_separate_scope_and_key() {
        assert_ne!(
            KeyNotifier::key_hash("ab", &key("c")),
            KeyNotifier::key_hash("a", &key("bc"))
        );
        assert_eq!(
            KeyNotifier::key_hash("a", &key("b")),
            KeyNotifier::key_hash("a", &key("b"))
        );
    }
}
