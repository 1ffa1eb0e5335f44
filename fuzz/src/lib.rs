//! The checks behind the fuzz targets: each takes the fuzzer's bytes, runs one of the crate's
//! hand-written parsers or codecs on them, and panics when an invariant fails.
//!
//! Two harnesses run them: `cargo fuzz` (the targets in `fuzz_targets/`, on nightly, for as
//! long as it is left to run), and the crate's test suite on stable (`tests/fuzz_corpus.rs`
//! includes this file), over the committed corpus in `fuzz/corpus/<target>/` and a bounded
//! number of generated inputs.
//!
//! The store checks (`redis_answer`, `postgres_answer`, `sql_literals`) talk to the real
//! servers: `REDIS_URL` (default `redis://127.0.0.1:6379`) and `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`). They only read and write keys under a
//! prefix of their own, and send `SELECT`s.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub, dead_code)]

use std::cmp::Ordering;
use std::fmt;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use tower_idempotency::store::{ClaimOutcome, ClaimRequest, Store};
use tower_idempotency::{
    Fingerprint, IdempotencyKey, JsonFingerprint, MAX_KEY_LEN, MemoryStore, StoredResponse,
};

/// The targets, by the name of their corpus folder and `cargo fuzz` target.
pub const TARGETS: &[&str] = &[
    "key",
    "json",
    "headers",
    "memory_answer",
    "redis_answer",
    "postgres_answer",
    "sql_literals",
];

/// Reads structured values off the fuzzer's bytes; once they run out, every read is zero.
struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }

    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.data.split_at(n.min(self.data.len()));
        self.data = rest;
        head
    }

    fn rest(&mut self) -> &'a [u8] {
        self.take(self.data.len())
    }
}

/// Splits the bytes at `0xff` into up to three fields; a missing field is `None` (a
/// missing Redis field, a `NULL` column).
fn fields(data: &[u8]) -> [Option<&[u8]>; 3] {
    let mut parts = data.splitn(3, |&b| b == 0xff);
    [parts.next(), parts.next(), parts.next()]
}

// ---------------------------------------------------------------------------------------
// The key

/// The key grammar, written from its documentation: surrounding whitespace trimmed; a value
/// that starts with `"` is an sf-string (printable ASCII, `\"` and `\\` escapes, nothing
/// after the closing quote); any other is 1 to 255 visible ASCII characters.
fn reference_key(raw: &[u8]) -> Option<String> {
    let raw = raw.trim_ascii();
    let text = if let Some(quoted) = raw.strip_prefix(b"\"") {
        let mut out = Vec::new();
        let mut bytes = quoted.iter();
        loop {
            match *bytes.next()? {
                b'"' => break,
                b'\\' => match *bytes.next()? {
                    c @ (b'"' | b'\\') => out.push(c),
                    _ => return None,
                },
                c if (0x20..=0x7e).contains(&c) => out.push(c),
                _ => return None,
            }
        }
        if bytes.next().is_some() {
            return None;
        }
        out
    } else {
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b)) {
            return None;
        }
        raw.to_vec()
    };
    if text.is_empty() || text.len() > MAX_KEY_LEN {
        return None;
    }
    String::from_utf8(text).ok()
}

