//! The Idempotent Consumer, whole: one call per delivery that claims the message, keeps its
//! lease while remote work runs, applies it in order with its ID, counts failed attempts,
//! parks poison messages, and says how to settle the delivery with the broker.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgConnection;
use tracing::Instrument;

use super::dead::{bounded, park, park_unclaimed, record_failure};
use super::delivery::{Message, Outcome};
use super::{
    Claim, Delivery, Inbox, InboxError, MAX_MESSAGE_ID, MessageLease, Ordered,
    is_transient_database_error,
};
use crate::error::{ConfigError, StoreError};

/// A failure of a message's work, as the consumer reads it.
type WorkError = Box<dyn Error + Send + Sync>;

/// Whether a failure of the work is transient ([`Consumer::with_transient`]).
type Classifier = dyn Fn(&(dyn Error + 'static)) -> bool + Send + Sync;

/// The consumer's [`Classifier`].
#[derive(Clone)]
struct Transient(Arc<Classifier>);

impl std::fmt::Debug for Transient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Transient(..)")
    }
}

/// The longest consumer name, in bytes.
const MAX_CONSUMER_NAME: usize = 200;

/// A consumer's settings over an [`Inbox`]: its name, the lease of a message's work, how many
/// failed attempts park a message, and the delay before a failed one is delivered again.
/// Cheap to clone.
///
/// [`deliver`](Consumer::deliver) takes one delivery of work that calls out through the
/// whole pattern ([`process`](Consumer::process) does the same in one commit for work that
/// stays in the database):
///
/// 1. a delivery without a usable ID is [`Outcome::Rejected`];
/// 2. the ID is claimed with a lease, committed at once: an ID processed before is
///    [`Outcome::Duplicate`] (the ID check comes first, so a seen message is never
///    [`Outcome::Stale`]); one that another worker holds is [`Outcome::InProgress`];
/// 3. an ordered message at or below its key's applied position is [`Outcome::Stale`]
///    (recorded as processed, its work never runs);
/// 4. the remote part of the work runs with no transaction open and no connection held,
///    while the lease is renewed;
/// 5. the database part runs in one transaction with the ID and the key's new position:
///    [`Outcome::Processed`];
/// 6. a failure of either part is counted; below the consumer's limit it is
///    [`Outcome::Failed`] (released, delivered again after a backoff), at the limit the
///    message is parked ([`Outcome::Parked`]: recorded as processed, kept with its reason as
///    a dead letter, never applied). A transient failure (a serialization failure or a
///    deadlock of the work's transaction, a connection cut: see
///    [`with_transient`](Consumer::with_transient)) says nothing about the message and is
///    not counted: the message is [`Outcome::Failed`] with zero attempts, released, and
///    delivered again after the first backoff, however often it happens.
///
/// Each delivery is counted (feature `metrics`) in
/// `tower_idempotency_inbox_deliveries_total{consumer, result}`, and redeliveries also in
/// `tower_idempotency_inbox_redeliveries_total{consumer, result}` (a redelivery that is not a
/// `duplicate` is one whose earlier attempt never committed). Each runs in a `tracing` span
/// named `process` with OpenTelemetry's messaging attributes. No message ID is ever a label.
#[derive(Clone, Debug)]
pub struct Consumer {
    inbox: Inbox,
    name: Arc<str>,
    lease: Duration,
    max_failures: u32,
    first_retry: Duration,
    max_retry: Duration,
    system: &'static str,
    transient: Transient,
}

impl Consumer {
    /// A consumer named `name` (the key of its message IDs and positions, and its metrics
    /// label) over `inbox`: a lease of 30 s, renewed every third of it while remote work
    /// runs; a message parked after 5 failed attempts; failed ones delivered again after
    /// 100 ms, doubling up to 30 s.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidConsumerName`] when `name` is empty or longer than 200 bytes.
    pub fn new(inbox: Inbox, name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        if name.is_empty() || name.len() > MAX_CONSUMER_NAME {
            return Err(ConfigError::InvalidConsumerName);
        }
        Ok(Self {
            inbox,
            name: name.into(),
            lease: Duration::from_secs(30),
            max_failures: 5,
            first_retry: Duration::from_millis(100),
            max_retry: Duration::from_secs(30),
            system: "unknown",
            transient: Transient(Arc::new(is_transient_database_error)),
        })
    }

