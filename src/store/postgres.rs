use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use std::sync::Arc;

use sqlx::postgres::{PgConnectOptions, PgRow};
use sqlx::{PgPool, Row};

mod claim;
mod migrate;
mod ops;
pub mod phased;
pub(crate) mod phases;
mod send;
pub(crate) mod sqlstate;
mod statements;
pub mod transactional;
mod workload;

use claim::*;
pub(crate) use migrate::migrate;
pub(crate) use sqlstate::db_error;
use sqlstate::*;
use statements::*;
use workload::Workload;

use super::listen::PgNotifier;
use super::sql::{append, push_bounds, push_execute};
use super::{ClaimOutcome, ClaimRequest, KeyNotifier, KeyWatch, LeaseToken, Store};
use crate::error::StoreError;
use crate::key::IdempotencyKey;
use crate::response::StoredResponse;

/// A store in PostgreSQL, shared by every app instance that uses the same database.
///
/// ```no_run
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_idempotency::{IdempotencyLayer, PostgresStore};
///
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/app").await?;
/// let store = PostgresStore::new(pool);
/// store.migrate().await?; // idempotent; safe to run from every instance at start
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer; Ok(()) }
/// ```
///
/// # Schema
///
/// [`migrate`](PostgresStore::migrate) creates the store's tables, sequence and functions
/// (all named `tower_idempotency_*`, listed there) in the first schema of the connection's
/// `search_path`, and records what it applied in its own history table,
/// `tower_idempotency_migrations`, so it never touches the application's migration history.
/// The SQL is in the crate's `migrations/` folder for those who apply migrations with their
/// own tool.
///
/// The store's functions run with `search_path = pg_catalog, <their schema>, pg_temp`, and
/// plain mode's statements written out in SQL and the purge name every table, function,
/// operator and type with its schema: an application schema ahead on the connection's path
/// (a table named like the store's, a `now()` of its own) cannot change what they read or
/// write. The store finds its schema, and calls its functions, through the connection's path,
/// so its schema must be on it; the other modes' and the inbox's statements find the store's
/// tables through it too, so keep tables named `tower_idempotency_*` out of schemas ahead of
/// the store's.
///
/// # Round trips and clocks
///
/// With the default [`ClaimStrategy::Adaptive`], a first request costs two statements (insert,
/// complete) and a replay one (the read) once most recent claims found their key, plus one
/// renewal per third of the lease for handlers that run longer than that; [`ClaimStrategy`]
/// trades these counts against what each statement costs the database. Every time (leases,
/// expiry) is computed by the database, through the function `tower_idempotency_now()`
/// (`pg_catalog.now()`), so app instances with skewed clocks agree. A test may replace that one
/// function to move the store's clock.
///
/// # Poolers and bounds
///
/// Every statement goes over the simple query protocol with its values written in as literals,
/// so the store works behind a pooler in transaction mode (PgBouncer, RDS Proxy, Supavisor)
/// with nothing to configure: every message is whole in itself, and no setting outlives its
/// transaction. The statements a request costs (the read, the insert and the completion) are
/// written out in SQL and prepared with SQL `PREPARE` on each server connection that runs them,
/// under a name that is a digest of their text, so that Postgres plans them once per
/// connection, and a client of a pooler that meets one on a shared server connection meets the
/// statement it means. Calls of the store's functions (the rarer paths: takeover, release,
/// renewal, and [`ClaimStrategy::Combined`]'s claim) are sent as text. A server connection that
/// does not hold one yet answers its first `EXECUTE` with an error (`prepared statement
/// "tower_idempotency_…" does not exist`, in the server's log once per server connection and
/// statement), and the store sends it again with the `PREPARE`. Each statement runs under the
/// store's own `statement_timeout` and `lock_timeout` ([`with_statement_timeout`], 5 s;
/// [`with_lock_timeout`], 1 s), set with `SET LOCAL` in the same message, so the application's
/// statements keep their own settings.
///
/// [`with_statement_timeout`]: PostgresStore::with_statement_timeout
/// [`with_lock_timeout`]: PostgresStore::with_lock_timeout
///
/// sqlx pings a connection when the pool hands it out (`test_before_acquire`, on by
/// default): one more round trip per statement. On a reliable network, a pool built with
/// `PgPoolOptions::new().test_before_acquire(false)` saves it.
#[derive(Clone, Debug)]
pub struct PostgresStore {
    pool: PgPool,
    strategy: ClaimStrategy,
    purge_duty: f64,
    statement_timeout: Duration,
    lock_timeout: Duration,
    prepared: bool,
    /// Wake-ups for waiting duplicates ([`PostgresStore::with_notifications`]).
    notifier: Option<Arc<PgNotifier>>,
    /// The store's statements written out in SQL, with its schema written in
    /// ([`PostgresStore::run_named`]).
    rendered: Arc<tokio::sync::OnceCell<Rendered>>,
    /// How often recent claims found their key's record ([`ClaimStrategy::Adaptive`]).
    workload: Arc<Workload>,
}

