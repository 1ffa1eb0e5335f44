//! A fault proxy that speaks enough of the Postgres protocol to strike at a statement
//! boundary: it forwards every connection to the server, reads the client's messages in
//! groups (everything up to a `Query` or a `Sync`: one round trip), names each group that
//! executes something by the statement it runs, and can, at the n-th execution of a named
//! statement:
//!
//! - [`Fault::CutBefore`]: close the connection before the group reaches the server (nothing
//!   of it runs);
//! - [`Fault::CutAfter`]: let the server execute it to the end (its `ReadyForQuery`), throw the
//!   answer away and close the connection (the client cannot know what happened);
//! - [`Fault::Stall`]: let the server execute it and hold its answer for a while (longer than
//!   the store's timeout), then deliver it to whoever still listens;
//! - [`Fault::Hold`]: let the server execute it and hold its answer until
//!   [`WireProxy::release`]; [`WireProxy::hit`] tells the test the point was reached, so that
//!   it can drop the request's future there.
//!
//! Without a fault armed it records what it saw ([`WireProxy::seen`]): a run without faults
//! lists the statement boundaries of a path, and the fault matrix strikes at each of them.
//! Connections that `LISTEN` are forwarded but never counted (their traffic depends on
//! timing, not on the path).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::AbortHandle;

/// What to do at the armed statement boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The statement never reaches the server.
    CutBefore,
    /// The server executes the statement; its answer is lost with the connection.
    CutAfter,
    /// The server executes the statement; its answer arrives this late.
    Stall(Duration),
    /// The server executes the statement; its answer waits for [`WireProxy::release`].
    Hold,
}

impl Fault {
    /// A short name for tables.
    pub fn name(&self) -> &'static str {
        match self {
            Fault::CutBefore => "cut before",
            Fault::CutAfter => "cut after",
            Fault::Stall(_) => "stall",
            Fault::Hold => "dropped",
        }
    }
}

/// A statement boundary: the `nth` (from 0) execution of the statement named `label`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Point {
    pub label: String,
    pub nth: usize,
}

impl std::fmt::Display for Point {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nth == 0 {
            write!(f, "{}", self.label)
        } else {
            write!(f, "{} (#{})", self.label, self.nth + 1)
        }
    }
}

/// A running proxy on `127.0.0.1`; dropping it closes the listener and every connection.
pub struct WireProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: AbortHandle,
}

struct Shared {
    target: SocketAddr,
    state: Mutex<State>,
    /// Notified when the armed fault fires.
    hit: Notify,
    /// `true` once [`WireProxy::release`] lets a held answer go.
    released: watch::Sender<bool>,
    conns: Mutex<Vec<AbortHandle>>,
}

#[derive(Default)]
struct State {
    /// Every counted execution, in the order the groups reached the proxy.
    seen: Vec<Point>,
    /// How many times each label was executed.
    counts: HashMap<String, usize>,
    /// Statement texts by prepared statement name (names of the crate's bare statements are
    /// the same on every connection).
    names: HashMap<String, String>,
    armed: Option<(Point, Fault)>,
    fired: bool,
}

/// What the server-to-client side does with the answer to one group.
#[derive(Clone, Copy, Debug)]
enum Answer {
    Forward,
    Cut,
    Stall(Duration),
    Hold,
}

