//! Phased mode when the database itself crashes: a Postgres server of the test's own is
//! stopped in `immediate` mode (every server process killed, as in a crash; the next start
//! replays the WAL) while a request waits in its remote call between phases. What a phase
//! committed survives, and nothing is done twice.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::postgres::PgPoolOptions;
use support::{read, req};
use tokio::sync::Notify;
use tower::{Layer, ServiceExt};
use tower_idempotency::body::RequestBody;
use tower_idempotency::{IdempotencyLayer, Phases, PostgresStore};

/// A Postgres server of this test's own, in a temporary directory.
struct Server {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    as_postgres: bool,
    options: &'static str,
}

fn bindir() -> PathBuf {
    let from_pg_config = Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let candidates = from_pg_config.into_iter().chain(
        std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("bin")),
    );
    for dir in candidates {
        if dir.join("initdb").exists() && dir.join("pg_ctl").exists() {
            return dir;
        }
    }
    panic!(
        "this test runs a Postgres server of its own and found no initdb/pg_ctl: install the \
         PostgreSQL server (Debian/Ubuntu: apt-get install postgresql; ./scripts/test.sh does)"
    );
}

impl Server {
    fn run(&self, program: &str, args: &[&str]) -> std::process::Output {
        let bin = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(bin);
            c
        } else {
            Command::new(bin)
        };
        let out = cmd.args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{program} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn init() -> Server {
        Self::init_with("")
    }

    /// A server started with `options` (`-c name=value …`) besides the usual ones.
    fn init_with(options: &'static str) -> Server {
        let bin = bindir();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("ti-dbcrash-{}", support::unique()));
        std::fs::create_dir_all(&dir).unwrap();
        // initdb refuses to run as root: run the server as the postgres system user then.
        let as_postgres = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
        if as_postgres {
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .unwrap();
        }
        let server = Server {
            bin,
            data: dir.join("data"),
            port,
            as_postgres,
            options,
        };
        let data = server.data.to_str().unwrap().to_owned();
        server.run(
            "initdb",
            &["-D", &data, "-U", "postgres", "--auth=trust", "--no-sync"],
        );
        server.start();
        server
    }

    fn start(&self) {
        let data = self.data.to_str().unwrap().to_owned();
        let sockets = self.data.parent().unwrap().to_str().unwrap().to_owned();
        let options = format!(
            "-p {} -k {sockets} -c listen_addresses=127.0.0.1 -c fsync=on \
             -c synchronous_commit=on {}",
            self.port, self.options
        );
        let log = self
            .data
            .parent()
            .unwrap()
            .join("log")
            .to_str()
            .unwrap()
            .to_owned();
        self.run(
            "pg_ctl",
            &["-D", &data, "-o", &options, "-l", &log, "-w", "start"],
        );
    }

    /// Every server process killed at once, as in a crash: the next start recovers from the
    /// WAL.
    fn crash(&self) {
        let data = self.data.to_str().unwrap().to_owned();
        self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let data = self.data.to_str().unwrap_or_default().to_owned();
        let _ = Command::new(if self.as_postgres { "runuser" } else { "true" })
            .args(if self.as_postgres {
                vec!["-u", "postgres", "--"]
            } else {
                vec![]
            })
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", &data, "-m", "immediate", "stop"])
            .output();
        if let Some(dir) = Path::new(&data).parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// `future`, or a failure naming `what` after 30 s.
async fn within<F: Future>(future: F, what: &str) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), future)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing after 30 s"))
}

