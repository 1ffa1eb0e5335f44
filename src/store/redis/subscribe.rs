//! Wake-ups across processes for [`RedisStore`](super::RedisStore)
//! ([`with_notifications`](super::RedisStore::with_notifications)).
//!
//! Completions and releases `PUBLISH` the key's hash on the store's channel, inside their
//! script. One subscribing connection per store (opened by the first waiter, never when nobody
//! waits) wakes the waiting duplicates of its process.

use std::future::poll_fn;
use std::pin::Pin;

use futures_core::Stream;

use super::super::notify::KeyWatch;
use super::super::subscriber::{Feed, Heard, Subscriber};
use crate::error::BoxError;
use crate::key::IdempotencyKey;

/// The wake-ups of one store (shared by its clones).
pub(super) struct RedisNotifier {
    subscriber: Subscriber,
    client: ::redis::Client,
    channel: String,
}

impl RedisNotifier {
    pub(super) fn new(client: ::redis::Client, channel: String) -> Self {
        Self {
            subscriber: Subscriber::new(),
            client,
            channel,
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
        let feed = || RedisFeed {
            client: self.client.clone(),
            channel: self.channel.clone(),
        };
        if !self.subscriber.ready(feed).await {
            return None;
        }
        Some(self.subscriber.keys().watch(scope, key))
    }
}

/// The subscribing connection, on the store's channel.
struct RedisFeed {
    client: ::redis::Client,
    channel: String,
}

impl Feed for RedisFeed {
    const WHAT: &'static str = "subscribe to finished keys";
    type Open = Pin<Box<dyn Stream<Item = ::redis::Msg> + Send>>;

    async fn open(&mut self) -> Result<Self::Open, BoxError> {
        let mut pubsub = self.client.get_async_pubsub().await?;
        pubsub.subscribe(&self.channel).await?;
        Ok(Box::pin(pubsub.into_on_message()))
    }

    async fn next(messages: &mut Self::Open) -> Heard {
        while let Some(message) = poll_fn(|cx| messages.as_mut().poll_next(cx)).await {
            if let Ok(hash) = std::str::from_utf8(message.get_payload_bytes())
                .unwrap_or_default()
                .parse::<u64>()
            {
                return Heard::Key(hash);
            }
        }
        Heard::Lost(None)
    }
}
