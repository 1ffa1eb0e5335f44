//! A NATS JetStream consumer that applies each charge message exactly once, in order per
//! account, with the inbox's [`Consumer`].
//!
//! JetStream delivers at least once: a message whose acknowledgement is lost (a crash after
//! the commit, a dropped connection) is delivered again after the consumer's ack wait. For
//! each delivery this consumer claims the message's ID with a lease (committed at once), does
//! the slow part of the work with no transaction open, and then applies the charge, records
//! the ID and moves the account's position in **one Postgres transaction**; it acknowledges
//! **after** that commit. A redelivery finds the ID and is acknowledged without being applied.
//!
//! ```sh
//! cargo run --example jetstream
//! ```
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `NATS_URL` | `nats://127.0.0.1:4222` | the server |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | the ledger and the inbox |
//! | `STREAM` | `CHARGES` | the stream (created if missing, subjects `<stream lowercase>.>`, file storage) |
//! | `CONSUMER` | `charges-consumer` | the durable pull consumer (explicit ack), and the inbox's consumer name |
//! | `MAX_DELIVER` | `5` | a message whose work failed this many times is parked (kept with its reason, acknowledged, never applied) |
//! | `ACK_WAIT_MS` | `30000` | JetStream's ack wait, and the inbox's lease: both kept alive while a message's work runs |
//! | `WORK_DELAY_MS` | `0` | each new message's work sleeps this long |
//! | `LOSE_ACKS` | `0` | after committing each of the first N new messages, skip the ack as a crash would |
//! | `HTTP_BIND` | `127.0.0.1:3001` | `GET /accounts/{account}` and `GET /metrics` |
//! | `EXIT_WHEN_IDLE_MS` | unset | exit once no message arrived for this long |
//!
//! Messages: subject `<stream lowercase>.<account>`, header `Nats-Msg-Id` (the same on every
//! retry of one logical message), JSON `{"account": "<id>", "amount_cents": <int>,
//! "sequence": <int>}` with the producer's per-account sequence. One line per delivery:
//! `processed <id>`, `duplicate <id>`, `stale <id>`, `parked <id>: <why>`,
//! `rejected <id>: <why>` (`-` for a message without an ID) or `failed <id>: <why>`.
//!
//! **Order.** The consumer lets JetStream hand out one unacknowledged message at a time
//! (`max_ack_pending = 1`), to this process or another on the same durable, so each
//! account's messages are applied in the order they were published, across crashes,
//! redeliveries and processes; the account's position, moved in the work's transaction, makes
//! a message at or below it `stale`. (For more throughput, split the accounts over several
//! durables by subject, each one in order.)
//!
//! **Parking.** Every failed attempt is counted in the database; the one that reaches
//! `MAX_DELIVER` parks the message. JetStream's own `max_deliver` is left unlimited, since a
//! message it stops delivering is dropped without a trace. A failure of the ledger's statement
//! that says nothing about the message (a serialization failure, a deadlock, a connection cut
//! by a failover) is not counted: the work's error keeps the `sqlx::Error` as its source, where
//! the consumer looks for it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, consumer::pull, stream::StorageType};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use futures_util::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::Deserialize;
use serde_json::json;
use sqlx::{PgConnection, PgPool};
use tokio::signal::unix::{SignalKind, signal};
use tower_idempotency::inbox::{Consumer, Inbox, Message, Outcome, Settle};

/// The largest charge the example's provider accepts; above it the work fails every time.
const MAX_AMOUNT_CENTS: i64 = 1_000_000_000;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Charge {
    account: String,
    amount_cents: i64,
    sequence: i64,
}

struct Config {
    nats_url: String,
    database_url: String,
    stream: String,
    consumer: String,
    max_deliver: u32,
    ack_wait: Duration,
    work_delay: Duration,
    lose_acks: u32,
    http_bind: SocketAddr,
    exit_when_idle: Option<Duration>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn config() -> Result<Config, Error> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    fn parse<T: std::str::FromStr>(name: &str, value: &str) -> Result<T, Error>
    where
        T::Err: std::fmt::Display,
    {
        value
            .parse()
            .map_err(|e| format!("{name}={value:?}: {e}").into())
    }
    let millis = |name: &str, default: &str| -> Result<Duration, Error> {
        Ok(Duration::from_millis(parse(name, &var(name, default))?))
    };
    let stream = var("STREAM", "CHARGES");
    if stream.is_empty()
        || !stream
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!("STREAM={stream:?}: letters, digits, '_' and '-' only").into());
    }
    let max_deliver: u32 = parse("MAX_DELIVER", &var("MAX_DELIVER", "5"))?;
    if max_deliver == 0 {
        return Err("MAX_DELIVER=0: at least one attempt".into());
    }
    let ack_wait = millis("ACK_WAIT_MS", "30000")?;
    if ack_wait < Duration::from_millis(10) {
        return Err("ACK_WAIT_MS: at least 10".into());
    }
    let exit_when_idle = match std::env::var("EXIT_WHEN_IDLE_MS") {
        Ok(v) => Some(Duration::from_millis(parse("EXIT_WHEN_IDLE_MS", &v)?)),
        Err(_) => None,
    };
    Ok(Config {
        nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
        database_url: var(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        stream,
        consumer: var("CONSUMER", "charges-consumer"),
        max_deliver,
        ack_wait,
        work_delay: millis("WORK_DELAY_MS", "0")?,
        lose_acks: parse("LOSE_ACKS", &var("LOSE_ACKS", "0"))?,
        http_bind: parse("HTTP_BIND", &var("HTTP_BIND", "127.0.0.1:3001"))?,
        exit_when_idle,
    })
}

