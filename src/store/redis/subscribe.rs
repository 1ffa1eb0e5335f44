//! Wake-ups across processes for [`RedisStore`](super::RedisStore)
//! ([`with_notifications`](super::RedisStore::with_notifications)).
//!
//! Completions and releases `PUBLISH` the key's hash on the store's channel, inside their
//! script. One subscribing connection per store (opened by the first waiter, never when nobody
//! waits) wakes the waiting duplicates of its process.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_core::Stream;
use tokio::sync::watch;

use super::super::notify::{KeyNotifier, KeyWatch};
use crate::key::IdempotencyKey;

/// How long the subscriber rests after it failed to connect or lost its connection.
const RECONNECT_PAUSE: Duration = Duration::from_secs(1);

/// How long a waiter waits for the subscriber to subscribe (the first waiter of a process,
/// while it connects) before it polls instead.
const READY_WAIT: Duration = Duration::from_secs(1);

/// The wake-ups of one store (shared by its clones).
pub(super) struct RedisNotifier {
    keys: KeyNotifier,
    client: ::redis::Client,
    channel: String,
    /// Whether the subscriber is subscribed now.
    subscribed: Arc<watch::Sender<bool>>,
    /// The subscriber task, started by the first waiter, aborted when the store is dropped.
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl RedisNotifier {
    pub(super) fn new(client: ::redis::Client, channel: String) -> Self {
        Self {
            keys: KeyNotifier::new(),
            client,
            channel,
            subscribed: Arc::new(watch::Sender::new(false)),
            task: Mutex::new(None),
        }
    }

    pub(super) fn channel(&self) -> &str {
        &self.channel
    }

    pub(super) fn client(&self) -> &::redis::Client {
        &self.client
    }

    /// Subscribes to the key's changes once the subscriber is subscribed; `None` when it is
    /// not within a second (the waiter then polls) or there is no runtime to run it in.
    pub(super) async fn watch(&self, scope: &str, key: &IdempotencyKey) -> Option<KeyWatch> {
        self.start()?;
        let mut subscribed = self.subscribed.subscribe();
        if !matches!(
            tokio::time::timeout(READY_WAIT, subscribed.wait_for(|on| *on)).await,
            Ok(Ok(_))
        ) {
            return None;
        }
        Some(self.keys.watch(scope, key))
    }

    /// Starts the subscriber task if it is not running.
    fn start(&self) -> Option<()> {
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        // A poisoned lock means a panic while starting; the slot itself is still sound.
        let mut task = self.task.lock().unwrap_or_else(|e| e.into_inner());
        if task.as_ref().is_none_or(|t| t.is_finished()) {
            *task = Some(runtime.spawn(subscribe(
                self.client.clone(),
                self.channel.clone(),
                self.keys.clone(),
                self.subscribed.clone(),
            )));
        }
        Some(())
    }
}

impl Drop for RedisNotifier {
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

/// Subscribes to the channel for good: wakes the waiters of each key named, and every waiter
/// after a lost connection (their wake-ups may have been lost with it).
async fn subscribe(
    client: ::redis::Client,
    channel: String,
    keys: KeyNotifier,
    subscribed: Arc<watch::Sender<bool>>,
) {
    let mut failing = false;
    loop {
        let pubsub = match client.get_async_pubsub().await {
            Ok(mut pubsub) => pubsub.subscribe(&channel).await.map(|()| pubsub),
            Err(err) => Err(err),
        };
        let pubsub = match pubsub {
            Ok(pubsub) => pubsub,
            Err(err) => {
                if failing {
                    tracing::debug!(
                        error = &err as &dyn std::error::Error,
                        "idempotency: still cannot subscribe to finished keys"
                    );
                } else {
                    tracing::warn!(
                        error = &err as &dyn std::error::Error,
                        "idempotency: cannot subscribe to finished keys; waiting duplicates \
                         poll meanwhile"
                    );
                }
                failing = true;
                tokio::time::sleep(RECONNECT_PAUSE).await;
                continue;
            }
        };
        failing = false;
        subscribed.send_replace(true);
        // Whatever changed before this point was not heard: every waiter claims again.
        keys.notify_all();
        let mut messages = pubsub.into_on_message();
        while let Some(message) = poll_fn(|cx| Pin::new(&mut messages).poll_next(cx)).await {
            if let Ok(hash) = std::str::from_utf8(message.get_payload_bytes())
                .unwrap_or_default()
                .parse::<u64>()
            {
                keys.notify_hash(hash);
            }
        }
        tracing::warn!("idempotency: lost the connection subscribed to finished keys");
        subscribed.send_replace(false);
        keys.notify_all();
        tokio::time::sleep(RECONNECT_PAUSE).await;
    }
}
