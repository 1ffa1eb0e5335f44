//! The shared runner: the command line ([`Args`], [`parse_args`]), one scenario run side by
//! side and round by round, each side on a fresh server driven by the client
//! ([`run_scenario`]), and the summary tables ([`print_table`]).

use std::time::Duration;

use tokio::runtime::Runtime;

use crate::BoxError;
use crate::client::{Stats, drive};
use crate::scenario::{Built, Ctx, KeyPlan, Scenario, all_scenarios};
use crate::server::{start_server, stop_server};

pub(crate) struct Args {
    pub(crate) scenarios: Vec<&'static Scenario>,
    pub(crate) connections: usize,
    pub(crate) seconds: Duration,
    pub(crate) warmup: Duration,
    pub(crate) pool: u32,
    pub(crate) rounds: usize,
    pub(crate) replay_keys: usize,
    /// The records the `memory-*-full` scenarios' stores hold (`--full-records`).
    pub(crate) full_records: usize,
    pub(crate) server_threads: usize,
    pub(crate) client_threads: usize,
    pub(crate) side: Side,
}

/// Which sides of each scenario run (`--side`); one side alone is for profiling it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Both,
    Layer,
    Baseline,
}

impl Side {
    fn runs(self, layered: bool) -> bool {
        match self {
            Side::Both => true,
            Side::Layer => layered,
            Side::Baseline => !layered,
        }
    }
}

const USAGE: &str = "usage: cargo bench --bench load -- [scenario...] [--connections N] \
[--seconds S] [--warmup S] [--pool N] [--rounds N] [--replay-keys N] [--full-records N] \
[--server-threads N] [--client-threads N] [--side both|layer|baseline]";

pub(crate) fn parse_args() -> Result<Args, String> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs this binary without it.
    // Then, like Criterion's test mode, make one short smoke run that checks every scenario
    // works (options given on the command line still apply).
    let measuring = argv.iter().any(|a| a == "--bench");
    let mut args = if measuring {
        Args {
            scenarios: Vec::new(),
            connections: 64,
            seconds: Duration::from_secs(10),
            warmup: Duration::from_secs(2),
            pool: 16,
            rounds: 1,
            replay_keys: 10_000,
            full_records: 1_000_000,
            server_threads: 2,
            client_threads: 2,
            side: Side::Both,
        }
    } else {
        println!("test mode (no --bench): a smoke run; `cargo bench --bench load` measures");
        Args {
            scenarios: Vec::new(),
            connections: 4,
            seconds: Duration::from_millis(100),
            warmup: Duration::from_millis(30),
            pool: 2,
            rounds: 1,
            replay_keys: 50,
            full_records: 1_000,
            server_threads: 2,
            client_threads: 1,
            side: Side::Both,
        }
    };
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        let secs = |v: String| -> Result<Duration, String> {
            v.parse::<f64>()
                .ok()
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .ok_or_else(|| format!("not a number of seconds: {v}"))
        };
        let num = |v: String| -> Result<usize, String> {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("not a positive number: {v}"))
        };
        match arg.as_str() {
            // `cargo bench` passes `--bench` to every benchmark binary.
            "--bench" => {}
            "--connections" => args.connections = num(value(&arg)?)?,
            "--seconds" => args.seconds = secs(value(&arg)?)?,
            "--warmup" => args.warmup = secs(value(&arg)?)?,
            "--pool" => {
                args.pool = u32::try_from(num(value(&arg)?)?).map_err(|e| e.to_string())?;
            }
            "--rounds" => args.rounds = num(value(&arg)?)?,
            "--replay-keys" => args.replay_keys = num(value(&arg)?)?,
            "--full-records" => args.full_records = num(value(&arg)?)?,
            "--server-threads" => args.server_threads = num(value(&arg)?)?,
            "--client-threads" => args.client_threads = num(value(&arg)?)?,
            "--side" => {
                args.side = match value(&arg)?.as_str() {
                    "both" => Side::Both,
                    "layer" => Side::Layer,
                    "baseline" => Side::Baseline,
                    other => return Err(format!("--side is both, layer or baseline, not {other}")),
                };
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other if other.starts_with('-') => {
                return Err(format!("unknown option {other}\n{USAGE}"));
            }
            name => {
                let scenario = all_scenarios().find(|s| s.name == name).ok_or_else(|| {
                    let names: Vec<_> = all_scenarios().map(|s| s.name).collect();
                    format!(
                        "unknown scenario {name}; the scenarios: {}",
                        names.join(", ")
                    )
                })?;
                args.scenarios.push(scenario);
            }
        }
    }
    if args.scenarios.is_empty() {
        args.scenarios = all_scenarios().collect();
    }
    Ok(args)
}

