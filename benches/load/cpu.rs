//! CPU accounting (Linux, from `/proc`), so a neighbour taking the CPU shows and costs can be
//! compared: the CPU time of the server's and the client's threads, of the pool's Postgres
//! backends and of the whole machine during a measured window.

use std::time::Duration;

/// CPU time used in a window.
#[derive(Clone, Copy, Default)]
pub(crate) struct Cpu {
    /// The server runtime's threads (named `server`).
    pub(crate) server: Duration,
    /// The client runtime's threads (named `client`).
    pub(crate) client: Duration,
    /// The pool's Postgres backends, when their `/proc` entries can be read.
    pub(crate) db: Option<Duration>,
    /// Every CPU of the machine (`/proc/stat`), when readable.
    pub(crate) machine: Option<Duration>,
}

impl Cpu {
    pub(crate) fn add(self, other: Cpu) -> Cpu {
        let sum = |a: Option<Duration>, b: Option<Duration>| Some(a? + b?);
        Cpu {
            server: self.server + other.server,
            client: self.client + other.client,
            db: sum(self.db, other.db),
            machine: sum(self.machine, other.machine),
        }
    }
}

/// Cumulative CPU times at one instant.
pub(crate) struct CpuSnapshot {
    server: u64,
    client: u64,
    db: Option<u64>,
    machine: Option<u64>,
}

/// The first field of a `schedstat` file: nanoseconds spent on a CPU.
fn schedstat_ns(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Busy time of the whole machine in nanoseconds: `/proc/stat`'s `cpu` line less idle and
/// iowait, in clock ticks (taken as 100 per second, Linux's `USER_HZ`).
fn machine_busy_ns() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle) * 10_000_000)
}

impl CpuSnapshot {
    pub(crate) fn take(db_pids: &[u32]) -> CpuSnapshot {
        let (mut server, mut client) = (0, 0);
        if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
            for task in tasks.flatten() {
                let dir = task.path().display().to_string();
                let comm = std::fs::read_to_string(format!("{dir}/comm")).unwrap_or_default();
                let ns = schedstat_ns(&format!("{dir}/schedstat")).unwrap_or(0);
                match comm.trim_end() {
                    "server" => server += ns,
                    "client" => client += ns,
                    _ => {}
                }
            }
        }
        let db = if db_pids.is_empty() {
            None
        } else {
            db_pids
                .iter()
                .map(|pid| schedstat_ns(&format!("/proc/{pid}/schedstat")))
                .sum()
        };
        CpuSnapshot {
            server,
            client,
            db,
            machine: machine_busy_ns(),
        }
    }

    pub(crate) fn since(&self, before: &CpuSnapshot) -> Cpu {
        let d = |a: u64, b: u64| Duration::from_nanos(a.saturating_sub(b));
        Cpu {
            server: d(self.server, before.server),
            client: d(self.client, before.client),
            db: self.db.zip(before.db).map(|(a, b)| d(a, b)),
            machine: self.machine.zip(before.machine).map(|(a, b)| d(a, b)),
        }
    }
}
