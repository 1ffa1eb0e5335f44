//! A RabbitMQ consumer that applies each charge message exactly once, with the inbox.
//!
//! RabbitMQ delivers at least once: a message whose acknowledgement is lost (the consumer
//! crashed after its work committed, the channel dropped) is delivered again. This consumer
//! records each message's ID and applies its charge **in one Postgres transaction**
//! ([`Inbox::process`]), and acknowledges **after** the commit. A redelivery then finds the
//! ID and is acknowledged without being applied again.
//!
//! ```sh
//! cargo run --example consumer
//! ```
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` | the broker |
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` | where the ledger and the inbox live |
//! | `QUEUE` | `charges` | the queue to consume (declared durable) |
//! | `LOSE_ACKS` | `0` | for demonstrations and tests: after committing each of the first N new messages, close the channel instead of acknowledging, as a crash would; RabbitMQ redelivers them |
//! | `EXIT_WHEN_IDLE_MS` | unset | exit once no message arrived for this long |
//!
//! Messages are JSON `{"account": "<id>", "amount_cents": <int>}` with the AMQP `message_id`
//! property set by the producer (the same ID on every retry of one logical message). The
//! consumer prints one line per delivery: `processed <id>`, `duplicate <id>` or
//! `rejected <id>: <why>`. A delivery whose work failed is requeued after a pause that grows
//! with its failures, and rejected for good after five failures of its own work (the
//! database's passing failures are not counted).

use std::future::poll_fn;
use std::pin::Pin;
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties, Consumer};
use serde::Deserialize;
use sqlx::PgConnection;
use tower_idempotency::inbox::{Delivery, Inbox, InboxError};

/// How many times a message's own work may fail before it is rejected for good.
const MAX_ATTEMPTS: u32 = 5;

/// The consumer group's name in the inbox: the same ID may be processed once per group.
const CONSUMER: &str = "charges-consumer";

#[derive(Deserialize)]
struct Charge {
    account: String,
    amount_cents: i64,
}

struct Config {
    amqp_url: String,
    database_url: String,
    queue: String,
    lose_acks: u32,
    exit_when_idle: Option<Duration>,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

fn config() -> Result<Config, Error> {
    let var = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let lose_acks = var("LOSE_ACKS", "0")
        .parse()
        .map_err(|e| format!("LOSE_ACKS: {e}"))?;
    let exit_when_idle = match std::env::var("EXIT_WHEN_IDLE_MS") {
        Ok(v) => Some(Duration::from_millis(
            v.parse().map_err(|e| format!("EXIT_WHEN_IDLE_MS: {e}"))?,
        )),
        Err(_) => None,
    };
    Ok(Config {
        amqp_url: var("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f"),
        database_url: var(
            "DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/postgres",
        ),
        queue: var("QUEUE", "charges"),
        lose_acks,
        exit_when_idle,
    })
}

async fn open_channel(conn: &Connection, queue: &str) -> Result<(Channel, Consumer), Error> {
    let channel = conn.create_channel().await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    // A small window of unacknowledged messages; all of them come back if the channel drops.
    channel.basic_qos(16, BasicQosOptions::default()).await?;
    let consumer = channel
        .basic_consume(
            queue.into(),
            CONSUMER.into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((channel, consumer))
}

/// Applies one charge, on the inbox's transaction.
async fn apply(conn: &mut PgConnection, id: &str, charge: &Charge) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO example_ledger (message_id, account, amount_cents) VALUES ($1, $2, $3)",
    )
    .bind(id)
    .bind(&charge.account)
    .bind(charge.amount_cents)
    // Unprepared: a statement prepared under a name would stay behind on the server
    // connection, which a transaction-mode pooler hands to other clients.
    .persistent(false)
    .execute(conn)
    .await?;
    Ok(())
}