pub(crate) struct Outcome {
    scenario: &'static Scenario,
    layer: Option<Stats>,
    baseline: Option<Stats>,
}

impl Outcome {
    /// Layer ÷ baseline requests per second, when both sides ran.
    fn ratio(&self) -> Option<f64> {
        Some(self.layer.as_ref()?.rps() / self.baseline.as_ref()?.rps())
    }
}

fn run_side(
    ctx: &Ctx,
    server_rt: &Runtime,
    client_rt: &Runtime,
    built: &Built,
    layered: bool,
    round: usize,
) -> Result<Stats, BoxError> {
    if let (KeyPlan::New, Some(schema)) = (built.keys, &built.schema) {
        server_rt.block_on(schema.truncate())?;
    }
    let (layer, baseline) = match built.fresh {
        Some(fresh) => fresh(),
        None => (built.layer.clone(), built.baseline.clone()),
    };
    let (router, tag) = if layered {
        (layer, format!("layer{round}"))
    } else {
        (baseline, format!("base{round}"))
    };
    let db_pids = match &built.schema {
        Some(schema) => server_rt.block_on(schema.backend_pids())?,
        None => Vec::new(),
    };
    let server = start_server(server_rt, router)?;
    let keys = match built.baseline_keys {
        Some(keys) if !layered => keys,
        _ => built.keys,
    };
    let stats = client_rt.block_on(drive(
        server.addr,
        &ctx.args,
        keys,
        built.expect,
        &tag,
        db_pids,
    ));
    stop_server(server_rt, server);
    let stats = stats?;
    println!(
        "  {:<8} round {}: {:>7.0} req/s  p50 {:>6.3} ms  p99 {:>6.3} ms  CPU/req: app {:>5.1} µs, \
         db {} µs; others {} cores  ({} requests{})",
        if layered { "layer" } else { "baseline" },
        round + 1,
        stats.rps(),
        stats.quantile_ms(0.50),
        stats.quantile_ms(0.99),
        stats.app_us(),
        opt(stats.db_us(), 1),
        opt(stats.others_cores(), 2),
        stats.requests,
        if stats.unexpected > 0 {
            format!(", {} with an unexpected status", stats.unexpected)
        } else {
            String::new()
        }
    );
    Ok(stats)
}