/// The default `statement_timeout` of the store's statements.
const DEFAULT_STATEMENT_TIMEOUT: Duration = Duration::from_secs(5);
/// The default `lock_timeout` of the store's statements.
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(1);

/// How [`PostgresStore`] claims a key: the statements a first request and a replay cost.
///
/// Every strategy keeps every guarantee (one atomic insert decides between racing first
/// requests; takeovers are fenced); they differ in round trips and in what the database
/// spends per statement. The figures in BENCHMARKS.md show the trade-off on one machine.
///
/// | strategy | first request | replay |
/// |---|---|---|
/// | [`Adaptive`](ClaimStrategy::Adaptive) (default) | 2 statements: insert, complete (3 while most claims find their key) | 1 statement: the read (2 while most claims are first requests) |
/// | [`Combined`](ClaimStrategy::Combined) | 2: claim (a read, then the insert), complete | 1: the read, which skips the insert |
/// | [`ReadFirst`](ClaimStrategy::ReadFirst) | 3: read, insert, complete | 1: the read |
/// | [`InsertFirst`](ClaimStrategy::InsertFirst) | 2: insert, complete | 2: insert (conflicts), read |
///
/// The read, the insert and the completion are bare statements prepared on the server
/// connection (see "Poolers and bounds" on [`PostgresStore`]); `Combined`'s claim is a call
/// of a PL/pgSQL function, one statement for either case, which costs the database more than
/// either bare statement (the call is planned every time, and the function saves and restores
/// its settings). `Adaptive` sends the statement that most likely settles the claim alone:
/// the insert while most recent claims were first requests, the read while most found their
/// key (retry storms, a client replaying a batch). Expired or abandoned keys cost one more
/// statement (the takeover) in every strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// The insert first while most recent claims were first requests, the read first while
    /// most found their key: the cheapest of [`ReadFirst`](Self::ReadFirst) and
    /// [`InsertFirst`](Self::InsertFirst) for the store's recent claims.
    #[default]
    Adaptive,
    /// One statement reads the record and inserts it when absent: a call of the claim
    /// function, which inserts only for an absent key.
    Combined,
    /// A plain `SELECT` first; the insert only when the key is absent.
    ReadFirst,
    /// A plain `INSERT … ON CONFLICT DO NOTHING` first; the read only when the key exists.
    InsertFirst,
}

impl PostgresStore {
    /// A store on `pool`. Run [`migrate`](PostgresStore::migrate) once before use.
    pub fn new(pool: PgPool) -> Self {
        let notifier = Arc::new(PgNotifier::new(pool.connect_options().as_ref().clone()));
        Self {
            pool,
            strategy: ClaimStrategy::Adaptive,
            purge_duty: 1.0,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            prepared: false,
            notifier: Some(notifier),
            rendered: Arc::default(),
            workload: Arc::default(),
        }
    }