/// A pool on `server` (room for a retry's connections while a request holds one), its store
/// migrated, and the handler's table made by `table`.
async fn migrated(server: &Server, table: &str) -> (sqlx::PgPool, PostgresStore) {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(20))
        .connect(&server.url())
        .await
        .unwrap();
    let store = PostgresStore::new(pool.clone());
    store.migrate().await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(table.to_owned()))
        .execute(&pool)
        .await
        .unwrap();
    (pool, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_committed_before_a_database_crash_survive_it_and_nothing_runs_twice() {
    let server = Server::init();
    let (pool, store) = migrated(
        &server,
        "CREATE TABLE payments (id bigserial PRIMARY KEY, status text NOT NULL)",
    )
    .await;

    let in_call = Arc::new(Notify::new());
    // Permits, not notifications: a permit given before the handler waits is not lost.
    let go_on = Arc::new(tokio::sync::Semaphore::new(0));
    let steps_run = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (in_call, go_on, steps_run) = (in_call.clone(), go_on.clone(), steps_run.clone());
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let (in_call, go_on, steps_run) = (in_call.clone(), go_on.clone(), steps_run.clone());
            async move {
                let phases = req.extensions().get::<Phases>().unwrap().clone();
                let answer = |status: StatusCode, body: String| {
                    let mut res = Response::new(Full::new(Bytes::from(body)));
                    *res.status_mut() = status;
                    Ok::<_, std::io::Error>(res)
                };
                let id: i64 = match phases
                    .step("pending", async |conn| {
                        steps_run.fetch_add(1, Ordering::SeqCst);
                        sqlx::query_scalar(
                            "INSERT INTO payments (status) VALUES ('pending') RETURNING id",
                        )
                        .fetch_one(conn)
                        .await
                    })
                    .await
                {
                    Ok(id) => id,
                    Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                };
                // The remote call; the database crashes meanwhile.
                in_call.notify_one();
                go_on.acquire().await.unwrap().forget();
                let last = async {
                    let mut tx = phases.tx().await.map_err(|e| e.to_string())?;
                    sqlx::query("UPDATE payments SET status = 'charged' WHERE id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| e.to_string())?;
                    Ok::<_, String>(())
                };
                match last.await {
                    Ok(()) => answer(StatusCode::CREATED, format!("payment {id}")),
                    Err(e) => answer(StatusCode::SERVICE_UNAVAILABLE, e),
                }
            }
        })
    };
    let svc = IdempotencyLayer::new(store.phased()).layer(handler);

    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "{}")));
    within(
        in_call.notified(),
        "the first request reaches its remote call",
    )
    .await;
    server.crash();
    server.start();
    // The request goes on after the crash: its claim and its step were committed before it,
    // so they survived, and its last phase commits with the answer.
    go_on.add_permits(1);
    let first = read(
        within(first, "the first request's answer")
            .await
            .unwrap()
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(steps_run.load(Ordering::SeqCst), 1);
    let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, status FROM payments")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(rows, vec![(1, "charged".to_owned())]);
    let replay = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(replay.body, first.body);

    // A second request is waiting in its remote call when the database crashes, and stalls
    // there past its lease (forced here: its lease's end moved into the past). A retry takes
    // the key over and resumes after the committed step; then both go on: the stalled one's
    // last phase is refused and commits nothing, the retry completes.
    let second = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k2"), "{}")));
    within(
        in_call.notified(),
        "the second request reaches its remote call",
    )
    .await;
    server.crash();
    server.start();
    sqlx::query(
        "UPDATE tower_idempotency_keys SET lease_expires_at = now() - interval '1 second' \
          WHERE key = 'k2' AND lease_token IS NOT NULL",
    )
    .execute(&pool)
    .await
    .unwrap();
    let retry = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k2"), "{}")));
    within(in_call.notified(), "the retry reaches its remote call").await;
    go_on.add_permits(2);
    let second = read(
        within(second, "the second request's answer")
            .await
            .unwrap()
            .unwrap(),
    )
    .await;
    // Its last phase is refused when its answer is stored: nothing of it commits.
    second.assert_problem(503, "store-unavailable");
    let retry = read(within(retry, "the retry's answer").await.unwrap().unwrap()).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(
        steps_run.load(Ordering::SeqCst),
        2,
        "the committed step did not run again"
    );
    let (payments, charged): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE status = 'charged') FROM payments")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((payments, charged), (2, 2));
    pool.close().await;
}

