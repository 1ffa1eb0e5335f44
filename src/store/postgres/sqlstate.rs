//! The SQLSTATEs the crate reads, and how a database error is recognised by one.

use crate::error::StoreError;

/// SQLSTATE `invalid_sql_statement_name`: here, `EXECUTE` of a statement the server
/// connection has not prepared.
pub(crate) const NOT_PREPARED: &str = "26000";
/// SQLSTATE `duplicate_prepared_statement`: a `PREPARE` of a statement the server connection
/// holds already.
pub(crate) const ALREADY_PREPARED: &str = "42P05";

/// SQLSTATE `in_failed_sql_transaction`: a statement sent in a transaction that an earlier
/// error aborted.
pub(crate) const IN_FAILED_TRANSACTION: &str = "25P02";
/// SQLSTATE `serialization_failure`.
pub(crate) const SERIALIZATION_FAILURE: &str = "40001";
/// SQLSTATE `deadlock_detected`.
pub(crate) const DEADLOCK_DETECTED: &str = "40P01";
/// SQLSTATE `check_violation`: among others, a row for which no partition exists.
pub(crate) const CHECK_VIOLATION: &str = "23514";
/// SQLSTATE `duplicate_table`: a table (a partition) created meanwhile by another process.
pub(crate) const DUPLICATE_TABLE: &str = "42P07";
/// SQLSTATE `invalid_object_definition`: among others, a partition that overlaps one
/// created meanwhile by another process.
pub(crate) const INVALID_OBJECT_DEFINITION: &str = "42P17";
/// The SQLSTATE the store's phase functions raise when the token no longer holds the record
/// (class `TI`: the crate's own).
pub(crate) const NOT_HELD: &str = "TI001";

/// SQLSTATE `query_canceled`: here, a statement cancelled at `statement_timeout`.
pub(crate) const QUERY_CANCELED: &str = "57014";
/// SQLSTATE `lock_not_available`: here, a lock not granted within `lock_timeout`.
pub(crate) const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Whether `err` is a database error with SQLSTATE `code`.
pub(crate) fn sqlstate_is(err: &sqlx::Error, code: &str) -> bool {
    err.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|c| c == code)
}

/// Whether a store error is a lock not granted within the store's `lock_timeout`: another
/// transaction holds the key's row.
pub(crate) fn waited_for_lock(err: &StoreError) -> bool {
    match err {
        StoreError::Backend(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(|e| sqlstate_is(e, LOCK_NOT_AVAILABLE)),
        _ => false,
    }
}

/// Whether `err` is a serialization failure (SQLSTATE 40001) or a deadlock (40P01): the
/// statement lost a race with a concurrent transaction and may be run again.
pub(crate) fn is_serialization_failure(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == SERIALIZATION_FAILURE || code == DEADLOCK_DETECTED)
}

/// [`is_serialization_failure`] for an error already mapped by [`db_error`].
pub(crate) fn lost_race(err: &StoreError) -> bool {
    match err {
        StoreError::Backend(source) => source
            .downcast_ref::<sqlx::Error>()
            .is_some_and(is_serialization_failure),
        _ => false,
    }
}

/// Maps a database error, recognising a missing schema by its SQLSTATE.
pub(crate) fn db_error(err: sqlx::Error) -> StoreError {
    if let Some(db) = err.as_database_error() {
        // 42P01 undefined_table, 42704 undefined_object (the sequence), 42883
        // undefined_function (the functions that later migrations add).
        if matches!(db.code().as_deref(), Some("42P01" | "42704" | "42883")) {
            return StoreError::Schema(format!(
                "{} (run PostgresStore::migrate() first)",
                db.message()
            ));
        }
    }
    StoreError::from(err)
}
