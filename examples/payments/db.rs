//! The example's own data (orders, payments, webhooks), in Postgres or in memory.

use std::collections::{HashMap, HashSet};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Extension;
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool, Postgres, Row as _, Transaction};
use tower_idempotency::{IdempotentTx, Phases, TxConn};

use super::*;

/// The data of the two services: the payments service (payments, orders, webhook events) and
/// the provider (its charges).
pub(crate) struct Storage {
    pub(crate) payments: Db,
    pub(crate) provider: Db,
}

/// Connections per pool. A keyed request holds one connection of its service's pool (its
/// transaction) for as long as its handler runs, so this is how many idempotent requests
/// each service runs at once; more wait for a connection, up to [`ACQUIRE_TIMEOUT`]. Two
/// pools: up to 64 connections per instance, within Postgres's default `max_connections`
/// (100).
pub(crate) const POOL_SIZE: u32 = 32;
pub(crate) const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serialises the `CREATE TABLE`s of instances that start together. (The bytes of "expaymnt".)
pub(crate) const SCHEMA_LOCK: i64 = 0x6578_7061_796d_6e74;

impl Storage {
    /// Everything in this process; the two services share it.
    pub(crate) fn memory() -> Self {
        let db = Db::Memory(Arc::default());
        Self {
            payments: db.clone(),
            provider: db,
        }
    }

    /// Connects to Postgres and creates the example's tables.
    ///
    /// Each service gets a pool of its own, as two real services would. A payment in flight
    /// holds a connection of the payments pool (its transaction) while it waits for the
    /// provider, which needs a connection for its own transaction: with one shared pool,
    /// [`POOL_SIZE`] concurrent payments could hold every connection and wait for the
    /// provider until the acquire timeout failed them all. For the same reason no handler
    /// takes a second connection from its pool while it holds its transaction.
    ///
    /// `DATABASE_URL` may name a pooler in transaction pooling mode (PgBouncer, say), which
    /// hands each transaction, and each statement outside one, to whichever server connection
    /// is free. So the example's own SQL never leaves anything on a server connection: a
    /// statement with parameters runs inside a transaction and unprepared
    /// (`.persistent(false)`; sqlx would otherwise prepare it under a name and reuse that
    /// name on the next connection), and one outside a transaction has no parameters and goes
    /// over the simple query protocol ([`sqlx::raw_sql`]). Locks are transaction-level
    /// (`pg_advisory_xact_lock`). Mind the pooler's pool size: a payment in flight holds a
    /// server connection (its transaction) while the provider needs another for its own.
    pub(crate) async fn postgres(url: &str) -> Result<Self, BoxError> {
        let payments = connect(url).await?;
        let mut tx = payments.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(SCHEMA_LOCK)
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(SCHEMA)
            .execute(&mut *tx)
            .await
            .map_err(|e| format!("cannot create the example's tables: {e}"))?;
        tx.commit().await?;
        let provider = connect(url).await?;
        Ok(Self {
            payments: Db::Postgres(payments),
            provider: Db::Postgres(provider),
        })
    }

    /// The pools of the payments service and of the provider, in Postgres.
    pub(crate) fn pools(&self) -> Option<(&PgPool, &PgPool)> {
        match (&self.payments, &self.provider) {
            (Db::Postgres(payments), Db::Postgres(provider)) => Some((payments, provider)),
            _ => None,
        }
    }

    pub(crate) async fn close(&self) {
        if let Some((payments, provider)) = self.pools() {
            tokio::join!(payments.close(), provider.close());
        }
    }
}

pub(crate) async fn connect(url: &str) -> Result<PgPool, BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(POOL_SIZE)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    Ok(pool)
}

/// Where one service keeps its data.
#[derive(Clone)]
pub(crate) enum Db {
    /// `DATABASE_URL` unset: in this process, gone when it exits.
    Memory(Arc<Mutex<MemoryDb>>),
    /// `DATABASE_URL` set: in the `example_*` tables, which survive a restart.
    Postgres(PgPool),
}

/// The in-memory twin of the Postgres tables.
#[derive(Default)]
pub(crate) struct MemoryDb {
    /// Charges the provider made (the last `ch_<n>`).
    pub(crate) charges: i64,
    /// Payments recorded (the last `pay_<n>`).
    pub(crate) payments: i64,
    /// Orders by (tenant, order id).
    pub(crate) orders: HashMap<(String, i64), MemoryOrder>,
    /// Webhook event ids applied.
    pub(crate) webhook_ids: HashSet<String>,
    /// Webhooks applied without an id (`IDEMPOTENCY=off`).
    pub(crate) webhooks_without_id: i64,
}

