use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use std::sync::Arc;

use sqlx::postgres::{PgConnectOptions, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Row};

mod migrate;
pub mod phased;
pub(crate) mod phases;
pub mod transactional;

pub(crate) use migrate::migrate;

use super::listen::{PURGE_WAITING, PgNotifier};
use super::sql::{Lit, append, prepared_name, push_bounds, push_execute};
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
/// The store's functions run with `search_path = pg_catalog, <their schema>, pg_temp`: an
/// application schema ahead on the connection's path (a table named like the store's, a
/// `now()` of its own) cannot change what they read or write. The store's own statements name
/// its tables and functions unqualified, so its schema must be on the connection's path.
///
/// # Round trips and clocks
///
/// With the default [`ClaimStrategy::Combined`], a replay costs one statement and a first
/// request two (claim, complete), plus one renewal per third of the lease for handlers that
/// run longer than that; [`ClaimStrategy`] trades these counts against what each statement
/// costs the database. Every time (leases, expiry) is computed by the database, through the
/// function `tower_idempotency_now()` (`pg_catalog.now()`), so app instances with skewed
/// clocks agree. A test may replace that one function to move the store's clock.
///
/// # Poolers and bounds
///
/// Every statement goes over the simple query protocol with its values written in as
/// literals, so the store works behind a pooler in transaction mode (PgBouncer, RDS Proxy,
/// Supavisor) with nothing to configure: every message is whole in itself, and no setting
/// outlives its transaction. Calls of the store's functions are sent as text (cheap to plan);
/// the statements written out in SQL (the read and the insert of
/// [`ClaimStrategy::ReadFirst`] and [`ClaimStrategy::InsertFirst`]) are prepared with SQL
/// `PREPARE` on each server connection that runs them, under a name that is a digest of
/// their text, so that Postgres plans them once per connection, and a client of a pooler that
/// meets one on a shared server connection meets the statement it means. A server connection
/// that does not hold one yet answers its first `EXECUTE` with an error (`prepared statement
/// "tower_idempotency_…" does not exist`, in the server's log once per server connection and
/// statement), and the store sends it again with the `PREPARE`. Each statement runs under
/// the store's own `statement_timeout` and `lock_timeout` ([`with_statement_timeout`], 5 s;
/// [`with_lock_timeout`], 1 s), set with `SET LOCAL` in the same message, so the
/// application's statements keep their own settings.
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
    /// The store's schema, quoted as an identifier: the schema of the function
    /// `tower_idempotency_now()` that the connection's `search_path` finds, looked up at the
    /// first statement sent prepared by name ([`PostgresStore::run_named`]).
    schema: Arc<tokio::sync::OnceCell<String>>,
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
/// | [`Combined`](ClaimStrategy::Combined) (default) | 2 statements: claim (a read, then the insert), complete | 1 statement: the read, which skips the insert |
/// | [`ReadFirst`](ClaimStrategy::ReadFirst) | 3: read, insert, complete | 1 plain `SELECT` |
/// | [`InsertFirst`](ClaimStrategy::InsertFirst) | 2: plain insert, complete | 2: insert (conflicts), read |
///
/// `Combined` suits most endpoints: one statement for a replay and two for a first request,
/// neither of them the slowest of the three. `ReadFirst`'s replay is a bare `SELECT` prepared
/// on the server connection (see "Poolers and bounds" on [`PostgresStore`]), the cheapest
/// replay of the three (1.13× `Combined`'s over HTTP, BENCHMARKS.md), for a
/// third statement on every first request: for endpoints whose clients retry a lot. Its
/// insert, also prepared, is `InsertFirst`'s first statement: a first request in two
/// statements, level with `Combined`'s over HTTP, and a replay in two, for endpoints that
/// see few retries. Expired or abandoned keys cost one more statement (the takeover) in every
/// strategy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimStrategy {
    /// One statement reads the record and inserts it when absent: a call of the claim
    /// function, which inserts only for an absent key.
    #[default]
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
            strategy: ClaimStrategy::Combined,
            purge_duty: 1.0,
            statement_timeout: DEFAULT_STATEMENT_TIMEOUT,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
            prepared: false,
            notifier: Some(notifier),
            schema: Arc::default(),
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
    /// inside the completion's function, never a `NOTIFY`, which would serialize commits
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

    /// The statement text of `template` with its arguments written in, after the store's
    /// bounds: one message, sent over the simple query protocol (see [`super::sql`]).
    fn statement(&self, template: &str, args: &[Lit<'_>]) -> Result<String, StoreError> {
        let hint: usize = args.iter().map(Lit::len_hint).sum();
        let mut sql = String::with_capacity(128 + template.len() + hint);
        sql.push_str("SET LOCAL transaction_isolation = 'read committed'; ");
        // The functions bound their own lock waits (their `p_lock_ms`); the purge, a plain
        // statement, waits for no lock (`SKIP LOCKED`).
        push_bounds(&mut sql, self.statement_timeout, Duration::ZERO);
        append(&mut sql, template, args)?;
        Ok(sql)
    }

    /// The message that runs `bare`, prepared by `name` on the server connection that
    /// receives it (and prepared first when `prepare` is set), after the store's settings.
    ///
    /// For a statement that reads the table, the plan settings make the plan the same whatever
    /// the table's statistics say, and keep it: a statement prepared while the table was empty
    /// (or analyzed so) would otherwise be planned as a sequential scan, and the plan kept for
    /// the life of the server connection reads the whole table on every call once it has grown
    /// (`tests/plans.rs`). A generic plan is made once, at the first `EXECUTE`, under these
    /// settings, and again only when something it depends on changes (a migration, an
    /// `ANALYZE`), under the same settings, since every message carries them. An insert of one
    /// row has one plan whatever the statistics say (its conflict is looked up in the key's
    /// unique index): its message goes without them.
    ///
    /// The message also pins the statement's `search_path` to the store's schema, as the
    /// store's functions pin their own: an application schema ahead on the connection's path
    /// (a table named like the store's, a `nextval` of its own) cannot change what it reads
    /// or writes. Postgres analyses a prepared statement again whenever it runs under another
    /// path than it was analysed with, so a statement prepared by the store of another schema
    /// on a pooler's shared server connection reads this store's tables.
    fn named_message(
        &self,
        bare: &Bare,
        schema: &str,
        name: &str,
        args: &[Lit<'_>],
        prepare: bool,
    ) -> Result<String, StoreError> {
        let hint: usize = args.iter().map(Lit::len_hint).sum();
        let extra = if prepare { bare.text.len() + 64 } else { 0 };
        let mut sql = String::with_capacity(320 + hint + extra);
        self.push_bare_settings(&mut sql, bare, schema);
        if bare.scans {
            sql.push_str(
                "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off; ",
            );
        }
        push_execute(&mut sql, name, bare.text, args, prepare)?;
        Ok(sql)
    }

    /// The settings in front of a [`Bare`] statement, prepared or not: `READ COMMITTED`, the
    /// `search_path` pinned to the store's `schema`, and the store's bounds (the lock bound
    /// for a statement that can wait for a row lock).
    fn push_bare_settings(&self, sql: &mut String, bare: &Bare, schema: &str) {
        sql.push_str("SET LOCAL transaction_isolation = 'read committed'; ");
        let _ = write!(
            sql,
            "SET LOCAL search_path = pg_catalog, {schema}, pg_temp; "
        );
        let lock = if bare.locks {
            self.lock_timeout
        } else {
            Duration::ZERO
        };
        push_bounds(sql, self.statement_timeout, lock);
        if bare.unflushed {
            sql.push_str("SET LOCAL synchronous_commit = off; ");
        }
    }

    /// Runs `bare` as a statement prepared by name on the server connection that runs it
    /// (SQL `PREPARE` and `EXECUTE` over the simple protocol), and returns its rows.
    ///
    /// Over the simple protocol Postgres parses, analyses and plans every statement it is sent; a
    /// prepared statement is planned once per server connection (a replay's read costs the database
    /// about a quarter less: BENCHMARKS.md). Unlike the extended protocol's prepared statements,
    /// whose names belong to the client connection and which a pooler in transaction mode carries
    /// to server connections that hold another client's statement of that name, a statement
    /// prepared here is named by its own text ([`prepared_name`]): found on any server connection,
    /// it is the statement meant. Where a server connection does not hold it yet (`26000`), the
    /// message is sent again with the `PREPARE` in front; where that meets the statement prepared
    /// meanwhile by another client of a pooler (`42P05`), it is sent again without. After a few
    /// rounds of that (a pooler with many server connections, each met for the first time), the
    /// statement is sent unprepared, as text, for this call.
    async fn run_named(&self, bare: &Bare, args: &[Lit<'_>]) -> Result<Vec<PgRow>, StoreError> {
        let schema = self
            .schema
            .get_or_try_init(|| async {
                sqlx::raw_sql(SCHEMA_OF_THE_STORE)
                    .fetch_one(&self.pool)
                    .await
                    .and_then(|row| row.try_get::<String, _>(0))
                    .map_err(|e| self.error(e))
            })
            .await?;
        let name = prepared_name(bare.text, args);
        let mut prepare = false;
        for _ in 0..NAMED_ATTEMPTS {
            let sql = self.named_message(bare, schema, &name, args, prepare)?;
            match sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&self.pool)
                .await
            {
                Err(e) if !prepare && sqlstate_is(&e, NOT_PREPARED) => prepare = true,
                Err(e) if prepare && sqlstate_is(&e, ALREADY_PREPARED) => prepare = false,
                other => return other.map_err(|e| self.error(e)),
            }
        }
        let mut sql = String::new();
        self.push_bare_settings(&mut sql, bare, schema);
        append(&mut sql, bare.text, args)?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.error(e))
    }

    /// Runs `template` and returns its rows (the settings sent before it return none).
    ///
    /// The store's function calls are sent as text: Postgres plans a call of a function in
    /// microseconds (the function keeps its own statements' plans per server connection), so
    /// preparing the call gains nothing measurable (BENCHMARKS.md).
    async fn rows(
        &self,
        template: &'static str,
        args: &[Lit<'_>],
    ) -> Result<Vec<PgRow>, StoreError> {
        let rows = if self.prepared {
            let mut query = sqlx::query(template);
            for arg in args {
                query = match *arg {
                    Lit::Text(text) => query.bind(text),
                    Lit::Bytes(bytes) => query.bind(bytes),
                    Lit::MaybeBytes(bytes) => query.bind(bytes),
                    Lit::Int(n) => query.bind(n),
                };
            }
            query.fetch_all(&self.pool).await
        } else {
            let sql = self.statement(template, args)?;
            sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&self.pool)
                .await
        };
        rows.map_err(|e| self.error(e))
    }

    /// Runs `template` and returns the rows it changed.
    async fn execute(&self, template: &str, args: &[Lit<'_>]) -> Result<u64, StoreError> {
        let sql = self.statement(template, args)?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| self.error(e))
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

    /// How a claim is sent to the database (default [`ClaimStrategy::Combined`]).
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

    async fn read(&self, req: &ClaimRequest<'_>) -> Result<Option<PgRow>, StoreError> {
        let args = claim_args(req, self.lock_timeout);
        let rows = if self.prepared {
            self.rows(READ_CALL, &args).await?
        } else {
            self.run_named(&READ, &args[..3]).await?
        };
        Ok(rows.into_iter().next())
    }

    /// The token of a fresh claim, or `None` when the key exists.
    async fn insert(&self, req: &ClaimRequest<'_>) -> Result<Option<i64>, StoreError> {
        let args = claim_args(req, self.lock_timeout);
        if !self.prepared {
            return match self.run_named(&INSERT, &args[..5]).await?.first() {
                Some(row) => Ok(Some(row.try_get("inserted")?)),
                None => Ok(None),
            };
        }
        match self.rows(INSERT_CALL, &args).await?.first() {
            Some(row) => Ok(row.try_get("inserted")?),
            None => Err(StoreError::Corrupt("the insert returned no row".into())),
        }
    }

    /// Runs a statement that acts on a claimed key (complete, release, renew) and returns the
    /// rows it changed. Under REPEATABLE READ or SERIALIZABLE (the connection's default), such
    /// a statement fails with a serialization failure when the row changed after its snapshot
    /// (a renewal still in flight as the answer is stored); it is run again, with a new
    /// snapshot: the token condition decides anew.
    async fn execute_token_statement(
        &self,
        template: &'static str,
        args: &[Lit<'_>],
    ) -> Result<u64, StoreError> {
        let mut attempts = 1;
        loop {
            match self.rows(template, args).await {
                Ok(rows) => {
                    let changed = match rows.first() {
                        Some(row) => row.try_get::<i64, _>("changed")?,
                        None => 0,
                    };
                    return Ok(changed.unsigned_abs());
                }
                Err(e) if lost_race(&e) && attempts < CLAIM_ATTEMPTS => attempts += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// One attempt of the claim's first step, as the strategy sends it.
    async fn look_and_insert(&self, req: &ClaimRequest<'_>) -> Result<Decision, StoreError> {
        Ok(match self.strategy {
            ClaimStrategy::Combined => {
                let rows = self
                    .rows(CLAIM, &claim_args(req, self.lock_timeout))
                    .await?;
                let row = rows
                    .first()
                    .ok_or_else(|| StoreError::Corrupt("the claim returned no row".into()))?;
                match row.try_get::<Option<i64>, _>("inserted")? {
                    Some(token) => Decision::Done(acquired(token, false)),
                    None => decide(row, req)?,
                }
            }
            ClaimStrategy::ReadFirst => match self.read(req).await? {
                Some(row) => decide(&row, req)?,
                None => match self.insert(req).await? {
                    Some(token) => Decision::Done(acquired(token, false)),
                    None => Decision::Retry,
                },
            },
            ClaimStrategy::InsertFirst => match self.insert(req).await? {
                Some(token) => Decision::Done(acquired(token, false)),
                None => match self.read(req).await? {
                    Some(row) => decide(&row, req)?,
                    // Deleted between the two statements (released or purged).
                    None => Decision::Retry,
                },
            },
        })
    }

    /// The claim of phased mode: a new key's record is inserted by a transaction whose commit
    /// does not wait for its WAL flush, with a token no crash can hand out twice; a key that
    /// has a record is claimed as [`Store::claim`] claims it.
    ///
    /// A phased claim is a lease, not a result: nothing is answered from it, and every phase
    /// after it commits fenced by its token and waits for its own flush, which flushes the
    /// claim's earlier WAL with it. A crash that loses the claim therefore loses nothing that
    /// was answered or committed after it: the request that held it finds its next phase
    /// refused (the key has no record, or another request's token), and a retry claims the
    /// key anew (`tests/database_crash.rs`). What the flush would have cost is a wait on the
    /// WAL for every request before its handler starts (BENCHMARKS.md).
    pub(crate) async fn claim_lease(
        &self,
        req: ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        let token = unrepeatable_token()?;
        let mut args = claim_args(&req, self.lock_timeout);
        // `$6`: the token instead of the lock timeout, which the message's settings carry.
        args[5] = Lit::Int(token);
        match self.run_named(&LEASE_INSERT, &args).await {
            Ok(rows) if !rows.is_empty() => return Ok(acquired(token, false)),
            // The key has a record: replay, refuse or take it over as any claim does.
            Ok(_) => {}
            Err(e) if waited_for_lock(&e) => return Ok(held_elsewhere()),
            Err(e) => return Err(e),
        }
        self.claim(req).await
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
    ///   and `tower_idempotency_processed_messages_daily`, partitioned by day (its partitions
    ///   are made and dropped by [`DailyInbox`](crate::inbox::DailyInbox));
    /// - their indexes besides the primary keys: `tower_idempotency_keys_expires_at`,
    ///   `tower_idempotency_keys_phased` (partial),
    ///   `tower_idempotency_processed_messages_processed_at` and
    ///   `tower_idempotency_message_failures_parked` (partial);
    /// - the sequence `tower_idempotency_lease_token_seq`;
    /// - the functions `tower_idempotency_now` (the store's clock),
    ///   `tower_idempotency_plain_claim`, `tower_idempotency_plain_read`, `tower_idempotency_insert_key`,
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
    /// The schema is one migration, `migrations/0001_schema.sql` (version 1).
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
    ///     tower_idempotency_migrations;
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

/// The arguments of the claim's statements: `$1` scope, `$2` key, `$3` fingerprint, `$4`
/// lease (ms), `$5` time to live (ms).
fn claim_args<'a>(req: &'a ClaimRequest<'a>, lock_timeout: Duration) -> [Lit<'a>; 6] {
    [
        Lit::Text(req.scope),
        Lit::Text(req.key.as_str()),
        Lit::Bytes(req.fingerprint.as_bytes()),
        Lit::Int(millis(req.lease)),
        // An in-progress record lives at least as long as its lease.
        Lit::Int(millis(req.ttl.max(req.lease))),
        Lit::Int(millis(lock_timeout)),
    ]
}

/// SQLSTATE `invalid_sql_statement_name`: here, `EXECUTE` of a statement the server
/// connection has not prepared.
const NOT_PREPARED: &str = "26000";
/// SQLSTATE `duplicate_prepared_statement`: a `PREPARE` of a statement the server connection
/// holds already.
const ALREADY_PREPARED: &str = "42P05";
/// How many messages [`PostgresStore::run_named`] sends before it sends the statement
/// unprepared: `EXECUTE`, `PREPARE` with `EXECUTE`, and once more each way.
const NAMED_ATTEMPTS: usize = 4;

/// SQLSTATE `query_canceled`: here, a statement cancelled at `statement_timeout`.
const QUERY_CANCELED: &str = "57014";
/// SQLSTATE `lock_not_available`: here, a lock not granted within `lock_timeout`.
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Whether `err` is a database error with SQLSTATE `code`.
pub(crate) fn sqlstate_is(err: &sqlx::Error, code: &str) -> bool {
    err.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|c| c == code)
}

/// Whether a store error is a lock not granted within the store's `lock_timeout`: another
/// transaction holds the key's row.
fn waited_for_lock(err: &StoreError) -> bool {
    match err {
        StoreError::Backend(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(|e| sqlstate_is(e, LOCK_NOT_AVAILABLE)),
        _ => false,
    }
}

/// Milliseconds for an interval parameter, clamped to 100 years so Postgres never sees an
/// out-of-range interval.
pub(crate) fn millis(d: Duration) -> i64 {
    const MAX: u128 = 100 * 365 * 24 * 3600 * 1000;
    i64::try_from(d.as_millis().min(MAX)).unwrap_or(i64::MAX)
}

/// Whether `err` is a serialization failure (SQLSTATE 40001) or a deadlock (40P01): the
/// statement lost a race with a concurrent transaction and may be run again.
pub(crate) fn is_serialization_failure(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "40001" || code == "40P01")
}

/// [`is_serialization_failure`] for an error already mapped by [`db_error`].
fn lost_race(err: &StoreError) -> bool {
    match err {
        StoreError::Backend(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(is_serialization_failure),
        _ => false,
    }
}

/// Maps a database error, recognising a missing schema by its SQLSTATE.
pub(crate) fn db_error(err: sqlx::Error) -> StoreError {
    if let Some(db) = err.as_database_error() {
        // 42P01 undefined_table, 42704 undefined_object (the sequence), 42883
        // undefined_function (the functions that later migrations add).
        if matches!(db.code().as_deref(), Some("42P01" | "42704" | "42883")) {
            return StoreError::Schema(format!(
                "{} (run PostgresStore::migrate() first)",
                db.message()
            ));
        }
    }
    StoreError::from(err)
}

/// The claim, in one statement: the function `tower_idempotency_plain_claim` reads the
/// record by its key and, only when the key is absent, inserts it. For a replay, an in-flight
/// key or a mismatch it costs the database the read alone; it returns one row whether or not
/// the key was there. (An `INSERT` written into the statement, as a data-modifying CTE, is set
/// up by the executor on every execution even when it inserts nothing: a replay through such a
/// statement took about 1.6 times the plain read's backend CPU in pgbench.)
///
/// Under READ COMMITTED the insert takes a fresh snapshot. When a concurrent request inserted
/// the key after the read's snapshot, the insert conflicts: the function returns neither an
/// inserted token nor a record, and the caller runs it again with a fresh snapshot. A record
/// that is expired, or whose lease ran out, comes back `claimable` and is taken over by
/// [`TAKEOVER`], a second statement that only this rare path pays for.
///
/// Arguments of every claim statement: `$1` scope, `$2` key, `$3` fingerprint, `$4` lease
/// (ms), `$5` time to live (ms), `$6` lock timeout (ms).
const CLAIM: &str = "SELECT * FROM tower_idempotency_plain_claim($1, $2, $3, $4, $5, $6)";

/// The schema of the store's functions as the connection's `search_path` finds them (where
/// its calls of them go), quoted as an identifier.
const SCHEMA_OF_THE_STORE: &str = "\
SELECT pg_catalog.quote_ident(n.nspname) \
  FROM pg_catalog.pg_proc AS p JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace \
 WHERE p.oid = 'tower_idempotency_now()'::pg_catalog.regprocedure";

/// A statement of the store written out in SQL (not a call of one of its functions), sent
/// prepared by name ([`PostgresStore::run_named`]): planning such a statement is most of what
/// it costs the database, and a prepared one is planned once per server connection.
struct Bare {
    /// The statement, its values as `$1`…`$n`.
    text: &'static str,
    /// Whether it can wait for a row lock (another transaction writing the key's row), so
    /// that its message sets the store's `lock_timeout`.
    locks: bool,
    /// Whether it reads the table, so that its plan could be a scan (an `INSERT … VALUES`
    /// cannot).
    scans: bool,
    /// Whether its commit may return before its WAL is flushed (`synchronous_commit = off`):
    /// only a statement whose effect every later commit that depends on it makes durable
    /// ([`LEASE_INSERT`]).
    unflushed: bool,
}

/// The read alone, for [`ClaimStrategy::ReadFirst`] and [`ClaimStrategy::InsertFirst`] with
/// prepared statements ([`PostgresStore::with_prepared_statements`]): a call of the function
/// that reads the record in the store's own schema. Otherwise [`READ`].
const READ_CALL: &str = "SELECT * FROM tower_idempotency_plain_read($1, $2, $3, $6)";

/// The read alone, for [`ClaimStrategy::ReadFirst`] and [`ClaimStrategy::InsertFirst`]: a
/// bare `SELECT` by key (it takes no lock, so it needs no lock bound), with the columns
/// [`decide`] reads. `$1` scope, `$2` key, `$3` fingerprint.
const READ: Bare = Bare {
    locks: false,
    scans: true,
    unflushed: false,
    text: READ_TEXT,
};
const READ_TEXT: &str = "\
SELECT k.fingerprint, k.lease_token, k.expires_at <= tower_idempotency_now() AS expired, \
       (k.expires_at <= tower_idempotency_now() \
        OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now() \
            AND k.fingerprint = $3)) AS claimable, \
       (extract(epoch FROM k.lease_expires_at - tower_idempotency_now()) * 1000)::bigint \
           AS lease_left_ms, \
       k.response_status, k.response_headers, k.response_body \
  FROM tower_idempotency_keys AS k WHERE k.scope = $1 AND k.key = $2";

/// The insert alone, for [`ClaimStrategy::ReadFirst`] and [`ClaimStrategy::InsertFirst`]
/// with prepared statements ([`PostgresStore::with_prepared_statements`]), a call of the
/// function that bounds its own lock wait: the new record's token, or `NULL` when the key
/// exists.
const INSERT_CALL: &str =
    "SELECT tower_idempotency_plain_insert($1, $2, $3, $4, $5, $6) AS inserted";

/// The insert alone, sent prepared by name: one row with the new record's token, or none
/// when the key exists. It waits for a concurrent insert of the same key to commit or roll
/// back (a transactional-mode request holds its row for as long as its handler runs), so its
/// message bounds the wait.
const INSERT: Bare = Bare {
    locks: true,
    scans: false,
    unflushed: false,
    text: "\
INSERT INTO tower_idempotency_keys AS k \
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at) \
VALUES ($1, $2, $3, nextval('tower_idempotency_lease_token_seq'), \
        tower_idempotency_now() + $4::float8 * interval '1 millisecond', \
        tower_idempotency_now() + $5::float8 * interval '1 millisecond') \
ON CONFLICT (scope, key) DO NOTHING \
RETURNING k.lease_token AS inserted",
};

/// The insert of a phased-mode claim ([`PostgresStore::claim_lease`]): [`INSERT`] with the
/// token given as `$6` (from [`unrepeatable_token`]), committed without waiting for its WAL
/// flush.
const LEASE_INSERT: Bare = Bare {
    locks: true,
    scans: false,
    unflushed: true,
    text: "\
INSERT INTO tower_idempotency_keys AS k \
       (scope, key, fingerprint, lease_token, lease_expires_at, expires_at) \
VALUES ($1, $2, $3, $6, \
        tower_idempotency_now() + $4::float8 * interval '1 millisecond', \
        tower_idempotency_now() + $5::float8 * interval '1 millisecond') \
ON CONFLICT (scope, key) DO NOTHING \
RETURNING k.lease_token AS inserted",
};

/// A lease token no claim lost in a crash can have handed out before: 62 random bits above
/// bit 62, so never one of the sequence's tokens either.
///
/// The sequence cannot give that promise to a claim whose commit does not wait for its WAL
/// flush: a crash that loses the claim's commit loses the sequence's advance with it, and
/// the server hands the same number out again after the restart, to the request that claims
/// the key anew while the first still runs and holds that number.
fn unrepeatable_token() -> Result<i64, StoreError> {
    let random = getrandom::u64().map_err(|e| StoreError::Backend(Box::new(e)))?;
    // `random >> 2` < 2^62, so the sum is in 2^62..2^63: a positive `i64`.
    i64::try_from((random >> 2) | (1 << 62)).map_err(|e| StoreError::Backend(Box::new(e)))
}

/// Takes over a record that is expired or whose lease ran out. The condition is checked
/// again on the row's latest version, so of two requests taking over at once, one wins; the
/// other gets `NULL` and claims again.
const TAKEOVER: &str =
    "SELECT tower_idempotency_plain_takeover($1, $2, $3, $4, $5, $6) AS lease_token";

/// Stores the answer while `$3` (the token) holds the record: `$4` time to live (ms), `$5`
/// status, `$6` headers, `$7` body, `$8` lock timeout (ms). Returns the rows changed.
const COMPLETE: &str = "SELECT tower_idempotency_plain_complete(\
     $1, $2, $3, $4, $5::smallint, $6, $7, $8) AS changed";

/// [`COMPLETE`], also waking the key's waiters: `$9` the key's hash.
const COMPLETE_WAKE: &str = "SELECT tower_idempotency_plain_complete(\
     $1, $2, $3, $4, $5::smallint, $6, $7, $8, $9) AS changed";

/// Deletes the record while `$3` (the token) holds it; `$4` lock timeout (ms).
const RELEASE: &str = "SELECT tower_idempotency_plain_release($1, $2, $3, $4) AS changed";

/// [`RELEASE`], also waking the key's waiters: `$5` the key's hash.
const RELEASE_WAKE: &str = "SELECT tower_idempotency_plain_release($1, $2, $3, $4, $5) AS changed";

/// Extends the lease `$3` (the token) holds by `$4` ms; `$5` lock timeout (ms).
const RENEW: &str = "SELECT tower_idempotency_plain_renew($1, $2, $3, $4, $5) AS changed";

/// Deletes up to `$1` expired records, oldest first, found by walking the `expires_at` index
/// and deleted by their row addresses (locked, so they cannot move). Written as a join on
/// the key, or without the order, the statement let Postgres scan the table instead (a hash
/// join, or a bare `LIMIT` when many records have expired), reading again, batch after
/// batch, the pages of the rows the batches before deleted, which stay until a `VACUUM`: a
/// backlog took quadratic time, and one batch could outlast the statement timeout
/// (`tests/plans.rs`).
const PURGE: &str = "
DELETE FROM tower_idempotency_keys
 WHERE ctid = ANY (ARRAY(
       SELECT ctid FROM tower_idempotency_keys
        WHERE expires_at <= tower_idempotency_now()
        ORDER BY expires_at
        LIMIT $1
          FOR UPDATE SKIP LOCKED))";

/// How often a claim that lost a race is run again before giving up with "in flight".
const CLAIM_ATTEMPTS: usize = 4;

enum Decision {
    Done(ClaimOutcome),
    /// The record is expired or abandoned: take it over ([`TAKEOVER`]).
    TakeOver {
        /// `false` when the old record had merely expired (that is a new claim).
        abandoned: bool,
    },
    /// No record in our snapshot, yet the insert conflicted: a concurrent insert won. Claim
    /// again.
    Retry,
}

/// Classifies the record read by [`CLAIM`] or [`READ`] (without an `inserted` token).
fn decide(row: &PgRow, req: &ClaimRequest<'_>) -> Result<Decision, StoreError> {
    let Some(fingerprint) = row.try_get::<Option<Vec<u8>>, _>("fingerprint")? else {
        return Ok(Decision::Retry);
    };
    if row.try_get::<Option<bool>, _>("claimable")? == Some(true) {
        let expired: Option<bool> = row.try_get("expired")?;
        return Ok(Decision::TakeOver {
            abandoned: expired == Some(false),
        });
    }
    if fingerprint != req.fingerprint.as_bytes() {
        return Ok(Decision::Done(ClaimOutcome::Mismatch));
    }
    if row.try_get::<Option<i64>, _>("lease_token")?.is_some() {
        let left: Option<i64> = row.try_get("lease_left_ms")?;
        let left = u64::try_from(left.unwrap_or(0)).unwrap_or(0);
        return Ok(Decision::Done(ClaimOutcome::InFlight {
            retry_after: Duration::from_millis(left),
        }));
    }
    Ok(Decision::Done(ClaimOutcome::Completed(decode_response(
        row,
    )?)))
}

/// The key is held by another request (or transaction): "in flight", retry in a second.
fn held_elsewhere() -> ClaimOutcome {
    ClaimOutcome::InFlight {
        retry_after: Duration::from_secs(1),
    }
}

fn acquired(token: i64, takeover: bool) -> ClaimOutcome {
    ClaimOutcome::Acquired {
        token: LeaseToken::from_raw(token),
        takeover,
    }
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

impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest<'_>) -> Result<ClaimOutcome, StoreError> {
        for _ in 0..CLAIM_ATTEMPTS {
            // Under REPEATABLE READ or SERIALIZABLE (the connection's default isolation level),
            // an insert that meets a record committed after its statement's snapshot fails
            // with a serialization failure: a concurrent claim won. Like a lost race under
            // READ COMMITTED, that is claimed again, with a new snapshot that sees the record.
            let decision = match self.look_and_insert(&req).await {
                Err(e) if lost_race(&e) => Decision::Retry,
                // Another transaction holds the key's row (a transactional-mode request on
                // the same key) longer than the store's lock timeout: the key is in use.
                Err(e) if waited_for_lock(&e) => return Ok(held_elsewhere()),
                other => other?,
            };
            match decision {
                Decision::Done(outcome) => return Ok(outcome),
                Decision::Retry => {}
                Decision::TakeOver { abandoned } => {
                    match self
                        .rows(TAKEOVER, &claim_args(&req, self.lock_timeout))
                        .await
                    {
                        Ok(rows) => {
                            let token = match rows.first() {
                                Some(row) => row.try_get::<Option<i64>, _>("lease_token")?,
                                None => None,
                            };
                            if let Some(token) = token {
                                return Ok(acquired(token, abandoned));
                            }
                        }
                        Err(e) if lost_race(&e) => {}
                        Err(e) if waited_for_lock(&e) => return Ok(held_elsewhere()),
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        // Every attempt lost a race to another claimer, which therefore holds the key now.
        Ok(held_elsewhere())
    }

    async fn complete(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let status = status_column(response)?;
        let headers = response.encode_headers();
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(ttl)),
            Lit::Int(i64::from(status)),
            Lit::Bytes(&headers),
            Lit::MaybeBytes(response.body().map(|b| &b[..])),
            Lit::Int(millis(self.lock_timeout)),
            Lit::Int(self.notification(scope, key).unwrap_or_default()),
        ];
        let done = match self.notifier {
            Some(_) => self.execute_token_statement(COMPLETE_WAKE, &args).await?,
            None => self.execute_token_statement(COMPLETE, &args[..8]).await?,
        };
        Ok(done == 1)
    }

    async fn release(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
    ) -> Result<bool, StoreError> {
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(self.lock_timeout)),
            Lit::Int(self.notification(scope, key).unwrap_or_default()),
        ];
        let done = match self.notifier {
            Some(_) => self.execute_token_statement(RELEASE_WAKE, &args).await?,
            None => self.execute_token_statement(RELEASE, &args[..4]).await?,
        };
        Ok(done == 1)
    }

    async fn renew(
        &self,
        scope: &str,
        key: &IdempotencyKey,
        token: LeaseToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let args = [
            Lit::Text(scope),
            Lit::Text(key.as_str()),
            Lit::Int(token.into_raw()),
            Lit::Int(millis(lease)),
            Lit::Int(millis(self.lock_timeout)),
        ];
        let done = self.execute_token_statement(RENEW, &args).await?;
        Ok(done == 1)
    }

    async fn watch(
        &self,
        scope: &str,
        key: &IdempotencyKey,
    ) -> Result<Option<KeyWatch>, StoreError> {
        match &self.notifier {
            Some(notifier) => notifier
                .watch(&self.pool, scope, key)
                .await
                .map_err(|e| self.error(e)),
            None => Ok(None),
        }
    }

    async fn purge_expired(&self, batch_size: usize) -> Result<u64, StoreError> {
        let batch = i64::try_from(batch_size.max(1)).unwrap_or(i64::MAX);
        // The waiting duplicates' registrations past their time (few: one per key waited for).
        self.execute(PURGE_WAITING, &[]).await?;
        let mut deleted = 0;
        loop {
            let started = std::time::Instant::now();
            let done = self.execute(PURGE, &[Lit::Int(batch)]).await?;
            deleted += done;
            if done < batch.unsigned_abs() {
                return Ok(deleted);
            }
            if self.purge_duty < 1.0 {
                let rest = started.elapsed().mul_f64(1.0 / self.purge_duty - 1.0);
                tokio::time::sleep(rest).await;
            }
        }
    }
}