/// The key parser agrees with [`reference_key`] on every input, from text and from a header
/// value; a parsed key is 1 to 255 printable ASCII characters and survives being turned into
/// a header and back, and so do the keys derived from it.
pub fn key(data: &[u8]) {
    let expected = reference_key(data);
    if let Ok(text) = std::str::from_utf8(data) {
        let parsed = IdempotencyKey::parse(text).ok();
        assert_eq!(
            parsed.as_ref().map(IdempotencyKey::as_str),
            expected.as_deref(),
            "parse({text:?})"
        );
    }
    let Ok(value) = HeaderValue::from_bytes(data) else {
        return;
    };
    let parsed = IdempotencyKey::from_header(&value).ok();
    assert_eq!(
        parsed.as_ref().map(IdempotencyKey::as_str),
        expected.as_deref(),
        "from_header({value:?})"
    );
    let Some(key) = parsed else {
        return;
    };
    let text = key.as_str();
    assert!(!text.is_empty() && text.len() <= MAX_KEY_LEN, "{key:?}");
    assert!(text.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{key:?}");
    let header = HeaderValue::from(key.clone());
    assert_eq!(
        IdempotencyKey::from_header(&header).as_ref(),
        Ok(&key),
        "{key:?} as the header {header:?}"
    );
    // A purpose made of the key's visible characters other than `:` (or a fixed one).
    let purpose: String = text
        .chars()
        .filter(|&c| c.is_ascii_graphic() && c != ':')
        .take(64)
        .collect();
    let purpose = if purpose.is_empty() { "p" } else { &purpose };
    let derived = key.derive(purpose).unwrap();
    assert!(derived.as_str().len() <= MAX_KEY_LEN, "{derived:?}");
    assert!(derived.as_str().ends_with(&format!(":{purpose}")));
    let header = HeaderValue::from(derived.clone());
    assert_eq!(IdempotencyKey::from_header(&header).as_ref(), Ok(&derived));
    assert_eq!(key.derive(purpose).as_ref(), Ok(&derived), "deterministic");
}

// ---------------------------------------------------------------------------------------
// JSON

/// The JSON canonicaliser (RFC 8785, with exact numbers) never panics and:
///
/// - accepts what `serde_json` accepts when duplicate member names are refused, except where
///   this crate documents otherwise: a number beyond a double's range (kept exactly here,
///   refused by `serde_json`), an exponent beyond 64 bits (refused here, also when it is the
///   exponent of the canonical form), and nesting of
///   exactly 128 levels (serde_json's limit is one lower);
/// - writes a canonical form that is a fixed point, has no whitespace outside strings, its
///   members in UTF-16 order, and means what the input means;
/// - writes each number with its exact decimal value (so different decimals never share a
///   canonical form, and equal ones always do), in ECMAScript's layout, which is RFC 8785's
///   wherever the text is a double's shortest form.
pub fn json(data: &[u8]) {
    let canonical = JsonFingerprint::new().canonicalize(data);
    let theirs = strict::<false>(data);
    let scan = Scan::of(data);
    match (&canonical, &theirs) {
        (Some(_), Err(e)) => assert!(
            scan.depth == 128 || scan.numbers.iter().any(|n| beyond_f64(n)),
            "accepted, but serde_json refuses it ({e}): {:?}",
            String::from_utf8_lossy(data)
        ),
        (None, Ok(_)) => assert!(
            scan.numbers.iter().any(|n| exponent_beyond_i64(n)),
            "refused, but serde_json accepts it: {:?}",
            String::from_utf8_lossy(data)
        ),
        _ => {}
    }
    let Some(canonical) = canonical else {
        return;
    };
    let shown = || String::from_utf8_lossy(data).into_owned();
    assert_eq!(
        JsonFingerprint::new().canonicalize(&canonical).as_deref(),
        Some(&canonical[..]),
        "not a fixed point: {:?}",
        shown()
    );
    let out = Scan::of(&canonical);
    assert!(
        !out.whitespace,
        "whitespace in the canonical form of {:?}",
        shown()
    );
    // Sorted, and the same document (numbers compared as serde_json reads them).
    match (strict::<true>(&canonical), &theirs) {
        (Ok(written), Ok(read)) => assert!(
            same(&written, read),
            "{:?} canonicalised to another document",
            shown()
        ),
        (Err(e), Ok(_)) => panic!("the canonical form of {:?}: {e}", shown()),
        _ => {}
    }
    numbers(&scan.numbers);
}

/// Each number is written with its exact value, and two numbers share a canonical form
/// exactly when their values are equal.
fn numbers(texts: &[&str]) {
    let canon = |text: &str| {
        let out = JsonFingerprint::new()
            .canonicalize(text.as_bytes())
            .unwrap_or_else(|| panic!("the number {text:?} alone is refused"));
        String::from_utf8(out).unwrap()
    };
    let mut seen = Vec::new();
    for &text in texts.iter().take(16) {
        let written = canon(text);
        let value = decimal(text).unwrap();
        assert_eq!(
            decimal(&written),
            Some(value.clone()),
            "{text:?} was written as {written:?}"
        );
        // RFC 8785's form where the text is the shortest of a double.
        if let Ok(x) = text.parse::<f64>()
            && x.is_finite()
            && decimal(&format!("{x:e}")) == Some(value.clone())
        {
            assert_eq!(written, ecmascript(x), "{text:?}");
        }
        seen.push((text, written, value));
    }
    for (i, (a, written_a, value_a)) in seen.iter().enumerate() {
        for (b, written_b, value_b) in &seen[i + 1..] {
            assert_eq!(
                written_a == written_b,
                value_a == value_b,
                "{a:?} -> {written_a:?}, {b:?} -> {written_b:?}"
            );
        }
    }
}

/// A decimal's exact value: the sign, the significant digits (no leading or trailing zeros)
/// and the power of ten of the last one. Zero is `(false, "", 0)`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Decimal {
    negative: bool,
    digits: String,
    exponent: i128,
}

