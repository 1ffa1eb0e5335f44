//! End-to-end tests of `examples/jetstream.rs` against the real NATS JetStream server
//! (`NATS_URL`, or `nats://127.0.0.1:4222`) and Postgres: each test starts the example as its
//! own process (or two), on a stream, a durable and a database of its own, publishes with a
//! real JetStream client, reads the lines the example prints and its HTTP answers, and kills
//! or stops it.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use serde_json::{Value, json};

/// How long the example may take to print its address.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a test waits for a line or a state it expects.
const WAIT: Duration = Duration::from_secs(30);

/// Every variable the example reads; removed from its environment unless a test sets it.
const EXAMPLE_VARS: &[&str] = &[
    "NATS_URL",
    "DATABASE_URL",
    "STREAM",
    "CONSUMER",
    "MAX_DELIVER",
    "ACK_WAIT_MS",
    "WORK_DELAY_MS",
    "LOSE_ACKS",
    "HTTP_BIND",
    "EXIT_WHEN_IDLE_MS",
];

fn nats_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A running example. Dropping it kills the process.
struct Example {
    child: Child,
    addr: String,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Example {
    fn start(env: &[(&str, &str)]) -> Example {
        let mut command = Command::new(support::example_path("jetstream"));
        for var in EXAMPLE_VARS {
            command.env_remove(var);
        }
        command
            .env("HTTP_BIND", "127.0.0.1:0")
            .env("RUST_LOG", "warn");
        command.envs(env.iter().copied());
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out = BufReader::new(child.stdout.take().unwrap());
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        let err = BufReader::new(child.stderr.take().unwrap());
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let addr = loop {
            if let Some(first) = lines.lock().unwrap().first() {
                break first
                    .strip_prefix("listening on http://")
                    .unwrap_or_else(|| panic!("the first line is {first:?}"))
                    .to_owned();
            }
            if let Ok(Some(status)) = child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "the example exited ({status}); stderr:\n{}",
                    stderr.lock().unwrap()
                );
            }
            assert!(Instant::now() < deadline, "the example never listened");
            std::thread::sleep(Duration::from_millis(20));
        };
        lines.lock().unwrap().remove(0);
        Example {
            child,
            addr,
            lines,
            stderr,
        }
    }

    /// The delivery lines printed so far.
    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn signal_and_wait(&mut self, signal: &str) -> ExitStatus {
        let pid = self.child.id().to_string();
        Command::new("kill")
            .args(["-s", signal, &pid])
            .status()
            .unwrap();
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit after SIG{signal}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    async fn get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut conn = tokio::net::TcpStream::connect(&self.addr).await.unwrap();
        let request = format!(
            "GET {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n",
            self.addr
        );
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.unwrap();
        let status = answer[9..12].parse().unwrap();
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (status, body)
    }

    async fn account(&self, account: &str) -> Value {
        let (status, body) = self.get(&format!("/accounts/{account}")).await;
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A stream, a durable and a database of one test's own.
struct Fixture {
    js: jetstream::Context,
    stream: String,
    subject: String,
    nats_url: String,
    db: support::PgDatabase,
}

impl Fixture {
    async fn new() -> Fixture {
        let client = async_nats::connect(nats_url()).await.unwrap_or_else(|e| {
            panic!(
                "NATS is unreachable at {}: {e}\nThese tests need NATS with JetStream: run \
                 ./scripts/test.sh, or start `nats-server -js` and set NATS_URL.",
                nats_url()
            )
        });
        let stream = format!("T{}", support::unique().to_uppercase());
        let subject = stream.to_lowercase();
        Fixture {
            js: jetstream::new(client),
            stream,
            subject,
            nats_url: nats_url(),
            db: support::PgDatabase::new().await,
        }
    }

    /// The example's environment for this fixture, with `extra`.
    fn env<'a>(&'a self, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let mut env = vec![
            ("STREAM", self.stream.as_str()),
            ("DATABASE_URL", self.db.url.as_str()),
            ("NATS_URL", self.nats_url.as_str()),
        ];
        env.extend_from_slice(extra);
        env
    }

    /// Publishes a charge with `id` (none: no `Nats-Msg-Id`) and waits for the stream's ack.
    async fn publish(&self, account: &str, id: Option<&str>, body: Value) {
        self.publish_raw(account, id, body.to_string()).await;
    }

    async fn publish_raw(&self, account: &str, id: Option<&str>, body: String) {
        let mut headers = async_nats::HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        self.js
            .publish_with_headers(format!("{}.{account}", self.subject), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn charge(&self, account: &str, id: &str, amount_cents: i64, sequence: i64) {
        let body = json!({"account": account, "amount_cents": amount_cents, "sequence": sequence});
        self.publish(account, Some(id), body).await;
    }

    async fn finish(self) {
        let _ = self.js.delete_stream(&self.stream).await;
        self.db.drop_database().await;
    }
}

/// Waits until the lines of `examples` hold `line` (all of them together).
async fn wait_for_line(examples: &[&Example], line: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        if examples.iter().any(|e| e.lines().iter().any(|l| l == line)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no line {line:?}; lines: {:?}; stderr: {}",
            examples.iter().map(|e| e.lines()).collect::<Vec<_>>(),
            examples[0].stderr.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn count(lines: &[String], prefix: &str) -> usize {
    lines.iter().filter(|l| l.starts_with(prefix)).count()
}

#[tokio::test]
async fn each_kind_of_delivery_prints_its_line_and_the_account_shows_what_was_applied() {
    let fx = Fixture::new().await;
    let ex = Example::start(&fx.env(&[]));
    fx.charge("acme", "m1", 100, 1).await;
    wait_for_line(&[&ex], "processed m1").await;
    fx.charge("acme", "m2", 250, 2).await;
    wait_for_line(&[&ex], "processed m2").await;
    // Republished after the stream's short deduplication window: the inbox knows the ID.
    tokio::time::sleep(Duration::from_millis(200)).await;
    fx.charge("acme", "m2", 250, 2).await;
    wait_for_line(&[&ex], "duplicate m2").await;
    // A new message at an applied sequence.
    fx.charge("acme", "m3", 999, 2).await;
    wait_for_line(&[&ex], "stale m3").await;
    // No ID, a body that is not a charge, an amount below one cent.
    fx.publish(
        "acme",
        None,
        json!({"account": "acme", "amount_cents": 5, "sequence": 9}),
    )
    .await;
    fx.publish_raw("acme", Some("m4"), "not json".into()).await;
    fx.charge("acme", "m5", -5, 3).await;
    fx.charge("acme", "m6", 7, 3).await;
    wait_for_line(&[&ex], "processed m6").await;

    let lines = ex.lines();
    assert_eq!(
        lines[..4],
        ["processed m1", "processed m2", "duplicate m2", "stale m3"]
    );
    assert!(lines[4].starts_with("rejected -: "), "{lines:?}");
    assert!(lines[5].starts_with("rejected m4: "), "{lines:?}");
    assert!(lines[6].starts_with("rejected m5: "), "{lines:?}");
    assert_eq!(lines[7], "processed m6");
    assert_eq!(lines.len(), 8, "{lines:?}");
    assert_eq!(
        ex.account("acme").await,
        json!({"account": "acme", "balance_cents": 357, "charges": 3, "last_sequence": 3})
    );
    assert_eq!(
        ex.account("nobody").await,
        json!({"account": "nobody", "balance_cents": 0, "charges": 0, "last_sequence": 0})
    );
    let (status, metrics) = ex.get("/metrics").await;
    assert_eq!(status, 200);
    for (result, n) in [
        ("processed", 3),
        ("duplicate", 1),
        ("stale", 1),
        ("rejected", 3),
    ] {
        let line = format!(
            "tower_idempotency_inbox_deliveries_total{{consumer=\"charges-consumer\",result=\"{result}\"}} {n}"
        );
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }
    assert!(
        !metrics.contains("m1"),
        "a message ID in a label:\n{metrics}"
    );
    fx.finish().await;
}

#[tokio::test]
async fn a_poison_message_is_parked_after_max_deliver_failed_attempts() {
    let fx = Fixture::new().await;
    let ex = Example::start(&fx.env(&[("MAX_DELIVER", "3")]));
    fx.charge("acme", "poison", 2_000_000_000, 1).await;
    fx.charge("acme", "after", 10, 2).await;
    wait_for_line(&[&ex], "processed after").await;
    let lines = ex.lines();
    let reason = "the provider refuses charges above 1000000000 cents";
    assert_eq!(
        lines,
        [
            format!("failed poison: {reason}"),
            format!("failed poison: {reason}"),
            format!("parked poison: {reason}"),
            "processed after".to_owned(),
        ]
    );
    let pool = sqlx::PgPool::connect(&fx.db.direct_url).await.unwrap();
    let inbox = tower_idempotency::inbox::Inbox::new(pool.clone());
    let dead = inbox.dead_letters("charges-consumer", 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id, "poison");
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(dead[0].reason, reason);
    assert!(dead[0].payload.as_deref().unwrap().starts_with(b"{"));
    assert_eq!(
        ex.account("acme").await,
        json!({"account": "acme", "balance_cents": 10, "charges": 1, "last_sequence": 2})
    );
    // Redelivered or republished, a parked message is a duplicate.
    tokio::time::sleep(Duration::from_millis(200)).await;
    fx.charge("acme", "poison", 2_000_000_000, 1).await;
    wait_for_line(&[&ex], "duplicate poison").await;
    pool.close().await;
    fx.finish().await;
}

#[tokio::test]
async fn lost_acks_are_redelivered_and_skipped_as_duplicates() {
    let fx = Fixture::new().await;
    let ex = Example::start(&fx.env(&[("LOSE_ACKS", "2"), ("ACK_WAIT_MS", "700")]));
    for (n, id) in ["a", "b", "c"].iter().enumerate() {
        fx.charge("acme", id, 100, i64::try_from(n).unwrap() + 1)
            .await;
    }
    wait_for_line(&[&ex], "processed c").await;
    wait_for_line(&[&ex], "duplicate a").await;
    wait_for_line(&[&ex], "duplicate b").await;
    assert_eq!(
        ex.account("acme").await,
        json!({"account": "acme", "balance_cents": 300, "charges": 3, "last_sequence": 3})
    );
    let (_, metrics) = ex.get("/metrics").await;
    assert!(
        metrics.contains(
            "tower_idempotency_inbox_redeliveries_total{consumer=\"charges-consumer\",result=\"duplicate\"} 2"
        ),
        "{metrics}"
    );
    fx.finish().await;
}

/// Sums the balances, charges and sequences that `n` charges per account of 100 cents each
/// should leave.
fn expected(accounts: &[&str], n: i64) -> HashMap<String, Value> {
    accounts
        .iter()
        .map(|a| {
            let v =
                json!({"account": a, "balance_cents": 100 * n, "charges": n, "last_sequence": n});
            ((*a).to_owned(), v)
        })
        .collect()
}

#[tokio::test]
async fn killed_mid_work_and_restarted_each_message_is_applied_once_in_order() {
    let fx = Fixture::new().await;
    let env = fx.env(&[("WORK_DELAY_MS", "120"), ("ACK_WAIT_MS", "600")]);
    let accounts = ["acme", "globex"];
    let per_account = 6;
    let mut ex = Example::start(&env);
    for seq in 1..=per_account {
        for account in accounts {
            fx.charge(account, &format!("{account}-{seq}"), 100, seq)
                .await;
        }
    }
    let mut all = Vec::new();
    // Each process is killed in a message's work (120 ms of every ~130), and the next one
    // starts while the killed one's message is still claimed and unacknowledged.
    for kill_after in [150, 400, 650] {
        tokio::time::sleep(Duration::from_millis(kill_after)).await;
        ex.kill();
        all.extend(ex.lines());
        ex = Example::start(&env);
    }
    let last = ["acme-6", "globex-6"];
    for id in last {
        wait_for_line(&[&ex], &format!("processed {id}")).await;
    }
    all.extend(ex.lines());
    for (account, want) in expected(&accounts, per_account) {
        assert_eq!(ex.account(&account).await, want, "{all:?}");
    }
    assert_eq!(count(&all, "stale"), 0, "{all:?}");
    // A process killed between a commit and its line prints nothing for that message; its
    // redelivery is then the `duplicate`. No message is processed twice, none is missing.
    for account in accounts {
        for seq in 1..=per_account {
            let id = format!("{account}-{seq}");
            let processed = all
                .iter()
                .filter(|l| **l == format!("processed {id}"))
                .count();
            let seen = all.iter().any(|l| *l == format!("duplicate {id}"));
            assert!(processed <= 1, "{id} processed twice: {all:?}");
            assert!(processed == 1 || seen, "{id} never settled: {all:?}");
        }
    }
    fx.finish().await;
}

#[tokio::test]
async fn two_processes_on_one_durable_apply_each_message_once_in_order() {
    let fx = Fixture::new().await;
    let env = fx.env(&[("WORK_DELAY_MS", "5")]);
    let a = Example::start(&env);
    let b = Example::start(&env);
    let accounts = ["acme", "globex", "initech"];
    let per_account = 10;
    for seq in 1..=per_account {
        for account in accounts {
            fx.charge(account, &format!("{account}-{seq}"), 100, seq)
                .await;
        }
    }
    for account in accounts {
        wait_for_line(&[&a, &b], &format!("processed {account}-{per_account}")).await;
    }
    let mut all = a.lines();
    all.extend(b.lines());
    for (account, want) in expected(&accounts, per_account) {
        assert_eq!(a.account(&account).await, want, "{all:?}");
    }
    assert_eq!(count(&all, "processed"), 30, "{all:?}");
    assert_eq!(count(&all, "stale") + count(&all, "failed"), 0, "{all:?}");
    fx.finish().await;
}

#[tokio::test]
async fn work_longer_than_the_ack_wait_is_kept_alive_and_not_redelivered() {
    let fx = Fixture::new().await;
    // Work of more than three ack waits; renewals every third of one (a margin of two
    // thirds for a busy machine).
    let env = fx.env(&[("WORK_DELAY_MS", "4000"), ("ACK_WAIT_MS", "1200")]);
    let a = Example::start(&env);
    let b = Example::start(&env);
    fx.charge("acme", "slow", 100, 1).await;
    wait_for_line(&[&a, &b], "processed slow").await;
    // Longer than an ack wait more: a redelivery would have come by now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut all = a.lines();
    all.extend(b.lines());
    assert_eq!(all, ["processed slow"]);
    fx.finish().await;
}

#[tokio::test]
async fn sigterm_stops_it_cleanly_and_an_idle_one_exits() {
    let fx = Fixture::new().await;
    let mut ex = Example::start(&fx.env(&[]));
    assert!(ex.signal_and_wait("TERM").success());
    let mut idle = Example::start(&fx.env(&[("EXIT_WHEN_IDLE_MS", "300")]));
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = idle.child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "still running while idle");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status}");
    fx.finish().await;
}

#[tokio::test]
async fn bad_settings_are_refused_with_their_name() {
    for (var, value) in [
        ("MAX_DELIVER", "0"),
        ("ACK_WAIT_MS", "soon"),
        ("STREAM", "a.b"),
    ] {
        let mut command = Command::new(support::example_path("jetstream"));
        for v in EXAMPLE_VARS {
            command.env_remove(v);
        }
        let out = command
            .env("HTTP_BIND", "127.0.0.1:0")
            .env(var, value)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(var), "{var}: {stderr}");
    }
}

/// The producer half: a retried request republishes with the `Nats-Msg-Id` derived from its
/// idempotency key. Within the stream's window the server drops the republish itself; after
/// it, the consumer's inbox does. Either way the charge is applied once.
#[tokio::test]
async fn a_republish_with_the_derived_message_id_is_applied_once() {
    use tower_idempotency::IdempotencyKey;
    use tower_idempotency::message_id::{MessageId, NATS_MSG_ID};

    let fx = Fixture::new().await;
    let ex = Example::start(&fx.env(&[]));
    let key = IdempotencyKey::parse("order-7f3a").unwrap();
    let id = MessageId::derive("", &key, "charge").unwrap();
    let body = json!({"account": "acme", "amount_cents": 40, "sequence": 1}).to_string();
    let publish = async || {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(NATS_MSG_ID, id.as_str());
        fx.js
            .publish_with_headers(format!("{}.acme", fx.subject), headers, body.clone().into())
            .await
            .unwrap()
            .await
            .unwrap()
    };
    let first = publish().await;
    let again = publish().await;
    assert!(!first.duplicate);
    assert!(
        again.duplicate,
        "the stream drops a republish within its window"
    );
    wait_for_line(&[&ex], &format!("processed {id}")).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !publish().await.duplicate,
        "past the window the stream keeps it"
    );
    wait_for_line(&[&ex], &format!("duplicate {id}")).await;
    assert_eq!(
        ex.account("acme").await,
        json!({"account": "acme", "balance_cents": 40, "charges": 1, "last_sequence": 1})
    );
    fx.finish().await;
}