    /// Whether completions and releases wake the duplicates waiting for their keys, in
    /// every process sharing the database (default `true`), for layers built
    /// [`with_wait_for_completion`](crate::IdempotencyLayer::with_wait_for_completion).
    ///
    /// A waiting duplicate registers its key's hash in `tower_idempotency_waiting` for a
    /// minute, and the store keeps one connection of its own (not from the pool,
    /// opened by the first waiter, never when nobody waits) that `LISTEN`s on
    /// `tower_idempotency` and wakes the waiters of its process; a waiter holds no connection
    /// while it waits. Completions, releases and rollbacks look the key's hash up in their
    /// own transaction and send `NOTIFY` only when someone waits (delivered when they
    /// commit): a key nobody waits for costs one primary-key probe of that small table
    /// inside the completion's statement, never a `NOTIFY`, which would serialize commits
    /// (no difference measured: BENCHMARKS.md). With `false`, completions are silent and
    /// waiters poll: they claim again at growing intervals (20 ms up to 500 ms). A process
    /// with notifications off completes keys silently, and waiters elsewhere notice only at
    /// their next recheck (within a second).
    ///
    /// The listening connection goes where the pool's connections go. Behind a pooler in
    /// transaction mode (PgBouncer), `LISTEN` does not work: give it a direct connection
    /// with [`with_listener_options`](Self::with_listener_options). While it cannot listen
    /// (not yet connected, reconnecting), waiters claim again at growing intervals instead.
    pub fn with_notifications(mut self, on: bool) -> Self {
        if !on {
            self.notifier = None;
        } else if self.notifier.is_none() {
            let options = self.pool.connect_options().as_ref().clone();
            self.notifier = Some(Arc::new(PgNotifier::new(options)));
        }
        self
    }

    /// Where the connection that listens for wake-ups connects
    /// ([`with_notifications`](Self::with_notifications); turns them on): a direct
    /// connection to the primary when the pool goes through a pooler in transaction mode.
    pub fn with_listener_options(mut self, options: PgConnectOptions) -> Self {
        self.notifier = Some(Arc::new(PgNotifier::new(options)));
        self
    }

    /// The payload of the notification of a change of (scope, key), when notifications are
    /// on.
    pub(crate) fn notification(&self, scope: &str, key: &IdempotencyKey) -> Option<i64> {
        self.notifier
            .as_ref()
            .map(|_| KeyNotifier::key_hash(scope, key).cast_signed())
    }

    /// Whether plain mode's statements are sent as prepared statements (default `false`).
    ///
    /// **Only on a direct connection to Postgres** (or PgBouncer 1.21 or later with
    /// `max_prepared_statements` set). By default every statement goes over the simple query
    /// protocol with its values written in, which a pooler in transaction mode carries
    /// safely, and Postgres plans each one it receives. Prepared, the statements are planned
    /// once per connection and their values sent in binary: a replay costs the database about
    /// half as much (see BENCHMARKS.md). But sqlx names its prepared statements per client
    /// connection (`sqlx_s_1`, …), and behind a pooler in transaction mode such a name meets
    /// another client's statement on a shared server connection: the statement fails, or runs
    /// the other client's statement with this one's values.
    ///
    /// Prepared, each statement is sent alone, so two of the store's bounds cannot travel
    /// with it: its `statement_timeout` (the layer's
    /// [`with_store_timeout`](crate::IdempotencyLayer::with_store_timeout) still bounds every
    /// call; set `statement_timeout` on the role for a bound in the database too) and its
    /// `READ COMMITTED` (the statements then run at the session's default isolation level;
    /// under `SERIALIZABLE`, claims of distinct keys can fail each other's serialization
    /// check, which the store retries a few times before answering "in flight"). Lock waits
    /// stay bounded by [`with_lock_timeout`](Self::with_lock_timeout). Transactional mode and
    /// the inbox always use the simple protocol.
    pub fn with_prepared_statements(mut self, prepared: bool) -> Self {
        self.prepared = prepared;
        self
    }