/// The value of a number's text (JSON's grammar, or Rust's `{:e}`).
fn decimal(text: &str) -> Option<Decimal> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match text.find(['e', 'E']) {
        Some(i) => {
            let e = &text[i + 1..];
            let (sign, digits) = match e.as_bytes().first() {
                Some(b'-') => (-1, &e[1..]),
                Some(b'+') => (1, &e[1..]),
                _ => (1, e),
            };
            let digits = digits.trim_start_matches('0');
            let magnitude: i128 = if digits.is_empty() {
                0
            } else {
                digits.parse().ok()?
            };
            (&text[..i], sign * magnitude)
        }
        None => (text, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: String = format!("{int}{frac}");
    let trimmed = all.trim_start_matches('0');
    let significant = trimmed.trim_end_matches('0');
    if significant.is_empty() {
        return Some(Decimal {
            negative: false,
            digits: String::new(),
            exponent: 0,
        });
    }
    let dropped = i128::try_from(trimmed.len() - significant.len()).ok()?;
    let frac_len = i128::try_from(frac.len()).ok()?;
    Some(Decimal {
        negative,
        digits: significant.to_owned(),
        exponent: exponent.checked_sub(frac_len)?.checked_add(dropped)?,
    })
}

/// ECMAScript's `Number::toString` of a finite double (RFC 8785, section 3.2.2.3), from
/// Rust's shortest round-trip digits.
fn ecmascript(x: f64) -> String {
    if x == 0.0 {
        return "0".to_owned();
    }
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap();
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let k = i64::try_from(digits.len()).unwrap();
    let n = exp.parse::<i64>().unwrap() + 1;
    let sign = if x < 0.0 { "-" } else { "" };
    let zeros = |count: i64| "0".repeat(usize::try_from(count).unwrap());
    let body = if k <= n && n <= 21 {
        format!("{digits}{}", zeros(n - k))
    } else if 0 < n && n <= 21 {
        let (a, b) = digits.split_at(usize::try_from(n).unwrap());
        format!("{a}.{b}")
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", zeros(-n))
    } else {
        let (first, rest) = digits.split_at(1);
        let point = if rest.is_empty() { "" } else { "." };
        let e = n - 1;
        let e_sign = if e < 0 { '-' } else { '+' };
        format!("{first}{point}{rest}e{e_sign}{}", e.unsigned_abs())
    };
    format!("{sign}{body}")
}

/// Beyond a double's range: `serde_json` refuses it, this crate keeps it exactly.
fn beyond_f64(number: &str) -> bool {
    number.parse::<f64>().map_or(true, |x| x.abs() > 1e308)
}

/// An exponent that does not fit in 64 bits, as written or in `e` notation after the first
/// significant digit: this crate refuses the text.
fn exponent_beyond_i64(number: &str) -> bool {
    let fits = |e: i128| i64::try_from(e.unsigned_abs()).is_ok();
    let Some(i) = number.find(['e', 'E']) else {
        return false;
    };
    let digits = number[i + 1..].trim_start_matches(['+', '-']);
    let digits = digits.trim_start_matches('0');
    if !digits.is_empty() && digits.parse::<i64>().is_err() {
        return true;
    }
    decimal(number).is_none_or(|d| {
        let k = i128::try_from(d.digits.len()).unwrap();
        !d.digits.is_empty() && !fits(d.exponent + k - 1)
    })
}

/// What a lexical scan of a text finds outside its strings: the deepest nesting, the
/// numbers, and whether there is whitespace. Exact on valid JSON, which is all it is used on.
struct Scan<'a> {
    depth: usize,
    numbers: Vec<&'a str>,
    whitespace: bool,
}

