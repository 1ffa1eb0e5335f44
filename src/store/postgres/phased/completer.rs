//! The completer: keys abandoned mid-phase (their process died and no retry came) driven to
//! completion by running their request again, which resumes after its last committed step.

use std::future::poll_fn;
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use sqlx::{AssertSqlSafe, Row};
use tower_service::Service;

use super::Phased;
use crate::body::Chunks;
use crate::error::{ConfigError, StoreError};
use crate::request::Buffered;
use crate::response::StoredResponse;
use crate::store::sql::{Lit, fill};

/// The records a completer runs again: in progress with recorded phases and a kept request,
/// whose lease ran out more than `$1` ms ago (oldest first, at most `$2`; the partial index
/// `tower_idempotency_keys_phased` finds them).
const ABANDONED: &str = "
SELECT request FROM tower_idempotency_keys
 WHERE phases IS NOT NULL AND request IS NOT NULL AND lease_token IS NOT NULL
   AND lease_expires_at < tower_idempotency_now() - $1::float8 * interval '1 millisecond'
 ORDER BY lease_expires_at
 LIMIT $2";

/// Encodes the request to keep (`None` when larger than `max`): the method's and the URI's
/// lengths and bytes, the headers (as [`StoredResponse::encode_headers`] writes them) with
/// their length, then the body. The body's chunks are joined into one (and put back as one).
pub(crate) fn keep_request(parts: &Parts, buffered: &mut Buffered, max: usize) -> Option<Vec<u8>> {
    let body = std::mem::take(&mut buffered.chunks).into_bytes();
    let mut chunks = Chunks::default();
    chunks.push(body.clone());
    buffered.chunks = chunks;
    let method = parts.method.as_str().as_bytes();
    let uri = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .as_bytes();
    let headers =
        StoredResponse::new(StatusCode::OK, parts.headers.clone(), Bytes::new()).encode_headers();
    let len = 10 + method.len() + uri.len() + headers.len() + body.len();
    if len > max {
        return None;
    }
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&u16::try_from(method.len()).ok()?.to_be_bytes());
    out.extend_from_slice(method);
    out.extend_from_slice(&u32::try_from(uri.len()).ok()?.to_be_bytes());
    out.extend_from_slice(uri);
    out.extend_from_slice(&u32::try_from(headers.len()).ok()?.to_be_bytes());
    out.extend_from_slice(&headers);
    out.extend_from_slice(&body);
    Some(out)
}

/// Decodes what [`keep_request`] wrote.
fn decode_request(bytes: &[u8]) -> Result<(Method, Uri, HeaderMap, Bytes), StoreError> {
    let corrupt = || StoreError::Corrupt("a kept request is not in the crate's encoding".into());
    let (n, rest) = bytes.split_first_chunk::<2>().ok_or_else(corrupt)?;
    let (method, rest) = rest
        .split_at_checked(usize::from(u16::from_be_bytes(*n)))
        .ok_or_else(corrupt)?;
    let (n, rest) = rest.split_first_chunk::<4>().ok_or_else(corrupt)?;
    let n = usize::try_from(u32::from_be_bytes(*n)).map_err(|_| corrupt())?;
    let (uri, rest) = rest.split_at_checked(n).ok_or_else(corrupt)?;
    let (n, rest) = rest.split_first_chunk::<4>().ok_or_else(corrupt)?;
    let n = usize::try_from(u32::from_be_bytes(*n)).map_err(|_| corrupt())?;
    let (headers, body) = rest.split_at_checked(n).ok_or_else(corrupt)?;
    Ok((
        Method::from_bytes(method).map_err(|_| corrupt())?,
        Uri::try_from(uri).map_err(|_| corrupt())?,
        StoredResponse::decode_headers(headers)?,
        Bytes::copy_from_slice(body),
    ))
}

/// What one pass of the completer did ([`Phased::complete_abandoned`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CompleterRun {
    /// Abandoned keys found.
    pub found: usize,
    /// Requests run again that were answered and stored (`2xx`, `4xx`).
    pub completed: usize,
    /// Requests run again that another request held meanwhile (`409`): a retry came.
    pub taken: usize,
    /// Requests run again that failed (`5xx`, an error of the service): their phases stay
    /// for the next pass.
    pub failed: usize,
}

