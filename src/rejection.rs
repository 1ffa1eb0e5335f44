//! The answers the layer gives instead of running the handler, as RFC 9457 problem details.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};

use crate::key::IDEMPOTENCY_KEY;
use crate::key::KeyError;

/// The media type of every rejection body.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Why the layer answered a request itself instead of running the handler (or, for
/// [`ResponseNotStored`](Rejection::ResponseNotStored), instead of replaying).
///
/// Each rejection renders as an `application/problem+json` document (RFC 9457) with the
/// members `type`, `title`, `status` and `detail`, following
/// draft-ietf-httpapi-idempotency-key-header-07. Replace the rendering with
/// [`IdempotencyLayer::with_rejection_handler`](crate::IdempotencyLayer::with_rejection_handler).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// `400`: the request has no idempotency key and the layer requires one.
    MissingKey {
        /// The header the layer reads the key from (`Idempotency-Key` unless configured with
        /// [`with_header`](crate::IdempotencyLayer::with_header)); `None` when the layer takes
        /// the key with [`with_key_from`](crate::IdempotencyLayer::with_key_from).
        header: Option<HeaderName>,
    },
    /// `400`: the key is empty, too long, has a character it may not, or is badly quoted.
    InvalidKey {
        /// What is wrong with the key.
        error: KeyError,
        /// The header the key was read from; `None` for a key taken with
        /// [`with_key_from`](crate::IdempotencyLayer::with_key_from).
        header: Option<HeaderName>,
    },
    /// `400`: the request carries the key header more than once.
    MultipleKeys {
        /// The header sent more than once.
        header: HeaderName,
    },
    /// `400`: the request body could not be read.
    UnreadableBody,
    /// `413`: the request body is larger than the layer's limit.
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// `409`: a request with this key is still being processed.
    InFlight {
        /// When the client should try again (sent as `Retry-After`, in whole seconds rounded
        /// up, at least 1). The layer says at most 1 s: it cannot know when the first request
        /// will answer, and what is left of its lease (renewed while the handler runs) is no
        /// estimate of it.
        retry_after: Duration,
    },
    /// `422`: the key was used before with a different request.
    KeyReused,
    /// `409`: the request with this key was completed, but its response was larger than the
    /// storage limit and cannot be replayed. The handler is not run again.
    ResponseNotStored {
        /// The status the handler answered the first time.
        original_status: StatusCode,
    },
    /// `503`: the idempotency store failed: before the handler ran (it did not run), or while
    /// its answer was stored (a commit whose outcome is unknown: it may have landed). Either
    /// way a retry with the same key is safe.
    StoreUnavailable,
    /// `503`: the handler ran past its bound
    /// ([`Transactional::with_handler_timeout`](crate::Transactional::with_handler_timeout),
    /// [`Phased::with_handler_timeout`](crate::Phased::with_handler_timeout)); it was stopped
    /// and its open transaction rolled back (in transactional mode nothing of it was
    /// committed; in phased mode its committed steps stay, and the retry resumes after them).
    HandlerTimedOut,
    /// `401`: the layer requires a scope
    /// ([`with_scope_required`](crate::IdempotencyLayer::with_scope_required)) and none could
    /// be derived from the request: it has no authenticated principal. Sent without a
    /// `WWW-Authenticate` challenge (the layer does not know the scheme).
    MissingScope,
}