impl<'a> Scan<'a> {
    fn of(text: &'a [u8]) -> Self {
        let mut scan = Scan {
            depth: 0,
            numbers: Vec::new(),
            whitespace: false,
        };
        let (mut depth, mut i, mut in_string, mut escaped) = (0usize, 0, false, false);
        while let Some(&b) = text.get(i) {
            i += 1;
            if in_string {
                match b {
                    _ if escaped => escaped = false,
                    b'\\' => escaped = true,
                    b'"' => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    scan.depth = scan.depth.max(depth);
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                b' ' | b'\t' | b'\n' | b'\r' => scan.whitespace = true,
                b'-' | b'0'..=b'9' => {
                    let start = i - 1;
                    while let Some(b'0'..=b'9' | b'.' | b'e' | b'E' | b'+' | b'-') = text.get(i) {
                        i += 1;
                    }
                    if let Ok(number) = std::str::from_utf8(&text[start..i]) {
                        scan.numbers.push(number);
                    }
                }
                _ => {}
            }
        }
        scan
    }
}

/// `serde_json`'s reading of a text, refusing duplicate member names (RFC 8785 requires it)
/// and, with `SORTED`, members out of UTF-16 order.
fn strict<const SORTED: bool>(data: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(data);
    let value = Strict::<SORTED>.deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

struct Strict<const SORTED: bool>;

impl<'de, const SORTED: bool> DeserializeSeed<'de> for Strict<SORTED> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Value, D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de, const SORTED: bool> Visitor<'de> for Strict<SORTED> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("not a finite number"))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(Strict::<SORTED>)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut members = Map::new();
        let mut last: Option<String> = None;
        while let Some(name) = map.next_key::<String>()? {
            if members.contains_key(&name) {
                return Err(de::Error::custom(format!("duplicate member {name:?}")));
            }
            if SORTED
                && let Some(last) = &last
                && last.encode_utf16().cmp(name.encode_utf16()) != Ordering::Less
            {
                return Err(de::Error::custom(format!(
                    "member {name:?} after {last:?}: not in UTF-16 order"
                )));
            }
            let value = map.next_value_seed(Strict::<SORTED>)?;
            members.insert(name.clone(), value);
            last = Some(name);
        }
        Ok(Value::Object(members))
    }
}

/// The same document; numbers equal as doubles, within the last digit `serde_json` may get
/// wrong when it reads a long number.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            x == y || (x - y).abs() <= 4.0 * f64::EPSILON * x.abs().max(y.abs())
        }
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| same(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(name, v)| y.get(name).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------------------
// Stored responses

/// The characters of a header name (RFC 9110 `token`, lower case).
const TOKEN: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~";

/// A response built from the fuzzer's bytes: any status, up to 16 headers (names repeat,
/// values hold any byte a header value may), a body or none.
fn response(data: &[u8]) -> StoredResponse {
    let mut r = Reader { data };
    let status = StatusCode::from_u16(100 + r.u16() % 900).unwrap();
    let headers = header_map(&mut r);
    // Trailers about one time in four (a gRPC answer's `grpc-status`).
    let trailers = r.byte().is_multiple_of(4).then(|| header_map(&mut r));
    let response = if r.byte() & 1 == 0 {
        StoredResponse::new(status, headers, Bytes::copy_from_slice(r.rest()))
    } else {
        StoredResponse::without_body(status, headers)
    };
    match trailers {
        Some(trailers) => response.with_trailers(trailers),
        None => response,
    }
}

/// Up to 16 valid headers read from `r`.
fn header_map(r: &mut Reader<'_>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for _ in 0..r.byte() % 17 {
        let len = 1 + usize::from(r.byte() % 24);
        let name: Vec<u8> = (0..len)
            .map(|_| TOKEN[usize::from(r.byte()) % TOKEN.len()])
            .collect();
        let len = usize::from(r.byte() % 48);
        let value: Vec<u8> = r
            .take(len)
            .iter()
            .map(|&b| {
                if b == 0x7f || (b < 0x20 && b != b'\t') {
                    b'x'
                } else {
                    b
                }
            })
            .collect();
        let name = HeaderName::from_bytes(&name).unwrap();
        headers.append(name, HeaderValue::from_bytes(&value).unwrap());
    }
    headers
}

