//! The idempotency key: its parser and the handler-facing value.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// The default header: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: http::HeaderName = http::HeaderName::from_static("idempotency-key");

use http::HeaderValue;
use sha2::{Digest, Sha256};

/// The longest key accepted, in characters (bytes: keys are ASCII).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key.
///
/// A key is 1 to [`MAX_KEY_LEN`] printable ASCII characters. The layer parses it from the
/// request header, accepting both forms clients send:
///
/// - a Structured Field string (RFC 8941 `sf-string`), as
///   draft-ietf-httpapi-idempotency-key-header-07 specifies:
///   `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`. Between the quotes it may
///   hold spaces and, escaped, `\"` and `\\` (space to `~`);
/// - a bare value, as Stripe's and many other clients send it:
///   `Idempotency-Key: 8e03978e-40d5-43e8-bc93-6894a57f9324`. This lenient legacy form is
///   visible ASCII only (`!` to `~`, no spaces), and is read as a quoted string when it
///   starts with `"`.
///
/// Both name the same key. Turned back into a header value (`HeaderValue::from(key)`), a key
/// is written bare when that reads back as the same key, and as a quoted string otherwise.
///
/// The layer inserts the parsed key into the request's extensions, so a handler can read it (`req.extensions().get::<IdempotencyKey>()`, or the axum
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
    /// The key contains a character it may not: outside visible ASCII (`!` to `~`) in a bare
    /// key, outside printable ASCII (space to `~`) in a quoted one.
    #[error(
        "the idempotency key contains a character that is not allowed \
         (a bare key is visible ASCII; a quoted key may hold spaces too)"
    )]
    InvalidCharacter,
    /// A quoted key is not a well-formed Structured Field string (no closing quote, a bad
    /// escape, or text after the closing quote).
    #[error("the idempotency key is not a well-formed structured field string")]
    MalformedString,
    /// A derivation purpose is empty, too long, not visible ASCII, or contains `:`.
    #[error("the derivation purpose must be 1 to 64 visible ASCII characters other than `:`")]
    InvalidPurpose,
}

/// The longest purpose accepted by [`IdempotencyKey::derive`].
const MAX_PURPOSE_LEN: usize = 64;

/// How a [derived](IdempotencyKey::derive) key in the hashed form starts. A key that starts
/// with it is always derived in the hashed form, so no key in the identity form starts with it.
const HASHED: &str = "~sha256-";

