-- tower-idempotency: the keys that duplicates are waiting for
-- (IdempotencyLayer::with_wait_for_completion on a PostgresStore with notifications).
--
-- A waiting duplicate registers the 64-bit hash of its (scope, key) here, for a while, before
-- it claims the key again. A completion, a release or a rollback of that key looks the hash
-- up in the same transaction and sends NOTIFY tower_idempotency only when a row is there, so
-- requests nobody waits for pay one primary-key probe of this small table, not a NOTIFY
-- (which would serialize their commits). Rows past their time are deleted by the purge.

CREATE TABLE tower_idempotency_waiting (
    hash  bigint      PRIMARY KEY,
    until timestamptz NOT NULL
);