impl WireProxy {
    /// Starts a proxy on a free port of `127.0.0.1` in front of `target`.
    pub async fn start(target: SocketAddr) -> WireProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            target,
            state: Mutex::new(State::default()),
            hit: Notify::new(),
            released: watch::channel(false).0,
            conns: Mutex::new(Vec::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone())).abort_handle();
        WireProxy {
            addr,
            shared,
            accept,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The statement boundaries executed so far, in order.
    pub fn seen(&self) -> Vec<Point> {
        self.shared.state.lock().unwrap().seen.clone()
    }

    /// Strikes with `fault` at `point` (once); the counts start again from zero.
    pub fn arm(&self, point: Point, fault: Fault) {
        let mut state = self.shared.state.lock().unwrap();
        state.seen.clear();
        state.counts.clear();
        state.armed = Some((point, fault));
        state.fired = false;
        self.shared.released.send_replace(false);
    }

    /// Whether the armed fault fired.
    pub fn fired(&self) -> bool {
        self.shared.state.lock().unwrap().fired
    }

    /// Resolves once the armed fault fires (at once if it did).
    pub async fn hit(&self) {
        loop {
            let notified = self.shared.hit.notified();
            if self.fired() {
                return;
            }
            notified.await;
        }
    }

    /// Lets a held answer ([`Fault::Hold`]) go; later holds are not held.
    pub fn release(&self) {
        self.shared.released.send_replace(true);
    }

    /// Disarms the fault and closes every open connection (the pool reconnects).
    pub fn heal(&self) {
        self.shared.state.lock().unwrap().armed = None;
        self.release();
    }
}

impl Drop for WireProxy {
    fn drop(&mut self) {
        self.accept.abort();
        for conn in self.shared.conns.lock().unwrap().drain(..) {
            conn.abort();
        }
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let _ = client.set_nodelay(true);
        let task = tokio::spawn(connection(client, shared.clone())).abort_handle();
        let mut conns = shared.conns.lock().unwrap();
        conns.retain(|c| !c.is_finished());
        conns.push(task);
    }
}

const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// Reads one untyped startup-phase message (length, then body).
async fn read_untyped(from: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    from.read_exact(&mut len).await.ok()?;
    let n = u32::from_be_bytes(len) as usize;
    if !(8..=1 << 20).contains(&n) {
        return None;
    }
    let mut msg = len.to_vec();
    msg.resize(n, 0);
    from.read_exact(&mut msg[4..]).await.ok()?;
    Some(msg)
}

/// One client connection: the startup (answering an SSL or GSS request with "no" itself),
/// then both directions until either ends or a fault cuts them.
async fn connection(mut client: TcpStream, shared: Arc<Shared>) {
    let startup = loop {
        let Some(msg) = read_untyped(&mut client).await else {
            return;
        };
        let code = u32::from_be_bytes([msg[4], msg[5], msg[6], msg[7]]);
        if code == SSL_REQUEST || code == GSSENC_REQUEST {
            if client.write_all(b"N").await.is_err() {
                return;
            }
            continue;
        }
        break msg;
    };
    let Ok(mut server) = TcpStream::connect(shared.target).await else {
        return;
    };
    let _ = server.set_nodelay(true);
    if server.write_all(&startup).await.is_err() {
        return;
    }
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // The answers the server owes, oldest first: the startup's, then one per group.
    let answers = Arc::new(Mutex::new(VecDeque::from([Answer::Forward])));
    let queued = Arc::new(Notify::new());
    let up = upstream(
        client_read,
        server_write,
        shared.clone(),
        answers.clone(),
        queued.clone(),
    );
    let down = downstream(server_read, client_write, shared, answers, queued);
    tokio::select! {
        () = up => {}
        () = down => {}
    }
}

/// Reads a typed message: (type, whole message with its header).
async fn read_typed(from: &mut OwnedReadHalf) -> Option<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    from.read_exact(&mut head).await.ok()?;
    let n = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if !(4..=1 << 30).contains(&n) {
        return None;
    }
    let mut msg = head.to_vec();
    msg.resize(n + 1, 0);
    from.read_exact(&mut msg[5..]).await.ok()?;
    Some((head[0], msg))
}

/// A NUL-terminated string at the start of `bytes`, and what follows it.
fn cstr(bytes: &[u8]) -> (String, &[u8]) {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    (
        String::from_utf8_lossy(&bytes[..end]).into_owned(),
        bytes.get(end + 1..).unwrap_or(&[]),
    )
}

