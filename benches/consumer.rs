//! A message consumer's throughput with the inbox against without it, on Postgres (no broker:
//! what each way adds to the consumer's own database work).
//!
//! ```text
//! cargo bench --bench consumer -- [--messages 4000] [--rounds 3] [--workers 8]
//! ```
//!
//! Each message charges one of 100 accounts: an `UPDATE` of the account's balance and an
//! `INSERT` into a ledger, the work's two statements. `--workers` tasks consume at once, each
//! owning its own accounts (as a broker's partitions would assign them), with a pool of as
//! many connections. The ways, in rounds whose order rotates (so every way is measured through
//! the same windows of a noisy machine), `--messages` new messages per way and round:
//!
//! - `none`: the work alone in a transaction: no ID recorded, a redelivery applied again;
//! - `id-by-hand`: the least an ID can cost: one prepared `INSERT … ON CONFLICT DO NOTHING`
//!   of it in the work's transaction, nothing else (no lock bound, no check that the work
//!   left the transaction usable);
//! - `id-checked`: `id-by-hand` and the check before the commit that `Inbox::process` makes
//!   (an `EXISTS` on the ID: that the work left the transaction usable);
//! - `id-function`: `id-by-hand` with the ID inserted through the function `Inbox::process`
//!   calls (`tower_idempotency_record_message`, with its lock bound) instead;
//! - `process`: `Inbox::process`, the ID inserted in the work's transaction (one commit);
//! - `in-order`: `Inbox::process_in_order`, the account's position moved in the work's
//!   transaction instead of an ID (one commit, one row per account);
//! - `consumer-process`: `Consumer::process`, ordered: the ID and the account's position moved
//!   in the work's transaction, failures counted (one commit);
//! - `deliver`: `Consumer::deliver`, unordered: the ID claimed with a lease and committed,
//!   then the work committed with it (two commits: the lease that lets remote work run with
//!   no transaction open);
//! - `deliver-ordered`: the same with the account's position.
//!
//! Printed: each way's messages per second in each round, the median over the rounds, and its
//! ratio to `none` (medians of the per-round ratios). Run without `--bench` (as
//! `cargo test --all-targets` does), it makes a smoke run of a few messages. `DATABASE_URL`
//! selects the server (default the local one). The bench's schema is dropped at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};
use tower_idempotency::inbox::{Consumer, Inbox, Message, Outcome};

const WAYS: [&str; 9] = [
    "none",
    "id-by-hand",
    "id-checked",
    "id-function",
    "process",
    "in-order",
    "consumer-process",
    "deliver",
    "deliver-ordered",
];
const ACCOUNTS: usize = 100;

struct Args {
    messages: usize,
    rounds: usize,
    workers: usize,
}

fn parse_args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let bench = argv.iter().any(|a| a == "--bench");
    let get = |name: &str, default: usize| {
        argv.iter()
            .position(|a| a == name)
            .and_then(|i| argv.get(i + 1))
            .map_or(default, |v| v.parse().unwrap())
    };
    if bench {
        Args {
            messages: get("--messages", 4000),
            rounds: get("--rounds", 3),
            workers: get("--workers", 8),
        }
    } else {
        Args {
            messages: 40,
            rounds: 1,
            workers: 2,
        }
    }
}

async fn work(conn: &mut PgConnection, account: &str, amount: i64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE bench_accounts SET balance = balance + $1 WHERE account = $2")
        .bind(amount)
        .bind(account)
        .execute(&mut *conn)
        .await?;
    sqlx::query("INSERT INTO bench_ledger (account, amount) VALUES ($1, $2)")
        .bind(account)
        .bind(amount)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Consumes one message `n` of `account` at `position` the way `way` says.
async fn consume(
    way: &str,
    pool: &PgPool,
    consumer: &Consumer,
    id: &str,
    account: &str,
    position: i64,
) {
    let inbox = consumer.inbox();
    match way {
        "none" => {
            let mut tx = pool.begin().await.unwrap();
            work(&mut tx, account, 1).await.unwrap();
            tx.commit().await.unwrap();
        }
        "id-by-hand" | "id-checked" | "id-function" => {
            let mut tx = pool.begin().await.unwrap();
            if way == "id-function" {
                sqlx::query("SELECT tower_idempotency_record_message($1, $2, 5000)")
                    .bind(consumer.name())
                    .bind(id)
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            } else {
                sqlx::query(
                    "INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
                     VALUES ($1, $2) ON CONFLICT DO NOTHING",
                )
                .bind(consumer.name())
                .bind(id)
                .execute(&mut *tx)
                .await
                .unwrap();
            }
            work(&mut tx, account, 1).await.unwrap();
            if way == "id-checked" {
                // As the inbox sends it: over the simple protocol, the values written in.
                let check = format!(
                    "SELECT EXISTS (SELECT 1 FROM tower_idempotency_processed_messages
                                     WHERE consumer = '{}' AND message_id = '{id}')",
                    consumer.name()
                );
                let row = sqlx::raw_sql(AssertSqlSafe(check))
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                assert!(sqlx::Row::get::<bool, _>(&row, 0));
            }
            tx.commit().await.unwrap();
        }
        "process" => {
            let _ = inbox
                .process(consumer.name(), id, async |c: &mut PgConnection| {
                    work(c, account, 1).await
                })
                .await
                .unwrap();
        }
        "in-order" => {
            let _ = inbox
                .process_in_order(
                    consumer.name(),
                    account,
                    position,
                    async |c: &mut PgConnection| work(c, account, 1).await,
                )
                .await
                .unwrap();
        }
        "consumer-process" => {
            let message = Message::new(Some(id)).ordered(account, position);
            let outcome = consumer
                .process(&message, async |c: &mut PgConnection| {
                    work(c, account, 1).await
                })
                .await;
            assert!(matches!(outcome, Outcome::Processed(())), "{outcome:?}");
        }
        _ => {
            let mut message = Message::new(Some(id));
            if way == "deliver-ordered" {
                message = message.ordered(account, position);
            }
            let outcome = consumer
                .deliver(
                    &message,
                    async || Ok::<_, sqlx::Error>(()),
                    async |c: &mut PgConnection, ()| work(c, account, 1).await,
                )
                .await;
            assert!(matches!(outcome, Outcome::Processed(())), "{outcome:?}");
        }
    }
}

