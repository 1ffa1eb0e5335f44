//! The client that drives a side: `--connections` keep-alive HTTP/1.1 connections sending
//! requests back to back through the warm-up and the measured window ([`drive`]), and what
//! that window produced ([`Stats`]).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::http::{StatusCode, header};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::cpu::{Cpu, CpuSnapshot};
use crate::runner::Args;
use crate::scenario::{KeyPlan, PATH, replay_key};
use crate::{BoxError, common};

pub(crate) fn request(host: &str, key: &str, body: &Bytes) -> http::Request<Full<Bytes>> {
    http::Request::post(PATH)
        .header(header::HOST, host)
        .header(header::CONTENT_TYPE, "application/json")
        .header("idempotency-key", key)
        .body(Full::new(body.clone()))
        .unwrap()
}

/// A small xorshift generator, one per connection: picks replay keys.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let n = u64::try_from(n.max(1)).unwrap_or(u64::MAX);
        usize::try_from(self.0 % n).unwrap_or(0)
    }
}

/// What one side's measured window produced.
pub(crate) struct Stats {
    pub(crate) requests: u64,
    pub(crate) unexpected: u64,
    window: Duration,
    /// Latencies of the requests completed in the window, in microseconds, sorted.
    latencies_us: Vec<u32>,
    /// CPU time used in the window.
    cpu: Cpu,
}

impl Stats {
    /// CPU time of the server's threads per request, in microseconds.
    pub(crate) fn app_us(&self) -> f64 {
        self.cpu.server.as_secs_f64() * 1e6 / self.requests as f64
    }

    /// CPU time of the pool's Postgres backends per request, in microseconds.
    pub(crate) fn db_us(&self) -> Option<f64> {
        Some(self.cpu.db?.as_secs_f64() * 1e6 / self.requests as f64)
    }

    /// What everything else on the machine used while this side ran, in cores.
    pub(crate) fn others_cores(&self) -> Option<f64> {
        let ours = self.cpu.server + self.cpu.client + self.cpu.db.unwrap_or_default();
        let busy = self.cpu.machine?;
        Some(busy.saturating_sub(ours).as_secs_f64() / self.window.as_secs_f64())
    }

    pub(crate) fn rps(&self) -> f64 {
        self.requests as f64 / self.window.as_secs_f64()
    }

    /// The latency at quantile `q` (nearest rank), in milliseconds.
    pub(crate) fn quantile_ms(&self, q: f64) -> f64 {
        if self.latencies_us.is_empty() {
            return f64::NAN;
        }
        let last = self.latencies_us.len() - 1;
        // `q` is in [0, 1], so the rank is in [0, last]; truncating it is the nearest rank.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rank = ((last as f64) * q).round() as usize;
        f64::from(self.latencies_us[rank.min(last)]) / 1000.0
    }

    pub(crate) fn merge(&mut self, other: Stats) {
        self.requests += other.requests;
        self.unexpected += other.unexpected;
        self.window += other.window;
        self.cpu = self.cpu.add(other.cpu);
        self.latencies_us.extend(other.latencies_us);
        self.latencies_us.sort_unstable();
    }
}

struct ConnResult {
    requests: u64,
    unexpected: u64,
    latencies_us: Vec<u32>,
}

/// Drives `addr` with `args.connections` connections: warm-up, then the measured window.
pub(crate) async fn drive(
    addr: SocketAddr,
    args: &Args,
    keys: KeyPlan,
    expect: StatusCode,
    tag: &str,
    db_pids: Vec<u32>,
) -> Result<Stats, BoxError> {
    let body = common::json_body(common::BODY_LEN);
    let host = addr.to_string();
    let mut senders = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                eprintln!("client connection failed: {e}");
            }
        });
        senders.push(sender);
    }
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let measure_until = measure_from + args.seconds;
    let probe = tokio::spawn(async move {
        tokio::time::sleep_until(measure_from.into()).await;
        let before = CpuSnapshot::take(&db_pids);
        tokio::time::sleep_until(measure_until.into()).await;
        CpuSnapshot::take(&db_pids).since(&before)
    });
    let mut tasks = Vec::with_capacity(senders.len());
    for (conn, mut sender) in senders.into_iter().enumerate() {
        let (body, host, tag) = (body.clone(), host.clone(), tag.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut out = ConnResult {
                requests: 0,
                unexpected: 0,
                latencies_us: Vec::new(),
            };
            let seed = u64::try_from(conn)
                .unwrap_or(0)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rng = Rng(seed | 1);
            let mut seq = 0u64;
            loop {
                let sent = Instant::now();
                if sent >= measure_until {
                    break;
                }
                let key = match keys {
                    KeyPlan::New => {
                        seq += 1;
                        format!("{tag}-{conn}-{seq}")
                    }
                    KeyPlan::Replay { count } => replay_key(rng.below(count)),
                };
                sender.ready().await?;
                let res = sender.send_request(request(&host, &key, &body)).await?;
                let status = res.status();
                res.into_body().collect().await?;
                let done = Instant::now();
                if done >= measure_from && done < measure_until {
                    out.requests += 1;
                    if status != expect {
                        out.unexpected += 1;
                    }
                    let us = (done - sent).as_micros();
                    out.latencies_us.push(u32::try_from(us).unwrap_or(u32::MAX));
                }
            }
            Ok::<_, BoxError>(out)
        }));
    }
    let mut stats = Stats {
        requests: 0,
        unexpected: 0,
        window: args.seconds,
        latencies_us: Vec::new(),
        cpu: Cpu::default(),
    };
    for task in tasks {
        let r = task.await??;
        stats.requests += r.requests;
        stats.unexpected += r.unexpected;
        stats.latencies_us.extend(r.latencies_us);
    }
    stats.latencies_us.sort_unstable();
    stats.cpu = probe.await?;
    Ok(stats)
}
