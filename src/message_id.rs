//! The producer half: broker deduplication IDs derived from an incoming idempotency key.
//!
//! A handler that publishes a message must publish it with the same ID on every retry of its
//! request, or each retry is a new message to the broker and to every consumer. Derive the
//! ID from the request's scope, its key and a purpose naming the message
//! ([`MessageId::derive`]), and set it where the broker looks:
//!
//! | broker | where | the broker's own deduplication |
//! |---|---|---|
//! | NATS JetStream | header `Nats-Msg-Id` ([`MessageId::as_str`]) | a publish with an ID seen within the stream's `duplicate_window` (default 2 minutes) is acknowledged and dropped |
//! | RabbitMQ (AMQP 0-9-1) | the `message_id` property ([`MessageId::as_str`]; at most 255 bytes, as a short string must be) | none: the ID is carried to the consumer |
//! | Amazon SQS FIFO | `MessageDeduplicationId` ([`MessageId::sqs_deduplication_id`]: at most 128 characters of the allowed set) | a send with an ID seen within 5 minutes is accepted and dropped |
//! | Kafka | a record header, e.g. `idempotency-key` ([`MessageId::as_str`]) | the idempotent producer drops only its own retries of one send within its session; a new send of the same record is a new record |
//!
//! **The consumer still needs the inbox.** A broker deduplicates publishes, and only within
//! its window: a retry after the window, a redelivery after a lost acknowledgement, a
//! consumer that crashed after its commit, or a replay from a dead-letter queue all reach the
//! consumer again. The consumer records the same ID with its work ([`crate::inbox`]).

use sha2::{Digest, Sha256};

use crate::{IdempotencyKey, KeyError, scope_digest};

/// The header JetStream deduplicates publishes by.
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";

/// The longest SQS FIFO `MessageDeduplicationId`, in characters.
const MAX_SQS_ID: usize = 128;

/// A message ID derived from an idempotency key in its scope: the same for every retry of the
/// request that carried the key, and different for each scope and each purpose.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageId(IdempotencyKey);

impl MessageId {
    /// The ID of the message `purpose` names (`"order-placed"`, `"email:receipt"` is refused:
    /// no `:`), published while handling the request that carried `key` in `scope`.
    ///
    /// A key is unique only within its scope: two tenants may both send `order-1`, and they
    /// are two requests. A broker's deduplication window and a consumer's inbox see every
    /// tenant's messages, so the ID carries the scope, or the second tenant's message would be
    /// dropped as a duplicate of the first's. Pass the same text as the layer's scope function
    /// ([`IdempotencyLayer::with_scope`](crate::IdempotencyLayer::with_scope)) returns for the
    /// request (a coarser one, say the tenant where the layer scopes by user, lets two of its
    /// users' keys meet), or `""` for the shared scope.
    ///
    /// - In the shared scope: `<key>:<purpose>`, or a digest of the key in place of a key too
    ///   long to fit, as [`IdempotencyKey::derive`].
    /// - In a scope: `~sha256-`, the hex SHA-256 of the scope's [`scope_digest`] and the key,
    ///   `:` and the purpose. It never equals an ID of another scope or of the shared scope.
    ///
    /// Either way at most 255 characters of visible ASCII.
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    /// use tower_idempotency::message_id::MessageId;
    ///
    /// let key = IdempotencyKey::parse("order-1")?;
    /// let a = MessageId::derive("tenant-a", &key, "order-placed")?;
    /// let b = MessageId::derive("tenant-b", &key, "order-placed")?;
    /// assert_ne!(a, b);
    /// assert_eq!(MessageId::derive("", &key, "order-placed")?.as_str(), "order-1:order-placed");
    /// # Ok::<(), tower_idempotency::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidPurpose`] when `purpose` is empty, longer than 64 characters, not
    /// visible ASCII, or contains `:`.
    pub fn derive(scope: &str, key: &IdempotencyKey, purpose: &str) -> Result<Self, KeyError> {
        if scope.is_empty() {
            return key.derive(purpose).map(Self);
        }
        key.derive_in_scope(&scope_digest(scope), purpose).map(Self)
    }

