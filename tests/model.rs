//! A model-based property test of the [`Store`] contract.
//!
//! Random sequences of claims, completions, releases, renewals, purges and clock advances, over
//! three (scope, key) pairs and two fingerprints, are applied to a small reference model
//! ([`Model`], the contract written out) and to each store: [`MemoryStore`], and
//! [`PostgresStore`] with every [`ClaimStrategy`]. After every step the store's answer must be
//! the model's: the claim's outcome (acquired, and whether by takeover / in flight, and for how
//! long / completed, with which response / mismatch), the `bool` of complete, release and
//! renew, the number of records purged (the memory store removes expired answers on its own as
//! it is used, so its purges may find fewer: at least the model's expired in-progress records).
//! Lease tokens are compared up to renaming: the model numbers claims in the order they were
//! acquired, the harness keeps each store's token for each number, and a store must never hand
//! out a token twice.
//!
//! Time is the test's: the memory store runs on a paused Tokio clock moved by
//! `tokio::time::advance`; each Postgres store gets a schema whose clock hook,
//! `tower_idempotency_now()`, is replaced by a function reading a one-row table, moved by
//! updating the table.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::str::FromStr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::PgSchema;
use tower_idempotency::{
    ClaimOutcome, ClaimRequest, ClaimStrategy, Fingerprint, IdempotencyKey, LeaseToken,
    MemoryStore, PostgresStore, Store, StoreError, StoredResponse,
};

/// The (scope, key) pairs the operations use: two keys of one scope, and the first key again
/// in another scope.
const KEYS: [(&str, &str); 3] = [("", "a"), ("", "b"), ("tenant", "a")];

const FINGERPRINTS: [Fingerprint; 2] = [
    Fingerprint::from_bytes([0; 32]),
    Fingerprint::from_bytes([1; 32]),
];

/// Both stores cap a duration at 100 years (so `Duration::MAX` means "never").
const MAX_SPAN_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

/// The responses a completion stores.
fn response(i: usize) -> StoredResponse {
    match i {
        0 => StoredResponse::new(
            StatusCode::OK,
            HeaderMap::new(),
            Bytes::from_static(b"zero"),
        ),
        1 => {
            let mut headers = HeaderMap::new();
            headers.insert("x-n", HeaderValue::from_static("1"));
            StoredResponse::new(StatusCode::CREATED, headers, Bytes::from_static(b"one"))
        }
        _ => StoredResponse::without_body(StatusCode::ACCEPTED, HeaderMap::new()),
    }
}

fn key(i: usize) -> IdempotencyKey {
    IdempotencyKey::parse(KEYS[i].1).unwrap()
}

/// Which claim's token an operation uses.
#[derive(Clone, Copy, Debug)]
enum Pick {
    /// The latest claim of the operation's key (the one most likely to hold it).
    Latest,
    /// Any claim made so far, of any key.
    Any(Index),
    /// A token no claim was given.
    Unknown,
}

#[derive(Clone, Debug)]
enum Op {
    Claim {
        key: usize,
        fp: usize,
        lease: Duration,
        ttl: Duration,
    },
    Complete {
        key: usize,
        token: Pick,
        ttl: Duration,
        response: usize,
    },
    Release {
        key: usize,
        token: Pick,
    },
    Renew {
        key: usize,
        token: Pick,
        lease: Duration,
    },
    Advance(Duration),
    Purge {
        batch: usize,
    },
}

/// What an operation answered.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    /// `claim` numbers the claims acquired so far, from 0.
    Acquired {
        claim: usize,
        takeover: bool,
    },
    InFlight {
        retry_after: Duration,
    },
    Completed(StoredResponse),
    Mismatch,
    /// complete, release or renew.
    Done(bool),
    Purged(u64),
    Advanced,
    /// Never expected: the store failed, answered something the model has no name for, or
    /// handed out a token it had given before.
    Wrong(String),
}

