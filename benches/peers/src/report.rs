//! The results of every run, and the tables printed from them.

use std::collections::HashMap;

use crate::checks;
use crate::contenders::{self, Contender, Storage};
use crate::load::{Outcome, Workload};

pub struct Results {
    contenders: Vec<&'static Contender>,
    workloads: Vec<Workload>,
    rounds: usize,
    /// By contender and workload, one entry per round (`None`: the run failed).
    runs: HashMap<(&'static str, Workload), Vec<Option<Outcome>>>,
    checks: HashMap<&'static str, Result<checks::Report, String>>,
}

pub fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    })
}

/// `12345.6` as `12,346`.
pub fn thousands(x: f64) -> String {
    let digits = format!("{:.0}", x.max(0.0));
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

fn or_dash(x: Option<f64>, f: impl Fn(f64) -> String) -> String {
    x.map_or_else(|| "—".to_owned(), f)
}

fn ratio(x: f64) -> String {
    format!("{x:.2}")
}

impl Results {
    pub fn new(
        contenders: Vec<&'static Contender>,
        workloads: Vec<Workload>,
        rounds: usize,
    ) -> Self {
        Self {
            contenders,
            workloads,
            rounds,
            runs: HashMap::new(),
            checks: HashMap::new(),
        }
    }

    pub fn record(&mut self, name: &'static str, workload: Workload, outcome: Option<Outcome>) {
        self.runs.entry((name, workload)).or_default().push(outcome);
    }

    pub fn record_check(&mut self, name: &'static str, report: Result<checks::Report, String>) {
        self.checks.insert(name, report);
    }

    fn outcome(&self, name: &str, workload: Workload, round: usize) -> Option<&Outcome> {
        self.runs
            .iter()
            .find(|((n, w), _)| *n == name && *w == workload)
            .and_then(|(_, runs)| runs.get(round))
            .and_then(Option::as_ref)
    }

    fn rps(&self, name: &str, workload: Workload, round: usize) -> Option<f64> {
        self.outcome(name, workload, round).map(Outcome::rps)
    }

    /// `a`'s requests per second over `b`'s, in the same round.
    fn ratio_in_round(&self, a: &str, b: &str, workload: Workload, round: usize) -> Option<f64> {
        Some(self.rps(a, workload, round)? / self.rps(b, workload, round)?)
    }

    fn median_rps(&self, name: &str, workload: Workload) -> Option<f64> {
        median(
            (0..self.rounds)
                .filter_map(|r| self.rps(name, workload, r))
                .collect(),
        )
    }

    fn median_ratio(&self, a: &str, b: &str, workload: Workload) -> Option<f64> {
        median(
            (0..self.rounds)
                .filter_map(|r| self.ratio_in_round(a, b, workload, r))
                .collect(),
        )
    }

    /// One line per finished run, as it finishes.
    pub fn run_line(&self, name: &str, workload: Workload, round: usize) -> String {
        let Some(o) = self.outcome(name, workload, round) else {
            return format!(
                "  round {} {:<6} {name:<27} failed",
                round + 1,
                workload.name()
            );
        };
        let vs_none = or_dash(self.ratio_in_round(name, "none", workload, round), ratio);
        let runs_per_request = if o.requests == 0 {
            0.0
        } else {
            o.handler_runs as f64 / o.requests as f64
        };
        let mut line = format!(
            "  round {} {:<6} {name:<27} {:>9} req/s  ×none {vs_none:>5}  handler runs/req {runs_per_request:.2}  \
             cores: bench {:.2} pg {:.2} others {:.2} steal {:.2}",
            round + 1,
            workload.name(),
            thousands(o.rps()),
            o.cpu.own,
            o.cpu.postgres,
            o.cpu.others,
            o.cpu.steal,
        );
        if o.errors() > 0 {
            let statuses: Vec<String> = o.non_2xx.iter().map(|(s, n)| format!("{s}×{n}")).collect();
            line.push_str(&format!(
                "  NON-2XX: {} in the window ({}), {} while completing the replay keys",
                o.non_2xx.values().sum::<u64>(),
                statuses.join(" "),
                o.prepare_non_2xx
            ));
        }
        line
    }

    /// A round's requests per second and ratios to `none`.
    pub fn print_round(&self, round: usize) {
        println!("\nRound {} of {}", round + 1, self.rounds);
        println!("| contender | new keys req/s | ×none | replays req/s | ×none |");
        println!("|---|---:|---:|---:|---:|");
        for c in &self.contenders {
            let cell = |w: Workload| {
                if !self.workloads.contains(&w) {
                    return ("—".to_owned(), "—".to_owned());
                }
                (
                    or_dash(self.rps(c.name, w, round), thousands),
                    or_dash(self.ratio_in_round(c.name, "none", w, round), ratio),
                )
            };
            let (new_rps, new_ratio) = cell(Workload::New);
            let (replay_rps, replay_ratio) = cell(Workload::Replay);
            println!(
                "| {} | {new_rps} | {new_ratio} | {replay_rps} | {replay_ratio} |",
                c.name
            );
        }
    }

    /// The tower-idempotency variant a peer is compared with: the one on the same store.
    fn reference(c: &Contender) -> Option<&'static str> {
        if c.name.starts_with("tower-idempotency") {
            return None;
        }
        match c.storage {
            Storage::Postgres => Some("tower-idempotency"),
            Storage::Memory => Some("tower-idempotency-memory"),
            Storage::Nothing => None,
        }
    }

    /// What makes a contender's figures suspect: failed runs, non-2xx answers, a handler
    /// that ran on replays, failed checks.
    fn flags(&self, c: &Contender) -> String {
        let mut flags = Vec::new();
        for &w in &self.workloads {
            let runs = self.runs.get(&(c.name, w));
            let failed = runs.map_or(0, |r| r.iter().filter(|o| o.is_none()).count());
            if failed > 0 {
                flags.push(format!("{} {} run(s) failed", failed, w.name()));
            }
            let outcomes: Vec<&Outcome> = runs
                .map(|r| r.iter().flatten().collect())
                .unwrap_or_default();
            let errors: u64 = outcomes.iter().map(|o| o.errors()).sum();
            if errors > 0 {
                flags.push(format!("{errors} non-2xx on {}", w.name()));
            }
            if w == Workload::Replay && c.storage != Storage::Nothing {
                let ran: u64 = outcomes.iter().map(|o| o.handler_runs).sum();
                if ran > 0 {
                    flags.push(format!("handler ran {ran}× on replays"));
                }
            }
        }
        match self.checks.get(c.name) {
            Some(Ok(report)) if c.storage != Storage::Nothing => {
                if !report.identical {
                    flags.push("replay not identical".to_owned());
                }
                if report.duplicate_runs != 1 {
                    flags.push(format!(
                        "{} runs for {} duplicates",
                        report.duplicate_runs,
                        checks::DUPLICATES
                    ));
                }
            }
            Some(Err(_)) => flags.push("checks failed to run".to_owned()),
            _ => {}
        }
        if flags.is_empty() {
            "—".to_owned()
        } else {
            flags.join("; ")
        }
    }

    pub fn print_final(&self) {
        println!(
            "\nMedians over {} round(s) (ratios: median of the per-round ratios)",
            self.rounds
        );
        println!(
            "| contender | new keys req/s | ratio to none | replays req/s | ratio to none | \
             tower-idempotency/peer (new, replay) | flags |"
        );
        println!("|---|---:|---:|---:|---:|---|---|");
        for c in &self.contenders {
            let cells = |w: Workload| {
                if !self.workloads.contains(&w) {
                    return ("—".to_owned(), "—".to_owned());
                }
                (
                    or_dash(self.median_rps(c.name, w), thousands),
                    or_dash(self.median_ratio(c.name, "none", w), ratio),
                )
            };
            let (new_rps, new_ratio) = cells(Workload::New);
            let (replay_rps, replay_ratio) = cells(Workload::Replay);
            let vs_peer = match Self::reference(c) {
                Some(reference) => {
                    let r = |w| {
                        if self.workloads.contains(&w) {
                            or_dash(self.median_ratio(reference, c.name, w), ratio)
                        } else {
                            "—".to_owned()
                        }
                    };
                    format!(
                        "{}, {} ({reference})",
                        r(Workload::New),
                        r(Workload::Replay)
                    )
                }
                None => "—".to_owned(),
            };
            println!(
                "| {} | {new_rps} | {new_ratio} | {replay_rps} | {replay_ratio} | {vs_peer} | {} |",
                c.name,
                self.flags(c)
            );
        }
    }

    /// The run in which other processes (and the hypervisor) took the most CPU.
    pub fn print_disturbance(&self) {
        let worst = self
            .runs
            .iter()
            .flat_map(|((name, w), runs)| {
                runs.iter()
                    .enumerate()
                    .filter_map(move |(r, o)| Some((*name, *w, r, o.as_ref()?)))
            })
            .max_by(|a, b| {
                let load = |o: &Outcome| o.cpu.others + o.cpu.steal;
                load(a.3).total_cmp(&load(b.3))
            });
        if let Some((name, w, r, o)) = worst {
            println!(
                "\nMost CPU taken by other processes in one window: {:.2} cores, and {:.2} stolen \
                 ({name}, {}, round {})",
                o.cpu.others,
                o.cpu.steal,
                w.name(),
                r + 1
            );
        }
    }

    pub fn print_checks(&self) {
        println!("\nChecks");
        println!(
            "| contender | first answer | replay identical | what differed | handler runs for {} concurrent duplicates | their statuses |",
            checks::DUPLICATES
        );
        println!("|---|---:|---|---|---:|---|");
        for c in &self.contenders {
            match self.checks.get(c.name) {
                Some(Ok(r)) => println!(
                    "| {} | {} | {} | {} | {} | {} |",
                    c.name,
                    r.first_status,
                    if r.identical { "yes" } else { "no" },
                    r.differences,
                    r.duplicate_runs,
                    r.statuses()
                ),
                Some(Err(e)) => println!("| {} | — | error | {e} | — | — |", c.name),
                None => {}
            }
        }
    }
}

/// All contenders' names, for the usage text.
pub fn names() -> String {
    contenders::ALL
        .iter()
        .map(|c| c.name)
        .collect::<Vec<_>>()
        .join(",")
}