    /// The ID, for `Nats-Msg-Id`, AMQP `message_id` or a Kafka header: at most 255 bytes of
    /// visible ASCII.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The ID as an SQS FIFO `MessageDeduplicationId`: itself when it fits (at most 128
    /// characters, each a letter, a digit or ASCII punctuation), else `sha256-` and the hex
    /// SHA-256 of the ID (71 characters; the same for every retry).
    pub fn sqs_deduplication_id(&self) -> String {
        let id = self.as_str();
        if id.len() <= MAX_SQS_ID && id.bytes().all(|b| b.is_ascii_graphic()) {
            return id.to_owned();
        }
        format!(
            "sha256-{}",
            crate::hex::encode(&Sha256::digest(id.as_bytes()))
        )
    }
}

impl std::fmt::Display for MessageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for MessageId {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn key(s: &str) -> IdempotencyKey {
        IdempotencyKey::parse(s).unwrap()
    }

    #[test]
    fn the_same_key_and_purpose_give_the_same_id_and_purposes_differ() {
        let k = key("order-7f3a");
        let a = MessageId::derive("", &k, "order-placed").unwrap();
        assert_eq!(a, MessageId::derive("", &k, "order-placed").unwrap());
        assert_eq!(a.as_str(), "order-7f3a:order-placed");
        assert_ne!(a, MessageId::derive("", &k, "receipt").unwrap());
        assert_eq!(a.sqs_deduplication_id(), "order-7f3a:order-placed");
        assert!(MessageId::derive("", &k, "").is_err());
        assert!(MessageId::derive("", &k, "a:b").is_err());
    }

    /// Keys are unique only within a scope: two tenants that send the same key must publish
    /// under different IDs, or the broker's deduplication window (or the consumer's inbox)
    /// drops the second tenant's message as a duplicate of the first's.
    #[test]
    fn two_scopes_with_one_key_derive_different_ids() {
        let k = key("order-1");
        let a = MessageId::derive("tenant-a", &k, "order-placed").unwrap();
        let b = MessageId::derive("tenant-b", &k, "order-placed").unwrap();
        assert_ne!(a, b);
        assert_eq!(
            a,
            MessageId::derive("tenant-a", &k, "order-placed").unwrap()
        );
        let shared = MessageId::derive("", &k, "order-placed").unwrap();
        assert_eq!(shared.as_str(), "order-1:order-placed");
        assert_ne!(a, shared);
        assert_ne!(a, MessageId::derive("tenant-a", &k, "receipt").unwrap());
        assert_ne!(
            a,
            MessageId::derive("tenant-a", &key("order-2"), "order-placed").unwrap()
        );
        assert!(a.as_str().ends_with(":order-placed"), "{a}");
        assert!(a.as_str().len() <= 255);
        // A key of the shared scope that spells a scoped ID's text derives something else.
        let (text, _) = a.as_str().rsplit_once(':').unwrap();
        assert_ne!(
            MessageId::derive("", &key(text), "order-placed").unwrap(),
            a
        );
        assert!(MessageId::derive("tenant-a", &k, "a:b").is_err());
        let long = MessageId::derive("tenant-a", &key(&"k".repeat(255)), "order-placed").unwrap();
        assert!(long.as_str().len() <= 255);
    }

    #[test]
    fn long_keys_fit_every_broker() {
        let long = key(&"k".repeat(255));
        let id = MessageId::derive("", &long, "order-placed").unwrap();
        assert!(id.as_str().len() <= 255, "{}", id.as_str().len());
        // The derived key is the key's digest and the purpose: short enough for SQS as is.
        assert_eq!(id.sqs_deduplication_id(), id.as_str());
        assert!(id.as_str().len() <= 128);
        // Kept whole by the derivation (at most 255), too long for SQS: digested, the same
        // digest on every retry.
        let medium = key(&"m".repeat(125));
        let id = MessageId::derive("", &medium, "placed").unwrap();
        assert_eq!(id.as_str().len(), 132);
        let sqs = id.sqs_deduplication_id();
        assert_eq!(sqs.len(), 71);
        assert!(sqs.starts_with("sha256-"));
        assert_eq!(
            sqs,
            MessageId::derive("", &medium, "placed")
                .unwrap()
                .sqs_deduplication_id()
        );
    }
}