/// The header codec: decoding any bytes returns the headers (and the trailers) or an error,
/// never a panic, and what it returns encodes to bytes that decode to the same; an encoding
/// is as long as the stores reserve for it; the headers and trailers of any response survive
/// encoding and decoding, the values of each name in their order.
pub fn headers(data: &[u8]) {
    if let Ok(decoded) = StoredResponse::decode_headers(data) {
        let again = StoredResponse::new(StatusCode::OK, decoded.clone(), Bytes::new());
        assert_eq!(
            StoredResponse::decode_headers(&again.encode_headers()).unwrap(),
            decoded
        );
    }
    if let Ok((decoded, trailers)) = StoredResponse::decode_head(data) {
        let mut again = StoredResponse::new(StatusCode::OK, decoded.clone(), Bytes::new());
        if let Some(trailers) = trailers.clone() {
            again = again.with_trailers(trailers);
        }
        let (headers, back) = StoredResponse::decode_head(&again.encode_headers()).unwrap();
        assert_eq!(headers, decoded);
        assert_eq!(
            back.filter(|t| !t.is_empty()),
            trailers.filter(|t| !t.is_empty())
        );
    }
    let response = response(data);
    let encoded = response.encode_headers();
    assert_eq!(
        encoded.len(),
        tower_idempotency::fuzzing::encoded_headers_len(&response)
    );
    let decoded = StoredResponse::decode(response.status(), &encoded, response.body().cloned());
    assert_eq!(decoded.unwrap(), response);
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
}

fn block_on<F: Future>(future: F) -> F::Output {
    RUNTIME.with(|rt| rt.block_on(future))
}

/// A claim of `key` in the scope `""`, with a fixed fingerprint.
fn claim(key: &IdempotencyKey) -> ClaimRequest<'_> {
    ClaimRequest {
        scope: "",
        key,
        fingerprint: Fingerprint::from_bytes([7; 32]),
        lease: std::time::Duration::from_secs(30),
        ttl: std::time::Duration::from_secs(60),
    }
}

/// Stores `answer` under a fresh claim of `key` and claims the key again: the replay is the
/// answer.
async fn round_trip<S: Store>(store: &S, key: &IdempotencyKey, answer: &StoredResponse) {
    let ClaimOutcome::Acquired { token, .. } = store.claim(claim(key)).await.unwrap() else {
        panic!("a fresh key is not acquired");
    };
    let ttl = std::time::Duration::from_secs(60);
    assert!(store.complete("", key, token, answer, ttl).await.unwrap());
    match store.claim(claim(key)).await.unwrap() {
        ClaimOutcome::Completed(replayed) => assert_eq!(&replayed, answer),
        other => panic!("the completed key is {other:?}"),
    }
}

/// The memory store's answer encoding (one buffer per answer): any answer is replayed as it
/// was stored.
pub fn memory_answer(data: &[u8]) {
    let store = MemoryStore::new();
    let key = IdempotencyKey::parse("k").unwrap();
    block_on(round_trip(&store, &key, &response(data)));
}

/// What the Redis and Postgres stores make of the stored status, head and body fields: the
/// status must be an HTTP status, the head what
/// [`encode_headers`](StoredResponse::encode_headers) writes (the headers, and the trailers
/// when there were any; missing: no headers); a missing body is an answer stored without its
/// body.
fn reference_answer(
    status: Option<i64>,
    head: Option<&[u8]>,
    body: Option<&[u8]>,
) -> Option<StoredResponse> {
    let status = StatusCode::from_u16(u16::try_from(status?).ok()?).ok()?;
    let body = body.map(Bytes::copy_from_slice);
    StoredResponse::decode(status, head.unwrap_or_default(), body).ok()
}

#[cfg(feature = "redis")]
pub use self::redis_store::redis_answer;

#[cfg(feature = "redis")]
mod redis_store {
    use std::cell::Cell;

    use sha2::{Digest, Sha256};
    use tower_idempotency::RedisStore;
    use tower_idempotency::store::Store;

    use super::*;

    struct Redis {
        store: RedisStore,
        conn: ::redis::aio::MultiplexedConnection,
        prefix: String,
        next: Cell<u64>,
    }

    thread_local! {
        static REDIS: Redis = block_on(connect());
    }

    async fn connect() -> Redis {
        let url = std::env::var("REDIS_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
        let client = ::redis::Client::open(url.as_str()).unwrap();
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("no Redis at {url} ({e}): set REDIS_URL"));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let prefix = format!("ti-fuzz:{}:{nanos}:", std::process::id());
        // A short grace: the keys of a failed check (which does not delete them) are gone a
        // minute after it, not a day.
        let store = RedisStore::open(&url)
            .unwrap()
            .with_prefix(prefix.as_str())
            .with_grace(std::time::Duration::from_secs(1));
        Redis {
            store,
            conn,
            prefix,
            next: Cell::new(0),
        }
    }