    /// How long a claim holds a message without a renewal. While the work runs it is
    /// renewed every third of it; a worker that dies holds the message this long, then the
    /// next delivery takes it over. Match the broker's redelivery timeout (JetStream's
    /// `ack_wait`, renewed there by in-progress acks), so that neither gives the message to a
    /// second worker while the first one lives.
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroLease`].
    pub fn with_lease(mut self, lease: Duration) -> Result<Self, ConfigError> {
        if lease.is_zero() {
            return Err(ConfigError::ZeroLease);
        }
        self.lease = lease;
        Ok(self)
    }

    /// How many failed attempts of a message's work park it (default 5).
    ///
    /// # Errors
    ///
    /// [`ConfigError::ZeroMaxFailures`].
    pub fn with_max_failures(mut self, attempts: u32) -> Result<Self, ConfigError> {
        if attempts == 0 {
            return Err(ConfigError::ZeroMaxFailures);
        }
        self.max_failures = attempts;
        Ok(self)
    }

    /// Which failures of a message's work (its remote part or its database part) are
    /// transient: not counted toward [`with_max_failures`](Self::with_max_failures), so a
    /// message that meets them is never parked for them; it is released and delivered again
    /// after the first backoff ([`Outcome::Failed`] with zero attempts). The classifier gets
    /// the work's error (as a `Box<dyn Error>`, so its [`source`](Error::source)s can be
    /// walked and downcast) and replaces the default, [`is_transient_database_error`]: call
    /// that from it to keep the database's transient failures.
    ///
    /// A failure classed transient is retried for as long as it happens: class as transient
    /// only what says nothing about the message (a provider's `503` or `429`, say), never
    /// what the message itself causes.
    ///
    /// ```
    /// use std::error::Error;
    /// use tower_idempotency::inbox::{Consumer, Inbox, is_transient_database_error};
    ///
    /// #[derive(Debug, thiserror::Error)]
    /// #[error("the provider is busy")]
    /// struct ProviderBusy;
    ///
    /// # fn build(inbox: Inbox) -> Result<Consumer, Box<dyn Error>> {
    /// let consumer = Consumer::new(inbox, "charges")?.with_transient(|e| {
    ///     e.downcast_ref::<ProviderBusy>().is_some() || is_transient_database_error(e)
    /// });
    /// # Ok(consumer) }
    /// ```
    #[must_use]
    pub fn with_transient(
        mut self,
        transient: impl Fn(&(dyn Error + 'static)) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.transient = Transient(Arc::new(transient));
        self
    }

    /// The delay before a failed message is delivered again: `first` after the first failed
    /// attempt, doubling with each one, at most `max`.
    #[must_use]
    pub fn with_retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.first_retry = first;
        self.max_retry = max.max(first);
        self
    }

    /// The broker's name in the spans' `messaging.system` (`nats`, `kafka`, `rabbitmq`,
    /// `aws_sqs`).
    #[must_use]
    pub fn with_messaging_system(mut self, system: &'static str) -> Self {
        self.system = system;
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The inbox the consumer records in.
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// The last position the consumer applied for `key` ([`Inbox::position`]).
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails.
    pub async fn position(&self, key: &str) -> Result<Option<i64>, StoreError> {
        self.inbox.position(&self.name, key).await
    }

    /// Counts and traces a delivery the application refused before it reached the inbox (a
    /// payload that does not parse, say), and answers [`Outcome::Rejected`]:
    /// [`Settle::Reject`](super::Settle::Reject), so the broker never delivers it again.
    pub fn reject<T>(&self, message: &Message<'_>, reason: impl Into<String>) -> Outcome<T> {
        let outcome = Outcome::Rejected {
            reason: reason.into(),
        };
        let span = self.span(message);
        span.in_scope(|| self.record(message, &outcome));
        outcome
    }

    /// Takes one delivery whose work stays in the database through the pattern in **one
    /// commit**: the ID recorded, the key's position moved (for an ordered message) and
    /// `work`'s writes, in one transaction ([`Inbox::process`]), with the same outcomes,
    /// counting and parking as [`deliver`](Self::deliver). No lease: a concurrent delivery of
    /// the same message waits for this one's commit (at most the inbox's lock timeout) and is
    /// then a `Duplicate`. Use [`deliver`](Self::deliver) when the work calls out.
    ///
    /// The work's error is anything that converts into a `Box<dyn Error + Send + Sync>` (a
    /// `sqlx::Error`, a `String`, the application's error type): its text is the failure's
    /// reason, and the consumer's classifier ([`with_transient`](Self::with_transient)) reads
    /// it, and its sources, to tell a transient failure, which is not counted.
    ///
    /// Never fails: every failure is an [`Outcome`].
    pub async fn process<T, E, W>(&self, message: &Message<'_>, work: W) -> Outcome<T>
    where
        W: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: Into<WorkError>,
    {
        self.traced(message, self.process_inner(message, work))
            .await
    }

    /// Runs a delivery's path in its span, and counts and records its outcome.
    async fn traced<T>(
        &self,
        message: &Message<'_>,
        path: impl Future<Output = Outcome<T>>,
    ) -> Outcome<T> {
        let span = self.span(message);
        let outcome = path.instrument(span.clone()).await;
        span.in_scope(|| self.record(message, &outcome));
        outcome
    }

    async fn process_inner<T, E, W>(&self, message: &Message<'_>, work: W) -> Outcome<T>
    where
        W: AsyncFnOnce(&mut PgConnection) -> Result<T, E>,
        E: Into<WorkError>,
    {
        let id = match usable(message) {
            Ok(id) => id,
            Err(rejected) => return rejected,
        };
        match self
            .inbox
            .process_at(&self.name, id, message.order, work)
            .await
        {
            Ok(Delivery::Processed(Ordered::Applied(out))) => Outcome::Processed(out),
            Ok(Delivery::Processed(Ordered::Stale)) => Outcome::Stale,
            Ok(Delivery::Duplicate) => Outcome::Duplicate,
            Err(InboxError::InProgress { retry_after }) => Outcome::InProgress { retry_after },
            Err(InboxError::Work(e)) => self.work_failed(None, message, id, e.into()).await,
            Err(e @ InboxError::Aborted) => self.failed(None, message, id, &e.to_string()).await,
            Err(e) => self.unavailable(&e),
        }
    }

    /// Takes one delivery through the pattern (see [`Consumer`]): `remote` is the part of the
    /// work that leaves the database (a provider call, carrying a key derived from the
    /// message ID, since a takeover after a crash runs it again); it runs with no
    /// transaction open while the lease is renewed. `work` gets its result and the
    /// transaction that commits the ID: do every write of the message through it. Their
    /// error is read as [`process`](Self::process)'s.
    ///
    /// Never fails: every failure is an [`Outcome`] whose [`settle`](Outcome::settle) says
    /// what to tell the broker.
    pub async fn deliver<P, T, E, R, W>(
        &self,
        message: &Message<'_>,
        remote: R,
        work: W,
    ) -> Outcome<T>
    where
        R: AsyncFnOnce() -> Result<P, E>,
        W: AsyncFnOnce(&mut PgConnection, P) -> Result<T, E>,
        E: Into<WorkError>,
    {
        self.traced(message, self.deliver_inner(message, remote, work))
            .await
    }

    async fn deliver_inner<P, T, E, R, W>(
        &self,
        message: &Message<'_>,
        remote: R,
        work: W,
    ) -> Outcome<T>
    where
        R: AsyncFnOnce() -> Result<P, E>,
        W: AsyncFnOnce(&mut PgConnection, P) -> Result<T, E>,
        E: Into<WorkError>,
    {
        let id = match usable(message) {
            Ok(id) => id,
            Err(rejected) => return rejected,
        };
        let order_key = message.order.map(|(key, _)| key);
        let claimed = self
            .inbox
            .claim_at::<E>(&self.name, id, self.lease, order_key)
            .await;
        let lease = match claimed {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(Claim::Duplicate) => return Outcome::Duplicate,
            Ok(Claim::InProgress { retry_after }) => return Outcome::InProgress { retry_after },
            Err(e) => return self.unavailable(&e),
        };
        // Stale before any remote work (the claim read the key's position): a message applied
        // before must not call out again.
        if let Some((key, position)) = message.order
            && lease.applied().is_some_and(|applied| position <= applied)
        {
            return match lease
                .commit_in_order(key, position, async |_: &mut PgConnection| Ok::<(), E>(()))
                .await
            {
                Ok(_) => Outcome::Stale,
                Err(e) => self.unavailable(&e),
            };
        }
        let prepared = match keep_alive(&lease, remote()).await {
            Some(Ok(prepared)) => prepared,
            Some(Err(e)) => return self.work_failed(Some(lease), message, id, e.into()).await,
            None => return self.unavailable(&InboxError::<E>::LeaseLost),
        };
        let mut lease = lease;
        let committed = lease
            .commit_keeping(message.order, async |tx: &mut PgConnection| {
                work(tx, prepared).await
            })
            .await;
        match committed {
            Ok(Ordered::Applied(out)) => Outcome::Processed(out),
            Ok(Ordered::Stale) => Outcome::Stale,
            Err(InboxError::Work(e)) => self.work_failed(Some(lease), message, id, e.into()).await,
            Err(e @ InboxError::Aborted) => {
                self.failed(Some(lease), message, id, &e.to_string()).await
            }
            // The commit's transaction lost a race and was rolled back, for sure: the claim is
            // given back, so that the redelivery works on the message at once (kept, it would
            // answer `InProgress` until the lease ran out).
            Err(InboxError::Store(e)) if super::transient::is_known_rollback(&e) => {
                release(lease).await;
                self.unavailable(&InboxError::<()>::Store(e))
            }
            Err(e) => self.unavailable(&e),
        }
    }

    /// A failure of the message's work: not counted when it is transient (the lease, if any,
    /// released for the next delivery), else counted ([`failed`](Self::failed)).
    async fn work_failed<T>(
        &self,
        lease: Option<MessageLease>,
        message: &Message<'_>,
        id: &str,
        error: WorkError,
    ) -> Outcome<T> {
        let reason = error.to_string();
        if !(self.transient.0)(&*error) {
            return self.failed(lease, message, id, &reason).await;
        }
        if let Some(lease) = lease {
            release(lease).await;
        }
        Outcome::Failed {
            attempts: 0,
            reason: bounded(&reason).to_owned(),
            retry_after: self.first_retry,
        }
    }

    /// Counts a failed attempt of the message's work, and parks the message at the limit. With
    /// `lease` (work that called out) the claim is parked, or released for the next delivery;
    /// without one (the work's transaction rolled back and nobody holds the message) the ID is
    /// recorded with the parking, unless another delivery recorded it meanwhile.
    async fn failed<T>(
        &self,
        lease: Option<MessageLease>,
        message: &Message<'_>,
        id: &str,
        reason: &str,
    ) -> Outcome<T> {
        let attempts = match record_failure(&self.inbox, &self.name, id, reason).await {
            Ok(attempts) => attempts,
            Err(e) => return self.unavailable(&InboxError::<()>::Store(e)),
        };
        let reason = bounded(reason).to_owned();
        if attempts >= self.max_failures {
            let parked = match lease {
                Some(lease) => park::<()>(lease, message.payload).await.map(|()| true),
                None => park_unclaimed(&self.inbox, &self.name, id, message.payload)
                    .await
                    .map_err(InboxError::Store),
            };
            return match parked {
                Ok(true) => Outcome::Parked { attempts, reason },
                // Another delivery recorded it meanwhile: that one's outcome stands.
                Ok(false) => Outcome::Duplicate,
                Err(e) => self.unavailable(&e),
            };
        }
        if let Some(lease) = lease {
            release(lease).await;
        }
        Outcome::Failed {
            attempts,
            reason,
            retry_after: self.backoff(attempts),
        }
    }

    /// The delay before the delivery after `attempts` failed ones.
    fn backoff(&self, attempts: u32) -> Duration {
        let doublings = attempts.saturating_sub(1).min(30);
        self.first_retry
            .saturating_mul(1 << doublings)
            .min(self.max_retry)
    }

    /// A failure that is not the work's (the database, a lost lease): not counted, retried
    /// after the first backoff.
    fn unavailable<T, E>(&self, e: &InboxError<E>) -> Outcome<T> {
        let reason = match e {
            InboxError::Store(store) => format!("{e}: {}", source_chain(store)),
            _ => e.to_string(),
        };
        Outcome::Failed {
            attempts: 0,
            reason,
            retry_after: self.first_retry,
        }
    }

    fn span(&self, message: &Message<'_>) -> tracing::Span {
        tracing::info_span!(
            "process",
            otel.name = "process",
            otel.kind = "consumer",
            messaging.system = self.system,
            messaging.operation.type = "process",
            messaging.operation.name = "process",
            messaging.consumer.group.name = &*self.name,
            messaging.destination.name = message.destination,
            messaging.message.id = message.id,
            tower_idempotency.redelivered = message.redelivered,
            tower_idempotency.result = tracing::field::Empty,
        )
    }

    fn record<T>(&self, message: &Message<'_>, outcome: &Outcome<T>) {
        let result = outcome.result();
        tracing::Span::current().record("tower_idempotency.result", result);
        match outcome {
            Outcome::Failed {
                reason, attempts, ..
            } => {
                tracing::warn!(attempts, reason = reason.as_str(), "message attempt failed");
            }
            Outcome::Parked { reason, attempts } => {
                tracing::error!(attempts, reason = reason.as_str(), "message parked");
            }
            Outcome::Rejected { reason } => {
                tracing::warn!(reason = reason.as_str(), "message rejected");
            }
            _ => tracing::debug!(result, "message settled"),
        }
        #[cfg(feature = "metrics")]
        {
            let consumer = self.name.to_string();
            metrics::counter!(
                "tower_idempotency_inbox_deliveries_total",
                "consumer" => consumer.clone(),
                "result" => result,
            )
            .increment(1);
            if message.redelivered {
                metrics::counter!(
                    "tower_idempotency_inbox_redeliveries_total",
                    "consumer" => consumer,
                    "result" => result,
                )
                .increment(1);
            }
        }
        #[cfg(not(feature = "metrics"))]
        let _ = message;
    }
}

/// Gives a failed message's lease back, so that the next delivery works on it at once.
async fn release(lease: MessageLease) {
    if let Err(e) = lease.release().await {
        // The lease frees the message when it runs out; the redelivery waits for that.
        tracing::warn!(
            error = &e as &dyn std::error::Error,
            "could not release a failed message's lease"
        );
    }
}

/// The message's ID, or the outcome of a delivery that cannot be a message.
fn usable<'a, T>(message: &Message<'a>) -> Result<&'a str, Outcome<T>> {
    let Some(id) = message.id else {
        return Err(rejected("the message has no ID"));
    };
    if id.is_empty() || id.len() > MAX_MESSAGE_ID {
        return Err(rejected("message IDs must be 1 to 1024 bytes long"));
    }
    if let Some((key, _)) = message.order
        && (key.is_empty() || key.len() > super::order::MAX_ORDER_KEY)
    {
        return Err(rejected("ordering keys must be 1 to 1024 bytes long"));
    }
    Ok(id)
}

fn rejected<T>(reason: &str) -> Outcome<T> {
    Outcome::Rejected {
        reason: reason.to_owned(),
    }
}

/// An error and its causes, `: `-separated.
fn source_chain(e: &StoreError) -> String {
    let mut out = String::new();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

/// Runs `work` while renewing `lease` every third of its length; `None` when the lease was
/// lost (another worker took the message over), and the work is dropped. The work is polled
/// while a renewal runs too (a remote call's stream must be read, its heartbeats answered,
/// however slow the database), and each renewal is bounded by a third of the lease: one that
/// does not answer in time counts as failed, and the next tick tries again.
async fn keep_alive<F: Future>(lease: &MessageLease, work: F) -> Option<F::Output> {
    // At least a millisecond: a lease of a few nanoseconds must not renew in a busy loop.
    let every = (lease.lease() / 3).max(Duration::from_millis(1));
    let mut work = std::pin::pin!(work);
    let mut next = tokio::time::Instant::now() + every;
    loop {
        let tick = tokio::time::sleep_until(next);
        if let Either::Work(out) = beside(work.as_mut(), tick).await {
            return Some(out);
        }
        next += every;
        let renewal = tokio::time::timeout(every, lease.renew());
        match beside(work.as_mut(), renewal).await {
            Either::Work(out) => return Some(out),
            Either::Other(Ok(Ok(true))) => {}
            Either::Other(Ok(Ok(false))) => return None,
            // The lease still holds for two thirds of it: try again at the next tick.
            Either::Other(Ok(Err(e))) => tracing::warn!(
                error = &e as &dyn std::error::Error,
                "could not renew a message lease"
            ),
            Either::Other(Err(_)) => tracing::warn!(
                "a message lease's renewal did not answer within a third of the lease"
            ),
        }
    }
}

/// Which of [`beside`]'s two futures finished first.
enum Either<W, O> {
    Work(W),
    Other(O),
}

/// Polls `work` and `other` together until one finishes; `work` first, so that work that is
/// done is never dropped for the other.
async fn beside<W, O>(mut work: std::pin::Pin<&mut W>, other: O) -> Either<W::Output, O::Output>
where
    W: Future,
    O: Future,
{
    let mut other = std::pin::pin!(other);
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(out) = work.as_mut().poll(cx) {
            return std::task::Poll::Ready(Either::Work(out));
        }
        other.as_mut().poll(cx).map(Either::Other)
    })
    .await
}