/// A bare key's characters (and a purpose's): `!` to `~`.
fn is_visible_ascii(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// A quoted key's characters (RFC 8941 `sf-string`, after unescaping): space to `~`.
fn is_printable_ascii(b: u8) -> bool {
    (0x20..=0x7e).contains(&b)
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
                validate(raw, is_visible_ascii)?;
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

    /// A key for a call this request makes to another service, such as a payment provider,
    /// so that the other side can deduplicate the call too.
    ///
    /// The derived key has one of two forms:
    ///
    /// - the **identity form** `<key>:<purpose>` (`order-42:charge`), when it fits in
    ///   [`MAX_KEY_LEN`] and the key does not start with `~sha256-`;
    /// - otherwise the **hashed form** `~sha256-<hex SHA-256 of the key>:<purpose>`, which
    ///   always fits (137 characters at most).
    ///
    /// Distinct (key, purpose) pairs never derive the same key: a purpose has no `:`, so the
    /// text after the last `:` of a derived key is its purpose, and the text before it is either
    /// the key itself (identity form) or `~sha256-` and the key's hash (hashed form). The two
    /// forms cannot be confused, because a key that starts with `~sha256-` is always hashed; two
    /// keys in the hashed form differ unless their SHA-256 collide. (A client cannot pick a key
    /// that derives what another key derives: sending the hash of a long key as a key of its
    /// own gives that hash's identity form, without the marker.)
    ///
    /// The result is deterministic (a retry of the request derives the same key) and always a
    /// valid key; send it in a header with `HeaderValue::from`, which quotes it when it must
    /// (a key with spaces).
    ///
    /// A derived key is unique only among the keys of one scope. When the other service sees
    /// all your tenants under one credential, include the tenant in the purpose or send the
    /// tenant's account with the call.
    ///
    /// ```
    /// use tower_idempotency::IdempotencyKey;
    ///
    /// let key = IdempotencyKey::parse(&"k".repeat(255))?;
    /// assert!(key.derive("charge")?.as_str().starts_with("~sha256-"));
    /// # Ok::<(), tower_idempotency::KeyError>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`KeyError::InvalidPurpose`] when `purpose` is empty, longer than 64 characters, not
    /// visible ASCII, or contains `:`.
    pub fn derive(&self, purpose: &str) -> Result<IdempotencyKey, KeyError> {
        Ok(self.derive_for(&Purpose::new(purpose)?))
    }

    /// [`derive`](Self::derive) with a purpose checked before (the outbound client layer
    /// checks its purpose once, when it is made).
    pub(crate) fn derive_for(&self, purpose: &Purpose) -> IdempotencyKey {
        let purpose = &*purpose.0;
        let derived =
            if self.0.len() + 1 + purpose.len() <= MAX_KEY_LEN && !self.0.starts_with(HASHED) {
                format!("{}:{purpose}", self.0)
            } else {
                let digest = Sha256::digest(self.0.as_bytes());
                format!("{HASHED}{}:{purpose}", crate::hex::encode(&digest))
            };
        IdempotencyKey(derived.into())
    }

    /// The key [`MessageId::derive`](crate::message_id::MessageId::derive) derives for
    /// `purpose` in the scope whose [`scope_digest`](crate::scope_digest) is `scope_digest`
    /// (not the shared scope's `""`): always the hashed form, `~sha256-` and the SHA-256 of a
    /// domain tag, the scope's digest and the key, then `:` and the purpose (137 characters at
    /// most).
    ///
    /// Distinct from every other scope's and from every key [`derive`](Self::derive) gives
    /// (the shared scope's): the digest has a fixed length, so (scope, key) pairs never share
    /// a hashed input; [`derive`](Self::derive)'s identity form never starts with `~sha256-`,
    /// and its hashed form hashes a key alone, which can never equal the tagged input (the tag
    /// holds a `NUL`, which no key does).
    pub(crate) fn derive_in_scope(
        &self,
        scope_digest: &str,
        purpose: &str,
    ) -> Result<IdempotencyKey, KeyError> {
        let purpose = Purpose::new(purpose)?;
        let mut hash = Sha256::new();
        hash.update(b"tower-idempotency scoped key\0");
        hash.update(scope_digest.as_bytes());
        hash.update(b"\0");
        hash.update(self.0.as_bytes());
        let derived = format!(
            "{HASHED}{}:{}",
            crate::hex::encode(&hash.finalize()),
            purpose.as_str()
        );
        Ok(IdempotencyKey(derived.into()))
    }

    /// A fresh key: 128 bits from the operating system's random source, as 32 lowercase hex
    /// digits (for calls that carry no key to derive from).
    pub(crate) fn random() -> Result<Self, getrandom::Error> {
        let mut bytes = [0u8; 16];
        getrandom::fill(&mut bytes)?;
        Ok(Self(crate::hex::encode(&bytes).into()))
    }

    /// The key as a header value: bare when that parses back to this key (the common case),
    /// otherwise a quoted `sf-string` with `"` and `\` escaped.
    fn header_text(&self) -> Cow<'_, str> {
        let bytes = self.0.as_bytes();
        if bytes.first() != Some(&b'"') && bytes.iter().copied().all(is_visible_ascii) {
            return Cow::Borrowed(&self.0);
        }
        let mut quoted = String::with_capacity(bytes.len() + 2);
        quoted.push('"');
        for c in self.0.chars() {
            if matches!(c, '"' | '\\') {
                quoted.push('\\');
            }
            quoted.push(c);
        }
        quoted.push('"');
        Cow::Owned(quoted)
    }
}

/// A valid derivation purpose: 1 to 64 visible ASCII characters other than `:`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Purpose(Arc<str>);

impl Purpose {
    pub(crate) fn new(purpose: &str) -> Result<Self, KeyError> {
        let p = purpose.as_bytes();
        if p.is_empty()
            || p.len() > MAX_PURPOSE_LEN
            || !p.iter().all(|&b| is_visible_ascii(b) && b != b':')
        {
            return Err(KeyError::InvalidPurpose);
        }
        Ok(Self(purpose.into()))
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.0
    }
}

