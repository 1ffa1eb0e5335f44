//! The load: `connections` keep-alive connections sending requests back to back through a
//! warm-up and a measured window, with a fresh key per request (`new`) or cycling over 1,000
//! keys completed beforehand (`replay`).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::app::Counters;
use crate::cpu;
use crate::http::{Common, Conn, Key, write_request};

/// Keys completed before a `replay` window.
pub const REPLAY_KEYS: u64 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Workload {
    New,
    Replay,
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::New => "new",
            Workload::Replay => "replay",
        }
    }
}

pub struct Plan {
    pub addr: SocketAddr,
    pub common: Common,
    pub connections: usize,
    pub warmup: Duration,
    pub seconds: Duration,
    pub workload: Workload,
    /// Distinguishes this run's keys from every other run's.
    pub tag: u64,
}

/// What a measured window produced.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub requests: u64,
    /// Answers outside 2xx, by status (in the window).
    pub non_2xx: BTreeMap<u16, u64>,
    /// Handler runs in the window.
    pub handler_runs: u64,
    /// Non-2xx answers while completing the replay keys.
    pub prepare_non_2xx: u64,
    pub window: Duration,
    /// Where the machine's CPU went in the window.
    pub cpu: cpu::Usage,
}

impl Outcome {
    pub fn rps(&self) -> f64 {
        self.requests as f64 / self.window.as_secs_f64()
    }

    pub fn errors(&self) -> u64 {
        self.non_2xx.values().sum::<u64>() + self.prepare_non_2xx
    }
}

fn replay_key(tag: u64, i: u64) -> Key {
    Key((u128::from(tag) << 64) | u128::from(i))
}

fn new_key(tag: u64, conn: usize, seq: u64) -> Key {
    Key((u128::from(tag) << 64) | (1 << 63) | ((conn as u128) << 40) | u128::from(seq))
}

/// Completes each replay key once, spread over the connections.
async fn complete_replay_keys(plan: &Plan) -> Result<u64> {
    let mut tasks = Vec::with_capacity(plan.connections);
    for c in 0..plan.connections {
        let (addr, common, tag, n) = (plan.addr, plan.common.clone(), plan.tag, plan.connections);
        tasks.push(tokio::spawn(async move {
            let mut conn = Conn::connect(addr).await?;
            let mut buf = Vec::with_capacity(512);
            let mut non_2xx = 0;
            for i in (c as u64..REPLAY_KEYS).step_by(n) {
                write_request(&mut buf, &common, "/orders", replay_key(tag, i), i);
                conn.send(&buf).await?;
                if !(200..300).contains(&conn.read_status().await?) {
                    non_2xx += 1;
                }
            }
            anyhow::Ok(non_2xx)
        }));
    }
    let mut non_2xx = 0;
    for task in tasks {
        non_2xx += task.await.context("a client task panicked")??;
    }
    Ok(non_2xx)
}

struct ConnCount {
    requests: u64,
    non_2xx: BTreeMap<u16, u64>,
}

/// Runs the warm-up and the measured window.
pub async fn run(plan: &Plan, counters: &Counters) -> Result<Outcome> {
    let prepare_non_2xx = match plan.workload {
        Workload::New => 0,
        Workload::Replay => complete_replay_keys(plan)
            .await
            .context("completing the replay keys")?,
    };
    let mut conns = Vec::with_capacity(plan.connections);
    for _ in 0..plan.connections {
        conns.push(Conn::connect(plan.addr).await?);
    }
    let start = Instant::now();
    let from = start + plan.warmup;
    let until = from + plan.seconds;
    let probe = {
        let (counters, window) = (counters.clone(), plan.seconds);
        tokio::spawn(async move {
            tokio::time::sleep_until(from.into()).await;
            let (runs, cpu) = (counters.orders(), cpu::Snapshot::take());
            tokio::time::sleep_until(until.into()).await;
            (
                counters.orders() - runs,
                cpu::Snapshot::take().since(&cpu, window),
            )
        })
    };
    let common = Arc::new(plan.common.clone());
    let mut tasks = Vec::with_capacity(conns.len());
    for (c, mut conn) in conns.into_iter().enumerate() {
        let (common, workload, tag) = (common.clone(), plan.workload, plan.tag);
        tasks.push(tokio::spawn(async move {
            let mut count = ConnCount {
                requests: 0,
                non_2xx: BTreeMap::new(),
            };
            let mut buf = Vec::with_capacity(512);
            // Each connection starts at its own place in the replay keys.
            let mut next = (c as u64 * 31) % REPLAY_KEYS;
            let mut seq = 0u64;
            while Instant::now() < until {
                let (key, qty) = match workload {
                    Workload::New => {
                        seq += 1;
                        (new_key(tag, c, seq), seq % 100)
                    }
                    Workload::Replay => {
                        let i = next;
                        next = (next + 1) % REPLAY_KEYS;
                        (replay_key(tag, i), i)
                    }
                };
                write_request(&mut buf, &common, "/orders", key, qty);
                conn.send(&buf).await?;
                let status = conn.read_status().await?;
                let done = Instant::now();
                if done >= from && done < until {
                    count.requests += 1;
                    if !(200..300).contains(&status) {
                        *count.non_2xx.entry(status).or_default() += 1;
                    }
                }
            }
            anyhow::Ok(count)
        }));
    }
    let mut outcome = Outcome {
        prepare_non_2xx,
        window: plan.seconds,
        ..Outcome::default()
    };
    for task in tasks {
        let count = task.await.context("a client task panicked")??;
        outcome.requests += count.requests;
        for (status, n) in count.non_2xx {
            *outcome.non_2xx.entry(status).or_default() += n;
        }
    }
    (outcome.handler_runs, outcome.cpu) = probe.await.context("the counter probe panicked")?;
    Ok(outcome)
}