#[derive(Default)]
pub(crate) struct MemoryOrder {
    pub(crate) total_cents: i128,
    pub(crate) payments: i64,
    pub(crate) shipping_address: Option<String>,
}

impl MemoryDb {
    /// An order of a tenant; empty when never seen.
    pub(crate) fn order(&self, tenant: &str, order_id: i64) -> Order {
        let order = self.orders.get(&(tenant.to_owned(), order_id));
        Order {
            order_id,
            total_cents: order.map_or(0, |o| o.total_cents),
            payments: order.map_or(0, |o| o.payments),
            shipping_address: order.and_then(|o| o.shipping_address.clone()),
        }
    }
}

/// Runs `f` on the in-memory data. Never held across an `.await`.
pub(crate) fn with_memory<T>(memory: &Mutex<MemoryDb>, f: impl FnOnce(&mut MemoryDb) -> T) -> T {
    // A panic while holding the lock cannot leave the data half-updated in a way that
    // matters for a demo; keep serving.
    let mut guard = memory.lock().unwrap_or_else(PoisonError::into_inner);
    f(&mut guard)
}

/// The example's tables. `IF NOT EXISTS`: created at the first start, kept afterwards.
pub(crate) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS example_provider_charges (
    id           bigserial   PRIMARY KEY,
    tenant       text        NOT NULL,
    amount_cents bigint      NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS example_payments (
    id              bigserial   PRIMARY KEY,
    tenant          text        NOT NULL,
    -- The key of the request that made the payment (committed with it); NULL without the
    -- layer (IDEMPOTENCY=off).
    idempotency_key text,
    order_id        bigint      NOT NULL,
    amount_cents    bigint      NOT NULL,
    -- NULL while the payment is pending (recorded, the provider not yet called back).
    charge_id       text,
    status          text        NOT NULL DEFAULT 'charged',
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- Tables made before payments had phases.
ALTER TABLE example_payments ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'charged';
ALTER TABLE example_payments ALTER COLUMN charge_id DROP NOT NULL;

CREATE INDEX IF NOT EXISTS example_payments_order ON example_payments (tenant, order_id);

CREATE TABLE IF NOT EXISTS example_orders (
    tenant           text        NOT NULL,
    order_id         bigint      NOT NULL,
    shipping_address text,
    updated_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, order_id)
);

CREATE TABLE IF NOT EXISTS example_webhook_events (
    id          bigserial   PRIMARY KEY,
    -- The webhook-id; NULL without the layer (IDEMPOTENCY=off).
    event_id    text        UNIQUE,
    payload     jsonb       NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);
";

/// An order with its payments, read in a transaction: a request's (which sees the request's
/// own writes), or one of its own ([`Db::order`]).
pub(crate) async fn select_order(
    conn: &mut PgConnection,
    tenant: &str,
    order_id: i64,
) -> Result<Order, sqlx::Error> {
    // SUM of bigints is a numeric, which never overflows; read as text, as sqlx decodes
    // numerics only with features this example does not use.
    let (total_cents, payments, shipping_address): (String, i64, Option<String>) = sqlx::query_as(
        "SELECT COALESCE(SUM(p.amount_cents), 0)::text,
                COUNT(p.id),
                (SELECT o.shipping_address FROM example_orders o
                  WHERE o.tenant = $1 AND o.order_id = $2)
           FROM example_payments p
          WHERE p.tenant = $1 AND p.order_id = $2 AND p.status = 'charged'",
    )
    .bind(tenant)
    .bind(order_id)
    .persistent(false)
    .fetch_one(conn)
    .await?;
    let total_cents = total_cents
        .parse()
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    Ok(Order {
        order_id,
        total_cents,
        payments,
        shipping_address,
    })
}

/// The number of rows in `table`, in one simple-protocol statement (no parameters, nothing
/// prepared: safe through a transaction-mode pooler; see `Storage`).
pub(crate) async fn count_rows(pool: &PgPool, table: &'static str) -> Result<i64, sqlx::Error> {
    let row = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(pool)
        .await?;
    row.try_get(0)
}

impl Db {
    /// Where a request's writes go. In Postgres: the layer's transaction when there is one,
    /// so that the writes commit with the key; without the layer (`IDEMPOTENCY=off`), a
    /// transaction of the request's own.
    pub(crate) async fn writer(
        &self,
        layer_tx: Option<Extension<IdempotentTx>>,
    ) -> Result<Writer, ApiError> {
        Ok(match (self, layer_tx) {
            (Self::Memory(memory), _) => Writer::Memory(memory.clone()),
            (Self::Postgres(_), Some(Extension(tx))) => Writer::Postgres(PgTx::Layer(tx)),
            (Self::Postgres(pool), None) => Writer::Postgres(PgTx::Own(pool.begin().await?)),
        })
    }

    /// Where a phased request's writes go: in Postgres, the last phase's transaction, which
    /// the layer commits with the answer; else as [`writer`](Self::writer).
    pub(crate) async fn last_phase_writer(
        &self,
        phases: Option<Extension<Phases>>,
    ) -> Result<Writer, ApiError> {
        match (self, phases) {
            (Self::Postgres(_), Some(Extension(phases))) => {
                Ok(Writer::Postgres(PgTx::LastPhase(phases)))
            }
            _ => self.writer(None).await,
        }
    }

    /// The number of charges the provider made.
    pub(crate) async fn charge_count(&self) -> Result<i64, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| m.charges)),
            Self::Postgres(pool) => count_rows(pool, "example_provider_charges").await,
        }
    }

    /// An order of a tenant; empty when never seen.
    pub(crate) async fn order(&self, tenant: &str, order_id: i64) -> Result<Order, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| m.order(tenant, order_id))),
            Self::Postgres(pool) => {
                // A statement with parameters outside a transaction is two exchanges with the
                // server, which a pooler may send to two server connections: read in a
                // transaction of its own (see `Storage`).
                let mut tx = pool.begin().await?;
                let order = select_order(&mut tx, tenant, order_id).await?;
                tx.commit().await?;
                Ok(order)
            }
        }
    }

    /// The number of webhook events applied.
    pub(crate) async fn webhooks_processed(&self) -> Result<i64, sqlx::Error> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| {
                // A count of events held in memory always fits an i64.
                i64::try_from(m.webhook_ids.len())
                    .unwrap_or(i64::MAX)
                    .saturating_add(m.webhooks_without_id)
            })),
            Self::Postgres(pool) => count_rows(pool, "example_webhook_events").await,
        }
    }
}