/// Checks a key's length and that each of its characters is `allowed`.
fn validate(key: &[u8], allowed: fn(u8) -> bool) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().copied().all(allowed) {
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
                if !is_printable_ascii(c) {
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
    validate(&key, is_printable_ascii)?;
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

/// The key as a header value that parses back to the same key: bare when it can be, quoted
/// otherwise (see [`IdempotencyKey`]).
impl From<IdempotencyKey> for HeaderValue {
    fn from(key: IdempotencyKey) -> Self {
        // A key is printable ASCII, and so is its quoted form: always a valid header value.
        HeaderValue::from_str(&key.header_text()).unwrap_or_else(|_| HeaderValue::from_static(""))
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

    /// A long key derived as `<sha256hex(key)>:charge` would equal the identity form of the
    /// short key `sha256hex(key)`: two payments, one provider charge.
    #[test]
    fn a_long_key_and_the_hex_of_its_hash_derive_different_keys() {
        let long = IdempotencyKey::parse(&"k".repeat(255)).unwrap();
        let hex = crate::hex::encode(&Sha256::digest(long.as_str().as_bytes()));
        let short = IdempotencyKey::parse(&hex).unwrap();
        assert_ne!(
            long.derive("charge").unwrap(),
            short.derive("charge").unwrap()
        );
    }

    #[test]
    fn quoted_keys_may_hold_spaces_bare_keys_may_not() {
        assert_eq!(IdempotencyKey::parse("\"a b\"").unwrap().as_str(), "a b");
        assert_eq!(IdempotencyKey::parse("\" \"").unwrap().as_str(), " ");
        assert_eq!(
            IdempotencyKey::parse("\" a \\\"b\\\\ \"").unwrap().as_str(),
            " a \"b\\ "
        );
        assert_eq!(
            IdempotencyKey::parse("a b"),
            Err(KeyError::InvalidCharacter)
        );
        // Still refused inside quotes: controls, DEL and non-ASCII (sf-string has no room
        // for them).
        for bad in ["\"a\tb\"", "\"a\u{7f}b\"", "\"clé\""] {
            assert_eq!(
                IdempotencyKey::parse(bad),
                Err(KeyError::InvalidCharacter),
                "{bad:?}"
            );
        }
        let spaced = format!("\"{}\"", " ".repeat(MAX_KEY_LEN + 1));
        assert_eq!(IdempotencyKey::parse(&spaced), Err(KeyError::TooLong));
    }

    #[test]
    fn a_key_becomes_a_header_that_parses_back_to_it() {
        let cases = [
            ("order-42", "order-42"),
            ("\"a b\"", "\"a b\""),
            ("\"\\\"quoted\\\"\"", "\"\\\"quoted\\\"\""),
            // Bare, a key that starts with a quote would read as a (bad) quoted string.
            ("\"\\\"abc\"", "\"\\\"abc\""),
            // A backslash alone needs no quoting.
            ("a\\b", "a\\b"),
        ];
        for (input, header) in cases {
            let key = IdempotencyKey::parse(input).unwrap();
            let value = HeaderValue::from(key.clone());
            assert_eq!(value, header, "{input:?}");
            assert_eq!(IdempotencyKey::from_header(&value).unwrap(), key);
        }
    }

    #[test]
    fn derived_keys_of_keys_with_spaces_are_sent_quoted() {
        let key = IdempotencyKey::parse("\"order 42\"").unwrap();
        let derived = key.derive("charge").unwrap();
        assert_eq!(derived.as_str(), "order 42:charge");
        let value = HeaderValue::from(derived.clone());
        assert_eq!(value, "\"order 42:charge\"");
        assert_eq!(IdempotencyKey::from_header(&value).unwrap(), derived);

        let long = IdempotencyKey::parse(&format!("\"{}\"", "a b".repeat(85))).unwrap();
        assert_eq!(long.as_str().len(), MAX_KEY_LEN);
        let derived = long.derive("charge").unwrap();
        assert!(derived.as_str().len() <= MAX_KEY_LEN);
        let value = HeaderValue::from(derived.clone());
        assert_eq!(IdempotencyKey::from_header(&value).unwrap(), derived);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        /// Where a derived key came from, read back from the derived key alone: a function of
        /// the derived key, so equal derived keys have equal origins.
        #[derive(Debug, PartialEq, Eq)]
        enum Origin {
            /// Identity form: the key itself.
            Key(String),
            /// Hashed form: the key's SHA-256, in hex.
            Hash(String),
        }

        fn origin(derived: &str) -> (Origin, String) {
            let (prefix, purpose) = derived.rsplit_once(':').unwrap();
            let origin = match prefix.strip_prefix(HASHED) {
                Some(hash) => Origin::Hash(hash.to_owned()),
                None => Origin::Key(prefix.to_owned()),
            };
            (origin, purpose.to_owned())
        }

        fn sha_hex(text: &str) -> String {
            crate::hex::encode(&Sha256::digest(text.as_bytes()))
        }

        /// A key as the parser can produce it: 1 to 255 printable ASCII characters.
        fn key(text: &str) -> IdempotencyKey {
            assert!(!text.is_empty() && text.len() <= MAX_KEY_LEN);
            assert!(text.bytes().all(is_printable_ascii));
            IdempotencyKey(text.into())
        }

        /// Keys of every shape that matters: short and long, with spaces and `:`, and keys
        /// that look like a derived key in either form.
        fn keys() -> impl Strategy<Value = String> {
            prop_oneof![
                "[ -~]{1,40}",
                "[ -~]{180,255}",
                "[a-z:]{1,30}",
                "[ -~]{0,100}:[!-9;-~]{1,64}",
                "[0-9a-f]{64}",
                "[0-9a-f]{64}:[a-z]{1,10}",
                "~sha256-[0-9a-f]{64}",
                "~sha256-[0-9a-f]{64}:[a-z]{1,10}",
                "~sha256-[ -~]{0,247}",
                "~[ -~]{0,30}",
            ]
        }

        /// Valid purposes: visible ASCII without `:`.
        fn purposes() -> impl Strategy<Value = String> {
            prop_oneof!["[a-z]{1,10}", "[!-9;-~]{1,64}"]
        }

        proptest! {
            #[test]
            fn a_derived_key_names_its_key_and_purpose(k in keys(), p in purposes()) {
                let derived = key(&k).derive(&p).unwrap();
                let (origin, purpose) = origin(derived.as_str());
                prop_assert_eq!(purpose, p);
                match origin {
                    Origin::Key(text) => prop_assert_eq!(text, k),
                    Origin::Hash(hash) => prop_assert_eq!(hash, sha_hex(&k)),
                }
            }

            #[test]
            fn distinct_pairs_derive_distinct_keys(
                (k1, p1) in (keys(), purposes()),
                (k2, p2) in (keys(), purposes()),
            ) {
                prop_assume!((&k1, &p1) != (&k2, &p2));
                prop_assert_ne!(key(&k1).derive(&p1).unwrap(), key(&k2).derive(&p2).unwrap());
            }

            /// Keys built from another key's derivation (its hash bare or with the marker, the
            /// derived key or its prefix, the key extended by `:purpose`): each derives a key of
            /// its own.
            #[test]
            fn keys_made_to_collide_do_not(k in keys(), p in purposes(), q in purposes()) {
                let derived = key(&k).derive(&p).unwrap();
                let hash = sha_hex(&k);
                let candidates = [
                    hash.clone(),
                    format!("{HASHED}{hash}"),
                    derived.as_str().to_owned(),
                    derived.as_str().rsplit_once(':').unwrap().0.to_owned(),
                    format!("{k}:{p}"),
                    format!("{k}:{q}"),
                ];
                for other in candidates {
                    if other.len() > MAX_KEY_LEN {
                        continue;
                    }
                    for purpose in [&p, &q] {
                        if (&other, purpose) != (&k, &p) {
                            prop_assert_ne!(&key(&other).derive(purpose).unwrap(), &derived);
                        }
                    }
                }
            }

            #[test]
            fn a_purpose_with_a_colon_is_refused(k in keys(), a in "[a-z]{0,10}", b in "[a-z]{0,10}") {
                prop_assert_eq!(
                    key(&k).derive(&format!("{a}:{b}")),
                    Err(KeyError::InvalidPurpose)
                );
            }

            #[test]
            fn a_derived_key_is_a_valid_key_and_survives_a_header(k in keys(), p in purposes()) {
                let derived = key(&k).derive(&p).unwrap();
                prop_assert!(derived.as_str().len() <= MAX_KEY_LEN);
                let value = HeaderValue::from(derived.clone());
                prop_assert_eq!(IdempotencyKey::from_header(&value).unwrap(), derived);
            }

            #[test]
            fn a_key_survives_a_header(k in keys()) {
                let k = key(&k);
                let value = HeaderValue::from(k.clone());
                prop_assert_eq!(&IdempotencyKey::from_header(&value).unwrap(), &k);
                // Bare exactly when the bare text reads back as the key.
                let bare = value.as_bytes() == k.as_str().as_bytes();
                prop_assert_eq!(bare, IdempotencyKey::parse(k.as_str()).as_ref() == Ok(&k));
            }
        }
    }
}
