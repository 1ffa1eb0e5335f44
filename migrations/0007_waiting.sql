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

-- Wakes the waiters of the key whose hash is `p_hash` (NULL: nobody asked): a NOTIFY when a
-- waiter registered the hash, nothing otherwise.
CREATE FUNCTION tower_idempotency_wake(p_hash bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF p_hash IS NOT NULL AND EXISTS (
        SELECT 1 FROM tower_idempotency_waiting WHERE hash = p_hash AND until > now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_hash::text);
    END IF;
END
$$;

-- Plain mode's completion and release (migration 6) that also wake the key's waiters.
CREATE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint, p_wake bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    changed bigint;
BEGIN
    changed := tower_idempotency_plain_complete(
        p_scope, p_key, p_token, p_ttl_ms, p_status, p_headers, p_body, p_lock_ms);
    IF changed > 0 THEN
        PERFORM tower_idempotency_wake(p_wake);
    END IF;
    RETURN changed;
END
$$;

CREATE FUNCTION tower_idempotency_plain_release(
    p_scope text, p_key text, p_token bigint, p_lock_ms bigint, p_wake bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    changed bigint;
BEGIN
    changed := tower_idempotency_plain_release(p_scope, p_key, p_token, p_lock_ms);
    IF changed > 0 THEN
        PERFORM tower_idempotency_wake(p_wake);
    END IF;
    RETURN changed;
END
$$;

-- Transactional mode's completion (migration 5) that also wakes the key's waiters (the
-- NOTIFY is delivered when the request's transaction commits). Its body is migration 5's,
-- not a call of it: this runs once per request.
CREATE FUNCTION tower_idempotency_complete_tx(
    p_record text, p_scope text, p_key text, p_ttl_ms bigint,
    p_status smallint, p_headers bytea, p_body bytea, p_wake bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE tower_idempotency_keys AS k
       SET lease_token = NULL, lease_expires_at = NULL,
           completed_at = statement_timestamp(),
           expires_at = statement_timestamp() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE k.ctid = p_record::tid AND k.scope = p_scope AND k.key = p_key
       AND k.lease_token = 0;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tower_idempotency: the claimed record is gone' USING ERRCODE = 'TI003';
    END IF;
    IF EXISTS (SELECT 1 FROM tower_idempotency_waiting WHERE hash = p_wake AND until > now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_wake::text);
    END IF;
END
$$;