/// Where one request's writes go ([`Db::writer`]). Nothing needs deduplicating here: in
/// Postgres the writes commit with the request's key (a retry replays, or finds that neither
/// was committed); in memory the data and the keys live and die together, and a handler's
/// write is its last step that can fail.
pub(crate) enum Writer {
    Memory(Arc<Mutex<MemoryDb>>),
    Postgres(PgTx),
}

/// A request's Postgres transaction.
pub(crate) enum PgTx {
    /// The layer's: the layer commits it once it stored the answer (a handler never does),
    /// or rolls it back on a `5xx`, an error, a panic or a dropped request.
    Layer(IdempotentTx),
    /// The last phase of a phased request: opened at the first statement, committed by the
    /// layer with the answer.
    LastPhase(Phases),
    /// The request's own (`IDEMPOTENCY=off`), committed by [`Writer::commit`].
    Own(Transaction<'static, Postgres>),
}

impl PgTx {
    /// The transaction's connection, for a statement or a few.
    pub(crate) async fn conn(&mut self) -> Result<Conn<'_>, ApiError> {
        match self {
            Self::Layer(tx) => tx.conn().await.map(Conn::Layer).map_err(|e| {
                // Only a handler that outlived its request could see this.
                tracing::error!(error = &e as &dyn std::error::Error, "no transaction");
                ApiError::internal("the request's transaction has ended")
            }),
            Self::LastPhase(phases) => phases.tx().await.map(Conn::Layer).map_err(phase_error),
            Self::Own(tx) => Ok(Conn::Own(tx)),
        }
    }
}

/// A connection inside a [`PgTx`]; `&mut *conn` is a sqlx executor.
pub(crate) enum Conn<'a> {
    Layer(TxConn<'a>),
    Own(&'a mut PgConnection),
}

impl Deref for Conn<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Self::Layer(conn) => conn,
            Self::Own(conn) => conn,
        }
    }
}

impl DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Self::Layer(conn) => conn,
            Self::Own(conn) => conn,
        }
    }
}

