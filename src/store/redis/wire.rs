//! What the store sends and reads: a key's cluster slot, patterns escaped for `SCAN`, the
//! server's settings and nodes, and replies decoded.

use std::time::Duration;

use ::redis::Value;
use bytes::Bytes;
use http::StatusCode;

use crate::error::StoreError;
use crate::response::StoredResponse;
use crate::store::{ClaimOutcome, LeaseToken};

/// The Cluster slot of a key: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub(super) fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = key
        .find('{')
        .and_then(|open| {
            let close = key[open + 1..].find('}')?;
            (close > 0).then(|| &bytes[open + 1..open + 1 + close])
        })
        .unwrap_or(bytes);
    let mut crc: u16 = 0;
    for &b in tag {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Escapes the glob characters of `SCAN MATCH` in a literal.
pub(super) fn glob_escape(literal: &str) -> String {
    let mut out = String::with_capacity(literal.len());
    for c in literal.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The masters of a `CLUSTER NODES` answer that are not failing.
pub(super) fn parse_masters(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let _id = fields.next()?;
            let address = fields.next()?;
            let flags = fields.next()?;
            if !flags.split(',').any(|f| f == "master") || flags.contains("fail") {
                return None;
            }
            let address = address.split('@').next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
}

/// The policies in a `CONFIG GET maxmemory-policy` answer (one per master in a cluster).
pub(super) fn collect_policies(value: &Value, out: &mut Vec<String>) {
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match value {
        Value::Map(pairs) => {
            for (k, v) in pairs {
                if text(k).as_deref() == Some("maxmemory-policy") {
                    out.extend(text(v));
                } else {
                    collect_policies(v, out);
                }
            }
        }
        Value::Array(items) => {
            let mut i = 0;
            while i < items.len() {
                if text(&items[i]).as_deref() == Some("maxmemory-policy") {
                    if let Some(v) = items.get(i + 1) {
                        out.extend(text(v));
                    }
                    i += 2;
                } else {
                    collect_policies(&items[i], out);
                    i += 1;
                }
            }
        }
        _ => {}
    }
}

/// Milliseconds as a script argument.
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn corrupt(what: &str) -> StoreError {
    StoreError::Corrupt(format!("unexpected answer from the Redis store's {what}"))
}

/// Reads a script's reply as bytes.
pub(super) fn bytes_of(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

pub(super) fn int_of(v: &Value) -> Option<i64> {
    match v {
        Value::Int(n) => Some(*n),
        other => std::str::from_utf8(bytes_of(other)?).ok()?.parse().ok(),
    }
}

/// The outcome of the claim script's reply.
pub(super) fn decode_claim(reply: &[Value]) -> Result<ClaimOutcome, StoreError> {
    let kind = reply
        .first()
        .and_then(bytes_of)
        .ok_or_else(|| corrupt("claim"))?;
    Ok(match kind {
        b"acquired" => {
            let token = reply
                .get(1)
                .and_then(int_of)
                .ok_or_else(|| corrupt("claim"))?;
            let takeover = reply.get(2).and_then(int_of) == Some(1);
            ClaimOutcome::Acquired {
                token: LeaseToken::from_raw(token),
                takeover,
            }
        }
        b"in_flight" => {
            let left = reply.get(1).and_then(int_of).unwrap_or(0);
            ClaimOutcome::InFlight {
                retry_after: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
            }
        }
        b"mismatch" => ClaimOutcome::Mismatch,
        b"completed" => {
            let status = reply
                .get(1)
                .and_then(int_of)
                .and_then(|s| u16::try_from(s).ok())
                .and_then(|s| StatusCode::from_u16(s).ok())
                .ok_or_else(|| StoreError::Corrupt("invalid stored status".into()))?;
            let head = reply.get(2).and_then(bytes_of).unwrap_or_default();
            let body = reply.get(3).and_then(bytes_of).map(Bytes::copy_from_slice);
            ClaimOutcome::Completed(StoredResponse::decode(status, head, body)?)
        }
        _ => return Err(corrupt("claim")),
    })
}
