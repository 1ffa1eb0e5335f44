//! A keyed request as the modes receive it: its key and settings, its body read in full and
//! its fingerprint.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, Response, request::Parts};
use http_body::Body;

use crate::answer::render;
use crate::body::{Chunks, ReadError, ResponseBody, read_frames};
use crate::config::Config;
use crate::error::BoxError;
use crate::fingerprint::{Fingerprint, Fingerprinter};
use crate::key::IdempotencyKey;
use crate::outcome::{Outcome, record};
use crate::rejection::Rejection;

/// A keyed request, as handed to a mode.
pub(crate) struct Keyed {
    pub(crate) config: Arc<Config>,
    pub(crate) key: IdempotencyKey,
}

/// A request body read in full: its chunks (small ones coalesced) and trailers.
pub(crate) struct Buffered {
    pub(crate) chunks: Chunks,
    pub(crate) trailers: Option<Box<HeaderMap>>,
}

/// A keyed request, read and fingerprinted, ready to claim (transactional mode).
#[cfg(feature = "postgres")]
pub(crate) struct Prepared {
    pub(crate) parts: Parts,
    pub(crate) scope: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) buffered: Buffered,
}

/// Reads the body of a request (up to the limit) and fingerprints the request; a request that
/// cannot be read is answered here.
#[cfg(feature = "postgres")]
pub(crate) async fn prepare<ReqBody, ResBody>(
    config: &Config,
    req: http::Request<ReqBody>,
) -> Result<Prepared, Response<ResponseBody<ResBody>>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    let (parts, body) = req.into_parts();
    let (scope, fingerprint, buffered) = read_request(config, &parts, body).await?;
    Ok(Prepared {
        parts,
        scope,
        fingerprint,
        buffered,
    })
}

/// [`prepare`] for a request whose head stays with the caller: derives the scope (as stores
/// see it: its digest), reads the body and fingerprints the request.
pub(crate) async fn read_request<ReqBody, ResBody>(
    config: &Config,
    parts: &Parts,
    body: ReqBody,
) -> Result<(String, Fingerprint, Buffered), Response<ResponseBody<ResBody>>>
where
    ReqBody: Body<Data = Bytes>,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body,
{
    let scope = config.scope_of(parts).map_err(|rejection| {
        record(Outcome::Rejected);
        render(config, &rejection)
    })?;
    let headers = &config.fingerprint_headers;
    let mut fingerprinter = Fingerprinter::new(parts, headers, &config.fingerprint);
    match read_body(body, &mut fingerprinter, config.max_request_body).await {
        Ok(mut buffered) => {
            let chunks = &mut buffered.chunks;
            // A fingerprint that needs the whole body at once gets it as one `Bytes`, which
            // then stays the body the handler reads.
            let fingerprint = fingerprinter.finish(parts, headers, || {
                let whole = std::mem::take(chunks).into_bytes();
                if !whole.is_empty() {
                    chunks.push(whole.clone());
                }
                whole
            });
            Ok((scope, fingerprint, buffered))
        }
        Err(rejection) => {
            record(Outcome::Rejected);
            Err(render(config, &rejection))
        }
    }
}

async fn read_body<B>(
    body: B,
    fingerprinter: &mut Fingerprinter,
    limit: usize,
) -> Result<Buffered, Rejection>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut chunks = Chunks::default();
    let read = read_frames(body, limit, |data| {
        fingerprinter.update(&data);
        chunks.push(data);
    })
    .await;
    match read {
        Ok(trailers) => Ok(Buffered {
            chunks,
            trailers: trailers.map(Box::new),
        }),
        Err(ReadError::TooLarge) => Err(Rejection::BodyTooLarge { limit }),
        Err(ReadError::Failed(e)) => {
            tracing::debug!(
                error = &*e as &dyn std::error::Error,
                "reading the request body failed"
            );
            Err(Rejection::UnreadableBody)
        }
    }
}