/// Two tenants send the same idempotency key (a key is unique only within its scope), and
/// each handler publishes its charge with the ID derived in its tenant's scope: the stream
/// keeps both publishes and the consumer applies both charges.
#[tokio::test]
async fn two_tenants_publishing_under_one_key_are_both_applied() {
    use tower_idempotency::IdempotencyKey;
    use tower_idempotency::message_id::{MessageId, NATS_MSG_ID};

    let fx = Fixture::new().await;
    let ex = Example::start(&fx.env(&[]));
    let key = IdempotencyKey::parse("order-1").unwrap();
    let mut ids = Vec::new();
    for tenant in ["acme", "globex"] {
        let id = MessageId::derive(tenant, &key, "charge").unwrap();
        let body = json!({"account": tenant, "amount_cents": 25, "sequence": 1}).to_string();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(NATS_MSG_ID, id.as_str());
        let ack = fx
            .js
            .publish_with_headers(format!("{}.{tenant}", fx.subject), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(
            !ack.duplicate,
            "{tenant}'s publish was dropped as a duplicate"
        );
        ids.push(id);
    }
    for id in &ids {
        wait_for_line(&[&ex], &format!("processed {id}")).await;
    }
    for tenant in ["acme", "globex"] {
        assert_eq!(
            ex.account(tenant).await,
            json!({"account": tenant, "balance_cents": 25, "charges": 1, "last_sequence": 1})
        );
    }
    fx.finish().await;
}
