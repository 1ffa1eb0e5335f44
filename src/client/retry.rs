//! What the client retries: which answers ([`RetryStatuses`], `Retry-After`) and which errors of
//! the inner service ([`ClassifyError`], [`ConnectionErrors`]).

use std::error::Error as StdError;
use std::io;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};

use crate::error::ConfigError;

/// The statuses retried by default:
///
/// - `409` with `Retry-After`: the server still runs an earlier attempt with this key (the
///   server layer's `request-in-progress`); a later attempt gets its answer.
/// - `429` and `503`: the server asks to come back later; it did not act on the request.
/// - `502` and `504`: a gateway lost its upstream's answer: a lost answer, like a closed
///   connection, which the key makes safe to retry.
///
/// Never another `4xx`: the request is wrong (`400`), the key was used for another request
/// (`422`), the route is missing (`404`); sending it again gets the same answer. Never `500`
/// and other `5xx` either: a server that fails without saying "later" is not helped by being
/// asked again at once (the key makes a later call with it safe; the server layer releases
/// keys whose answer was a `5xx`).
const DEFAULT_RETRY_STATUSES: [u16; 5] = [409, 429, 502, 503, 504];

/// The most links of an error's `source()` chain that [`ConnectionErrors`] reads (a chain is
/// a few links long; the bound only keeps a cyclic `source()` from looping).
const MAX_SOURCES: usize = 32;

/// The statuses a call retries (sorted, each once; only `4xx` and `5xx`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RetryStatuses(Vec<StatusCode>);

impl Default for RetryStatuses {
    fn default() -> Self {
        Self(
            DEFAULT_RETRY_STATUSES
                .iter()
                .filter_map(|&code| StatusCode::from_u16(code).ok())
                .collect(),
        )
    }
}

impl RetryStatuses {
    /// The set of `statuses`, or the first that is not a `4xx` or a `5xx`.
    pub(crate) fn new(statuses: impl IntoIterator<Item = StatusCode>) -> Result<Self, ConfigError> {
        let mut set = Vec::new();
        for status in statuses {
            if !(status.is_client_error() || status.is_server_error()) {
                return Err(ConfigError::NotRetryable(status));
            }
            set.push(status);
        }
        set.sort_unstable();
        set.dedup();
        Ok(Self(set))
    }

    fn contains(&self, status: StatusCode) -> bool {
        self.0.binary_search(&status).is_ok()
    }
}

/// When an answer is worth another attempt with the same key: `None` when it is the call's
/// answer, else `Some` of the least wait the server asked for (zero when it named none).
///
/// A `409` is retried only when it says "later" with a `Retry-After` (see the module
/// documentation for why the header, not the problem document, is read).
pub(crate) fn retry_answer(
    statuses: &RetryStatuses,
    status: StatusCode,
    headers: &HeaderMap,
    now: SystemTime,
) -> Option<Duration> {
    if !statuses.contains(status) {
        return None;
    }
    let after = retry_after(headers, now);
    if status == StatusCode::CONFLICT {
        return after;
    }
    Some(after.unwrap_or_default())
}

/// The wait a `Retry-After` asks for (RFC 9110, section 10.2.3): delta-seconds
/// (`Retry-After: 3`), or an HTTP-date — an IMF-fixdate (`Wed, 21 Oct 2015 07:28:00 GMT`), or
/// one of the two obsolete forms recipients must also accept — as the time from `now` to
/// that date (zero for a date already past). `None` without the header, or with a value that
/// is neither.
///
/// Delta-seconds too large to count are an unbounded wait (the call's deadline then applies).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Some(
            value
                .parse::<u64>()
                .map_or(Duration::MAX, Duration::from_secs),
        );
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

/// Decides whether an error of the inner service is worth another attempt with the same key
/// ("transient") or is the call's outcome.
///
/// The key makes sending a request again safe whatever became of the last attempt; an error
/// is retried only when a later attempt can succeed where this one failed. Implemented for
/// closures `Fn(&E) -> bool` (write the parameter's type: `|e: &MyError| …`) and by the
/// default, [`ConnectionErrors`]. Set it with
/// [`IdempotentClientLayer::with_error_classifier`](super::IdempotentClientLayer::with_error_classifier).
pub trait ClassifyError<E> {
    /// `true` when `error` is worth another attempt.
    fn is_transient(&self, error: &E) -> bool;
}

impl<E, F> ClassifyError<E> for F
where
    F: Fn(&E) -> bool,
{
    fn is_transient(&self, error: &E) -> bool {
        self(error)
    }
}

