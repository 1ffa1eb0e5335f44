//! A PgBouncer of a test's own, in transaction pooling mode with a pool size the test
//! chooses, in front of the test server ([`super::database_url`]). Stopped when dropped.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

pub struct PgBouncer {
    dir: PathBuf,
    pub port: u16,
}

fn find() -> PathBuf {
    let candidates = [
        "/usr/sbin/pgbouncer",
        "/usr/local/bin/pgbouncer",
        "/usr/bin/pgbouncer",
    ];
    if let Some(found) = candidates.iter().map(PathBuf::from).find(|p| p.exists()) {
        return found;
    }
    panic!(
        "this test runs PgBouncer and found none: run ./scripts/test.sh (it installs it), or \
         install it (Debian/Ubuntu: apt-get install pgbouncer; macOS: brew install pgbouncer)"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl PgBouncer {
    /// Starts PgBouncer with at most `server_connections` server connections per database and
    /// user, and no reserve: more clients wait for one.
    pub fn start(server_connections: u32) -> PgBouncer {
        let bin = find();
        let url = super::database_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let (auth, rest) = rest.split_once('@').unwrap_or(("postgres", rest));
        let user = auth.split(':').next().unwrap_or("postgres");
        let hostport = rest.split('/').next().unwrap_or("127.0.0.1:5432");
        let (host, pg_port) = hostport.split_once(':').unwrap_or((hostport, "5432"));
        let port = free_port();
        let dir = std::env::temp_dir().join(format!("ti-pgbouncer-{}", super::unique()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host={host} port={pg_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 pool_mode = transaction\nauth_type = trust\nauth_file = {users}\n\
                 default_pool_size = {server_connections}\nreserve_pool_size = 0\n\
                 max_client_conn = 1000\nignore_startup_parameters = extra_float_digits\n\
                 logfile = {log}\npidfile = {pid}\n",
                users = dir.join("users.txt").display(),
                log = dir.join("pgbouncer.log").display(),
                pid = dir.join("pgbouncer.pid").display(),
            ),
        )
        .unwrap();
        let root = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
        let status = if root {
            // PgBouncer refuses to run as root.
            Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(&bin)
                .arg("-d")
                .arg(dir.join("pgbouncer.ini"))
                .status()
        } else {
            Command::new(&bin)
                .arg("-d")
                .arg(dir.join("pgbouncer.ini"))
                .status()
        }
        .unwrap();
        assert!(
            status.success(),
            "PgBouncer did not start (see {})",
            dir.display()
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "PgBouncer does not answer on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        PgBouncer { dir, port }
    }

    /// `url` (a database URL on the test server) through this PgBouncer.
    pub fn url_for(&self, database: &str) -> String {
        let url = super::database_url();
        let rest = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
        let user = rest.split_once('@').map_or("postgres", |(auth, _)| {
            auth.split(':').next().unwrap_or("postgres")
        });
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        std::thread::sleep(Duration::from_millis(100));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