/// One way's round: `messages` new messages by `workers` tasks; messages per second.
async fn round(
    way: &'static str,
    pool: &PgPool,
    consumer: &Consumer,
    args: &Args,
    round: usize,
    positions: &Arc<Vec<AtomicI64>>,
) -> f64 {
    let per_worker = args.messages / args.workers;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let (pool, consumer, positions) = (pool.clone(), consumer.clone(), positions.clone());
        let workers = args.workers;
        tasks.push(tokio::spawn(async move {
            for i in 0..per_worker {
                // This worker's accounts only: w, w + workers, w + 2 workers, …
                let slot = w + (i % (ACCOUNTS / workers)) * workers;
                let account = format!("acct-{slot}");
                let position = positions[slot].fetch_add(1, Ordering::SeqCst) + 1;
                let id = format!("{way}-{round}-{w}-{i}");
                consume(way, &pool, &consumer, &id, &account, position).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    (per_worker * args.workers) as f64 / secs
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let schema = format!("ti_bench_consumer_{}", std::process::id());
    let admin = PgPool::connect(&url).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&url)
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(u32::try_from(args.workers).unwrap())
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(options)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE bench_accounts (account text PRIMARY KEY, balance bigint NOT NULL);
         INSERT INTO bench_accounts SELECT 'acct-' || n, 0 FROM generate_series(0, {}) n;
         CREATE TABLE bench_ledger (id bigserial PRIMARY KEY, account text NOT NULL,
                                    amount bigint NOT NULL);",
        ACCOUNTS - 1
    )))
    .execute(&pool)
    .await
    .unwrap();
    // A consumer per way: each way's IDs and positions are its own.
    let consumers: Vec<Consumer> = WAYS
        .iter()
        .map(|way| Consumer::new(inbox.clone(), format!("bench-{way}")).unwrap())
        .collect();
    // One position counter per account and way, so each way's positions only grow.
    let positions: Vec<Arc<Vec<AtomicI64>>> = WAYS
        .iter()
        .map(|_| Arc::new((0..ACCOUNTS).map(|_| AtomicI64::new(0)).collect()))
        .collect();

    // A warm-up round of every way, not counted.
    for (w, way) in WAYS.iter().enumerate() {
        round(way, &pool, &consumers[w], &args, usize::MAX, &positions[w]).await;
    }
    let mut rates = vec![Vec::new(); WAYS.len()];
    for r in 0..args.rounds {
        for k in 0..WAYS.len() {
            let w = (r + k) % WAYS.len();
            let rate = round(WAYS[w], &pool, &consumers[w], &args, r, &positions[w]).await;
            rates[w].push(rate);
        }
    }
    println!(
        "{} messages per way and round, {} workers, {} rounds (rotated order)",
        args.messages, args.workers, args.rounds
    );
    println!(
        "{:<16} {:>10}  {:>8}  per round (msg/s)",
        "way", "median", "÷ none"
    );
    for (w, way) in WAYS.iter().enumerate() {
        let mut ratios: Vec<f64> = rates[w].iter().zip(&rates[0]).map(|(a, b)| a / b).collect();
        let per_round: Vec<String> = rates[w].iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "{:<16} {:>10.0}  {:>8.2}  {}",
            way,
            median(&mut rates[w].clone()),
            median(&mut ratios),
            per_round.join(" ")
        );
    }
    pool.close().await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&admin)
        .await
        .unwrap();
}
