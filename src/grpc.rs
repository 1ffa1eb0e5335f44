//! gRPC through the layer.
//!
//! A gRPC call is an HTTP/2 `POST` whose outcome travels in a `grpc-status` trailer after the
//! messages (or, for a call that fails at once, in the headers of a response without a body,
//! "trailers-only"); its HTTP status is `200` either way. The layer keeps the trailers with
//! the stored answer and replays them, so a retried call gets its first outcome, and it
//! decides whether to store a gRPC answer on the HTTP status its `grpc-status` stands for
//! (below), not on the `200`: a call that failed with `UNAVAILABLE` is not stored, as a `503`
//! would not be.

use http::{HeaderMap, HeaderValue, StatusCode, header};

/// The trailer (or, trailers-only, the header) that carries a gRPC call's outcome.
const GRPC_STATUS: &str = "grpc-status";

/// Whether a response is a gRPC one (`content-type: application/grpc`, `+proto` and the
/// like).
pub(crate) fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(b"application/grpc"))
}

/// The HTTP status that the `grpc-status` in `map` stands for, as `google.rpc.Code`
/// documents each code's HTTP mapping; `None` without one. A code the layer does not know, or
/// a value that is not a code, stands for `500`.
pub(crate) fn status_in(map: &HeaderMap) -> Option<StatusCode> {
    map.get(GRPC_STATUS).map(http_status)
}

fn http_status(code: &HeaderValue) -> StatusCode {
    let code = code
        .to_str()
        .ok()
        .and_then(|c| c.trim().parse::<u32>().ok());
    let http = match code {
        Some(0) => 200,          // OK
        Some(1) => 499,          // CANCELLED
        Some(3 | 9 | 11) => 400, // INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE
        Some(4) => 504,          // DEADLINE_EXCEEDED
        Some(5) => 404,          // NOT_FOUND
        Some(6 | 10) => 409,     // ALREADY_EXISTS, ABORTED
        Some(7) => 403,          // PERMISSION_DENIED
        Some(8) => 429,          // RESOURCE_EXHAUSTED
        Some(12) => 501,         // UNIMPLEMENTED
        Some(14) => 503,         // UNAVAILABLE
        Some(16) => 401,         // UNAUTHENTICATED
        // UNKNOWN (2), INTERNAL (13), DATA_LOSS (15), and anything else.
        _ => 500,
    };
    StatusCode::from_u16(http).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_stand_for_their_http_statuses() {
        for (code, http) in [
            ("0", 200),
            ("1", 499),
            ("2", 500),
            ("3", 400),
            ("4", 504),
            ("5", 404),
            ("6", 409),
            ("7", 403),
            ("8", 429),
            ("9", 400),
            ("10", 409),
            ("11", 400),
            ("12", 501),
            ("13", 500),
            ("14", 503),
            ("15", 500),
            ("16", 401),
            ("17", 500),
            ("x", 500),
        ] {
            let mut map = HeaderMap::new();
            map.insert(GRPC_STATUS, HeaderValue::from_static(code));
            assert_eq!(
                status_in(&map),
                Some(StatusCode::from_u16(http).unwrap()),
                "{code}"
            );
        }
        assert_eq!(status_in(&HeaderMap::new()), None);
    }
}