/// The claim an operation's token belongs to (`None`: a token no claim was given).
fn resolve(pick: Pick, key: usize, claims: &[usize]) -> Option<usize> {
    match pick {
        Pick::Latest => claims.iter().rposition(|&k| k == key),
        Pick::Any(i) => (!claims.is_empty()).then(|| i.index(claims.len())),
        Pick::Unknown => None,
    }
}

fn token_pick(op: &Op) -> Option<(usize, Pick)> {
    match *op {
        Op::Complete { key, token, .. }
        | Op::Release { key, token }
        | Op::Renew { key, token, .. } => Some((key, token)),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// The model: the contract, in milliseconds of a clock that starts at 0.

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .min(MAX_SPAN_MS)
}

#[derive(Clone, Debug)]
struct Record {
    fp: usize,
    /// The record counts as absent from this time on.
    expires_at: u64,
    state: State,
}

#[derive(Clone, Debug)]
enum State {
    InProgress { claim: usize, lease_until: u64 },
    Completed(usize),
}

#[derive(Debug, Default)]
struct Model {
    now: u64,
    records: [Option<Record>; KEYS.len()],
    /// The key of each claim acquired so far, by claim number.
    claims: Vec<usize>,
    /// Of the records the latest purge deleted, how many were in progress.
    purged_running: u64,
}

impl Model {
    fn apply(&mut self, op: &Op, claim: Option<usize>) -> Seen {
        let now = self.now;
        match *op {
            Op::Claim {
                key,
                fp,
                lease,
                ttl,
            } => {
                let takeover = match &self.records[key] {
                    // An expired record counts as absent.
                    Some(r) if r.expires_at > now => {
                        if r.fp != fp {
                            return Seen::Mismatch;
                        }
                        match r.state {
                            State::Completed(i) => return Seen::Completed(response(i)),
                            State::InProgress { lease_until, .. } if lease_until > now => {
                                return Seen::InFlight {
                                    retry_after: Duration::from_millis(lease_until - now),
                                };
                            }
                            // The lease ran out: taken over.
                            State::InProgress { .. } => true,
                        }
                    }
                    _ => false,
                };
                let claim = self.claims.len();
                self.claims.push(key);
                let lease_until = now + ms(lease);
                self.records[key] = Some(Record {
                    fp,
                    // In progress, a record lives at least as long as its lease.
                    expires_at: now + ms(ttl).max(ms(lease)),
                    state: State::InProgress { claim, lease_until },
                });
                Seen::Acquired { claim, takeover }
            }
            // A token holds its in-progress record, expired or not, until a claim replaces it
            // or it is released or purged.
            Op::Complete {
                key, ttl, response, ..
            } => Seen::Done(match self.held(key, claim) {
                Some(r) => {
                    r.state = State::Completed(response);
                    r.expires_at = now + ms(ttl);
                    true
                }
                None => false,
            }),
            Op::Release { key, .. } => {
                let held = self.held(key, claim).is_some();
                if held {
                    self.records[key] = None;
                }
                Seen::Done(held)
            }
            Op::Renew { key, lease, .. } => Seen::Done(match self.held(key, claim) {
                Some(r) => {
                    let until = now + ms(lease);
                    r.state = State::InProgress {
                        claim: claim.unwrap(),
                        lease_until: until,
                    };
                    r.expires_at = r.expires_at.max(until);
                    true
                }
                None => false,
            }),
            Op::Advance(by) => {
                self.now += ms(by);
                Seen::Advanced
            }
            Op::Purge { .. } => {
                let (mut purged, mut running) = (0, 0);
                for record in &mut self.records {
                    if let Some(r) = record.as_ref().filter(|r| r.expires_at <= now) {
                        running += u64::from(matches!(r.state, State::InProgress { .. }));
                        *record = None;
                        purged += 1;
                    }
                }
                self.purged_running = running;
                Seen::Purged(purged)
            }
        }
    }

    fn held(&mut self, key: usize, claim: Option<usize>) -> Option<&mut Record> {
        self.records[key]
            .as_mut()
            .filter(|r| matches!(r.state, State::InProgress { claim: c, .. } if Some(c) == claim))
    }
}

// ---------------------------------------------------------------------------------------------
// The stores under test.

/// A store with its clock.
trait Subject {
    type Store: Store;
    fn name(&self) -> String;
    fn store(&self) -> &Self::Store;
    async fn advance(&self, by: Duration);
    /// Whether the store removes expired answers on its own (the memory store does, as it
    /// is used): then a purge finds the expired in-progress records and any number of the
    /// expired answers, which count as absent all the same.
    fn sweeps_answers(&self) -> bool {
        false
    }
}

/// Applies `op` to a store. `tokens` holds the store's token of each claim, by claim number.
async fn apply<T: Subject>(
    subject: &T,
    tokens: &mut Vec<LeaseToken>,
    op: &Op,
    claim: Option<usize>,
) -> Seen {
    let store = subject.store();
    // A token no claim of this store was given (stores number tokens from 1).
    let token = claim.map_or(LeaseToken::from_raw(-1), |c| tokens[c]);
    let result: Result<Seen, StoreError> = async {
        Ok(match *op {
            Op::Claim {
                key: k,
                fp,
                lease,
                ttl,
            } => {
                let key = key(k);
                let outcome = store
                    .claim(ClaimRequest {
                        scope: KEYS[k].0,
                        key: &key,
                        fingerprint: FINGERPRINTS[fp],
                        lease,
                        ttl,
                    })
                    .await?;
                match outcome {
                    ClaimOutcome::Acquired { token, takeover } if !tokens.contains(&token) => {
                        tokens.push(token);
                        Seen::Acquired {
                            claim: tokens.len() - 1,
                            takeover,
                        }
                    }
                    ClaimOutcome::InFlight { retry_after } => Seen::InFlight { retry_after },
                    ClaimOutcome::Completed(r) => Seen::Completed(r),
                    ClaimOutcome::Mismatch => Seen::Mismatch,
                    other => Seen::Wrong(format!("{other:?} (a token given before?)")),
                }
            }
            Op::Complete {
                key: k,
                ttl,
                response: r,
                ..
            } => Seen::Done(
                store
                    .complete(KEYS[k].0, &key(k), token, &response(r), ttl)
                    .await?,
            ),
            Op::Release { key: k, .. } => {
                Seen::Done(store.release(KEYS[k].0, &key(k), token).await?)
            }
            Op::Renew { key: k, lease, .. } => {
                Seen::Done(store.renew(KEYS[k].0, &key(k), token, lease).await?)
            }
            Op::Advance(by) => {
                subject.advance(by).await;
                Seen::Advanced
            }
            Op::Purge { batch } => Seen::Purged(store.purge_expired(batch).await?),
        })
    }
    .await;
    result.unwrap_or_else(|e| Seen::Wrong(format!("store error: {e}")))
}

/// Runs `ops` on the model and, in lockstep, on every subject (each with a fresh store and a
/// clock at the same start), failing at the first answer that differs from the model's.
async fn run_case<T: Subject>(subjects: &[T], ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut tokens: Vec<Vec<LeaseToken>> = vec![Vec::new(); subjects.len()];
    for (step, op) in ops.iter().enumerate() {
        let claim = token_pick(op).and_then(|(key, pick)| resolve(pick, key, &model.claims));
        let before = format!("{:?} at {} ms", model.records, model.now);
        let expected = model.apply(op, claim);
        for (subject, tokens) in subjects.iter().zip(&mut tokens) {
            let seen = apply(subject, tokens, op, claim).await;
            let swept = match (&seen, &expected) {
                (Seen::Purged(n), Seen::Purged(all)) => {
                    subject.sweeps_answers() && (model.purged_running..=*all).contains(n)
                }
                _ => false,
            };
            if seen != expected && !swept {
                return Err(TestCaseError::fail(format!(
                    "step {step}: {op:?} (claim {claim:?}) on {}:\n  store: {seen:?}\n  model: \
                     {expected:?}\n  model before the step: {before}",
                    subject.name()
                )));
            }
        }
    }
    Ok(())
}

fn span() -> impl Strategy<Value = Duration> {
    prop_oneof![
        6 => prop::sample::select(vec![0u64, 100, 200, 300, 500]).prop_map(Duration::from_millis),
        1 => Just(Duration::MAX),
    ]
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        6 => Just(Pick::Latest),
        2 => any::<Index>().prop_map(Pick::Any),
        1 => Just(Pick::Unknown),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS.len();
    prop_oneof![
        5 => (key.clone(), prop_oneof![3 => Just(0), 1 => Just(1)], span(), span())
            .prop_map(|(key, fp, lease, ttl)| Op::Claim { key, fp, lease, ttl }),
        3 => (key.clone(), pick(), span(), 0..3usize)
            .prop_map(|(key, token, ttl, response)| Op::Complete { key, token, ttl, response }),
        1 => (key.clone(), pick()).prop_map(|(key, token)| Op::Release { key, token }),
        2 => (key, pick(), span()).prop_map(|(key, token, lease)| Op::Renew { key, token, lease }),
        3 => prop::sample::select(vec![50u64, 100, 200, 300, 500, 1000])
            .prop_map(|ms| Op::Advance(Duration::from_millis(ms))),
        1 => (1..4usize).prop_map(|batch| Op::Purge { batch }),
    ]
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        // Nothing is written into the repository; a failure prints its (shrunk) operations.
        failure_persistence: None,
        ..Config::default()
    })
}

