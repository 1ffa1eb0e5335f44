//! The fault matrix: every statement boundary of a Postgres path (a keyed request in each
//! mode, a completer's pass, a consumer's delivery), struck with each fault (the connection
//! cut before the statement reaches the server, cut after the server executed it, its answer
//! stalled past the store's timeout, the future dropped while it is in flight), then retried
//! as a client would, or redelivered as a broker would.
//!
//! The boundaries are not written down here: a run without faults records them
//! (`support::wire`), and every cell strikes at one. Each cell asserts the invariant:
//!
//! - the work's database effects happen at most once per key (the payment rows), and the
//!   provider charges once (it deduplicates by the derived key, as real providers do);
//! - no committed answer is lost: once a retry gets the success, a further retry replays
//!   it byte for byte, and a success the first attempt already showed its client is the one
//!   replayed;
//! - nothing hangs: every request answers within a bound;
//! - a message whose work committed is a duplicate at its next delivery, and its work
//!   committed exactly once.
//!
//! Plain mode promises less where the fault hits the completion (the answer could not be
//! stored: the key waits for its lease and the retry runs the handler again, as after a crash
//! between the handler and the store); the matrix holds it to exactly that.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::collections::HashMap;
use std::net::ToSocketAddrs as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use support::wire::{Fault, Point, WireProxy};
use support::{Answer, PgSchema, read, req};
use tokio::sync::Semaphore;
use tower::util::BoxCloneSyncService as BoxCloneService;
use tower::{Layer, ServiceExt};
use tower_idempotency::body::RequestBody;
use tower_idempotency::inbox::{Consumer, Inbox, Message, Outcome as ConsumerOutcome};
use tower_idempotency::{
    IdempotencyLayer, IdempotentTx, PhaseError, Phased, Phases, PostgresStore,
};

/// The store's timeout in every cell; stalls outlast it.
const STORE_TIMEOUT: Duration = Duration::from_millis(400);
const STALL: Duration = Duration::from_millis(1200);
/// The lease; the database clock is moved past it when a retry meets the key in flight.
const LEASE: Duration = Duration::from_secs(5);
/// Every request answers within this, or the cell hangs.
const BOUND: Duration = Duration::from_secs(15);
/// Cells run at once (each mostly waits on the database and its stalls).
const AT_ONCE: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Plain,
    Transactional,
    Phased,
    /// A phased request abandoned after its first step (it answered `502`), then a pass of
    /// the completer: the pass is the path struck.
    Completer,
    /// `Consumer::deliver`: a leased claim, the provider's charge with no transaction open,
    /// then the work's write committed with the message's ID.
    Deliver,
    /// `Consumer::process`: the ID recorded and the work's write in one transaction.
    Process,
}

impl Mode {
    fn consumes(self) -> bool {
        matches!(self, Mode::Deliver | Mode::Process)
    }
}

/// The message every consumer cell delivers.
const MESSAGE_ID: &str = "msg-1";

const FAULTS: [Fault; 4] = [
    Fault::CutBefore,
    Fault::CutAfter,
    Fault::Stall(STALL),
    Fault::Hold,
];

type Svc = BoxCloneService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::body::ResponseBody<Full<Bytes>>>,
    std::io::Error,
>;

/// A provider that deduplicates by key, as payment providers do.
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<HashMap<String, String>>>);

