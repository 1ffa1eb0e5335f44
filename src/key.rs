//! The idempotency key: its parser and the handler-facing value.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use http::HeaderValue;
use sha2::{Digest, Sha256};

/// The longest key accepted, in characters (bytes: keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key.
///
/// A key is 1 to [`MAX_KEY_LEN`] visible ASCII characters (`!` to `~`). The layer parses it
/// from the request header, accepting both forms clients send:
///
/// - a Structured Field string, as draft-ietf-httpapi-idempotency-key-header-07 specifies:
///   `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`;
/// - a bare value, as Stripe's and many other clients send it:
///   `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`.
///
/// Both name the same key. The layer inserts the parsed key into the request's extensions,
/// so a handler can read it (`req.extensions().get::<IdempotencyKey>()`, or the axum
/// extractor behind the `axum` feature) and pass a [derived](IdempotencyKey::derive) key on to
/// the services it calls.
///
/// ```
/// use tower_idempotency::IdempotencyKey;
///
/// let bare = IdempotencyKey::parse("order-42")?;
/// let quoted = IdempotencyKey::parse("\"order-42\"")?;
/// assert_eq!(bare, quoted);
/// assert_eq!(bare.derive("charge")?.as_str(), "order-42:charge");
/// # Ok::<(), tower_idempotency::KeyError>(())
/// ```
///
/// Cloning a key is cheap (a reference count).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

/// Why a header value is not a valid idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The key is empty (or an empty quoted string).
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    #[error("the idempotency key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    /// The key contains a character outside visible ASCII (`!` to `~`).
    #[error("the idempotency key contains a character that is not visible ASCII")]
    InvalidCharacter,
    /// A quoted key is not a well-formed Structured Field string (no closing quote, a bad
    /// escape, or text after the closing quote).
    #[error("the idempotency key is not a well-formed structured field string")]
    MalformedString,
    /// A derivation purpose is empty, too long, or not visible ASCII.
    #[error("the derivation purpose must be 1 to 64 visible ASCII characters")]
    InvalidPurpose,
}

/// The longest purpose accepted by [`IdempotencyKey::derive`].
const MAX_PURPOSE_LEN: usize = 64;