    /// The `statement_timeout` of the store's own statements (default 5 s; zero leaves the
    /// session's setting). Set with `SET LOCAL` in the message that carries the statement,
    /// so it never applies to the application's statements — in transactional mode, not to
    /// the handler's either. The database then gives up on a statement that the layer gave
    /// up on ([`with_store_timeout`](crate::IdempotencyLayer::with_store_timeout)), instead of
    /// running it on for nobody; keep it at or below the layer's bound.
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// The `lock_timeout` of the store's own statements (default 1 s; zero leaves the
    /// session's setting). A store statement waits on a lock only when another transaction
    /// holds the key's row: a transactional-mode request on the same key, or a concurrent
    /// claim. A claim that waits longer answers "in flight" (`409`); other statements fail
    /// (`503` before the handler ran).
    pub fn with_lock_timeout(mut self, timeout: Duration) -> Self {
        self.lock_timeout = timeout;
        self
    }

    /// Maps a database error; a statement cancelled at the store's `statement_timeout` is
    /// [`StoreError::Timeout`].
    pub(crate) fn error(&self, err: sqlx::Error) -> StoreError {
        if sqlstate_is(&err, QUERY_CANCELED) {
            return StoreError::Timeout(self.statement_timeout);
        }
        db_error(err)
    }

    /// The bounds put in front of the store's statements: `statement_timeout`, `lock_timeout`.
    pub(crate) fn bounds(&self) -> (Duration, Duration) {
        (self.statement_timeout, self.lock_timeout)
    }