/// The default [`ClassifyError`]: retries an error when its `source()` chain says that the
/// connection failed or was lost — and nothing else.
///
/// Transient, anywhere in the chain:
///
/// - a [`std::io::Error`] of kind `ConnectionRefused`, `ConnectionReset`,
///   `ConnectionAborted`, `NotConnected`, `BrokenPipe`, `TimedOut`, `UnexpectedEof`,
///   `HostUnreachable`, `NetworkUnreachable` or `NetworkDown` (a server restarting, a
///   connection cut, a network partition);
/// - a [`hyper::Error`] that says the connection closed before the answer
///   ([`is_incomplete_message`](hyper::Error::is_incomplete_message)), that the request was
///   never sent on a connection that went away ([`is_canceled`](hyper::Error::is_canceled),
///   [`is_closed`](hyper::Error::is_closed)), that the body could not be written
///   ([`is_body_write_aborted`](hyper::Error::is_body_write_aborted)), or that hyper timed
///   out ([`is_timeout`](hyper::Error::is_timeout)).
///
/// Everything else is the call's outcome after one attempt — above all errors that fail the
/// same way every time: a request hyper-util refuses to send (a URI without scheme and host,
/// an unsupported method or version), a TLS handshake the client refused (rustls reports it
/// through tokio-rustls as an `io::Error` of kind `InvalidData`; native-tls errors are not
/// `io::Error`s), a malformed answer ([`is_parse`](hyper::Error::is_parse)), a host name
/// that does not resolve, HTTP/2 stream errors (`h2` is not read), and any error type it does
/// not know. Connection failures are recognised by their cause, not by hyper-util's
/// `is_connect()`: a refused TLS handshake is a connect error too.
///
/// For an inner service whose error is not a [`std::error::Error`] (tower's `BoxError`, say),
/// or to retry more, give a closure; [`ConnectionErrors::matches`] reads any error:
///
/// ```
/// use tower_idempotency::BoxError;
/// use tower_idempotency::client::{ConnectionErrors, IdempotentClientLayer};
///
/// let layer = IdempotentClientLayer::new("charge")?
///     .with_error_classifier(|e: &BoxError| ConnectionErrors::matches(&**e));
/// # let _ = layer;
/// # Ok::<(), tower_idempotency::KeyError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectionErrors;

