//! A TCP proxy for fault tests: it forwards every connection to a target address, and the
//! test can stall it ([`Proxy::pause`]: bytes stop flowing both ways but every connection
//! stays open, like a network that drops packets), switch its target ([`Proxy::set_target`]:
//! new connections go elsewhere, like a VIP or DNS switch at failover), cut every open
//! connection ([`Proxy::cut_all`]) and lose answers ([`Proxy::lose_answers`]: the request
//! reaches the server, which answers, and the answer is thrown away with the connection).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// How many of the next answers to lose ([`Proxy::lose_answers`]).
    to_lose: AtomicUsize,
    /// How many answers were lost.
    lost: AtomicUsize,
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
            to_lose: AtomicUsize::new(0),
            lost: AtomicUsize::new(0),
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

    /// Loses the next `n` answers: the next `n` times the server sends bytes on a connection
    /// (the start of its answer, when no answer is under way), those bytes are thrown away
    /// and the connection is closed both ways. The server did the work and answered; the client sees
    /// its connection closed before any answer.
    pub fn lose_answers(&self, n: usize) {
        self.shared.to_lose.store(n, Ordering::SeqCst);
    }

    /// How many answers were lost so far.
    pub fn answers_lost(&self) -> usize {
        self.shared.lost.load(Ordering::SeqCst)
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
    let up = pump(client_read, server_write, shared.paused.subscribe(), None);
    let down = pump(
        server_read,
        client_write,
        shared.paused.subscribe(),
        Some(&shared),
    );
    // When one direction ends, the whole connection ends (both sockets are dropped).
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Copies `from` to `to`. With `answers` (the server-to-client direction), bytes that arrive
/// after the client wrote (the start of an answer) may be lost instead.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
    answers: Option<&Shared>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(shared) = answers {
            let lose = shared
                .to_lose
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            if lose {
                shared.lost.fetch_add(1, Ordering::SeqCst);
                return;
            }
        }
        // Paused while the bytes were in flight: hold them until resumed.
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
