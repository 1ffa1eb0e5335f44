//! What a consumer is given and what it answers: one delivery of a message
//! ([`Message`]), what became of it ([`Outcome`]), and what to tell the broker ([`Settle`]).

use std::time::Duration;

/// One delivery of a message, as [`Consumer::deliver`](super::Consumer::deliver) needs it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Message<'a> {
    pub(super) id: Option<&'a str>,
    pub(super) order: Option<(&'a str, i64)>,
    pub(super) payload: Option<&'a [u8]>,
    pub(super) redelivered: bool,
    pub(super) destination: Option<&'a str>,
}

impl<'a> Message<'a> {
    /// A delivery of the message with this ID (`None`: it came without one, and is
    /// [`Outcome::Rejected`]). Choose the ID the producer sets once per logical message and
    /// keeps on every retry (`Nats-Msg-Id`, AMQP `message_id`), not one the broker assigns
    /// per publish.
    pub fn new(id: Option<&'a str>) -> Self {
        Self {
            id,
            ..Self::default()
        }
    }

    /// The message is at `position` of the ordering key `key` (an account and the
    /// producer's sequence for it, say): applied only past the key's last applied position,
    /// which moves in the same commit.
    #[must_use]
    pub fn ordered(mut self, key: &'a str, position: i64) -> Self {
        self.order = Some((key, position));
        self
    }

    /// The payload to keep with the message if it is parked.
    #[must_use]
    pub fn payload(mut self, payload: &'a [u8]) -> Self {
        self.payload = Some(payload);
        self
    }

    /// Whether the broker says it delivered the message before (JetStream: a delivery count
    /// above one; AMQP: `redelivered`). Only a hint, counted in the metrics: the inbox, not
    /// the flag, decides what is a duplicate.
    #[must_use]
    pub fn redelivered(mut self, redelivered: bool) -> Self {
        self.redelivered = redelivered;
        self
    }

    /// The subject, queue or topic the message came from, for the tracing span.
    #[must_use]
    pub fn destination(mut self, destination: &'a str) -> Self {
        self.destination = Some(destination);
        self
    }
}

/// What [`Consumer::deliver`](super::Consumer::deliver) (or
/// [`Consumer::process`](super::Consumer::process)) did with a delivery;
/// [`settle`](Outcome::settle) says what to tell the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// A new message: its work ran and committed with its ID (and its position).
    Processed(T),
    /// The message was processed (or parked) before: nothing ran.
    Duplicate,
    /// The message is at or below its key's applied position: recorded as processed, its
    /// work did not run.
    Stale,
    /// The message's work failed as often as the consumer allows: recorded as processed and
    /// kept as a dead letter ([`Inbox::dead_letters`](super::Inbox::dead_letters)) with
    /// `reason`; never applied.
    Parked {
        /// How many attempts failed.
        attempts: u32,
        /// The last attempt's reason.
        reason: String,
    },
    /// The delivery cannot be a message: no ID, an unusable ID or ordering key, or a payload
    /// the application refused ([`Consumer::reject`](super::Consumer::reject)). Nothing is
    /// recorded.
    Rejected {
        /// Why.
        reason: String,
    },
    /// This attempt failed and nothing committed; the message should be delivered again
    /// after `retry_after`.
    Failed {
        /// Failed attempts of the message's work so far; zero when the failure is not
        /// counted: the work did not fail (the database failed, or the lease was lost to
        /// another worker), or its failure was transient
        /// ([`Consumer::with_transient`](super::Consumer::with_transient)).
        attempts: u32,
        /// Why.
        reason: String,
        /// The backoff before the next delivery.
        retry_after: Duration,
    },
    /// Another worker holds the message under a lease that has not run out: nothing ran;
    /// deliver it again after `retry_after`.
    InProgress {
        /// How long until the other worker's lease runs out.
        retry_after: Duration,
    },
}

/// What to tell the broker about a delivery ([`Outcome::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// Acknowledge: the message is done with (processed, a duplicate, stale, or parked).
    Ack,
    /// Do not acknowledge; deliver it again after this long (JetStream: `nak` with the
    /// delay; RabbitMQ: reject with requeue after the delay).
    Retry(Duration),
    /// Acknowledge so that it is never delivered again (JetStream: `term`; RabbitMQ: reject
    /// without requeue, to a dead-letter exchange if one is set).
    Reject,
}

impl<T> Outcome<T> {
    /// The result's name, as in the metrics and the span: `processed`, `duplicate`, `stale`,
    /// `parked`, `rejected`, or `failed` (for [`Outcome::Failed`] and
    /// [`Outcome::InProgress`]: both are redelivered).
    pub fn result(&self) -> &'static str {
        match self {
            Self::Processed(_) => "processed",
            Self::Duplicate => "duplicate",
            Self::Stale => "stale",
            Self::Parked { .. } => "parked",
            Self::Rejected { .. } => "rejected",
            Self::Failed { .. } | Self::InProgress { .. } => "failed",
        }
    }

    /// What to tell the broker. Settle after
    /// [`Consumer::deliver`](super::Consumer::deliver) returns, never before: the commit
    /// comes first.
    pub fn settle(&self) -> Settle {
        match self {
            Self::Processed(_) | Self::Duplicate | Self::Stale | Self::Parked { .. } => Settle::Ack,
            Self::Rejected { .. } => Settle::Reject,
            Self::Failed { retry_after, .. } | Self::InProgress { retry_after } => {
                Settle::Retry(*retry_after)
            }
        }
    }
}