#[tokio::main]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("consumer: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Error> {
    let config = config()?;
    let pool = sqlx::PgPool::connect(&config.database_url).await?;
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    // No unique constraint on message_id: the inbox alone must keep charges single.
    // (Simple query protocol: nothing prepared, safe through a transaction-mode pooler.)
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS example_ledger (
             id bigserial PRIMARY KEY,
             message_id text NOT NULL,
             account text NOT NULL,
             amount_cents bigint NOT NULL
         )",
    )
    .execute(&pool)
    .await?;

    let conn = Connection::connect(&config.amqp_url, ConnectionProperties::default()).await?;
    let (mut channel, mut consumer) = open_channel(&conn, &config.queue).await?;
    println!("consuming {}", config.queue);
    let mut acks_to_lose = config.lose_acks;
    // Failed attempts of the messages that failed and have not succeeded since.
    let mut failures: std::collections::HashMap<String, u32> = std::collections::HashMap::new();

    loop {
        let next = poll_fn(|cx| Pin::new(&mut consumer).poll_next(cx));
        let next = match config.exit_when_idle {
            Some(idle) => match tokio::time::timeout(idle, next).await {
                Ok(next) => next,
                Err(_) => break,
            },
            None => next.await,
        };
        let delivery = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e.into()),
            None => return Err("the broker cancelled the consumer".into()),
        };
        let Some(id) = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
        else {
            // Without an ID there is no way to deduplicate: park it for a human.
            println!("rejected <none>: no message_id");
            delivery
                .reject(BasicRejectOptions { requeue: false })
                .await?;
            continue;
        };
        let charge: Charge = match serde_json::from_slice(&delivery.data) {
            Ok(c) => c,
            Err(e) => {
                println!("rejected {id}: {e}");
                delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
                continue;
            }
        };

        match inbox
            .process(CONSUMER, &id, async |conn: &mut PgConnection| {
                apply(conn, &id, &charge).await
            })
            .await
        {
            Ok(Delivery::Processed(())) => {
                failures.remove(&id);
                println!("processed {id}");
                if acks_to_lose > 0 {
                    // Committed, but the acknowledgement never reaches RabbitMQ: what a crash
                    // right here does. Every unacknowledged delivery of the channel is requeued.
                    acks_to_lose -= 1;
                    channel
                        .close(200, "simulated lost acknowledgement".into())
                        .await?;
                    (channel, consumer) = open_channel(&conn, &config.queue).await?;
                    continue;
                }
            }
            Ok(Delivery::Duplicate) => println!("duplicate {id}"),
            Err(InboxError::InvalidMessageId) => {
                println!("rejected {id}: invalid message id");
                delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
                continue;
            }
            // Nothing was committed: requeue, RabbitMQ delivers it again, after a pause that
            // grows with the message's failures (a requeued message comes straight back). A
            // message whose own work keeps failing is poison: after a few attempts it is
            // rejected for good (to the queue's dead-letter exchange, if it has one). The
            // database's passing failures (a deadlock, a failover) are never counted.
            Err(e) => {
                let transient = tower_idempotency::inbox::is_transient_database_error(&e);
                let attempts = failures.entry(id.clone()).or_insert(0);
                if !transient {
                    *attempts += 1;
                }
                if *attempts >= MAX_ATTEMPTS {
                    println!("rejected {id}: {e} (failed {MAX_ATTEMPTS} times)");
                    failures.remove(&id);
                    delivery
                        .reject(BasicRejectOptions { requeue: false })
                        .await?;
                    continue;
                }
                let pause = Duration::from_millis(100 << (*attempts).min(5));
                eprintln!("consumer: {id}: {e}; requeued in {pause:?}");
                tokio::time::sleep(pause).await;
                delivery
                    .reject(BasicRejectOptions { requeue: true })
                    .await?;
                continue;
            }
        }
        // The acknowledgement goes last, after the commit.
        delivery.ack(BasicAckOptions::default()).await?;
    }
    conn.close(200, "idle".into()).await?;
    Ok(())
}