/// The ledger: one row per consumer and account.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS example_jetstream_accounts (
    consumer      text   NOT NULL,
    account       text   NOT NULL,
    balance_cents bigint NOT NULL,
    charges       bigint NOT NULL,
    PRIMARY KEY (consumer, account)
)";

#[derive(Clone)]
struct App {
    consumer: Consumer,
    pool: PgPool,
    metrics: PrometheusHandle,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run().await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Error> {
    let config = config()?;
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let pool = PgPool::connect(&config.database_url).await?;
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    sqlx::raw_sql(SCHEMA).execute(&pool).await?;
    let consumer = Consumer::new(inbox, config.consumer.clone())?
        .with_lease(config.ack_wait)?
        .with_max_failures(config.max_deliver)?
        .with_retry_backoff(Duration::from_millis(100), Duration::from_secs(5))
        .with_messaging_system("nats");

    let nats = async_nats::connect(&config.nats_url).await?;
    let js = jetstream::new(nats);
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: config.stream.clone(),
            subjects: vec![format!("{}.>", config.stream.to_lowercase())],
            storage: StorageType::File,
            // The stream's own deduplication by `Nats-Msg-Id` is kept to the shortest window
            // the server accepts (100 ms), so that a republished message reaches the consumer
            // and what this example shows is the inbox's deduplication: it holds the IDs for
            // as long as it is told to, where the stream's default two minutes would hide a
            // republish within them and miss one after.
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await?;
    let durable = stream
        .create_consumer(pull::Config {
            durable_name: Some(config.consumer.clone()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: config.ack_wait,
            max_deliver: -1,
            max_ack_pending: 1,
            ..Default::default()
        })
        .await?;
    let mut messages = durable.messages().await?;

    let app = App {
        consumer,
        pool,
        metrics,
    };
    let listener = tokio::net::TcpListener::bind(config.http_bind).await?;
    let addr = listener.local_addr()?;
    let routes = Router::new()
        .route("/accounts/{account}", get(account))
        .route("/metrics", get(render_metrics))
        .with_state(app.clone());
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, routes).await {
            eprintln!("error: the HTTP server stopped: {e}");
        }
    });
    println!("listening on http://{addr}");

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let lost_acks = AtomicU32::new(0);
    let idle = config.exit_when_idle.unwrap_or(Duration::MAX);
    loop {
        let next = tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            next = tokio::time::timeout(idle, messages.next()) => next,
        };
        let message = match next {
            Err(_) => break,
            Ok(None) => return Err("the consumer's message stream ended".into()),
            Ok(Some(Err(e))) => {
                tracing::warn!(error = %e, "could not receive from JetStream");
                continue;
            }
            Ok(Some(Ok(message))) => message,
        };
        handle(&app, &config, &lost_acks, message).await;
    }
    Ok(())
}

/// Takes one delivery through the inbox and settles it with JetStream after the commit.
async fn handle(app: &App, config: &Config, lost_acks: &AtomicU32, message: jetstream::Message) {
    let id = message
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Msg-Id"))
        .map(|v| v.as_str().to_owned());
    let redelivered = message.info().is_ok_and(|info| info.delivered > 1);
    let payload = message.payload.clone();
    let subject = message.subject.to_string();
    let (message, acker) = message.split();
    let acker = Arc::new(acker);
    // In-progress acks keep JetStream from redelivering while the work runs, as the inbox's
    // renewals keep its lease.
    let keep_alive = {
        let acker = acker.clone();
        let every = config.ack_wait / 3;
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = acker.ack_with(AckKind::Progress).await {
                    tracing::warn!(error = %e, "could not send an in-progress ack");
                }
            }
        })
    };
    drop(message);

    let delivery = Message::new(id.as_deref())
        .payload(&payload)
        .redelivered(redelivered)
        .destination(&subject);
    let outcome = match serde_json::from_slice::<Charge>(&payload) {
        Err(e) => app
            .consumer
            .reject(&delivery, format!("the body is not a charge: {e}")),
        Ok(charge) => match check(&charge) {
            Err(why) => app.consumer.reject(&delivery, why),
            Ok(()) => {
                let delivery = delivery.ordered(&charge.account, charge.sequence);
                apply(app, config, &delivery, &charge).await
            }
        },
    };
    keep_alive.abort();

    let id = id.as_deref().unwrap_or("-");
    match &outcome {
        Outcome::Processed(()) => println!("processed {id}"),
        Outcome::Duplicate => println!("duplicate {id}"),
        Outcome::Stale => println!("stale {id}"),
        Outcome::Parked { reason, .. } => println!("parked {id}: {reason}"),
        Outcome::Rejected { reason } => println!("rejected {id}: {reason}"),
        Outcome::Failed { reason, .. } => println!("failed {id}: {reason}"),
        Outcome::InProgress { retry_after } => {
            println!("failed {id}: another worker holds its lease for {retry_after:?}");
        }
    }
    if matches!(outcome, Outcome::Processed(()))
        && lost_acks.load(Ordering::Relaxed) < config.lose_acks
    {
        // As a crash after the commit would: JetStream redelivers it after the ack wait.
        lost_acks.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let settled = match outcome.settle() {
        Settle::Ack => acker.ack().await,
        Settle::Retry(after) => acker.ack_with(AckKind::Nak(Some(after))).await,
        Settle::Reject => acker.ack_with(AckKind::Term).await,
    };
    if let Err(e) = settled {
        // Lost: JetStream delivers the message again, and the inbox settles it again.
        tracing::warn!(error = %e, "could not settle a message with JetStream");
    }
}