    /// The Redis store's encoding of an answer (status, header encoding and body as fields of
    /// the key's hash): any answer is replayed as it was stored; fields holding any bytes,
    /// or missing, are read as [`reference_answer`] says or refused, never a panic.
    pub fn redis_answer(data: &[u8]) {
        REDIS.with(|redis| block_on(check(redis, data)));
    }

    async fn check(redis: &Redis, data: &[u8]) {
        let n = redis.next.get();
        redis.next.set(n + 1);
        let key = IdempotencyKey::parse(&format!("k{n}")).unwrap();
        let record = record_name(&redis.prefix, &key);
        let fence = format!("{}:f", record.trim_end_matches(":r"));
        let mut conn = redis.conn.clone();
        round_trip(&redis.store, &key, &response(data)).await;
        let exists: bool = ::redis::cmd("EXISTS")
            .arg(&record)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(exists, "the record is not named {record:?}");

        let [status, headers, body] = fields(data);
        let status = status.filter(|s| !s.is_empty());
        for (field, value) in [("status", status), ("headers", headers), ("body", body)] {
            let cmd = match value {
                Some(v) => {
                    let mut c = ::redis::cmd("HSET");
                    c.arg(&record).arg(field).arg(v);
                    c
                }
                None => {
                    let mut c = ::redis::cmd("HDEL");
                    c.arg(&record).arg(field);
                    c
                }
            };
            let _: i64 = cmd.query_async(&mut conn).await.unwrap();
        }
        let status = status
            .and_then(|s| std::str::from_utf8(s).ok())
            .and_then(|s| s.parse::<i64>().ok());
        let expected = reference_answer(status, headers, body);
        match redis.store.claim(claim(&key)).await {
            Ok(ClaimOutcome::Completed(read)) => assert_eq!(Some(read), expected),
            Ok(other) => panic!("the completed key is {other:?}"),
            Err(e) => assert_eq!(expected, None, "refused: {e}"),
        }
        let _: i64 = ::redis::cmd("DEL")
            .arg(&record)
            .arg(&fence)
            .query_async(&mut conn)
            .await
            .unwrap();
    }

    /// The name of the key's record, as the Redis store names it: the prefix, a hash tag of
    /// the first 16 bytes of SHA-256 over the scope's length, the scope and the key, `:r`.
    fn record_name(prefix: &str, key: &IdempotencyKey) -> String {
        let mut h = Sha256::new();
        h.update(0u64.to_be_bytes());
        h.update(key.as_str().as_bytes());
        let digest = h.finalize();
        let tag: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        format!("{prefix}{{{tag}}}:r")
    }
}

#[cfg(feature = "postgres")]
pub use self::postgres::{postgres_answer, sql_literals};

#[cfg(feature = "postgres")]
mod postgres {
    use std::cell::RefCell;

    use sqlx::{AssertSqlSafe, Connection, PgConnection, Row};
    use tower_idempotency::fuzzing::{self, Literal};

    use super::*;

    /// The connections: one as the store's pool makes them, and one whose session settings
    /// are as hostile to literals as Postgres allows (`standard_conforming_strings` off,
    /// `client_encoding` SJIS, whose characters can hold the bytes of `\` and `'`).
    struct Pg {
        plain: PgConnection,
        hostile: PgConnection,
    }

    thread_local! {
        static PG: RefCell<Pg> = RefCell::new(block_on(connect()));
    }

    async fn connect() -> Pg {
        let url = std::env::var("DATABASE_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let open = || async {
            PgConnection::connect(&url)
                .await
                .unwrap_or_else(|e| panic!("no Postgres at {url} ({e}): set DATABASE_URL"))
        };
        let plain = open().await;
        let mut hostile = open().await;
        sqlx::raw_sql(
            "SET standard_conforming_strings = off; SET escape_string_warning = off; \
             SET client_encoding = 'SJIS'",
        )
        .execute(&mut hostile)
        .await
        .unwrap();
        Pg { plain, hostile }
    }

    async fn row(conn: &mut PgConnection, sql: String) -> sqlx::postgres::PgRow {
        sqlx::raw_sql(AssertSqlSafe(sql.clone()))
            .fetch_one(conn)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }

    const ANSWER: &str = "SELECT $1::smallint AS response_status, $2::bytea AS response_headers, \
                          $3::bytea AS response_body";