/// A phased claim is a lease, not a result: its commit does not wait for the WAL flush, and a
/// crash can lose it. Every commit after it is fenced by its token and flushed, so what the
/// crash loses is only the lease: the request that held it has its next phase refused, and the
/// retry that claims the key anew (with a token the lost claim's cannot equal: the sequence's
/// lost advance would hand the same number out again) does the work once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_lost_in_a_database_crash_fences_its_request_and_the_retry_does_the_work_once() {
    // The WAL writer flushes an unflushed commit every 10 s here, and nothing else writes in
    // between: a crash right after the claim loses it.
    let server = Server::init_with("-c wal_writer_delay=10000 -c autovacuum=off");
    let (pool, store) = migrated(
        &server,
        "CREATE TABLE payments (id bigserial PRIMARY KEY, key text NOT NULL)",
    )
    .await;

    let in_call = Arc::new(Notify::new());
    // One gate per request, in the order they reach the handler.
    let gates = Arc::new([
        tokio::sync::Semaphore::new(0),
        tokio::sync::Semaphore::new(0),
    ]);
    let arrived = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (in_call, gates, arrived) = (in_call.clone(), gates.clone(), arrived.clone());
        tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
            let (in_call, gates, arrived) = (in_call.clone(), gates.clone(), arrived.clone());
            async move {
                let phases = req.extensions().get::<Phases>().unwrap().clone();
                let answer = |status: StatusCode, body: String| {
                    let mut res = Response::new(Full::new(Bytes::from(body)));
                    *res.status_mut() = status;
                    Ok::<_, std::io::Error>(res)
                };
                // The remote call, with the claim committed and nothing else yet.
                let gate = arrived.fetch_add(1, Ordering::SeqCst);
                in_call.notify_one();
                gates[gate].acquire().await.unwrap().forget();
                let key = phases.key().as_str().to_owned();
                match phases
                    .step("charged", async |conn| {
                        sqlx::query_scalar::<_, i64>(
                            "INSERT INTO payments (key) VALUES ($1) RETURNING id",
                        )
                        .bind(key)
                        .fetch_one(conn)
                        .await
                    })
                    .await
                {
                    Ok(id) => answer(StatusCode::CREATED, format!("payment {id}")),
                    Err(e) => answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                }
            }
        })
    };
    let svc = IdempotencyLayer::new(store.phased()).layer(handler);

    let first = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "{}")));
    within(
        in_call.notified(),
        "the first request reaches its remote call",
    )
    .await;
    server.crash();
    server.start();
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tower_idempotency_keys WHERE key = 'k'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        records, 0,
        "the claim's commit did not wait for its WAL flush: the crash lost it"
    );

    // The retry finds no record and claims the key anew; while it is in its remote call, the
    // first request comes back from its own and tries to commit its step: refused.
    let retry = tokio::spawn(svc.clone().oneshot(req("POST", "/pay", Some("k"), "{}")));
    within(in_call.notified(), "the retry reaches its remote call").await;
    gates[0].add_permits(1);
    let first = read(
        within(first, "the first request's answer")
            .await
            .unwrap()
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 503, "{}", first.text());
    assert!(first.text().contains("lease"), "{}", first.text());
    let payments: i64 = sqlx::query_scalar("SELECT count(*) FROM payments")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payments, 0, "the first request's step committed nothing");

    gates[1].add_permits(1);
    let retry = read(within(retry, "the retry's answer").await.unwrap().unwrap()).await;
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert_eq!(retry.text(), "payment 1");
    let replay = read(
        svc.clone()
            .oneshot(req("POST", "/pay", Some("k"), "{}"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(replay.status, 201);
    assert_eq!(replay.body, retry.body);
    let payments: Vec<(i64, String)> = sqlx::query_as("SELECT id, key FROM payments")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        payments,
        vec![(1, "k".to_owned())],
        "the work was done once"
    );
    pool.close().await;
}
