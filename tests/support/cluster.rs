//! Private PostgreSQL clusters for fault tests: a primary on a free loopback port, in a
//! temporary directory, and a streaming standby of it (synchronous replication), which the
//! tests kill (`SIGKILL` of the postmaster), promote and restart. Every cluster is stopped and
//! its directory removed when its [`Cluster`] is dropped, also when the test panics.
//!
//! The binaries are found like scripts/test.sh finds them (`/usr/lib/postgresql/*/bin`, …);
//! as root the servers run as the `postgres` system user (`runuser -u postgres --`).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// The `application_name` of the standby, named in the primary's `synchronous_standby_names`.
pub const STANDBY_NAME: &str = "ti_standby";

/// One PostgreSQL server: its data directory, port and log.
pub struct Cluster {
    /// The temporary directory holding the data directory, the socket and the log.
    pub dir: PathBuf,
    pub port: u16,
    bin: PathBuf,
}

/// The directory of `initdb`, `pg_ctl` and `pg_basebackup`.
fn pg_bin() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    // The newest major version first.
    dirs.sort_by_key(|d| {
        std::cmp::Reverse(
            d.parent()
                .and_then(|p| p.file_name())
                .and_then(|n| n.to_str())
                .and_then(|n| n.parse::<u32>().ok())
                .unwrap_or(0),
        )
    });
    dirs.extend(
        [
            "/usr/local/pgsql/bin",
            "/opt/homebrew/bin",
            "/usr/local/bin",
            "/usr/bin",
        ]
        .map(PathBuf::from),
    );
    dirs.into_iter()
        .find(|d| d.join("initdb").is_file() && d.join("pg_ctl").is_file())
        .unwrap_or_else(|| {
            panic!(
                "PostgreSQL's initdb and pg_ctl were not found (looked in /usr/lib/postgresql/*/bin \
                 and the usual places). Install PostgreSQL (Debian: apt-get install postgresql; \
                 ./scripts/test.sh does it when run as root)."
            )
        })
}

fn is_root() -> bool {
    // `id -u` rather than libc: no unsafe, no new dependency.
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A command that runs as the user owning the clusters: `postgres` when we are root.
fn pg_command(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(mut command: Command) -> Output {
    let shown = format!("{command:?}");
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh, empty directory owned by the clusters' user; short, for the Unix socket's path.
fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tipg_{}", super::unique()));
    std::fs::create_dir_all(&dir).unwrap();
    if is_root() {
        run({
            let mut c = Command::new("chown");
            c.arg("postgres").arg(&dir);
            c
        });
    }
    dir
}

impl Cluster {
    /// `initdb` and start a primary, ready for a synchronous standby named
    /// [`STANDBY_NAME`] (whose acknowledgement every commit waits for once it is connected:
    /// start it with [`Cluster::standby`] before writing anything). `sync = false`: a lone
    /// server, no replication settings.
    pub fn primary(sync: bool) -> Cluster {
        let bin = pg_bin();
        let dir = temp_dir();
        let cluster = Cluster {
            port: free_port(),
            dir,
            bin,
        };
        let mut initdb = pg_command(&cluster.bin.join("initdb"));
        initdb.arg("-D").arg(cluster.data()).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]);
        run(initdb);
        let mut conf = cluster.common_settings();
        if sync {
            conf.push_str(&format!(
                "synchronous_standby_names = '{STANDBY_NAME}'\n\
                 synchronous_commit = on\n\
                 wal_level = replica\n\
                 max_wal_senders = 4\n"
            ));
        }
        cluster.append("postgresql.conf", &conf);
        cluster.start();
        cluster
    }

    /// A streaming standby of `primary` (`pg_basebackup -R`), connected as [`STANDBY_NAME`],
    /// started; returns once the primary reports it as its synchronous standby.
    pub fn standby(primary: &Cluster) -> Cluster {
        let cluster = Cluster {
            port: free_port(),
            dir: temp_dir(),
            bin: primary.bin.clone(),
        };
        let mut backup = pg_command(&cluster.bin.join("pg_basebackup"));
        backup
            .arg("-D")
            .arg(cluster.data())
            .args(["-R", "-X", "stream", "--no-sync", "-c", "fast"])
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
            ]);
        run(backup);
        // The standby's own port and socket; no synchronous standby of its own, so that it
        // takes writes at once when promoted.
        let mut conf = cluster.common_settings();
        conf.push_str("synchronous_standby_names = ''\n");
        cluster.append("postgresql.conf", &conf);
        // After the `primary_conninfo` that `-R` wrote: the last setting wins.
        cluster.append(
            "postgresql.auto.conf",
            &format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres \
                 application_name={STANDBY_NAME}'\n",
                primary.port
            ),
        );
        cluster.start();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let state = primary.psql(&format!(
                "SELECT sync_state FROM pg_stat_replication \
                 WHERE application_name = '{STANDBY_NAME}' AND state = 'streaming'"
            ));
            if state.trim() == "sync" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the standby did not become the synchronous standby within 60 s ({state:?})"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn log(&self) -> PathBuf {
        self.dir.join("log")
    }

    fn common_settings(&self) -> String {
        format!(
            "\n# tests/support/cluster.rs\n\
             port = {}\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\n\
             max_connections = 200\n\
             fsync = off\n\
             full_page_writes = off\n\
             shared_buffers = 16MB\n",
            self.port,
            self.dir.display()
        )
    }

    fn append(&self, file: &str, text: &str) {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(self.data().join(file))
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut c = pg_command(&self.bin.join("pg_ctl"));
        c.arg("-D")
            .arg(self.data())
            .arg("-l")
            .arg(self.log())
            .args(args);
        c
    }

    /// Starts the server and waits until it accepts connections.
    pub fn start(&self) {
        run(self.pg_ctl(&["-w", "-t", "60", "start"]));
    }

    /// `pg_ctl restart -m immediate`: every backend is killed at once (no checkpoint, crash
    /// recovery at the start), like a crash and a restart by a supervisor.
    pub fn restart_immediate(&self) {
        run(self.pg_ctl(&["-w", "-t", "60", "-m", "immediate", "restart"]));
    }

    /// `pg_ctl promote`: a standby becomes a primary; returns once it takes writes.
    pub fn promote(&self) {
        run(self.pg_ctl(&["-w", "-t", "60", "promote"]));
    }

    /// The postmaster's process id, from `postmaster.pid`.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data().join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// Kills the postmaster with `SIGKILL`, like a machine that dies: no shutdown, no
    /// checkpoint. Its backends notice and exit on their own a moment later.
    pub fn kill9(&self) {
        let pid = self.postmaster_pid().expect("the server is running");
        run({
            let mut c = Command::new("kill");
            c.args(["-9", &pid.to_string()]);
            c
        });
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs `sql` with `psql` (as the clusters' user, over TCP) and returns its unaligned
    /// output.
    pub fn psql(&self, sql: &str) -> String {
        let mut c = pg_command(&self.bin.join("psql"));
        c.args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1"])
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(["-U", "postgres", "-d", "postgres", "-c", sql]);
        String::from_utf8(run(c).stdout).unwrap()
    }

    /// The server's log so far (for failure messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.log()).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // `immediate`: nothing to keep. A server that was killed has nothing to stop.
        if self.postmaster_pid().is_some() {
            let _ = self
                .pg_ctl(&["-w", "-t", "30", "-m", "immediate", "stop"])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