impl Writer {
    /// The provider makes a charge.
    pub(crate) async fn create_charge(
        &mut self,
        tenant: &str,
        amount_cents: i64,
    ) -> Result<Charge, ApiError> {
        let id: i64 = match self {
            Self::Memory(memory) => with_memory(memory, |m| {
                m.charges += 1;
                m.charges
            }),
            Self::Postgres(tx) => {
                sqlx::query_scalar(
                    "INSERT INTO example_provider_charges (tenant, amount_cents)
                     VALUES ($1, $2) RETURNING id",
                )
                .bind(tenant)
                .bind(amount_cents)
                .persistent(false)
                .fetch_one(&mut *tx.conn().await?)
                .await?
            }
        };
        Ok(Charge {
            charge_id: format!("ch_{id}"),
            amount_cents,
        })
    }

    /// Records a payment made with `key` (`None` without the layer).
    pub(crate) async fn record_payment(
        &mut self,
        tenant: &str,
        key: Option<&str>,
        order_id: i64,
        amount_cents: i64,
        charge_id: &str,
    ) -> Result<Payment, ApiError> {
        let id: i64 = match self {
            Self::Memory(memory) => with_memory(memory, |m| {
                let order = m.orders.entry((tenant.to_owned(), order_id)).or_default();
                // Cannot fail (see `Order::total_cents`); checked all the same, so that a
                // total is never capped or wrapped silently.
                order.total_cents = order
                    .total_cents
                    .checked_add(i128::from(amount_cents))
                    .ok_or_else(|| ApiError::internal("the order's total is out of range"))?;
                order.payments += 1;
                m.payments += 1;
                Ok::<_, ApiError>(m.payments)
            })?,
            Self::Postgres(tx) => {
                sqlx::query_scalar(
                    "INSERT INTO example_payments
                         (tenant, idempotency_key, order_id, amount_cents, charge_id)
                     VALUES ($1, $2, $3, $4, $5)
                     RETURNING id",
                )
                .bind(tenant)
                .bind(key)
                .bind(order_id)
                .bind(amount_cents)
                .bind(charge_id)
                .persistent(false)
                .fetch_one(&mut *tx.conn().await?)
                .await?
            }
        };
        Ok(Payment {
            payment_id: format!("pay_{id}"),
            order_id,
            amount_cents,
            charge_id: charge_id.to_owned(),
        })
    }

    /// Sets an order's shipping address, creating the order if needed, and reads it back.
    pub(crate) async fn set_shipping_address(
        &mut self,
        tenant: &str,
        order_id: i64,
        address: &str,
    ) -> Result<Order, ApiError> {
        match self {
            Self::Memory(memory) => Ok(with_memory(memory, |m| {
                let order = m.orders.entry((tenant.to_owned(), order_id)).or_default();
                order.shipping_address = Some(address.to_owned());
                m.order(tenant, order_id)
            })),
            Self::Postgres(tx) => {
                let mut conn = tx.conn().await?;
                sqlx::query(
                    "INSERT INTO example_orders (tenant, order_id, shipping_address)
                     VALUES ($1, $2, $3)
                     ON CONFLICT (tenant, order_id)
                     DO UPDATE SET shipping_address = EXCLUDED.shipping_address,
                                   updated_at = now()",
                )
                .bind(tenant)
                .bind(order_id)
                .bind(address)
                .persistent(false)
                .execute(&mut *conn)
                .await?;
                // Through the transaction: it sees the new address, and it takes no second
                // connection from the pool.
                Ok(select_order(&mut conn, tenant, order_id).await?)
            }
        }
    }

    /// Applies a webhook event once per event id (`None`: always).
    pub(crate) async fn record_webhook(
        &mut self,
        event_id: Option<&str>,
        payload: &str,
    ) -> Result<(), ApiError> {
        match self {
            Self::Memory(memory) => with_memory(memory, |m| match event_id {
                Some(id) => {
                    m.webhook_ids.insert(id.to_owned());
                }
                None => m.webhooks_without_id += 1,
            }),
            Self::Postgres(tx) => {
                sqlx::query(
                    "INSERT INTO example_webhook_events (event_id, payload)
                     VALUES ($1, $2::jsonb)
                     ON CONFLICT (event_id) DO NOTHING",
                )
                .bind(event_id)
                .bind(payload)
                .persistent(false)
                .execute(&mut *tx.conn().await?)
                .await?;
            }
        }
        Ok(())
    }

    /// Commits a transaction of the request's own. The layer's transaction is left to the
    /// layer, which commits it after it stored the answer.
    pub(crate) async fn commit(self) -> Result<(), ApiError> {
        if let Self::Postgres(PgTx::Own(tx)) = self {
            tx.commit().await?;
        }
        Ok(())
    }
}
