//! The consumer example against the real RabbitMQ and Postgres: acknowledgements are lost,
//! RabbitMQ redelivers, and every charge is applied exactly once.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::process::Stdio;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use support::{PgDatabase, example_path, unique};

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn publish(queue: &str, messages: &[(String, i64)]) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to RabbitMQ at {}: {e}\nRun ./scripts/test.sh (it starts \
                 RabbitMQ), or set AMQP_URL to a broker you own.",
                amqp_url()
            )
        });
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions::durable(),
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for (id, amount) in messages {
        let body = format!("{{\"account\":\"acct-1\",\"amount_cents\":{amount}}}");
        let confirm = channel
            .basic_publish(
                "".into(),
                queue.into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_message_id(id.as_str().into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "the broker did not confirm {id}");
    }
    conn.close(200, "published".into()).await.unwrap();
}

async fn delete_queue(queue: &str) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = conn.create_channel().await.unwrap();
    let _ = channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_acknowledgements_never_apply_a_charge_twice() {
    let db = PgDatabase::new().await;
    let queue = format!("charges_{}", unique());
    // 20 distinct charges, and the producer retries message m3 (same ID, sent twice).
    let mut messages: Vec<(String, i64)> = (1..=20).map(|i| (format!("m{i}"), i)).collect();
    messages.push(("m3".into(), 3));
    publish(&queue, &messages).await;

    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(example_path("consumer"))
            .env("DATABASE_URL", &db.url)
            .env("AMQP_URL", amqp_url())
            .env("QUEUE", &queue)
            .env("LOSE_ACKS", "5")
            .env("EXIT_WHEN_IDLE_MS", "2000")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the consumer did not finish")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "consumer failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let count = |prefix: &str| stdout.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(count("processed "), 20, "{stdout}");
    // Each lost acknowledgement came back once, as did the producer's retry.
    assert_eq!(count("duplicate "), 6, "{stdout}");

    let pool = sqlx::PgPool::connect(&db.direct_url).await.unwrap();
    let (rows, total, distinct): (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), sum(amount_cents)::bigint, count(DISTINCT message_id)
           FROM example_ledger",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (rows, total, distinct),
        (20, 210, 20),
        "each charge applied exactly once"
    );
    pool.close().await;
    delete_queue(&queue).await;
    db.drop_database().await;
}