impl Provider {
    fn charge(&self, key: &str) -> String {
        let mut charges = self.0.lock().unwrap();
        let n = charges.len();
        charges
            .entry(key.to_owned())
            .or_insert_with(|| format!("ch_{n}"))
            .clone()
    }
    fn charges(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

struct Cell {
    mode: Mode,
    schema: PgSchema,
    admin: PgPool,
    store: PostgresStore,
    proxy: WireProxy,
    provider: Provider,
    svc: Svc,
    phased: Phased,
    consumer: Consumer,
    /// The statements the proxy saw before the struck path began (the completer's setup).
    setup: usize,
}

impl Cell {
    /// A cell for `mode`, with the completer's setup run.
    async fn new(mode: Mode) -> Cell {
        let mut cell = Cell::start(mode).await;
        if mode == Mode::Completer {
            // Abandoned after its first step: the completer's to finish.
            let first = cell.send().await.unwrap();
            assert_eq!(first.status, 502, "the completer's setup: {}", first.text());
            // The claim ended at the 502; the completer takes what ended before its pass.
            cell.schema.advance_clock(Duration::from_secs(1)).await;
            cell.setup = cell.proxy.seen().len();
        }
        cell
    }

    /// A cell for `mode`, nothing sent yet.
    async fn start(mode: Mode) -> Cell {
        let schema = PgSchema::new().await;
        // Migrated and inspected straight at the server: only the layer's path crosses the
        // proxy.
        let admin = schema.direct_pool(4).await;
        PostgresStore::new(admin.clone()).migrate().await.unwrap();
        schema.controlled_clock().await;
        sqlx::raw_sql(
            "CREATE TABLE payments (id bigserial PRIMARY KEY, status text NOT NULL, \
             charge text)",
        )
        .execute(&admin)
        .await
        .unwrap();
        let opts = schema.connect_options();
        let target = (opts.get_host(), opts.get_port())
            .to_socket_addrs()
            .unwrap()
            .next()
            .unwrap();
        let proxy = WireProxy::start(target).await;
        let pool = PgPoolOptions::new()
            // The completer's cells on one connection: which statements a pooled connection
            // has prepared already decides the path's boundaries (`PREPARE` or not), and with
            // several, which one a statement gets varies from run to run.
            .max_connections(if mode == Mode::Completer { 1 } else { 8 })
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(
                opts.host(&proxy.addr().ip().to_string())
                    .port(proxy.addr().port())
                    .application_name(&schema.name),
            )
            .await
            .unwrap();
        let store = PostgresStore::new(pool.clone());
        let provider = Provider::default();
        let phased = store.phased().with_resumable_requests(64 * 1024);
        let svc = service(mode, &store, &phased, &admin, &provider);
        let consumer = Consumer::new(Inbox::new(pool), "matrix")
            .unwrap()
            .with_lease(LEASE)
            .unwrap();
        Cell {
            mode,
            schema,
            admin,
            store,
            proxy,
            provider,
            svc,
            phased,
            consumer,
            setup: 0,
        }
    }

    /// The HTTP path struck, once: a request, or a pass of the completer (no client sees its
    /// answers: as a request whose client went away).
    async fn attempt(&self) -> Result<Answer, String> {
        if self.mode != Mode::Completer {
            return self.send().await;
        }
        let mut svc = self.svc.clone();
        let pass = self.phased.complete_abandoned(&mut svc, Duration::ZERO, 10);
        match tokio::time::timeout(BOUND, pass).await {
            Ok(_) => Err("dropped".to_owned()),
            Err(_) => Err(format!("the completer's pass hung past {BOUND:?}")),
        }
    }

    /// One delivery of the message through the consumer.
    async fn deliver(&self) -> Result<ConsumerOutcome<i64>, String> {
        let message = Message::new(Some(MESSAGE_ID));
        let insert = async |conn: &mut sqlx::PgConnection, charge: String| {
            sqlx::query_scalar(
                "INSERT INTO payments (status, charge) VALUES ('charged', $1) RETURNING id",
            )
            .bind(charge)
            .fetch_one(conn)
            .await
        };
        let outcome = match self.mode {
            Mode::Deliver => {
                let provider = self.provider.clone();
                let remote = async move || {
                    Ok::<_, sqlx::Error>(provider.charge(&format!("{MESSAGE_ID}:charge")))
                };
                let call = self.consumer.deliver(&message, remote, insert);
                tokio::time::timeout(BOUND, call).await
            }
            _ => {
                let call = self
                    .consumer
                    .process(&message, async |conn| insert(conn, "none".into()).await);
                tokio::time::timeout(BOUND, call).await
            }
        };
        outcome.map_err(|_| format!("no outcome within {BOUND:?}"))
    }

    async fn scalar(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.admin)
            .await
            .unwrap()
    }

    async fn send(&self) -> Result<Answer, String> {
        self.send_to("/pay").await
    }

    /// A request to `path` (plain mode's `/fail-once` answers `503` the first time, before
    /// any effect).
    async fn send_to(&self, path: &str) -> Result<Answer, String> {
        let call = self
            .svc
            .clone()
            .oneshot(req("POST", path, Some("k-1"), r#"{"amount":500}"#));
        match tokio::time::timeout(BOUND, call).await {
            Ok(Ok(res)) => Ok(read(res).await),
            Ok(Err(e)) => Err(format!("service error: {e}")),
            Err(_) => Err(format!("no answer within {BOUND:?}")),
        }
    }

    async fn cleanup(self) {
        drop(self.proxy);
        self.store.pool().close().await;
        self.admin.close().await;
        self.schema.drop_schema().await;
    }
}

/// The layer in `mode` over a payment handler: a pending payment row, the provider's charge,
/// then the row charged and `201`.
fn service(
    mode: Mode,
    store: &PostgresStore,
    phased: &Phased,
    admin: &PgPool,
    provider: &Provider,
) -> Svc {
    let admin = admin.clone();
    let provider = provider.clone();
    let failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = tower::service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let admin = admin.clone();
        let provider = provider.clone();
        let failed = failed.clone();
        async move {
            let answer = |status: StatusCode, body: String| {
                let mut res = Response::new(Full::new(Bytes::from(body)));
                *res.status_mut() = status;
                Ok::<_, std::io::Error>(res)
            };
            let key = req
                .extensions()
                .get::<tower_idempotency::IdempotencyKey>()
                .unwrap()
                .as_str()
                .to_owned();
            match mode {
                Mode::Plain => {
                    if req.uri().path() == "/fail-once"
                        && !failed.swap(true, std::sync::atomic::Ordering::SeqCst)
                    {
                        return answer(StatusCode::SERVICE_UNAVAILABLE, "not now".into());
                    }
                    // The effect goes straight to the database, not through the store.
                    let id: i64 = match sqlx::query_scalar(
                        "INSERT INTO payments (status) VALUES ('charged') RETURNING id",
                    )
                    .fetch_one(&admin)
                    .await
                    {
                        Ok(id) => id,
                        Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    };
                    let charge = provider.charge(&format!("{key}:charge"));
                    answer(
                        StatusCode::CREATED,
                        format!(r#"{{"payment":{id},"charge":"{charge}"}}"#),
                    )
                }
                Mode::Transactional => {
                    let tx = req.extensions().get::<IdempotentTx>().unwrap().clone();
                    let Ok(mut conn) = tx.conn().await else {
                        return answer(StatusCode::SERVICE_UNAVAILABLE, "no tx".into());
                    };
                    let id: i64 = match sqlx::query_scalar(
                        "INSERT INTO payments (status) VALUES ('charged') RETURNING id",
                    )
                    .fetch_one(&mut *conn)
                    .await
                    {
                        Ok(id) => id,
                        Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    };
                    answer(StatusCode::CREATED, format!(r#"{{"payment":{id}}}"#))
                }
                Mode::Phased | Mode::Completer => {
                    let phases = req.extensions().get::<Phases>().unwrap().clone();
                    // A handler that tries a failed step once more, as a retry-on-transient-
                    // error helper would: a step whose commit was uncertain must not run again.
                    let mut pending = phases
                        .step("pending", async |conn| insert_pending(conn).await)
                        .await;
                    if let Err(PhaseError::Store(_)) = pending {
                        pending = phases
                            .step("pending", async |conn| insert_pending(conn).await)
                            .await;
                    }
                    let id: i64 = match pending {
                        Ok(id) => id,
                        Err(PhaseError::LeaseLost) => {
                            return answer(StatusCode::CONFLICT, "lease lost".into());
                        }
                        Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    };
                    // The provider's charge, between the steps, then its ID as a recovery
                    // point of its own (a step with no writes but its record).
                    let charge = provider.charge(&format!("{key}:charge"));
                    let charged = phases
                        .step("charged", async |_conn| {
                            Ok::<_, std::convert::Infallible>(charge.clone())
                        })
                        .await;
                    let charge = match charged {
                        Ok(charge) => charge,
                        Err(e) => return answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    };
                    if mode == Mode::Completer && phases.recovery_point().is_none() {
                        // The first attempt's provider answer is lost: abandoned after its
                        // steps, for the completer.
                        return answer(StatusCode::BAD_GATEWAY, "provider answer lost".into());
                    }
                    let last = async {
                        let mut tx = phases.tx().await?;
                        sqlx::query(
                            "UPDATE payments SET status = 'charged', charge = $1 WHERE id = $2",
                        )
                        .bind(&charge)
                        .bind(id)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| PhaseError::Store(e.into()))?;
                        Ok::<_, PhaseError>(())
                    };
                    match last.await {
                        Ok(()) => answer(
                            StatusCode::CREATED,
                            format!(r#"{{"payment":{id},"charge":"{charge}"}}"#),
                        ),
                        Err(e) => answer(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                    }
                }
                Mode::Deliver | Mode::Process => answer(StatusCode::NOT_FOUND, String::new()),
            }
        }
    });
    match mode {
        Mode::Plain | Mode::Deliver | Mode::Process => {
            BoxCloneService::new(configure(IdempotencyLayer::new(store.clone())).layer(handler))
        }
        Mode::Transactional => BoxCloneService::new(
            configure(IdempotencyLayer::new(store.transactional())).layer(handler),
        ),
        Mode::Phased => {
            BoxCloneService::new(configure(IdempotencyLayer::new(store.phased())).layer(handler))
        }
        Mode::Completer => {
            BoxCloneService::new(configure(IdempotencyLayer::new(phased.clone())).layer(handler))
        }
    }
}

/// The first step's write: a pending payment.
async fn insert_pending(conn: &mut sqlx::PgConnection) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("INSERT INTO payments (status) VALUES ('pending') RETURNING id")
        .fetch_one(conn)
        .await
}

fn configure<M>(layer: IdempotencyLayer<M>) -> IdempotencyLayer<M> {
    layer
        .with_lease(LEASE)
        .with_store_timeout(STORE_TIMEOUT)
        .with_cancel_on_disconnect(true)
}

/// The statement boundaries of the struck path, from a run without faults.
async fn boundaries(mode: Mode) -> Vec<Point> {
    let cell = Cell::new(mode).await;
    if mode.consumes() {
        let outcome = cell.deliver().await.unwrap();
        assert!(
            matches!(outcome, ConsumerOutcome::Processed(_)),
            "{mode:?} without faults: {outcome:?}"
        );
    } else if mode == Mode::Completer {
        cell.attempt().await.unwrap_err();
        let completed = cell
            .scalar("SELECT count(*) FROM tower_idempotency_keys WHERE completed_at IS NOT NULL")
            .await;
        assert_eq!(
            completed, 1,
            "the completer without faults completed nothing"
        );
    } else {
        let first = cell.send().await.unwrap();
        assert_eq!(
            first.status,
            201,
            "{mode:?} without faults: {}",
            first.text()
        );
    }
    let mut seen = cell.proxy.seen();
    if mode == Mode::Completer {
        // The pass alone, not the setup; counted from the pass's start, as an armed fault
        // counts.
        let setup: Vec<Point> = seen.drain(..cell.setup).collect();
        for point in &mut seen {
            point.nth -= setup.iter().filter(|p| p.label == point.label).count();
        }
    }
    cell.cleanup().await;
    seen
}

/// What one cell showed: whether its fault fired, and the invariant's verdict.
struct Verdict {
    fired: bool,
    first: String,
    retries: usize,
    outcome: Result<(), String>,
}

/// One cell: the fault at `point`, the first attempt (a request, a completer pass, a
/// delivery), then retries (or redeliveries) until the success, then the checks.
async fn strike(mode: Mode, point: Point, fault: Fault) -> Verdict {
    let cell = Cell::new(mode).await;
    cell.proxy.arm(point.clone(), fault);
    if mode.consumes() {
        let first = if fault == Fault::Hold {
            tokio::select! {
                outcome = cell.deliver() => outcome,
                () = cell.proxy.hit() => Err("dropped".to_owned()),
            }
        } else {
            cell.deliver().await
        };
        let fired = cell.proxy.fired();
        cell.proxy.heal();
        let outcome = check_delivery(&cell, mode, &first).await;
        let verdict = Verdict {
            fired,
            first: match &first {
                Ok(outcome) => outcome.result().to_owned(),
                Err(e) => e.clone(),
            },
            retries: outcome.as_ref().map_or(0, |n| *n),
            outcome: outcome.map(|_| ()),
        };
        cell.cleanup().await;
        return verdict;
    }
    let first = if fault == Fault::Hold {
        tokio::select! {
            answer = cell.attempt() => answer,
            () = cell.proxy.hit() => Err("dropped".to_owned()),
        }
    } else {
        cell.attempt().await
    };
    let fired = cell.proxy.fired();
    // The future was dropped (or the fault is over): let held answers go, strike no more.
    cell.proxy.heal();
    // Plain mode: did the first request's answer reach the store?
    let stored = cell
        .scalar("SELECT count(*) FROM tower_idempotency_keys WHERE completed_at IS NOT NULL")
        .await;
    let completion_lost =
        mode == Mode::Plain && stored == 0 && first.as_ref().is_ok_and(|a| a.status == 201);
    let outcome = check(&cell, mode, completion_lost, &first).await;
    let verdict = Verdict {
        fired,
        first: match &first {
            Ok(answer) => answer.status.as_u16().to_string(),
            Err(e) => e.clone(),
        },
        retries: outcome.as_ref().map_or(0, |(n, _)| *n),
        outcome: outcome.map(|_| ()),
    };
    cell.cleanup().await;
    verdict
}

/// After a struck delivery, the broker's redeliveries until one is settled with an ack
/// (at once after a failure, after the lease, the database clock moved past it, when the
/// message is in progress), then one more, which must be a duplicate. The message's work
/// must have committed exactly once (not lost, not twice), and the provider charged once.
async fn check_delivery(
    cell: &Cell,
    mode: Mode,
    first: &Result<ConsumerOutcome<i64>, String>,
) -> Result<usize, String> {
    let mut settled = match first {
        Ok(outcome) => match outcome {
            ConsumerOutcome::Processed(_) | ConsumerOutcome::Duplicate => true,
            ConsumerOutcome::Failed { .. } | ConsumerOutcome::InProgress { .. } => false,
            other => return Err(format!("first delivery: {other:?}")),
        },
        Err(e) if e == "dropped" => false,
        Err(e) => return Err(format!("first delivery: {e}")),
    };
    let mut redeliveries = 0;
    while !settled {
        redeliveries += 1;
        if redeliveries > 8 {
            return Err("not settled after 8 redeliveries".into());
        }
        match cell.deliver().await? {
            ConsumerOutcome::Processed(_) | ConsumerOutcome::Duplicate => settled = true,
            ConsumerOutcome::InProgress { .. } => {
                cell.schema
                    .advance_clock(LEASE + Duration::from_secs(1))
                    .await
            }
            ConsumerOutcome::Failed { .. } => tokio::time::sleep(Duration::from_millis(50)).await,
            other => return Err(format!("redelivery: {other:?}")),
        }
    }
    match cell.deliver().await? {
        ConsumerOutcome::Duplicate => {}
        other => return Err(format!("a delivery after the ack: {other:?}")),
    }
    let payments = cell.scalar("SELECT count(*) FROM payments").await;
    if payments != 1 {
        return Err(format!("the work committed {payments} times"));
    }
    if mode == Mode::Deliver && cell.provider.charges() != 1 {
        return Err(format!("{} provider charges", cell.provider.charges()));
    }
    Ok(redeliveries)
}

async fn check(
    cell: &Cell,
    mode: Mode,
    completion_lost: bool,
    first: &Result<Answer, String>,
) -> Result<(usize, ()), String> {
    if let Err(e) = first
        && e != "dropped"
    {
        return Err(format!("first request: {e}"));
    }
    // A 503 after a fault may follow a commit that landed: it must not tell the client that
    // nothing was done.
    if let Ok(answer) = first
        && answer.status == 503
        && answer.text().contains("not processed")
    {
        return Err(format!(
            "a 503 says the request was not processed: {}",
            answer.text()
        ));
    }
    // Retry as a client does: at once after a 5xx, after the lease (the database clock moved
    // past it) after a 409.
    let mut success = None;
    let mut retries = 0;
    if let Ok(first) = first
        && first.status == 201
    {
        success = Some(first.clone());
    }
    while success.is_none() {
        retries += 1;
        if retries > 8 {
            return Err("no success after 8 retries".into());
        }
        let answer = cell.send().await?;
        match answer.status.as_u16() {
            201 => success = Some(answer),
            409 => {
                cell.schema
                    .advance_clock(LEASE + Duration::from_secs(1))
                    .await
            }
            s if s >= 500 => tokio::time::sleep(Duration::from_millis(50)).await,
            s => return Err(format!("retry answered {s}: {}", answer.text())),
        }
    }
    let success = success.unwrap();
    let replay = cell.send().await?;
    // Plain mode could not store the answer the first request's client got: the key waits
    // for its lease, then the handler runs again (as after a crash before the store).
    if completion_lost && !replay.replayed() {
        // The first success was not stored: the key is the lease's until it runs out, then
        // the handler runs again, and that answer is stored.
        let mut again = replay;
        if again.status == 409 {
            cell.schema
                .advance_clock(LEASE + Duration::from_secs(1))
                .await;
            again = cell.send().await?;
        }
        if again.status != 201 {
            return Err(format!(
                "after the lease: {} {}",
                again.status,
                again.text()
            ));
        }
        let replay = cell.send().await?;
        if !replay.replayed() || replay.body != again.body {
            return Err("the success after the lease was not replayed".into());
        }
    } else {
        if replay.status != 201 || !replay.replayed() {
            return Err(format!(
                "the success was not replayed: {} {}",
                replay.status,
                replay.text()
            ));
        }
        if replay.body != success.body {
            return Err(format!(
                "the replay differs from the success a client got: {} vs {}",
                replay.text(),
                success.text()
            ));
        }
    }
    let payments = cell.scalar("SELECT count(*) FROM payments").await;
    let charged = cell
        .scalar("SELECT count(*) FROM payments WHERE status = 'charged'")
        .await;
    let most = if completion_lost { 2 } else { 1 };
    if payments > most || charged != payments {
        return Err(format!(
            "{payments} payment rows, {charged} of them charged"
        ));
    }
    if mode != Mode::Transactional && cell.provider.charges() != 1 {
        return Err(format!("{} provider charges", cell.provider.charges()));
    }
    Ok((retries, ()))
}

async fn matrix(mode: Mode) {
    let points = boundaries(mode).await;
    assert!(!points.is_empty(), "no statement boundary recorded");
    let gate = Arc::new(Semaphore::new(AT_ONCE));
    let mut cells = Vec::new();
    for point in &points {
        for fault in FAULTS {
            let gate = gate.clone();
            let point = point.clone();
            cells.push((
                point.clone(),
                fault,
                tokio::spawn(async move {
                    let _permit = gate.acquire_owned().await.unwrap();
                    strike(mode, point, fault).await
                }),
            ));
        }
    }
    let mut failures = Vec::new();
    let mut unfired = 0;
    println!("| {mode:?} | statement boundary | fault | first answer | retries | result |");
    for (point, fault, task) in cells {
        let verdict = task.await.unwrap();
        if !verdict.fired {
            unfired += 1;
        }
        let result = match &verdict.outcome {
            Ok(()) if verdict.fired => "holds".to_owned(),
            Ok(()) => "holds (not reached)".to_owned(),
            Err(e) => format!("FAILS: {e}"),
        };
        println!(
            "| | `{point}` | {} | {} | {} | {result} |",
            fault.name(),
            verdict.first,
            verdict.retries
        );
        if let Err(e) = verdict.outcome {
            failures.push(format!("{point} × {}: {e}", fault.name()));
        }
    }
    println!(
        "{mode:?}: {} boundaries × {} faults = {} cells, {} failed, {unfired} not reached",
        points.len(),
        FAULTS.len(),
        points.len() * FAULTS.len(),
        failures.len()
    );
    assert!(
        unfired * 4 <= points.len() * FAULTS.len(),
        "too many cells were never reached ({unfired}): the path differs from its recording"
    );
    assert!(failures.is_empty(), "{mode:?}:\n{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_holds_at_every_statement_boundary() {
    matrix(Mode::Plain).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_mode_holds_at_every_statement_boundary() {
    matrix(Mode::Transactional).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_holds_at_every_statement_boundary() {
    matrix(Mode::Completer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_leased_delivery_holds_at_every_statement_boundary() {
    matrix(Mode::Deliver).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumers_one_commit_delivery_holds_at_every_statement_boundary() {
    matrix(Mode::Process).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phased_mode_holds_at_every_statement_boundary() {
    matrix(Mode::Phased).await;
}

/// A request that answers `5xx` ends its claim so that the retry runs at once (plain mode
/// releases the key; phased mode, here after a step, ends the lease and keeps the steps).
/// When the store does not answer that statement (here: its connection cut before it reached
/// the server), the claim is ended once the store answers again, not left to its lease: the
/// retry runs within moments, not after the lease (the database clock stands still here, so
/// the lease would never run out).
async fn ended_once_the_store_answers(mode: Mode, path: &str, statement: &str) {
    // The statement that ends the claim, as the wire names it.
    let probe = Cell::start(mode).await;
    let first = probe.send_to(path).await.unwrap();
    assert!(first.status.is_server_error(), "{}", first.text());
    let end = probe
        .proxy
        .seen()
        .into_iter()
        .find(|p| p.label.starts_with(statement))
        .unwrap_or_else(|| panic!("no {statement} in {:?}", probe.proxy.seen()));
    probe.cleanup().await;

    let cell = Cell::start(mode).await;
    cell.proxy.arm(end, Fault::CutBefore);
    let first = cell.send_to(path).await.unwrap();
    assert!(first.status.is_server_error(), "{}", first.text());
    assert!(cell.proxy.fired());
    let mut retry = cell.send_to(path).await.unwrap();
    for _ in 0..50 {
        if retry.status != 409 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        retry = cell.send_to(path).await.unwrap();
    }
    assert_eq!(retry.status, 201, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(cell.scalar("SELECT count(*) FROM payments").await, 1);
    assert_eq!(cell.provider.charges(), 1);
    cell.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_the_store_could_not_make_is_made_once_it_answers_again() {
    ended_once_the_store_answers(
        Mode::Plain,
        "/fail-once",
        "SELECT tower_idempotency_plain_release",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_phased_claim_the_store_could_not_end_is_ended_once_it_answers_again() {
    ended_once_the_store_answers(
        Mode::Completer,
        "/pay",
        "WITH done AS (UPDATE tower_idempotency_keys",
    )
    .await;
}

/// A delivery dropped while the `BEGIN` of its transaction is on its way leaves no
/// connection inside a transaction: sqlx's `begin`, dropped before the server's answer,
/// gives the connection back to the pool with the transaction open (the server ran the
/// `BEGIN`), and every statement sent on it after that runs in a transaction nobody ends,
/// holding its locks (the next delivery of the message waited for them for ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_dropped_during_its_begin_leaves_no_transaction_open() {
    let cell = Cell::start(Mode::Deliver).await;
    cell.proxy.arm(
        Point {
            label: "BEGIN".to_owned(),
            nth: 0,
        },
        Fault::Hold,
    );
    tokio::select! {
        outcome = cell.deliver() => panic!("the delivery answered through a held BEGIN: {outcome:?}"),
        () = cell.proxy.hit() => {}
    }
    cell.proxy.heal();
    // The connection goes back to the pool once the held answer arrives.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let open = cell
        .scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{}' \
             AND state LIKE 'idle in transaction%'",
            cell.schema.name
        ))
        .await;
    assert_eq!(open, 0, "a pooled connection was left inside a transaction");
    // And the message is delivered in the end, once.
    let outcome = check_delivery(&cell, Mode::Deliver, &Err("dropped".to_owned())).await;
    assert!(outcome.is_ok(), "{outcome:?}");
    cell.cleanup().await;
}
