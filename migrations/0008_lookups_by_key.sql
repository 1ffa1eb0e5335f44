-- tower-idempotency: the functions find a record by its key, whatever the statistics say.
--
-- PL/pgSQL keeps the plan of each statement in a function for the life of the connection,
-- and after five calls that plan is a generic one, made on the table's statistics of that
-- moment. A table analyzed while it was empty (right after this migration, or on a server
-- whose autovacuum is off or has not come round yet) says it has no rows, and on such a
-- table a sequential scan is the cheaper plan: kept, it would read the whole table on every
-- request once the table has grown, until something made Postgres plan again. A lookup by
-- key has one right plan, the primary key, so each function that looks a record up plans
-- with sequential scans off (a setting of the function: it holds while the function runs and
-- is put back when it returns; the purge is not among them). tests/plans.rs checks it.

ALTER FUNCTION tower_idempotency_plain_claim(text, text, bytea, bigint, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_read(text, text, bytea, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_takeover(text, text, bytea, bigint, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_complete(text, text, bigint, bigint, smallint, bytea, bytea, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_complete(text, text, bigint, bigint, smallint, bytea, bytea, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_release(text, text, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_release(text, text, bigint, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_plain_renew(text, text, bigint, bigint, bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_wake(bigint)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_claim_in_tx(bigint, text, text, bytea)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_claim_tx(bigint, text, text, bytea)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_complete_tx(text, text, text, bigint, smallint, bytea, bytea)
    SET enable_seqscan = off;
ALTER FUNCTION tower_idempotency_complete_tx(text, text, text, bigint, smallint, bytea, bytea, bigint)
    SET enable_seqscan = off;
