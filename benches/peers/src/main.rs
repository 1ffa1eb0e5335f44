//! One axum handler behind each published Rust idempotency middleware, measured side by side
//! in alternating rounds. See README.md; run with `bash benches/peers/run.sh`.

mod app;
mod checks;
mod contenders;
mod cpu;
mod http;
mod instance;
mod load;
mod report;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use tokio::runtime::Handle;

use crate::contenders::Contender;
use crate::instance::Instance;
use crate::load::{Plan, Workload};
use crate::report::Results;

const USAGE: &str = "\
usage: peers-bench [options]
  --only a,b,c        contenders to run (none is always included); default all:
                      {names}
  --workload W        new | replay | both (default both)
  --connections N     client connections (default 32)
  --seconds S         measured seconds per run (default 10)
  --warmup S          warm-up seconds per run (default 2)
  --rounds R          rounds (default 3)
  --db-url URL        default $DATABASE_URL or postgres://postgres@127.0.0.1:5432/peers_bench
  --no-checks         skip the correctness checks";

struct Args {
    contenders: Vec<&'static Contender>,
    workloads: Vec<Workload>,
    connections: usize,
    seconds: Duration,
    warmup: Duration,
    rounds: usize,
    db_url: String,
    checks: bool,
}

fn usage() -> String {
    USAGE.replace("{names}", &report::names())
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        contenders: contenders::ALL.iter().collect(),
        workloads: vec![Workload::New, Workload::Replay],
        connections: 32,
        seconds: Duration::from_secs(10),
        warmup: Duration::from_secs(2),
        rounds: 3,
        db_url: std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/peers_bench".to_owned()),
        checks: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            println!("{}", usage());
            std::process::exit(0);
        }
        if flag == "--no-checks" {
            args.checks = false;
            continue;
        }
        let value = it
            .next()
            .with_context(|| format!("{flag} needs a value\n{}", usage()))?;
        let number = |v: &str| -> Result<u64> {
            v.parse()
                .with_context(|| format!("{flag}: `{v}` is not a whole number"))
        };
        match flag.as_str() {
            "--only" => {
                let mut chosen: Vec<&'static Contender> = vec![&contenders::ALL[0]];
                for name in value.split(',').map(str::trim).filter(|n| !n.is_empty()) {
                    let c = contenders::by_name(name).with_context(|| {
                        format!(
                            "--only: no contender `{name}`; there are {}",
                            report::names()
                        )
                    })?;
                    if !chosen.iter().any(|x| x.name == c.name) {
                        chosen.push(c);
                    }
                }
                // The order of the tables, whatever the order given.
                chosen.sort_by_key(|c| contenders::ALL.iter().position(|x| x.name == c.name));
                args.contenders = chosen;
            }
            "--workload" => {
                args.workloads = match value.as_str() {
                    "new" => vec![Workload::New],
                    "replay" => vec![Workload::Replay],
                    "both" => vec![Workload::New, Workload::Replay],
                    other => bail!("--workload: `{other}` is not new, replay or both"),
                }
            }
            "--connections" => args.connections = usize::try_from(number(&value)?.max(1))?,
            "--seconds" => args.seconds = Duration::from_secs(number(&value)?.max(1)),
            "--warmup" => args.warmup = Duration::from_secs(number(&value)?),
            "--rounds" => args.rounds = usize::try_from(number(&value)?.max(1))?,
            "--db-url" => args.db_url = value,
            other => bail!("unknown option {other}\n{}", usage()),
        }
    }
    Ok(args)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("server")
        .enable_all()
        .build()
        .context("building the server runtime")?;
    let client_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("building the client runtime")?;
    let result = client_rt.block_on(run(&args, server_rt.handle()));
    server_rt.shutdown_timeout(Duration::from_secs(5));
    result
}

/// A tag no other run of this process (or a recent one) uses, for keys.
fn tag(seq: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    (nanos << 16) ^ seq
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_owned())
}

fn print_header(args: &Args) {
    println!("peers-bench: one handler behind each idempotency middleware, side by side");
    println!(
        "{} connections, {} s warm-up + {} s measured per run, {} round(s), workloads {}, \
         server runtime 2 workers, client runtime 1 thread, Postgres pools of {} on {}",
        args.connections,
        args.warmup.as_secs(),
        args.seconds.as_secs(),
        args.rounds,
        args.workloads
            .iter()
            .map(|w| w.name())
            .collect::<Vec<_>>()
            .join("+"),
        contenders::POOL_SIZE,
        args.db_url
    );
    if let Ok(rev) = std::env::var("PEERS_MAIN_REV") {
        println!("tower-idempotency checkout: {rev}");
    }
    println!("load average at start: {}", loadavg());
    println!("\nContenders");
    for c in &args.contenders {
        println!("- {}: {}\n    {}", c.name, c.version, c.config);
    }
}

async fn run(args: &Args, server_rt: &Handle) -> Result<()> {
    print_header(args);
    let mut results = Results::new(args.contenders.clone(), args.workloads.clone(), args.rounds);
    let mut seq = 0u64;
    if args.checks {
        for c in &args.contenders {
            seq += 1;
            let report = async {
                let instance = Instance::start(server_rt, c, &args.db_url).await?;
                let report = checks::run(&instance, tag(seq)).await;
                instance.stop(server_rt).await?;
                report
            }
            .await;
            results.record_check(c.name, report.map_err(|e| format!("{e:#}")));
        }
        results.print_checks();
    }
    println!("\nRuns");
    let n = args.contenders.len();
    for round in 0..args.rounds {
        for &workload in &args.workloads {
            for i in 0..n {
                let c = args.contenders[(round + i) % n];
                seq += 1;
                let outcome = match run_one(args, server_rt, c, workload, tag(seq)).await {
                    Ok(outcome) => Some(outcome),
                    Err(e) => {
                        println!("  {} {}: {e:#}", c.name, workload.name());
                        None
                    }
                };
                results.record(c.name, workload, outcome);
                println!("{}", results.run_line(c.name, workload, round));
            }
        }
        results.print_round(round);
        println!();
    }
    if args.checks {
        results.print_checks();
    }
    results.print_final();
    results.print_disturbance();
    println!("\nload average at the end: {}", loadavg());
    Ok(())
}

async fn run_one(
    args: &Args,
    server_rt: &Handle,
    c: &Contender,
    workload: Workload,
    tag: u64,
) -> Result<load::Outcome> {
    let instance = Instance::start(server_rt, c, &args.db_url).await?;
    let plan = Plan {
        addr: instance.addr,
        common: instance.common.clone(),
        connections: args.connections,
        warmup: args.warmup,
        seconds: args.seconds,
        workload,
        tag,
    };
    let outcome = load::run(&plan, &instance.counters).await;
    instance.stop(server_rt).await?;
    outcome
}