/// A statement's label: its text without the values written into it (string and number
/// literals, so that a token or a key does not make each run's label new) and without its
/// `SET LOCAL` preamble, on one line, at most 160 characters.
fn label_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let mut prev = ' ';
    while let Some(c) = chars.next() {
        if c == '\'' {
            // A string literal ('' inside it is a quote): one placeholder. An `E` prefix was
            // pushed already; drop it.
            if prev == 'E' {
                out.pop();
            }
            loop {
                match chars.next() {
                    Some('\'') if chars.peek() == Some(&'\'') => {
                        chars.next();
                    }
                    Some('\'') | None => break,
                    Some(_) => {}
                }
            }
            out.push('?');
            prev = '?';
            continue;
        }
        if c.is_ascii_digit() && !(prev.is_ascii_alphanumeric() || prev == '_' || prev == '$') {
            while chars
                .peek()
                .is_some_and(|d| d.is_ascii_digit() || *d == '.')
            {
                chars.next();
            }
            out.push('N');
            prev = 'N';
            continue;
        }
        out.push(c);
        prev = c;
    }
    let kept: Vec<&str> = out
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty() && !s.starts_with("SET LOCAL"))
        .collect();
    let one_line = kept
        .join("; ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    unqualified(&one_line).chars().take(160).collect()
}