impl Phased {
    /// Runs again, through `service` (the application with this layer in it), the requests
    /// of keys abandoned mid-phase: a step committed, the lease ran out more than `grace`
    /// ago, and no retry came. Each request resumes after its last committed step, as a
    /// client's retry would, and its answer is stored for the client's retry to replay. At
    /// most `batch` keys per pass. Only requests kept with
    /// [`with_resumable_requests`](Phased::with_resumable_requests) can be run again.
    ///
    /// Each request is counted in the metric `tower_idempotency_completer_runs_total`
    /// (label `outcome`: `completed`, `taken`, `failed`; feature `metrics`) and logged.
    ///
    /// # Errors
    ///
    /// [`StoreError`] when the abandoned keys cannot be read.
    pub async fn complete_abandoned<S, B, RB>(
        &self,
        service: &mut S,
        grace: Duration,
        batch: usize,
    ) -> Result<CompleterRun, StoreError>
    where
        S: Service<Request<B>, Response = Response<RB>>,
        S::Error: std::fmt::Display,
        B: From<Bytes>,
    {
        let limit = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        let sql = fill(
            ABANDONED,
            &[
                Lit::Int(crate::store::postgres::millis(grace)),
                Lit::Int(limit),
            ],
        )?;
        let rows = sqlx::raw_sql(AssertSqlSafe(sql))
            .fetch_all(self.store.pool())
            .await
            .map_err(|e| self.store.error(e))?;
        let mut run = CompleterRun {
            found: rows.len(),
            ..CompleterRun::default()
        };
        for row in rows {
            let kept: Vec<u8> = row.try_get("request")?;
            let (method, uri, headers, body) = match decode_request(&kept) {
                Ok(request) => request,
                Err(e) => {
                    tracing::error!(error = &e as &dyn std::error::Error, "completer: skipped");
                    run.failed += 1;
                    continue;
                }
            };
            let mut request = Request::new(B::from(body));
            *request.method_mut() = method;
            *request.uri_mut() = uri;
            *request.headers_mut() = headers;
            let answered = async {
                poll_fn(|cx| service.poll_ready(cx)).await?;
                service.call(request).await
            };
            let outcome = match answered.await {
                Ok(response) if response.status() == StatusCode::CONFLICT => {
                    run.taken += 1;
                    "taken"
                }
                Ok(response) if response.status().is_server_error() => {
                    run.failed += 1;
                    "failed"
                }
                Ok(_) => {
                    run.completed += 1;
                    "completed"
                }
                Err(e) => {
                    tracing::warn!(error = %e, "completer: the service failed");
                    run.failed += 1;
                    "failed"
                }
            };
            tracing::info!(outcome, "completer: ran an abandoned request again");
            #[cfg(feature = "metrics")]
            metrics::counter!("tower_idempotency_completer_runs_total", "outcome" => outcome)
                .increment(1);
        }
        Ok(run)
    }
}

/// Spawns a task that calls [`Phased::complete_abandoned`] every `every` (keys whose lease
/// ran out more than `every` ago, 100 per pass). Failures are logged and tried again at the
/// next tick. Abort the returned handle to stop it. Run it in as many instances as you like:
/// two completers running the same request meet as two retries do (one gets `409`).
///
/// # Errors
///
/// [`ConfigError::ZeroPurgePeriod`] for a zero period, [`ConfigError::NoRuntime`] outside a
/// Tokio runtime.
pub fn spawn_completer<S, B, RB>(
    phased: &Phased,
    mut service: S,
    every: Duration,
) -> Result<tokio::task::JoinHandle<()>, ConfigError>
where
    S: Service<Request<B>, Response = Response<RB>> + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display,
    B: From<Bytes> + Send + 'static,
    RB: Send,
{
    if every.is_zero() {
        return Err(ConfigError::ZeroPurgePeriod);
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::NoRuntime)?;
    let phased = phased.clone();
    Ok(runtime.spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match phased.complete_abandoned(&mut service, every, 100).await {
                Ok(run) if run.found > 0 => tracing::info!(?run, "completer pass"),
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "completer: could not read the abandoned keys"
                ),
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_requests_round_trip_and_respect_their_bound() {
        let (mut parts, ()) = Request::post("/payments?x=1")
            .header("idempotency-key", "k")
            .header("authorization", "Bearer t")
            .body(())
            .unwrap()
            .into_parts();
        parts.headers.append("x-many", "1".parse().unwrap());
        parts.headers.append("x-many", "2".parse().unwrap());
        let mut chunks = Chunks::default();
        chunks.push(Bytes::from_static(b"{\"a\":"));
        chunks.push(Bytes::from_static(b"1}"));
        let mut buffered = Buffered {
            chunks,
            trailers: None,
        };
        let kept = keep_request(&parts, &mut buffered, 4096).unwrap();
        let (method, uri, headers, body) = decode_request(&kept).unwrap();
        assert_eq!(method, Method::POST);
        assert_eq!(uri, "/payments?x=1");
        assert_eq!(headers, parts.headers);
        assert_eq!(body, "{\"a\":1}");
        assert_eq!(
            std::mem::take(&mut buffered.chunks).into_bytes(),
            "{\"a\":1}"
        );
        assert!(keep_request(&parts, &mut buffered, 10).is_none());
        for cut in 0..kept.len() {
            let _ = decode_request(&kept[..cut]);
        }
        assert!(decode_request(&[0, 9]).is_err());
    }
}