// ---------------------------------------------------------------------------------------------
// The memory store, on a paused Tokio clock.

struct Memory(MemoryStore);

impl Subject for Memory {
    type Store = MemoryStore;
    fn name(&self) -> String {
        "MemoryStore".into()
    }
    fn store(&self) -> &MemoryStore {
        &self.0
    }
    async fn advance(&self, by: Duration) {
        tokio::time::advance(by).await;
    }
    fn sweeps_answers(&self) -> bool {
        true
    }
}

#[test]
fn memory_store_follows_the_model() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    let result = runner(1024).run(&prop::collection::vec(op(), 1..40), |ops| {
        rt.block_on(run_case(&[Memory(MemoryStore::new())], &ops))
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

// ---------------------------------------------------------------------------------------------
// The Postgres store, on a clock of its schema.

/// The clock every case starts from.
const START: &str = "2030-01-01 00:00:00+00";

struct Postgres {
    strategy: ClaimStrategy,
    store: PostgresStore,
    pool: PgPool,
}

impl Postgres {
    /// A migrated store in `schema`, whose clock hook reads the schema's clock.
    async fn new(schema: &PgSchema, strategy: ClaimStrategy) -> Self {
        let s = &schema.name;
        let opts = PgConnectOptions::from_str(&support::database_url())
            .unwrap()
            .options([
                ("search_path", s.to_string()),
                // Thousands of tiny commits: waiting for each to reach the disk is all the
                // time they would take.
                ("synchronous_commit", "off".into()),
            ]);
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(opts)
            .await
            .unwrap();
        let store = PostgresStore::new(pool.clone()).with_claim_strategy(strategy);
        store.migrate().await.unwrap();
        // The store reads the time through its clock hook: here, the schema's clock.
        schema.controlled_clock_from(&format!("'{START}'")).await;
        Postgres {
            strategy,
            store,
            pool,
        }
    }

    /// No records, and the clock back at [`START`].
    async fn reset(&self) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DELETE FROM tower_idempotency_keys; UPDATE ti_clock SET t = '{START}';"
        )))
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