fn is_visible_ascii(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

impl IdempotencyKey {
    /// Parses a key from a header value's text, in either the quoted (Structured Field
    /// string) or the bare form.
    pub fn parse(value: &str) -> Result<Self, KeyError> {
        Self::parse_bytes(value.as_bytes())
    }

    /// Parses a key from a header value.
    pub fn from_header(value: &HeaderValue) -> Result<Self, KeyError> {
        Self::parse_bytes(value.as_bytes())
    }

    fn parse_bytes(raw: &[u8]) -> Result<Self, KeyError> {
        let raw = raw.trim_ascii();
        let key = match raw.first() {
            Some(b'"') => unquote(raw)?,
            _ => {
                validate(raw)?;
                Cow::Borrowed(raw)
            }
        };
        // validate() admitted only ASCII bytes, so this is valid UTF-8 (the error cannot
        // happen). The text is borrowed up to here and copied once, into the key.
        let text = std::str::from_utf8(&key).map_err(|_| KeyError::InvalidCharacter)?;
        Ok(Self(Arc::from(text)))
    }

    /// The key's text (unquoted).
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A key for a call this request makes to another service, such as a payment provider:
    /// `<key>:<purpose>`, so that the other side can deduplicate the call too.
    ///
    /// The result is deterministic (a retry of the request derives the same key) and always a
    /// valid key: when `<key>:<purpose>` would be longer than [`MAX_KEY_LEN`], the incoming key
    /// is replaced by the hex SHA-256 of it (`<sha256>:<purpose>`).
    ///
    /// A derived key is unique only among the keys of one scope. When the other service sees
    /// all your tenants under one credential, include the tenant in the purpose or send the
    /// tenant's account with the call.
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidPurpose`] when `purpose` is empty, longer than 64 characters or not
    /// visible ASCII.
    pub fn derive(&self, purpose: &str) -> Result<IdempotencyKey, KeyError> {
        let p = purpose.as_bytes();
        if p.is_empty() || p.len() > MAX_PURPOSE_LEN || !p.iter().copied().all(is_visible_ascii) {
            return Err(KeyError::InvalidPurpose);
        }
        let derived = if self.0.len() + 1 + p.len() <= MAX_KEY_LEN {
            format!("{}:{purpose}", self.0)
        } else {
            let digest = Sha256::digest(self.0.as_bytes());
            format!("{}:{purpose}", crate::fingerprint::hex(&digest))
        };
        Ok(IdempotencyKey(derived.into()))
    }
}

fn validate(key: &[u8]) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().copied().all(is_visible_ascii) {
        return Err(KeyError::InvalidCharacter);
    }
    Ok(())
}

/// Parses an RFC 8941 sf-string (`"..."` with `\"` and `\\` escapes) that must make up the
/// whole value. A string without escapes is borrowed, not copied.
fn unquote(raw: &[u8]) -> Result<Cow<'_, [u8]>, KeyError> {
    // Filled only from the first escape on.
    let mut unescaped: Option<Vec<u8>> = None;
    let mut i = 1;
    loop {
        match raw.get(i) {
            None => return Err(KeyError::MalformedString),
            Some(b'\\') => match raw.get(i + 1) {
                Some(&c @ (b'"' | b'\\')) => {
                    unescaped.get_or_insert_with(|| raw[1..i].to_vec()).push(c);
                    i += 2;
                }
                _ => return Err(KeyError::MalformedString),
            },
            Some(b'"') => {
                if i + 1 != raw.len() {
                    return Err(KeyError::MalformedString);
                }
                break;
            }
            Some(&c) => {
                // sf-string admits space; a key does not (validated below).
                if !(0x20..=0x7e).contains(&c) {
                    return Err(KeyError::InvalidCharacter);
                }
                if let Some(out) = &mut unescaped {
                    out.push(c);
                }
                i += 1;
            }
        }
    }
    let key = match unescaped {
        Some(out) => Cow::Owned(out),
        None => Cow::Borrowed(&raw[1..i]),
    };
    validate(&key)?;
    Ok(key)
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&&*self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<&HeaderValue> for IdempotencyKey {
    type Error = KeyError;
    fn try_from(value: &HeaderValue) -> Result<Self, Self::Error> {
        Self::from_header(value)
    }
}

impl From<IdempotencyKey> for HeaderValue {
    fn from(key: IdempotencyKey) -> Self {
        // A key is visible ASCII, which is always a valid header value.
        HeaderValue::from_str(&key.0).unwrap_or_else(|_| HeaderValue::from_static(""))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_quoted_are_the_same_key() {
        assert_eq!(
            IdempotencyKey::parse("abc"),
            IdempotencyKey::parse("\"abc\"")
        );
        assert_eq!(
            IdempotencyKey::parse("\"a\\\"b\"").unwrap().as_str(),
            "a\"b"
        );
        assert_eq!(
            IdempotencyKey::parse("\"a\\\\b\"").unwrap().as_str(),
            "a\\b"
        );
    }

    #[test]
    fn rejects_bad_keys() {
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse("\"\""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse("a b"),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(
            IdempotencyKey::parse("\"a b\""),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(IdempotencyKey::parse("é"), Err(KeyError::InvalidCharacter));
        assert_eq!(
            IdempotencyKey::parse("\"abc"),
            Err(KeyError::MalformedString)
        );
        assert_eq!(
            IdempotencyKey::parse("\"abc\";x=1"),
            Err(KeyError::MalformedString)
        );
        assert_eq!(
            IdempotencyKey::parse("\"a\\b\""),
            Err(KeyError::MalformedString)
        );
        assert_eq!(
            IdempotencyKey::parse(&"k".repeat(256)),
            Err(KeyError::TooLong)
        );
        assert!(IdempotencyKey::parse(&"k".repeat(255)).is_ok());
        assert!(IdempotencyKey::parse(&format!("\"{}\"", "k".repeat(255))).is_ok());
    }

    #[test]
    fn derive_stays_valid_at_the_length_limit() {
        let long = IdempotencyKey::parse(&"k".repeat(255)).unwrap();
        let d = long.derive("charge").unwrap();
        assert!(d.as_str().len() <= MAX_KEY_LEN);
        assert!(d.as_str().ends_with(":charge"));
        assert_eq!(IdempotencyKey::parse(d.as_str()).unwrap(), d);
        assert_eq!(long.derive("charge").unwrap(), d, "deterministic");
        let other = IdempotencyKey::parse(&"j".repeat(255)).unwrap();
        assert_ne!(other.derive("charge").unwrap(), d);
        assert_eq!(long.derive(""), Err(KeyError::InvalidPurpose));
        assert_eq!(long.derive("a b"), Err(KeyError::InvalidPurpose));
    }
}
