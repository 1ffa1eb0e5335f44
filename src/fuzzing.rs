//! Entry points into the crate's hand-written encoders and decoders that are not public, for
//! the fuzz targets in `fuzz/` and the stable harness that replays their corpora
//! (`tests/fuzz_corpus.rs`).
//!
//! Behind the `fuzzing` feature and hidden from the docs: not part of the public API, and
//! free to change in any release. Each function calls the crate's own code and adds nothing
//! to it. (The key parser, the JSON canonicaliser and the header codec are public already:
//! [`IdempotencyKey::parse`](crate::IdempotencyKey::parse),
//! [`JsonFingerprint::canonicalize`](crate::JsonFingerprint::canonicalize),
//! [`StoredResponse::encode_headers`](crate::StoredResponse::encode_headers) and
//! [`StoredResponse::decode_headers`](crate::StoredResponse::decode_headers).)

#[cfg(feature = "postgres")]
use crate::error::StoreError;
#[cfg(feature = "postgres")]
use crate::response::StoredResponse;
#[cfg(feature = "postgres")]
use crate::store::sql::{self, Lit};

/// A value for [`sql_fill`]: the literals the Postgres store writes into its statements.
#[cfg(feature = "postgres")]
#[derive(Clone, Copy, Debug)]
pub enum Literal<'a> {
    /// A `text` value.
    Text(&'a str),
    /// A `bytea` value.
    Bytes(&'a [u8]),
    /// A `bytea` value that may be `NULL`.
    MaybeBytes(Option<&'a [u8]>),
    /// An integer.
    Int(i64),
}

#[cfg(feature = "postgres")]
impl<'a> From<Literal<'a>> for Lit<'a> {
    fn from(literal: Literal<'a>) -> Self {
        match literal {
            Literal::Text(t) => Lit::Text(t),
            Literal::Bytes(b) => Lit::Bytes(b),
            Literal::MaybeBytes(b) => Lit::MaybeBytes(b),
            Literal::Int(n) => Lit::Int(n),
        }
    }
}

/// The statement the Postgres store would send for `template` (placeholders `$1`…`$9`) and
/// `args`.
///
/// # Errors
///
/// As the store's: a placeholder without its argument, or a text with a NUL.
#[cfg(feature = "postgres")]
pub fn sql_fill(template: &str, args: &[Literal<'_>]) -> Result<String, StoreError> {
    let args: Vec<Lit<'_>> = args.iter().map(|&a| a.into()).collect();
    sql::fill(template, &args)
}

/// The expression of type `text` the Postgres store writes for `text`.
///
/// # Errors
///
/// When `text` holds a NUL (Postgres text cannot).
#[cfg(feature = "postgres")]
pub fn sql_text(text: &str) -> Result<String, StoreError> {
    let mut out = String::new();
    sql::push_text(&mut out, text)?;
    Ok(out)
}

/// The expression of type `bytea` the Postgres store writes for `bytes`.
#[cfg(feature = "postgres")]
pub fn sql_bytea(bytes: &[u8]) -> String {
    let mut out = String::new();
    sql::push_bytea(&mut out, bytes);
    out
}

/// The `response_status` column the Postgres store writes for `response`.
///
/// # Errors
///
/// When the status does not fit the column.
#[cfg(feature = "postgres")]
pub fn postgres_status_column(response: &StoredResponse) -> Result<i16, StoreError> {
    crate::store::postgres::status_column(response)
}

/// The stored response the Postgres store reads from a row with the columns
/// `response_status` (`smallint`), `response_headers` and `response_body` (`bytea`).
///
/// # Errors
///
/// [`StoreError::Corrupt`] when the columns do not hold a stored response, or the error of
/// reading a column.
#[cfg(feature = "postgres")]
pub fn postgres_decode_response(row: &sqlx::postgres::PgRow) -> Result<StoredResponse, StoreError> {
    crate::store::postgres::decode_response(row)
}

/// The length the stores reserve for what
/// [`StoredResponse::encode_headers`](crate::StoredResponse::encode_headers) writes (headers
/// and trailers): it must be that output's length.
pub fn encoded_headers_len(response: &StoredResponse) -> usize {
    response.encoded_headers_len()
}