impl Subject for Postgres {
    type Store = PostgresStore;
    fn name(&self) -> String {
        format!("PostgresStore ({:?})", self.strategy)
    }
    fn store(&self) -> &PostgresStore {
        &self.store
    }
    async fn advance(&self, by: Duration) {
        sqlx::query("UPDATE ti_clock SET t = t + $1::float8 * interval '1 millisecond'")
            .bind(i64::try_from(by.as_millis()).unwrap())
            .execute(&self.pool)
            .await
            .unwrap();
    }
}

const STRATEGIES: [ClaimStrategy; 4] = [
    ClaimStrategy::Adaptive,
    ClaimStrategy::Combined,
    ClaimStrategy::ReadFirst,
    ClaimStrategy::InsertFirst,
];

/// One schema (and store) per claim strategy.
async fn postgres_subjects() -> (Vec<PgSchema>, Vec<Postgres>) {
    let mut schemas = Vec::new();
    let mut subjects = Vec::new();
    for strategy in STRATEGIES {
        let schema = PgSchema::new().await;
        subjects.push(Postgres::new(&schema, strategy).await);
        schemas.push(schema);
    }
    (schemas, subjects)
}

async fn cleanup(schemas: Vec<PgSchema>, subjects: Vec<Postgres>) {
    for subject in subjects {
        subject.pool.close().await;
    }
    for schema in schemas {
        schema.drop_schema().await;
    }
}