impl Rejection {
    /// The HTTP status of this rejection.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::MissingKey { .. }
            | Self::InvalidKey { .. }
            | Self::MultipleKeys { .. }
            | Self::UnreadableBody => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::InFlight { .. } | Self::ResponseNotStored { .. } => StatusCode::CONFLICT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::StoreUnavailable | Self::HandlerTimedOut => StatusCode::SERVICE_UNAVAILABLE,
            Self::MissingScope => StatusCode::UNAUTHORIZED,
        }
    }

    /// A stable identifier of the problem, used as the last part of the `type` URI.
    pub fn code(&self) -> &'static str {
        match self {
            Self::MissingKey { .. } => "missing-key",
            Self::InvalidKey { .. } => "invalid-key",
            Self::MultipleKeys { .. } => "multiple-keys",
            Self::UnreadableBody => "unreadable-body",
            Self::BodyTooLarge { .. } => "body-too-large",
            Self::InFlight { .. } => "request-in-progress",
            Self::KeyReused => "key-reused",
            Self::ResponseNotStored { .. } => "response-not-stored",
            Self::StoreUnavailable => "store-unavailable",
            Self::HandlerTimedOut => "handler-timed-out",
            Self::MissingScope => "missing-scope",
        }
    }

    /// A short, human-readable summary (the problem's `title`), the same for every occurrence
    /// of the problem type; the [`detail`](Self::detail) names the header.
    pub fn title(&self) -> &'static str {
        match self {
            Self::MissingKey { .. } => "The idempotency key is missing",
            Self::InvalidKey { .. } => "The idempotency key is invalid",
            Self::MultipleKeys { .. } => "The idempotency key is sent more than once",
            Self::UnreadableBody => "The request body could not be read",
            Self::BodyTooLarge { .. } => "The request body is too large",
            Self::InFlight { .. } => "A request with this Idempotency-Key is being processed",
            Self::KeyReused => "Idempotency-Key is already used with a different request",
            Self::ResponseNotStored { .. } => {
                "The request with this Idempotency-Key was processed, but its response cannot be replayed"
            }
            Self::StoreUnavailable => "The idempotency store is unavailable",
            Self::HandlerTimedOut => "The request took too long to process",
            Self::MissingScope => "The request has no authenticated principal",
        }
    }

    /// The explanation specific to this occurrence (the problem's `detail`). For a problem
    /// with the key, it names where the layer reads the key: its header, or, for a key taken
    /// with [`with_key_from`](crate::IdempotencyLayer::with_key_from), the request.
    pub fn detail(&self) -> String {
        const KEY_RULES: &str = "A key is 1 to 255 visible ASCII characters, bare, or a quoted \
             string that may also hold spaces.";
        match self {
            Self::MissingKey { header: Some(h) } => {
                format!("This operation requires the {} header.", header_name(h))
            }
            Self::MissingKey { header: None } => "This operation requires an idempotency key, \
                 which this service derives from the request; this request has none."
                .into(),
            Self::InvalidKey {
                error,
                header: Some(h),
            } => format!(
                "The {} header is not a valid idempotency key: {error}. {KEY_RULES}",
                header_name(h)
            ),
            Self::InvalidKey {
                error,
                header: None,
            } => format!(
                "The idempotency key this service derives from the request is not valid: \
                 {error}. {KEY_RULES}"
            ),
            Self::MultipleKeys { header } => {
                format!("Send exactly one {} header.", header_name(header))
            }
            Self::UnreadableBody => "The request body ended unexpectedly.".into(),
            Self::BodyTooLarge { limit } => {
                format!("Requests with an idempotency key may carry at most {limit} bytes.")
            }
            Self::InFlight { retry_after } => format!(
                "The first request with this key has not finished. Retry after {} s.",
                retry_after_secs(*retry_after)
            ),
            Self::KeyReused => "This key was used with a different method, path, query or body; \
                 use a new key for a new request."
                .into(),
            Self::ResponseNotStored { original_status } => format!(
                "The request was processed once (status {}); its response was too large to store. \
                 It is not processed again.",
                original_status.as_u16()
            ),
            Self::StoreUnavailable => {
                "The idempotency store failed, so the request's outcome could not be recorded. It is \
                 safe to retry with the same key: a retry replays the answer if the request did \
                 complete, and runs it otherwise."
                    .into()
            }
            Self::HandlerTimedOut => "The request ran longer than the server allows and was \
                 stopped: its unfinished work was rolled back. It is safe to retry with the same \
                 key."
                .into(),
            Self::MissingScope => "The request was not processed: this operation needs an \
                 authenticated client. Authenticate, then retry with the same key."
                .into(),
        }
    }

    /// The problem's `type` URI.
    pub fn type_uri(&self) -> String {
        format!(
            "https://docs.rs/tower-idempotency/latest/tower_idempotency/problems/index.html#{}",
            self.code()
        )
    }

    /// Renders the rejection as an `application/problem+json` response.
    ///
    /// `409 in progress` carries `Retry-After`; `503` carries a `Retry-After` of 1 to 3 s,
    /// chosen at random, so that clients turned away together by a store outage do not all
    /// come back in the same second.
    pub fn to_response(&self) -> Response<Bytes> {
        let status = self.status();
        let mut body = String::with_capacity(256);
        body.push_str("{\"type\":");
        json_string(&mut body, &self.type_uri());
        body.push_str(",\"title\":");
        json_string(&mut body, self.title());
        let _ = write!(body, ",\"status\":{}", status.as_u16());
        body.push_str(",\"detail\":");
        json_string(&mut body, &self.detail());
        if let Self::ResponseNotStored { original_status } = self {
            let _ = write!(body, ",\"original_status\":{}", original_status.as_u16());
        }
        body.push('}');

        let mut res = Response::new(Bytes::from(body));
        *res.status_mut() = status;
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        let retry = match self {
            Self::InFlight { retry_after } => Some(retry_after_secs(*retry_after)),
            Self::StoreUnavailable | Self::HandlerTimedOut => Some(spread_retry_after()),
            _ => None,
        };
        if let Some(secs) = retry {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        res
    }
}

/// A header's name as the problem documents write it: `Idempotency-Key` as the draft spells
/// it, other names as configured (header names are lowercase, like HTTP/2 sends them).
fn header_name(name: &HeaderName) -> &str {
    if *name == IDEMPOTENCY_KEY {
        "Idempotency-Key"
    } else {
        name.as_str()
    }
}

