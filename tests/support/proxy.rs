//! A TCP proxy for fault tests: it forwards every connection to a target address, and the
//! test can stall it ([`Proxy::pause`]: bytes stop flowing both ways but every connection
//! stays open, like a network that drops packets), switch its target ([`Proxy::set_target`]:
//! new connections go elsewhere, like a VIP or DNS switch at failover) and cut every open
//! connection ([`Proxy::cut_all`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

/// A running proxy on `127.0.0.1`; dropping it closes the listener and every connection.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

struct Shared {
    target: Mutex<SocketAddr>,
    /// `true` while paused.
    paused: watch::Sender<bool>,
    /// The tasks of the open connections (finished ones are pruned as new ones come).
    conns: Mutex<Vec<AbortHandle>>,
}

impl Proxy {
    /// Starts a proxy on a free port of `127.0.0.1` that forwards to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            target: Mutex::new(target),
            paused: watch::channel(false).0,
            conns: Mutex::new(Vec::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone())).abort_handle();
        Proxy {
            addr,
            shared,
            accept,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `postgres://postgres@<proxy>/<db>`: a Postgres URL through this proxy.
    pub fn pg_url(&self, db: &str) -> String {
        format!("postgres://postgres@{}/{db}", self.addr)
    }

    /// Stops forwarding: bytes already read wait, nothing more is read or written, and new
    /// connections are accepted but not connected onwards. Connections stay open.
    pub fn pause(&self) {
        self.shared.paused.send_replace(true);
    }

    /// Forwards again, from where it stopped.
    pub fn resume(&self) {
        self.shared.paused.send_replace(false);
    }

    /// New connections go to `target`; open ones keep their old target.
    pub fn set_target(&self, target: SocketAddr) {
        *self.shared.target.lock().unwrap() = target;
    }

    /// Closes every open connection, both sides (the listener stays).
    pub fn cut_all(&self) {
        for conn in self.shared.conns.lock().unwrap().drain(..) {
            conn.abort();
        }
    }

    /// How many connections are open.
    pub fn open_connections(&self) -> usize {
        let mut conns = self.shared.conns.lock().unwrap();
        conns.retain(|c| !c.is_finished());
        conns.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut_all();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let task = tokio::spawn(forward(client, shared.clone())).abort_handle();
        let mut conns = shared.conns.lock().unwrap();
        conns.retain(|c| !c.is_finished());
        conns.push(task);
    }
}

/// One connection: connects to the target (once not paused) and pumps both ways until
/// either side closes.
async fn forward(client: TcpStream, shared: Arc<Shared>) {
    let mut paused = shared.paused.subscribe();
    if paused.wait_for(|p| !*p).await.is_err() {
        return;
    }
    let target = *shared.target.lock().unwrap();
    let Ok(server) = TcpStream::connect(target).await else {
        // Nothing listens there: the client sees its connection closed.
        return;
    };
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, shared.paused.subscribe());
    let down = pump(server_read, client_write, shared.paused.subscribe());
    // When one direction ends, the whole connection ends (both sockets are dropped).
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, mut paused: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Paused while the bytes were in flight: hold them until resumed.
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