impl ConnectionErrors {
    /// Whether `error`, or an error in its `source()` chain, says that the connection failed
    /// or was lost (see [`ConnectionErrors`]).
    pub fn matches(error: &(dyn StdError + 'static)) -> bool {
        let mut next = Some(error);
        for _ in 0..MAX_SOURCES {
            let Some(error) = next else {
                return false;
            };
            if let Some(io) = error.downcast_ref::<io::Error>() {
                if transient_io(io.kind()) {
                    return true;
                }
                // `io::Error::source` skips the error it wraps: read that one too.
                next = match io.get_ref() {
                    Some(inner) => Some(inner as &(dyn StdError + 'static)),
                    None => io.source(),
                };
                continue;
            }
            if let Some(hyper) = error.downcast_ref::<hyper::Error>()
                && (hyper.is_incomplete_message()
                    || hyper.is_canceled()
                    || hyper.is_closed()
                    || hyper.is_body_write_aborted()
                    || hyper.is_timeout())
            {
                return true;
            }
            next = error.source();
        }
        false
    }
}

impl<E> ClassifyError<E> for ConnectionErrors
where
    E: StdError + 'static,
{
    fn is_transient(&self, error: &E) -> bool {
        Self::matches(error)
    }
}

fn transient_io(kind: io::ErrorKind) -> bool {
    use io::ErrorKind as K;
    matches!(
        kind,
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::NotConnected
            | K::BrokenPipe
            | K::TimedOut
            | K::UnexpectedEof
            | K::HostUnreachable
            | K::NetworkUnreachable
            | K::NetworkDown
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn with_retry_after(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, HeaderValue::from_static(value));
        headers
    }

    /// 1994-11-06 08:49:37 UTC, the date of RFC 9110's examples.
    fn rfc_example() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777)
    }

    #[test]
    fn the_default_statuses_are_409_429_502_503_504() {
        let statuses = RetryStatuses::default();
        let later = with_retry_after("1");
        for code in 100..1000u16 {
            let status = StatusCode::from_u16(code).unwrap();
            assert_eq!(
                retry_answer(&statuses, status, &later, SystemTime::now()).is_some(),
                [409, 429, 502, 503, 504].contains(&code),
                "{code}"
            );
        }
    }

    #[test]
    fn a_409_is_retried_only_with_a_retry_after_and_the_others_without() {
        let statuses = RetryStatuses::default();
        let now = SystemTime::now();
        let none = HeaderMap::new();
        assert_eq!(
            retry_answer(&statuses, StatusCode::CONFLICT, &none, now),
            None
        );
        assert_eq!(
            retry_answer(&statuses, StatusCode::CONFLICT, &with_retry_after("x"), now),
            None,
            "an unreadable Retry-After says nothing"
        );
        assert_eq!(
            retry_answer(&statuses, StatusCode::CONFLICT, &with_retry_after("2"), now),
            Some(Duration::from_secs(2))
        );
        for status in [429, 502, 503, 504] {
            let status = StatusCode::from_u16(status).unwrap();
            assert_eq!(
                retry_answer(&statuses, status, &none, now),
                Some(Duration::ZERO)
            );
        }
    }

    #[test]
    fn statuses_outside_4xx_and_5xx_are_refused_and_an_empty_set_retries_none() {
        for code in [100, 101, 200, 201, 204, 301, 304, 399, 600, 999] {
            let status = StatusCode::from_u16(code).unwrap();
            let refused = RetryStatuses::new([StatusCode::SERVICE_UNAVAILABLE, status]);
            assert_eq!(refused, Err(ConfigError::NotRetryable(status)), "{code}");
        }
        let empty = RetryStatuses::new([]).unwrap();
        for code in 400..600u16 {
            let status = StatusCode::from_u16(code).unwrap();
            let answer = retry_answer(&empty, status, &with_retry_after("1"), SystemTime::now());
            assert_eq!(answer, None, "{code}");
        }
        let some = RetryStatuses::new([StatusCode::INTERNAL_SERVER_ERROR; 3]).unwrap();
        assert_eq!(some.0, [StatusCode::INTERNAL_SERVER_ERROR]);
    }

    #[test]
    fn retry_after_is_read_as_delta_seconds_or_an_http_date() {
        let now = rfc_example();
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
        assert_eq!(
            retry_after(&with_retry_after(" 3 "), now),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            retry_after(&with_retry_after("99999999999999999999999"), now),
            Some(Duration::MAX)
        );
        // The three forms of RFC 9110, section 5.6.7, ten seconds after `now`.
        for date in [
            "Sun, 06 Nov 1994 08:49:47 GMT",
            "Sunday, 06-Nov-94 08:49:47 GMT",
            "Sun Nov  6 08:49:47 1994",
        ] {
            let headers = with_retry_after(date);
            assert_eq!(
                retry_after(&headers, now),
                Some(Duration::from_secs(10)),
                "{date}"
            );
        }
        // A date already past: no wait.
        assert_eq!(
            retry_after(&with_retry_after("Sun, 06 Nov 1994 08:49:00 GMT"), now),
            Some(Duration::ZERO)
        );
        for bad in ["", "-1", "1.5", "soon", "Sun, 06 Nov 1994 25:00:00 GMT"] {
            let mut headers = HeaderMap::new();
            headers.insert(header::RETRY_AFTER, HeaderValue::from_str(bad).unwrap());
            assert_eq!(retry_after(&headers, now), None, "{bad:?}");
        }
    }

    #[derive(Debug, thiserror::Error)]
    #[error("wrapper")]
    struct Wrapper(#[source] Box<dyn StdError + Send + Sync>);

    #[test]
    fn connection_errors_are_found_anywhere_in_the_chain_and_nothing_else() {
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::ConnectionReset,
            io::ErrorKind::ConnectionAborted,
            io::ErrorKind::NotConnected,
            io::ErrorKind::BrokenPipe,
            io::ErrorKind::TimedOut,
            io::ErrorKind::UnexpectedEof,
            io::ErrorKind::HostUnreachable,
            io::ErrorKind::NetworkUnreachable,
            io::ErrorKind::NetworkDown,
        ] {
            let error = io::Error::from(kind);
            assert!(ConnectionErrors.is_transient(&error), "{kind:?}");
            let wrapped = Wrapper(Box::new(Wrapper(Box::new(io::Error::from(kind)))));
            assert!(ConnectionErrors.is_transient(&wrapped), "{kind:?} wrapped");
            // An io::Error around another that is transient.
            let around = io::Error::other(Wrapper(Box::new(io::Error::from(kind))));
            assert!(ConnectionErrors.is_transient(&around), "{kind:?} inside");
        }
        for kind in [
            io::ErrorKind::InvalidData,
            io::ErrorKind::InvalidInput,
            io::ErrorKind::PermissionDenied,
            io::ErrorKind::NotFound,
            io::ErrorKind::Other,
        ] {
            let error = Wrapper(Box::new(io::Error::new(kind, "tls: bad certificate")));
            assert!(!ConnectionErrors.is_transient(&error), "{kind:?}");
        }
        assert!(!ConnectionErrors.is_transient(&Wrapper("no cause".into())));
        assert!(!ConnectionErrors.is_transient(&std::fmt::Error));
    }

    #[test]
    fn a_closure_classifies_errors_of_its_type() {
        let classify = |e: &io::Error| e.kind() == io::ErrorKind::InvalidData;
        assert!(classify.is_transient(&io::Error::from(io::ErrorKind::InvalidData)));
        assert!(!classify.is_transient(&io::Error::from(io::ErrorKind::ConnectionReset)));
    }
}