#[test]
fn postgres_store_follows_the_model() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (schemas, subjects) = rt.block_on(postgres_subjects());
    let result = runner(128).run(&prop::collection::vec(op(), 1..32), |ops| {
        rt.block_on(async {
            for subject in &subjects {
                subject.reset().await;
            }
            run_case(&subjects, &ops).await
        })
    });
    rt.block_on(cleanup(schemas, subjects));
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// The schema's clock really is the store's: real time moves nothing, the clock moves
/// leases and expiry, to the millisecond, whichever statement computes them.
#[tokio::test]
async fn postgres_time_is_the_schema_clock() {
    let (schemas, subjects) = postgres_subjects().await;
    let key = key(0);
    let claim = ClaimRequest {
        scope: "",
        key: &key,
        fingerprint: FINGERPRINTS[0],
        lease: Duration::from_millis(100),
        ttl: Duration::from_millis(100),
    };
    for pg in &subjects {
        let store = pg.store();
        let ClaimOutcome::Acquired { token, .. } = store.claim(claim).await.unwrap() else {
            panic!("{}: not acquired", pg.name())
        };
        let stamped: bool = sqlx::query_scalar(
            "SELECT lease_expires_at = (SELECT t FROM ti_clock) + interval '100 ms'
                    AND expires_at = lease_expires_at
               FROM tower_idempotency_keys",
        )
        .fetch_one(&pg.pool)
        .await
        .unwrap();
        assert!(stamped, "{}: the claim used the schema's clock", pg.name());
        // Real time passes; the store's does not.
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(
            store.claim(claim).await.unwrap(),
            ClaimOutcome::InFlight {
                retry_after: Duration::from_millis(100)
            },
            "{}",
            pg.name()
        );
        pg.advance(Duration::from_millis(99)).await;
        assert_eq!(
            store.claim(claim).await.unwrap(),
            ClaimOutcome::InFlight {
                retry_after: Duration::from_millis(1)
            },
            "{}",
            pg.name()
        );
        pg.advance(Duration::from_millis(1)).await;
        let outcome = store.claim(claim).await.unwrap();
        let ClaimOutcome::Acquired { token: next, .. } = outcome else {
            panic!("{}: {outcome:?}", pg.name())
        };
        assert_ne!(next, token);
        assert!(!store.renew("", &key, token, claim.lease).await.unwrap());
        // The completion's expiry too: 100 ms from the completion.
        assert!(
            store
                .complete("", &key, next, &response(0), claim.ttl)
                .await
                .unwrap()
        );
        pg.advance(Duration::from_millis(99)).await;
        assert_eq!(store.purge_expired(10).await.unwrap(), 0, "{}", pg.name());
        pg.advance(Duration::from_millis(1)).await;
        assert_eq!(store.purge_expired(10).await.unwrap(), 1, "{}", pg.name());
    }
    cleanup(schemas, subjects).await;
}