/// `text` without the tests' schema names (`ti_<digits and underscores>.`): each test works
/// in a schema of its own, and the path is the same in each.
fn unqualified(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("ti_") {
        let after = &rest[at + 3..];
        let len = after
            .find(|c: char| !(c.is_ascii_digit() || c == '_'))
            .unwrap_or(after.len());
        let starts_word = !rest[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
        if starts_word && len > 0 && after[len..].starts_with('.') {
            out.push_str(&rest[..at]);
            rest = &after[len + 1..];
        } else {
            out.push_str(&rest[..at + 3]);
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The crate's statements prepared by name (`PREPARE tower_idempotency_<digest>(...) AS ...`):
/// the name and the label of what it runs. The digest covers the schema, so the label, not
/// the name, identifies the statement across tests.
fn prepared(text: &str) -> Option<(String, String)> {
    let rest = text.trim_start().strip_prefix("PREPARE ")?;
    let name_end = rest.find(|c: char| c == '(' || c.is_whitespace())?;
    let body = &rest[rest.find(" AS ")? + 4..];
    Some((rest[..name_end].to_owned(), label_of(body)))
}

/// The label of a simple query: each of its statements labelled, those prepared by name
/// remembered, those executed by name labelled by what they run.
fn query_label(text: &str, shared: &Shared) -> String {
    let mut names_used = Vec::new();
    for stmt in text.split(';') {
        let label = if let Some((name, label)) = prepared(stmt) {
            shared
                .state
                .lock()
                .unwrap()
                .names
                .insert(name, label.clone());
            format!("PREPARE {label}")
        } else if let Some(label) =
            executed(stmt).and_then(|name| shared.state.lock().unwrap().names.get(name).cloned())
        {
            format!("EXECUTE {label}")
        } else if let Some(name) = executed(stmt) {
            // Executed before this proxy saw it prepared (a connection that had it already,
            // or a first try that the server refuses): the digest in the name is the schema's,
            // so the label keeps the shape of the call only.
            label_of(&stmt.replacen(name, "tower_idempotency_#", 1))
        } else {
            label_of(stmt)
        };
        if !label.is_empty() {
            names_used.push(label);
        }
    }
    names_used.join("; ").chars().take(160).collect()
}

/// The name an `EXECUTE name(...)` runs.
fn executed(text: &str) -> Option<&str> {
    let rest = text.trim_start().strip_prefix("EXECUTE ")?;
    Some(
        &rest[..rest
            .find(|c: char| c == '(' || c.is_whitespace())
            .unwrap_or(rest.len())],
    )
}

/// The client-to-server direction: groups are held until their last message, named, counted,
/// and struck at when armed.
async fn upstream(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<Shared>,
    answers: Arc<Mutex<VecDeque<Answer>>>,
    queued: Arc<Notify>,
) {
    let mut group: Vec<u8> = Vec::new();
    let mut executes: Option<String> = None;
    let mut listener = false;
    // Statement texts parsed on this connection, by name (sqlx's own names are per connection).
    let mut local: HashMap<String, String> = HashMap::new();
    let mut parsed_last: Option<String> = None;
    loop {
        let Some((kind, msg)) = read_typed(&mut from).await else {
            return;
        };
        let body = &msg[5..];
        match kind {
            b'Q' => {
                let (text, _) = cstr(body);
                if text.trim_start().to_ascii_uppercase().starts_with("LISTEN") {
                    listener = true;
                }
                executes = Some(query_label(&text, &shared));
            }
            b'P' => {
                let (name, rest) = cstr(body);
                let (text, _) = cstr(rest);
                let label = label_of(&text);
                if name.starts_with("tower_idempotency") {
                    shared
                        .state
                        .lock()
                        .unwrap()
                        .names
                        .insert(name.clone(), label.clone());
                }
                local.insert(name, label.clone());
                parsed_last = Some(label);
            }
            b'B' => {
                let (_portal, rest) = cstr(body);
                let (name, _) = cstr(rest);
                let label = if name.is_empty() {
                    parsed_last.clone()
                } else {
                    local
                        .get(&name)
                        .cloned()
                        .or_else(|| shared.state.lock().unwrap().names.get(&name).cloned())
                };
                executes = Some(label.unwrap_or_else(|| format!("statement {name}")));
            }
            _ => {}
        }
        group.extend_from_slice(&msg);
        match kind {
            // The end of a round trip: the server answers it with one ReadyForQuery.
            b'Q' | b'S' => {
                let answer = match executes.take() {
                    Some(label) if !listener => {
                        let mut state = shared.state.lock().unwrap();
                        let nth = state.counts.entry(label.clone()).or_insert(0);
                        let point = Point { label, nth: *nth };
                        *nth += 1;
                        state.seen.push(point.clone());
                        let strike = match &state.armed {
                            Some((at, fault)) if *at == point && !state.fired => Some(*fault),
                            _ => None,
                        };
                        match strike {
                            Some(fault) => {
                                state.fired = true;
                                drop(state);
                                shared.hit.notify_waiters();
                                match fault {
                                    Fault::CutBefore => return,
                                    Fault::CutAfter => Answer::Cut,
                                    Fault::Stall(d) => Answer::Stall(d),
                                    Fault::Hold => Answer::Hold,
                                }
                            }
                            None => Answer::Forward,
                        }
                    }
                    _ => Answer::Forward,
                };
                answers.lock().unwrap().push_back(answer);
                queued.notify_one();
                if to.write_all(&group).await.is_err() {
                    return;
                }
                group.clear();
            }
            // Terminate, a password message, Flush, copy data: on at once.
            b'X' | b'p' | b'H' | b'd' | b'c' | b'f' => {
                if to.write_all(&group).await.is_err() {
                    return;
                }
                group.clear();
            }
            _ => {}
        }
    }
}

/// The server-to-client direction: each answer, up to its ReadyForQuery, is forwarded, lost,
/// stalled or held as its group was marked.
async fn downstream(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: Arc<Shared>,
    answers: Arc<Mutex<VecDeque<Answer>>>,
    queued: Arc<Notify>,
) {
    let mut held: Vec<u8> = Vec::new();
    loop {
        let Some((kind, msg)) = read_typed(&mut from).await else {
            return;
        };
        let current = loop {
            let front = answers.lock().unwrap().front().copied();
            match front {
                Some(answer) => break answer,
                // An answer before its group was queued cannot happen (the group is queued
                // before it is sent); wait rather than guess.
                None => queued.notified().await,
            }
        };
        match current {
            Answer::Forward if held.is_empty() => {
                if to.write_all(&msg).await.is_err() {
                    return;
                }
            }
            _ => held.extend_from_slice(&msg),
        }
        if kind != b'Z' {
            continue;
        }
        answers.lock().unwrap().pop_front();
        match current {
            Answer::Forward => {}
            Answer::Cut => return,
            Answer::Stall(d) => tokio::time::sleep(d).await,
            Answer::Hold => {
                let mut released = shared.released.subscribe();
                let _ = released.wait_for(|r| *r).await;
            }
        }
        if !held.is_empty() {
            if to.write_all(&held).await.is_err() {
                return;
            }
            held.clear();
        }
    }
}
