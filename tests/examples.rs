//! The two small examples a newcomer reads first, run as programs: the axum quick start and
//! the plain hyper server. A key's second request is the first answer replayed; another body
//! with the key is `422`; the quick start's keys are each account's own.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};

/// Starts an example on a free port and returns it with its address.
fn start(name: &str) -> (Child, SocketAddr) {
    let mut child = Command::new(support::example_path(name))
        .env("BIND", "127.0.0.1:0")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("{name} printed {line:?}"))
        .parse()
        .unwrap();
    (child, addr)
}

/// Sends one HTTP/1.1 request and returns the status, the head and the body.
fn post(addr: SocketAddr, path: &str, key: &str, body: &str) -> (u16, String, String) {
    post_as(addr, "Bearer alice", path, key, body)
}

/// [`post`] with an `Authorization` header of its own (`""`: none).
fn post_as(
    addr: SocketAddr,
    authorization: &str,
    path: &str,
    key: &str,
    body: &str,
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    let authorization = if authorization.is_empty() {
        String::new()
    } else {
        format!("Authorization: {authorization}\r\n")
    };
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Idempotency-Key: {key}\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_owned())
}

fn replays_the_first_answer(name: &str, path: &str) {
    let (mut child, addr) = start(name);
    let (status, head, first) = post(addr, path, "k1", "two coffees");
    assert_eq!(status, 201, "{name}: {head}\n{first}");
    assert!(!head.contains("idempotent-replayed"));
    let (status, head, again) = post(addr, path, "k1", "two coffees");
    assert_eq!(status, 201);
    assert!(head.contains("idempotent-replayed: true"), "{name}: {head}");
    assert_eq!(again, first, "{name}: the replay is the first answer");
    let (status, head, _) = post(addr, path, "k1", "three coffees");
    assert_eq!(status, 422, "{name}: {head}");
    let (status, _, other) = post(addr, path, "k2", "two coffees");
    assert_eq!(status, 201);
    assert_ne!(other, first, "{name}: a new key runs the handler again");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn the_quickstart_replays_the_first_answer() {
    replays_the_first_answer("quickstart", "/payments");
}

/// The quick start scopes keys to the account: the same key for another account runs the
/// handler anew, and a request without an account is refused before any key is looked at.
#[test]
fn the_quickstart_keeps_each_accounts_keys_apart() {
    let (mut child, addr) = start("quickstart");
    let (status, _, alice) = post_as(addr, "Bearer alice", "/payments", "k1", "tea");
    assert_eq!(status, 201);
    let (status, head, bob) = post_as(addr, "Bearer bob", "/payments", "k1", "tea");
    assert_eq!(status, 201);
    assert!(!head.contains("idempotent-replayed"), "{head}");
    assert_ne!(bob, alice, "another account's key is its own");
    let (status, head, again) = post_as(addr, "Bearer alice", "/payments", "k1", "tea");
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert_eq!((status, again), (201, alice));
    let (status, _, _) = post_as(addr, "", "/payments", "k1", "tea");
    assert_eq!(status, 401);
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn the_hyper_example_replays_the_first_answer() {
    replays_the_first_answer("hyper", "/orders");
}
