//! How the store sends its statements: as text with its settings in front, or prepared by
//! name on the server connection (pooler-safe), and how their rows come back.

use std::time::Duration;

use sqlx::postgres::PgRow;
use sqlx::{AssertSqlSafe, Row};

use super::*;
use crate::error::StoreError;
use crate::store::sql::Lit;

impl PostgresStore {
    /// The statement text of `template` with its arguments written in, after the store's
    /// bounds: one message, sent over the simple query protocol (see [`super::sql`]).
    pub(super) fn statement(&self, template: &str, args: &[Lit<'_>]) -> Result<String, StoreError> {
        let hint: usize = args.iter().map(Lit::len_hint).sum();
        let mut sql = String::with_capacity(128 + template.len() + hint);
        sql.push_str("SET LOCAL transaction_isolation = 'read committed'; ");
        // The functions bound their own lock waits (their `p_lock_ms`); the purge, a plain
        // statement, waits for no lock (`SKIP LOCKED`).
        push_bounds(&mut sql, self.statement_timeout, Duration::ZERO);
        append(&mut sql, template, args)?;
        Ok(sql)
    }

    /// The message that runs `bare` (its `text` as [`Rendered`] wrote it), prepared by `name`
    /// on the server connection that receives it (and prepared first when `prepare` is set),
    /// after the store's settings.
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
    pub(super) fn named_message(
        &self,
        bare: &Bare,
        (text, name): (&str, &str),
        args: &[Lit<'_>],
        prepare: bool,
    ) -> Result<String, StoreError> {
        let hint: usize = args.iter().map(Lit::len_hint).sum();
        let extra = if prepare { text.len() + 64 } else { 0 };
        let mut sql = String::with_capacity(256 + hint + extra);
        self.push_bare_settings(&mut sql, bare);
        if bare.scans {
            sql.push_str(
                "SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off; ",
            );
        }
        push_execute(&mut sql, name, text, bare.params, args, prepare)?;
        Ok(sql)
    }

    /// The settings in front of a [`Bare`] statement, prepared or not: `READ COMMITTED` and
    /// the store's bounds (the lock bound for a statement that can wait for a row lock).
    pub(super) fn push_bare_settings(&self, sql: &mut String, bare: &Bare) {
        sql.push_str("SET LOCAL transaction_isolation = 'read committed'; ");
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

    /// The store's [`Bare`] statements and its purges with its schema written in, rendered
    /// at the first of them sent: the schema is the one of the function
    /// `tower_idempotency_now()` that the connection's `search_path` finds.
    pub(super) async fn rendered(&self) -> Result<&Rendered, StoreError> {
        self.rendered
            .get_or_try_init(|| async {
                let schema = sqlx::raw_sql(SCHEMA_OF_THE_STORE)
                    .fetch_one(&self.pool)
                    .await
                    .and_then(|row| row.try_get::<String, _>(0))
                    .map_err(|e| self.error(e))?;
                Ok(Rendered::new(&schema))
            })
            .await
    }

    /// Runs `bare` as a statement prepared by name on the server connection that runs it
    /// (SQL `PREPARE` and `EXECUTE` over the simple protocol), and returns its rows.
    ///
    /// Over the simple protocol Postgres parses, analyses and plans every statement it is sent; a
    /// prepared statement is planned once per server connection (a replay's read costs the database
    /// about a third less: BENCHMARKS.md). Unlike the extended protocol's prepared statements,
    /// whose names belong to the client connection and which a pooler in transaction mode carries
    /// to server connections that hold another client's statement of that name, a statement
    /// prepared here is named by its own text ([`prepared_name`]): found on any server connection,
    /// it is the statement meant. Where a server connection does not hold it yet (`26000`), the
    /// message is sent again, on the same pooled connection, with the `PREPARE` in front (on a
    /// direct connection that is the server connection that refused it); where that meets the
    /// statement prepared
    /// meanwhile by another client of a pooler (`42P05`), it is sent again without. After a few
    /// rounds of that (a pooler with many server connections, each met for the first time), the
    /// statement is sent unprepared, as text, for this call.
    pub(super) async fn run_named(
        &self,
        bare: &Bare,
        args: &[Lit<'_>],
    ) -> Result<Vec<PgRow>, StoreError> {
        let statement = self.rendered().await?.get(bare)?;
        // Every try on one pooled connection: on a direct connection the statement refused
        // as not prepared is prepared and run there, in two messages. (Through the pool, the
        // second try could meet another connection that has it already, and bounce.)
        let mut conn = self.pool.acquire().await.map_err(|e| self.error(e))?;
        let mut prepare = false;
        for _ in 0..NAMED_ATTEMPTS {
            let sql = self.named_message(bare, statement, args, prepare)?;
            match sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_all(&mut *conn)
                .await
            {
                Err(e) if !prepare && sqlstate_is(&e, NOT_PREPARED) => prepare = true,
                Err(e) if prepare && sqlstate_is(&e, ALREADY_PREPARED) => prepare = false,
                other => return other.map_err(|e| self.error(e)),
            }
        }
        let mut sql = String::new();
        self.push_bare_settings(&mut sql, bare);
        append(&mut sql, statement.0, args)?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| self.error(e))
    }

    /// Runs `template` and returns its rows (the settings sent before it return none).
    ///
    /// The store's function calls are sent as text: Postgres plans a call of a function in
    /// microseconds (the function keeps its own statements' plans per server connection), so
    /// preparing the call gains nothing measurable (BENCHMARKS.md).
    pub(super) async fn rows(
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
    pub(super) async fn execute(
        &self,
        template: &str,
        args: &[Lit<'_>],
    ) -> Result<u64, StoreError> {
        let sql = self.statement(template, args)?;
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .map(|done| done.rows_affected())
            .map_err(|e| self.error(e))
    }
}

/// How many messages [`PostgresStore::run_named`] sends before it sends the statement
/// unprepared: `EXECUTE`, `PREPARE` with `EXECUTE`, and once more each way.
const NAMED_ATTEMPTS: usize = 4;