/// The ledger's statement failed. Its source is the database's error, so that the consumer can
/// tell a transient failure (not counted toward `MAX_DELIVER`) from one of the charge's own.
#[derive(Debug)]
struct LedgerRefused(sqlx::Error);

impl std::fmt::Display for LedgerRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the ledger refused the charge: {}", self.0)
    }
}

impl std::error::Error for LedgerRefused {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// What the example refuses in a charge that parses.
fn check(charge: &Charge) -> Result<(), String> {
    if charge.account.is_empty() || charge.account.len() > 200 {
        return Err("account: 1 to 200 bytes".into());
    }
    if charge.amount_cents < 1 {
        return Err("amount_cents: at least 1".into());
    }
    if charge.sequence < 1 {
        return Err("sequence: at least 1".into());
    }
    Ok(())
}

/// The charge's work: the provider's part (slow, no transaction open), then the ledger's,
/// committed with the message's ID and the account's position.
async fn apply(app: &App, config: &Config, delivery: &Message<'_>, charge: &Charge) -> Outcome<()> {
    let delay = config.work_delay;
    let amount = charge.amount_cents;
    let provider = async || {
        tokio::time::sleep(delay).await;
        if amount > MAX_AMOUNT_CENTS {
            return Err(Error::from(format!(
                "the provider refuses charges above {MAX_AMOUNT_CENTS} cents"
            )));
        }
        Ok(())
    };
    let consumer = app.consumer.name();
    let ledger = async |tx: &mut PgConnection, (): ()| {
        sqlx::query(
            "INSERT INTO example_jetstream_accounts AS a (consumer, account, balance_cents, charges)
             VALUES ($1, $2, $3, 1)
             ON CONFLICT (consumer, account) DO UPDATE
                SET balance_cents = a.balance_cents + EXCLUDED.balance_cents,
                    charges = a.charges + 1",
        )
        .bind(consumer)
        .bind(&charge.account)
        .bind(amount)
        // Unnamed: behind a pooler in transaction mode a statement prepared by name on one
        // server connection is not there on the next.
        .persistent(false)
        .execute(tx)
        .await
        .map(drop)
        .map_err(|e| Error::from(LedgerRefused(e)))
    };
    app.consumer.deliver(delivery, provider, ledger).await
}

/// `GET /accounts/{account}`: the account's balance, charges and last applied sequence (all
/// zero for an account never charged).
async fn account(State(app): State<App>, Path(account): Path<String>) -> impl IntoResponse {
    let row: Result<Option<(i64, i64)>, _> = sqlx::query_as(
        "SELECT balance_cents, charges FROM example_jetstream_accounts
          WHERE consumer = $1 AND account = $2",
    )
    .bind(app.consumer.name())
    .bind(&account)
    .persistent(false)
    .fetch_optional(&app.pool)
    .await;
    let position = app.consumer.position(&account).await;
    match (row, position) {
        (Ok(row), Ok(position)) => {
            let (balance_cents, charges) = row.unwrap_or((0, 0));
            let body = json!({
                "account": account,
                "balance_cents": balance_cents,
                "charges": charges,
                "last_sequence": position.unwrap_or(0),
            });
            (StatusCode::OK, Json(body)).into_response()
        }
        (Err(e), _) => unavailable(&e),
        (_, Err(e)) => unavailable(&e),
    }
}

fn unavailable(e: &dyn std::fmt::Display) -> axum::response::Response {
    let body = json!({"error": format!("the database is unavailable: {e}")});
    (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
}

/// `GET /metrics`: the counters in Prometheus's text format.
async fn render_metrics(State(app): State<App>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}
