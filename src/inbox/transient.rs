//! Which failures of a message's work say nothing about the message: a race lost with a
//! concurrent transaction, a connection cut, a server going down. A [`Consumer`] does not count
//! them toward its parking limit, so that a healthy message is never parked for them.
//!
//! [`Consumer`]: super::Consumer

use std::error::Error;

use crate::store::postgres::sqlstate::{
    DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE, SERIALIZATION_FAILURE,
};

/// SQLSTATE `admin_shutdown`: the server process was terminated (`pg_terminate_backend`, a
/// fast shutdown, a failover).
const ADMIN_SHUTDOWN: &str = "57P01";
/// SQLSTATE `crash_shutdown`: another server process crashed and this one was stopped.
const CRASH_SHUTDOWN: &str = "57P02";
/// SQLSTATE `cannot_connect_now`: the server is starting up or shutting down.
const CANNOT_CONNECT_NOW: &str = "57P03";
/// SQLSTATE `too_many_connections`.
const TOO_MANY_CONNECTIONS: &str = "53300";
/// SQLSTATE class `connection_exception` (`08000`, `08003`, `08006`, …).
const CONNECTION_EXCEPTION_CLASS: &str = "08";

/// Whether `error`, or one of its sources ([`Error::source`]), is a failure of the database
/// that says nothing about the work that met it: run again, the same work may well succeed.
/// These are the `sqlx::Error`s
///
/// - with SQLSTATE `40001` (serialization failure) or `40P01` (deadlock): the transaction
///   lost a race with a concurrent one;
/// - with SQLSTATE `55P03` (a lock not granted within `lock_timeout`): another transaction
///   held a row for long;
/// - of class `08` (connection exception), `57P01`, `57P02` or `57P03` (the server process
///   terminated, crashed, or not accepting connections) and `53300` (too many connections);
/// - that are not the server's answer but the connection's: an I/O error (a connection cut
///   or reset), a pool that timed out or was closed, a crashed connection worker.
///
/// Not transient: every other SQLSTATE (a constraint violated, a syntax error, a statement
/// cancelled at `statement_timeout` — `57014`, which a statement too slow for its bound meets
/// on every attempt), and every error that carries no `sqlx::Error`.
///
/// This is how a [`Consumer`](super::Consumer) tells its work's transient failures by
/// default; a classifier of [`Consumer::with_transient`](super::Consumer::with_transient) may
/// call it and add its own.
///
/// ```
/// use tower_idempotency::inbox::is_transient_database_error;
///
/// let cut = sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into());
/// assert!(is_transient_database_error(&cut));
/// assert!(!is_transient_database_error(&sqlx::Error::RowNotFound));
/// ```
pub fn is_transient_database_error(error: &(dyn Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(e) = e.downcast_ref::<sqlx::Error>() {
            return is_transient(e);
        }
        cause = e.source();
    }
    false
}

/// Whether `error`, or one of its sources, is the server's answer that the transaction was
/// rolled back by a race (`40001`, `40P01`) or a lock not granted in time (`55P03`): nothing of
/// it committed, for sure (unlike a cut connection, after which a commit may have landed).
pub(crate) fn is_known_rollback(error: &(dyn Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            return db.code().is_some_and(|code| {
                [SERIALIZATION_FAILURE, DEADLOCK_DETECTED, LOCK_NOT_AVAILABLE].contains(&&*code)
            });
        }
        cause = e.source();
    }
    false
}

/// [`is_transient_database_error`] of one `sqlx::Error`.
fn is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| {
            [
                SERIALIZATION_FAILURE,
                DEADLOCK_DETECTED,
                LOCK_NOT_AVAILABLE,
                ADMIN_SHUTDOWN,
                CRASH_SHUTDOWN,
                CANNOT_CONNECT_NOW,
                TOO_MANY_CONNECTIONS,
            ]
            .contains(&&*code)
                || code.starts_with(CONNECTION_EXCEPTION_CLASS)
        }),
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An application's error that keeps the database's as its source.
    #[derive(Debug, thiserror::Error)]
    #[error("the ledger failed")]
    struct Ledger(#[source] sqlx::Error);

    #[test]
    fn connection_failures_are_transient_and_other_errors_are_not() {
        let cut = || sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into());
        assert!(is_transient_database_error(&cut()));
        assert!(is_transient_database_error(&sqlx::Error::PoolTimedOut));
        assert!(is_transient_database_error(&Ledger(cut())));
        let boxed: Box<dyn Error + Send + Sync> = Box::new(Ledger(cut()));
        assert!(is_transient_database_error(&*boxed));
        assert!(!is_transient_database_error(&sqlx::Error::RowNotFound));
        assert!(!is_transient_database_error(&Ledger(
            sqlx::Error::RowNotFound
        )));
        assert!(!is_transient_database_error(&std::io::Error::from(
            std::io::ErrorKind::ConnectionReset
        )));
        let text: Box<dyn Error + Send + Sync> = "could not serialize access".into();
        assert!(!is_transient_database_error(&*text));
    }
}
