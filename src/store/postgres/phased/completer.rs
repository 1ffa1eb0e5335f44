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
/// whose lease ran out more than `$1` ms ago, and still within their TTL (oldest first, at
/// most `$2`; the partial index `tower_idempotency_keys_phased` finds them). A record past
/// its TTL is not resumed by anyone: a request with its key is a new one, which would run
/// every committed step again.
const ABANDONED: &str = "
SELECT scope, key FROM tower_idempotency_keys
 WHERE phases IS NOT NULL AND request IS NOT NULL AND lease_token IS NOT NULL
   AND lease_expires_at < tower_idempotency_now() - $1::float8 * interval '1 millisecond'
   AND expires_at > tower_idempotency_now()
 ORDER BY lease_expires_at
 LIMIT $2";

/// The kept request of one record [`ABANDONED`] found, read just before its re-run (one in
/// memory at a time), while the record is still abandoned (a retry may have come since).
const KEPT: &str = "
SELECT request FROM tower_idempotency_keys
 WHERE scope = $1 AND key = $2
   AND phases IS NOT NULL AND request IS NOT NULL AND lease_token IS NOT NULL
   AND lease_expires_at < tower_idempotency_now() - $3::float8 * interval '1 millisecond'
   AND expires_at > tower_idempotency_now()";

/// Whether the record a re-run was for is completed now (`true`), held by a live lease
/// (`false`), or neither (no row: still abandoned, or gone).
const SETTLED: &str = "
SELECT lease_token IS NULL AS completed FROM tower_idempotency_keys
 WHERE scope = $1 AND key = $2
   AND (lease_token IS NULL OR lease_expires_at > tower_idempotency_now())";

/// Marks a request the completer runs again with the record it was kept on. The layer runs
/// it only against that record: a request whose scope or key comes out otherwise (a
/// credential expired, the scope or key settings changed) or whose record is no longer
/// there (completed and purged, or expired) is not run, so a re-run can resume a record but
/// never start a new one, which would run every committed step again.
#[derive(Clone, Debug)]
pub(crate) struct Resumption {
    pub(crate) scope: String,
    pub(crate) key: String,
}

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
    /// Requests run again whose record is completed now: their answer is stored.
    pub completed: usize,
    /// Requests whose record another request holds (a retry came), or took or completed
    /// between the search and the re-run.
    pub taken: usize,
    /// Requests run again whose record is neither completed nor held afterwards: the
    /// request failed (`5xx`, an error of the service), or never reached its record (it was
    /// answered before the layer, a credential having expired, or the layer found it another
    /// scope, key or payload than its record's, or it answered `4xx`). Their phases stay for
    /// the next pass.
    pub failed: usize,
}

impl Phased {
    /// Runs again, through `service` (the application with this layer in it), the requests
    /// of keys abandoned mid-phase: a step committed, the lease ran out more than `grace`
    /// ago, and no retry came. Each request resumes after its last committed step, as a
    /// client's retry would, and its answer is stored for the client's retry to replay. At
    /// most `batch` keys per pass, one after the other, and only records still within their
    /// TTL; each kept request is read just before its re-run, so a pass holds one in memory
    /// at a time. Only requests kept with
    /// [`with_resumable_requests`](Phased::with_resumable_requests) can be run again. Each
    /// re-run is bounded by the layer's
    /// [`with_handler_timeout`](Phased::with_handler_timeout) (with no bound there, a re-run
    /// that hangs stops the pass).
    ///
    /// Give each keys table one completer per application: a completer runs what it finds
    /// through its own `service`, and a request kept by another application (another router
    /// on a shared table) does not reach its record there; it is counted `failed` and stays
    /// for that application's completer or its client's retry.
    ///
    /// A request run again resumes the record it was found on or nothing: the layer runs it
    /// only when its scope and key come out as the record's and the record is still there to
    /// take over (never as a new claim, which would run every committed step again). A `4xx`
    /// it answers is not stored over the committed steps (the kept credential may have
    /// expired): the client's retry resumes them. Each outcome is read from the record
    /// afterwards, not from the answer's status.
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
            let scope: String = row.try_get("scope")?;
            let key: String = row.try_get("key")?;
            let sql = fill(
                KEPT,
                &[
                    Lit::Text(&scope),
                    Lit::Text(&key),
                    Lit::Int(crate::store::postgres::millis(grace)),
                ],
            )?;
            let kept = sqlx::raw_sql(AssertSqlSafe(sql))
                .fetch_optional(self.store.pool())
                .await
                .map_err(|e| self.store.error(e))?;
            let Some(kept) = kept else {
                // A retry took it, or completed it, since the search.
                run.taken += 1;
                continue;
            };
            let kept: Vec<u8> = kept.try_get("request")?;
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
            request.extensions_mut().insert(Resumption {
                scope: scope.clone(),
                key: key.clone(),
            });
            let answered = async {
                poll_fn(|cx| service.poll_ready(cx)).await?;
                service.call(request).await
            };
            let status = match answered.await {
                Ok(response) => Some(response.status()),
                Err(e) => {
                    tracing::warn!(error = %e, "completer: the service failed");
                    None
                }
            };
            // The record tells what the re-run did, not the answer's status: a `4xx` may come
            // from before the layer, a `2xx` from a replay of another record.
            let settled = async {
                let sql = fill(SETTLED, &[Lit::Text(&scope), Lit::Text(&key)])?;
                let rows = sqlx::raw_sql(AssertSqlSafe(sql))
                    .fetch_all(self.store.pool())
                    .await
                    .map_err(|e| self.store.error(e))?;
                match rows.first() {
                    Some(row) => Ok::<_, StoreError>(Some(row.try_get::<bool, _>("completed")?)),
                    None => Ok(None),
                }
            };
            let settled = settled.await.unwrap_or_else(|e| {
                tracing::warn!(
                    error = &e as &dyn std::error::Error,
                    "completer: could not read the record of a request run again"
                );
                None
            });
            let outcome = match settled {
                Some(true) => {
                    run.completed += 1;
                    "completed"
                }
                Some(false) => {
                    run.taken += 1;
                    "taken"
                }
                None => {
                    if status.is_some_and(|s| !s.is_server_error()) {
                        tracing::warn!(
                            status = status.map(|s| s.as_u16()),
                            "completer: the request run again did not reach its record (answered \
                             before the layer, or its scope, key or payload came out otherwise); \
                             its phases stay"
                        );
                    }
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