pub(crate) fn run_scenario(
    ctx: &Ctx,
    scenario: &'static Scenario,
    server_rt: &Runtime,
    client_rt: &Runtime,
) -> Result<Outcome, BoxError> {
    println!(
        "{}: layer = {}; baseline = {}",
        scenario.name, scenario.layer_side, scenario.baseline
    );
    let built = server_rt.block_on((scenario.build)(ctx))?;
    let mut result = (None::<Stats>, None::<Stats>);
    let mut run = || -> Result<(), BoxError> {
        for round in 0..ctx.args.rounds {
            // Alternate which side goes first, so a drift (a warming cache, a growing
            // table, a neighbour's build) does not favour one side.
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for layered in order.into_iter().filter(|l| ctx.args.side.runs(*l)) {
                let stats = run_side(ctx, server_rt, client_rt, &built, layered, round)?;
                let slot = if layered {
                    &mut result.0
                } else {
                    &mut result.1
                };
                match slot {
                    Some(s) => s.merge(stats),
                    None => *slot = Some(stats),
                }
            }
        }
        Ok(())
    };
    let ran = run();
    let Built { schema, owned, .. } = built;
    if let Some(schema) = schema {
        server_rt.block_on(schema.drop_schema());
    }
    // Servers the scenario started stop here.
    drop(owned);
    ran?;
    let (layer, baseline) = result;
    let unexpected = |s: &Option<Stats>| s.as_ref().map_or(0, |s| s.unexpected);
    if unexpected(&layer) + unexpected(&baseline) > 0 {
        return Err(format!(
            "{}: answers with an unexpected status (layer {}, baseline {})",
            scenario.name,
            unexpected(&layer),
            unexpected(&baseline)
        )
        .into());
    }
    let outcome = Outcome {
        scenario,
        layer,
        baseline,
    };
    if let Some(ratio) = outcome.ratio() {
        println!("  ratio {ratio:.3} (target ≥ {})", scenario.target);
    }
    Ok(outcome)
}

/// `v` with `decimals` decimals, or `–`.
fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "–".to_owned(), |v| format!("{v:.decimals$}"))
}

pub(crate) fn print_table(args: &Args, outcomes: &[Outcome]) {
    println!();
    println!(
        "{} connections, pool {}, {} s measured after {} s warm-up, {} round(s), server {} \
         threads, client {} threads, 1 KiB JSON body",
        args.connections,
        args.pool,
        args.seconds.as_secs_f64(),
        args.warmup.as_secs_f64(),
        args.rounds,
        args.server_threads,
        args.client_threads
    );
    println!();
    println!(
        "| scenario | layer req/s | layer p50 ms | layer p99 ms | baseline req/s | baseline p50 ms | baseline p99 ms | ratio | target | met |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let cells = |s: &Option<Stats>| match s {
        Some(s) => format!(
            "{:.0} | {:.3} | {:.3}",
            s.rps(),
            s.quantile_ms(0.50),
            s.quantile_ms(0.99)
        ),
        None => "– | – | –".to_owned(),
    };
    for o in outcomes {
        let (ratio, met) = match o.ratio() {
            Some(r) => (
                format!("{r:.3}"),
                if r >= o.scenario.target { "yes" } else { "no" },
            ),
            None => ("–".to_owned(), "–"),
        };
        println!(
            "| {} | {} | {} | {ratio} | ≥ {} | {met} |",
            o.scenario.name,
            cells(&o.layer),
            cells(&o.baseline),
            o.scenario.target,
        );
    }
    println!();
    println!(
        "CPU time per request (µs): app = the server process's threads, db = the pool's \
         Postgres backends; cost ratio = baseline (app + db) ÷ layer (app + db); others = what \
         the rest of the machine used meanwhile, in cores."
    );
    println!();
    println!(
        "| scenario | layer app | layer db | baseline app | baseline db | cost ratio | others (cores) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for o in outcomes {
        let cost = |s: &Stats| s.app_us() + s.db_us().unwrap_or(0.0);
        let part = |s: &Option<Stats>, f: fn(&Stats) -> Option<f64>| opt(s.as_ref().and_then(f), 1);
        let ratio = match (&o.layer, &o.baseline) {
            (Some(l), Some(b)) => format!("{:.3}", cost(b) / cost(l)),
            _ => "–".to_owned(),
        };
        let others: Vec<String> = [&o.layer, &o.baseline]
            .into_iter()
            .flatten()
            .map(|s| opt(s.others_cores(), 2))
            .collect();
        println!(
            "| {} | {} | {} | {} | {} | {ratio} | {} |",
            o.scenario.name,
            part(&o.layer, |s| Some(s.app_us())),
            part(&o.layer, Stats::db_us),
            part(&o.baseline, |s| Some(s.app_us())),
            part(&o.baseline, Stats::db_us),
            others.join(" / "),
        );
    }
}
