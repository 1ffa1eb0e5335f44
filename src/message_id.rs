//! The producer half: broker deduplication IDs derived from an incoming idempotency key.
//!
//! A handler that publishes a message must publish it with the same ID on every retry of its
//! request, or each retry is a new message to the broker and to every consumer. Derive the
//! ID from the request's key and a purpose naming the message ([`MessageId::derive`]), and
//! set it where the broker looks:
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

use crate::{IdempotencyKey, KeyError};

/// The header JetStream deduplicates publishes by.
pub const NATS_MSG_ID: &str = "Nats-Msg-Id";

/// The longest SQS FIFO `MessageDeduplicationId`, in characters.
const MAX_SQS_ID: usize = 128;

/// A message ID derived from an idempotency key: the same for every retry of the request that
/// carried the key, and different for each purpose.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageId(IdempotencyKey);

impl MessageId {
    /// The ID of the message `purpose` names (`"order-placed"`, `"email:receipt"` is refused:
    /// no `:`), published while handling the request that carried `key`: `<key>:<purpose>`, or
    /// a digest of the key in place of a key too long to fit (at most 255 characters, visible
    /// ASCII, as [`IdempotencyKey::derive`]).
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidPurpose`] when `purpose` is empty, longer than 64 characters, not
    /// visible ASCII, or contains `:`.
    pub fn derive(key: &IdempotencyKey, purpose: &str) -> Result<Self, KeyError> {
        key.derive(purpose).map(Self)
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
        let a = MessageId::derive(&k, "order-placed").unwrap();
        assert_eq!(a, MessageId::derive(&k, "order-placed").unwrap());
        assert_eq!(a.as_str(), "order-7f3a:order-placed");
        assert_ne!(a, MessageId::derive(&k, "receipt").unwrap());
        assert_eq!(a.sqs_deduplication_id(), "order-7f3a:order-placed");
        assert!(MessageId::derive(&k, "").is_err());
        assert!(MessageId::derive(&k, "a:b").is_err());
    }

    #[test]
    fn long_keys_fit_every_broker() {
        let long = key(&"k".repeat(255));
        let id = MessageId::derive(&long, "order-placed").unwrap();
        assert!(id.as_str().len() <= 255, "{}", id.as_str().len());
        // The derived key is the key's digest and the purpose: short enough for SQS as is.
        assert_eq!(id.sqs_deduplication_id(), id.as_str());
        assert!(id.as_str().len() <= 128);
        // Kept whole by the derivation (at most 255), too long for SQS: digested, the same
        // digest on every retry.
        let medium = key(&"m".repeat(125));
        let id = MessageId::derive(&medium, "placed").unwrap();
        assert_eq!(id.as_str().len(), 132);
        let sqs = id.sqs_deduplication_id();
        assert_eq!(sqs.len(), 71);
        assert!(sqs.starts_with("sha256-"));
        assert_eq!(
            sqs,
            MessageId::derive(&medium, "placed")
                .unwrap()
                .sqs_deduplication_id()
        );
    }
}