/// A `Retry-After` for a `503`: 1, 2 or 3 s, at random. (A store outage turns every client
/// away at once; the same hint for all would bring them back as one stampede.)
fn spread_retry_after() -> u64 {
    use std::hash::BuildHasher;
    // Each `RandomState` has its own random keys: hashing the time with it is random enough
    // to spread clients, and needs no random-number crate.
    let r = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    1 + r % 3
}

/// `Retry-After` is whole seconds; round up and never say 0.
fn retry_after_secs(d: Duration) -> u64 {
    let secs = d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    secs.max(1)
}

/// Appends `s` as a JSON string literal.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store may say a key is held for as long as a `Duration` goes (a lease of
    /// `Duration::MAX`): the `409`'s `Retry-After` says the most seconds it can, never a
    /// panic on the rounding up.
    #[test]
    fn the_longest_retry_after_is_rendered() {
        let r = Rejection::InFlight {
            retry_after: Duration::MAX,
        }
        .to_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(
            r.headers()[header::RETRY_AFTER],
            u64::MAX.to_string().as_str()
        );
    }

    #[test]
    fn renders_problem_json() {
        let r = Rejection::InFlight {
            retry_after: Duration::from_millis(1500),
        }
        .to_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let v: serde_json::Value = serde_json::from_slice(r.body()).unwrap();
        assert_eq!(v["status"], 409);
        assert!(
            v["type"]
                .as_str()
                .unwrap()
                .ends_with("#request-in-progress")
        );
        assert!(v["detail"].as_str().unwrap().contains("2 s"));
    }

    #[test]
    fn escapes_json() {
        let mut s = String::new();
        json_string(&mut s, "a\"b\\c\n\u{1}");
        assert_eq!(s, r#""a\"b\\c\n\u0001""#);
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        assert_eq!(v, "a\"b\\c\n\u{1}");
    }

    #[test]
    fn every_rejection_is_valid_json_with_its_status() {
        let all = [
            Rejection::MissingKey {
                header: Some(IDEMPOTENCY_KEY),
            },
            Rejection::MissingKey { header: None },
            Rejection::InvalidKey {
                error: KeyError::TooLong,
                header: Some(IDEMPOTENCY_KEY),
            },
            Rejection::InvalidKey {
                error: KeyError::Empty,
                header: None,
            },
            Rejection::MultipleKeys {
                header: IDEMPOTENCY_KEY,
            },
            Rejection::UnreadableBody,
            Rejection::BodyTooLarge { limit: 10 },
            Rejection::InFlight {
                retry_after: Duration::ZERO,
            },
            Rejection::KeyReused,
            Rejection::ResponseNotStored {
                original_status: StatusCode::CREATED,
            },
            Rejection::StoreUnavailable,
            Rejection::HandlerTimedOut,
            Rejection::MissingScope,
        ];
        for r in all {
            let res = r.to_response();
            let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
            assert_eq!(v["status"], res.status().as_u16(), "{r:?}");
            assert_eq!(v["title"], r.title());
        }
    }

    #[test]
    fn key_problems_name_the_header_the_key_is_read_from() {
        let webhook = HeaderName::from_static("webhook-id");
        let header = Some(webhook.clone());
        for r in [
            Rejection::MissingKey {
                header: header.clone(),
            },
            Rejection::InvalidKey {
                error: KeyError::InvalidCharacter,
                header,
            },
            Rejection::MultipleKeys { header: webhook },
        ] {
            let (title, detail) = (r.title(), r.detail());
            assert!(detail.contains("webhook-id header"), "{detail}");
            assert!(!title.contains("Idempotency-Key"), "{title}");
            assert!(!detail.contains("Idempotency-Key"), "{detail}");
        }
        let default = Rejection::MissingKey {
            header: Some(IDEMPOTENCY_KEY),
        };
        assert_eq!(
            default.detail(),
            "This operation requires the Idempotency-Key header."
        );
        for r in [
            Rejection::MissingKey { header: None },
            Rejection::InvalidKey {
                error: KeyError::Empty,
                header: None,
            },
        ] {
            let detail = r.detail();
            assert!(detail.contains("derives from the request"), "{detail}");
            assert!(!detail.contains("header"), "{detail}");
        }
    }

    #[test]
    fn a_503_retry_after_is_spread_over_one_to_three_seconds() {
        let seen: std::collections::BTreeSet<String> = (0..200)
            .map(|_| {
                let res = Rejection::StoreUnavailable.to_response();
                res.headers()[header::RETRY_AFTER]
                    .to_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        // 200 draws miss one of three values with probability about 3 * (2/3)^200.
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), ["1", "2", "3"]);
    }
}
