//! Where the machine's CPU went during a measured window: this process (server and client),
//! the Postgres processes, everything else, and time stolen by the hypervisor. Read from
//! `/proc` (Linux); elsewhere every figure is zero.

use std::time::Duration;

/// Clock ticks per second of `/proc`'s CPU times (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

#[derive(Clone, Copy, Debug, Default)]
pub struct Snapshot {
    /// The machine's busy ticks (user, nice, system, irq, softirq), all CPUs.
    busy: u64,
    steal: u64,
    own: u64,
    postgres: u64,
}

/// CPU used in a window, in cores (1.0 = one core busy throughout).
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub own: f64,
    pub postgres: f64,
    pub others: f64,
    pub steal: f64,
}

impl Snapshot {
    pub fn take() -> Self {
        let (busy, steal) = machine().unwrap_or_default();
        Self {
            busy,
            steal,
            own: process_ticks("self").unwrap_or_default(),
            postgres: postgres_ticks(),
        }
    }

    pub fn since(&self, before: &Snapshot, window: Duration) -> Usage {
        let cores = |ticks: u64| ticks as f64 / TICKS_PER_SECOND / window.as_secs_f64();
        let busy = self.busy.saturating_sub(before.busy);
        let own = self.own.saturating_sub(before.own);
        let postgres = self.postgres.saturating_sub(before.postgres);
        Usage {
            own: cores(own),
            postgres: cores(postgres),
            others: cores(busy.saturating_sub(own + postgres)),
            steal: cores(self.steal.saturating_sub(before.steal)),
        }
    }
}

/// The busy and stolen ticks of all CPUs, from the first line of `/proc/stat`.
fn machine() -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal
    let get = |i: usize| v.get(i).copied().unwrap_or(0);
    Some((get(0) + get(1) + get(2) + get(5) + get(6), get(7)))
}

/// A process's user and system ticks, from `/proc/<pid>/stat` (all its threads).
fn process_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces: fields count after the last `)`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The ticks of every process named `postgres` (the server and its backends).
fn postgres_ticks() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.flatten()
        .filter_map(|entry| {
            let name = entry.file_name();
            let pid = name.to_str()?;
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            if comm.trim_end() != "postgres" {
                return None;
            }
            process_ticks(pid)
        })
        .sum()
}