    /// The Postgres store's encoding of an answer (`smallint` status, `bytea` header encoding
    /// and body, written as the store writes its literals): any answer is read back as it
    /// was stored; columns holding any value, or `NULL`, are read as [`reference_answer`]
    /// says or refused, never a panic.
    pub fn postgres_answer(data: &[u8]) {
        PG.with(|pg| block_on(check_answer(&mut pg.borrow_mut(), data)));
    }

    async fn check_answer(pg: &mut Pg, data: &[u8]) {
        let answer = response(data);
        let status = fuzzing::postgres_status_column(&answer).unwrap();
        let headers = answer.encode_headers();
        let sql = fuzzing::sql_fill(
            ANSWER,
            &[
                Literal::Int(i64::from(status)),
                Literal::Bytes(&headers),
                Literal::MaybeBytes(answer.body().map(|b| &b[..])),
            ],
        )
        .unwrap();
        let read = fuzzing::postgres_decode_response(&row(&mut pg.plain, sql).await);
        assert_eq!(read.unwrap(), answer);

        let [status, headers, body] = fields(data);
        let status = status.filter(|s| !s.is_empty()).map(|s| {
            let mut r = Reader { data: s };
            i16::from_be_bytes([r.byte(), r.byte()])
        });
        let sql = fuzzing::sql_fill(
            ANSWER,
            &[
                status.map_or(Literal::MaybeBytes(None), |s| Literal::Int(i64::from(s))),
                Literal::MaybeBytes(headers),
                Literal::MaybeBytes(body),
            ],
        )
        .unwrap();
        let expected = reference_answer(status.map(i64::from), headers, body);
        match fuzzing::postgres_decode_response(&row(&mut pg.plain, sql).await) {
            Ok(read) => assert_eq!(Some(read), expected),
            Err(e) => assert_eq!(expected, None, "refused: {e}"),
        }
    }

    /// The SQL literal writer: any text (but one with a NUL, which is refused) and any bytes
    /// reach Postgres as they are, through a statement that is ASCII whatever the value, and
    /// read the same on a session with `standard_conforming_strings` off and an SJIS client
    /// encoding; a value is copied in once and never scanned for placeholders.
    pub fn sql_literals(data: &[u8]) {
        PG.with(|pg| block_on(check_literals(&mut pg.borrow_mut(), data)));
    }

    async fn check_literals(pg: &mut Pg, data: &[u8]) {
        let text = String::from_utf8_lossy(data);
        let mut r = Reader { data };
        let n = i64::from_be_bytes(std::array::from_fn(|_| r.byte()));
        let bytes = data;
        if text.contains('\0') {
            assert!(fuzzing::sql_text(&text).is_err(), "a NUL is written");
        }
        let text = text.replace('\0', "");
        let literal = fuzzing::sql_text(&text).unwrap();
        assert!(literal.is_ascii(), "{literal}");
        assert!(fuzzing::sql_bytea(bytes).is_ascii());

        let args = [Literal::Text(&text), Literal::Bytes(bytes), Literal::Int(n)];
        let sql = fuzzing::sql_fill(
            "SELECT $1 AS t, $2 AS b, $3::text AS n, (0 -$3::numeric)::text AS m",
            &args,
        )
        .unwrap();
        assert!(sql.is_ascii(), "{sql}");
        let read = row(&mut pg.plain, sql).await;
        assert_eq!(read.get::<String, _>("t"), text);
        assert_eq!(read.get::<Vec<u8>, _>("b"), bytes);
        assert_eq!(read.get::<String, _>("n"), n.to_string());
        assert_eq!(read.get::<String, _>("m"), (-i128::from(n)).to_string());
        // The hostile session reads the values back as hex, ASCII in every encoding.
        let sql = fuzzing::sql_fill(
            "SELECT encode(convert_to($1, 'UTF8'), 'hex') AS t, encode($2, 'hex') AS b, \
             $3::text AS n, (0 -$3::numeric)::text AS m",
            &args,
        )
        .unwrap();
        let read = row(&mut pg.hostile, sql).await;
        assert_eq!(read.get::<String, _>("t"), hex(text.as_bytes()));
        assert_eq!(read.get::<String, _>("b"), hex(bytes));
        assert_eq!(read.get::<String, _>("n"), n.to_string());
        assert_eq!(read.get::<String, _>("m"), (-i128::from(n)).to_string());
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }
}