    /// How a claim is sent to the database (default [`ClaimStrategy::Adaptive`]).
    pub fn with_claim_strategy(mut self, strategy: ClaimStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// The share of time [`purge_expired`](Store::purge_expired) may spend deleting, from
    /// `0.01` to `1.0` (default `1.0`: batches back to back).
    ///
    /// Each batch takes database time that a busy server would otherwise give to requests.
    /// With a duty cycle below 1, the purge pauses after each batch for as long as it makes
    /// its share come out right (`0.1`: a batch that took 20 ms is followed by 180 ms of
    /// rest), so a purge of a large backlog stretches over more time but takes at most that
    /// share of a backend. Values outside the range are clamped.
    pub fn with_purge_duty_cycle(mut self, duty: f64) -> Self {
        self.purge_duty = if duty.is_nan() {
            1.0
        } else {
            duty.clamp(0.01, 1.0)
        };
        self
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates or upgrades the store's schema. Safe to call from several instances at once
    /// (an advisory lock serialises them) and on every start (applied migrations are skipped);
    /// it runs in one transaction, so it applies everything or nothing.
    ///
    /// It works in the first schema of the connection's `search_path`, and creates there:
    ///
    /// - the tables `tower_idempotency_keys` (the keys' records), `tower_idempotency_waiting`
    ///   (the keys that duplicates wait for), `tower_idempotency_processed_messages`,
    ///   `tower_idempotency_positions` and `tower_idempotency_message_failures` (the inbox),
    ///   `tower_idempotency_processed_messages_daily`, partitioned by day (its partitions
    ///   are made and dropped by [`DailyInbox`](crate::inbox::DailyInbox)), and
    ///   `tower_idempotency_daily_floor` (one row: the first day the daily inbox keeps);
    /// - their indexes besides the primary keys: `tower_idempotency_keys_expires_at`,
    ///   `tower_idempotency_keys_phased` (partial),
    ///   `tower_idempotency_processed_messages_processed_at` and
    ///   `tower_idempotency_message_failures_parked` (partial);
    /// - the sequence `tower_idempotency_lease_token_seq`;
    /// - the functions `tower_idempotency_now` (the store's clock),
    ///   `tower_idempotency_plain_claim`, `tower_idempotency_plain_read`,
    ///   `tower_idempotency_insert_key`,
    ///   `tower_idempotency_plain_insert`, `tower_idempotency_plain_takeover`,
    ///   `tower_idempotency_plain_complete` (two: with and without the wake-up),
    ///   `tower_idempotency_plain_release` (two), `tower_idempotency_plain_renew`,
    ///   `tower_idempotency_wake`, `tower_idempotency_claim_tx`, `tower_idempotency_complete_tx`
    ///   (two), `tower_idempotency_phase_record`, `tower_idempotency_phase_held`,
    ///   `tower_idempotency_phase_complete` and `tower_idempotency_record_message` (two: with
    ///   and without a position);
    /// - its history table, `tower_idempotency_migrations`: each migration applied, with the
    ///   SHA-256 of its SQL.
    ///
    /// The schema is made by the files of `migrations/`, applied in order: `0001_schema.sql`
    /// (version 1), then `0002_phase_leases.sql` (version 2: the phase statements' leases),
    /// then `0003_daily_floor.sql` (version 3: the daily inbox's floor, the first day of the
    /// partitions it has when it is applied).
    ///
    /// # Databases migrated by earlier builds
    ///
    /// Earlier builds of the crate made the same schema in thirteen migrations (versions 1 to
    /// 13). A database whose history records all thirteen, each with the checksum of its SQL,
    /// is taken over in the same transaction, its rows kept: the function that nothing calls
    /// (`tower_idempotency_claim_in_tx`) is dropped, the functions' settings are set as
    /// version 1 sets them, and the thirteen rows of the history are replaced by version 1's.
    ///
    /// A history that records only some of the thirteen (a build older still), or a migration
    /// with a checksum that matches none this crate knows, is refused with
    /// [`StoreError::Schema`], and nothing is changed. Either run `migrate()` of a build that
    /// still has the thirteen migrations, then this one; or reset the store once: in its
    /// schema, run the statements below, which drop its tables, sequence and functions (the
    /// keys' records and the inbox's processed message IDs go with them), then `migrate()`.
    ///
    /// ```sql
    /// DROP TABLE IF EXISTS tower_idempotency_keys, tower_idempotency_waiting,
    ///     tower_idempotency_processed_messages, tower_idempotency_positions,
    ///     tower_idempotency_message_failures, tower_idempotency_processed_messages_daily,
    ///     tower_idempotency_daily_floor, tower_idempotency_migrations;
    /// DROP SEQUENCE IF EXISTS tower_idempotency_lease_token_seq;
    /// DO $$
    /// DECLARE
    ///     f regprocedure;
    /// BEGIN
    ///     FOR f IN SELECT p.oid FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
    ///               WHERE n.nspname = current_schema() AND p.proname LIKE 'tower\_idempotency\_%'
    ///     LOOP
    ///         EXECUTE format('DROP FUNCTION %s', f);
    ///     END LOOP;
    /// END
    /// $$;
    /// ```
    ///
    /// # Errors
    ///
    /// [`StoreError::Backend`] when the database fails; [`StoreError::Schema`] when the
    /// history is refused (above), its message naming the schema and the way out.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        migrate(&self.pool).await
    }
}

/// Milliseconds for an interval parameter, clamped to 100 years so Postgres never sees an
/// out-of-range interval.
pub(crate) fn millis(d: Duration) -> i64 {
    const MAX: u128 = 100 * 365 * 24 * 3600 * 1000;
    i64::try_from(d.as_millis().min(MAX)).unwrap_or(i64::MAX)
}

/// The `response_status` column's value (`smallint`; any HTTP status fits).
pub(crate) fn status_column(response: &StoredResponse) -> Result<i16, StoreError> {
    i16::try_from(response.status().as_u16())
        .map_err(|_| StoreError::Corrupt("status out of range".into()))
}

/// Reads the stored response of a completed record from `row`.
pub(crate) fn decode_response(row: &PgRow) -> Result<StoredResponse, StoreError> {
    let status: Option<i16> = row.try_get("response_status")?;
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .ok_or_else(|| StoreError::Corrupt("invalid stored status".into()))?;
    let headers: Option<Vec<u8>> = row.try_get("response_headers")?;
    let body: Option<Vec<u8>> = row.try_get("response_body")?;
    StoredResponse::decode(
        status,
        headers.as_deref().unwrap_or_default(),
        body.map(Bytes::from),
    )
}
