-- tower-idempotency, transactional mode, second version: correct at every isolation level,
-- and no server-side ERROR for the normal outcomes (replay, in flight, mismatch).
--
-- The claim runs inside the request's transaction, at whatever isolation level it has, so it
-- never decides from a snapshot alone:
--   1. it takes the key's transaction-scoped advisory lock without waiting ('held' when another
--      transaction has it);
--   2. it inserts the key's record as an in-progress placeholder. The unique check of the
--      insert sees every committed record, whatever the snapshot: a record committed after the
--      snapshot (REPEATABLE READ, SERIALIZABLE) makes the insert fail with 40001, which the
--      caller answers by claiming again; a visible one makes it do nothing;
--   3. a record that is there and stale (expired, or a plain-mode claim whose lease ran out,
--      with the same payload) is taken over in place;
--   4. otherwise the record is returned for the caller to classify ('record').
-- The placeholder is never seen by others: the completion turns it into the completed record
-- in the same transaction, a rollback removes it. It is found again by its ctid, so the
-- completion reads no index (under SERIALIZABLE, an index read would take predicate locks
-- that make concurrent requests with other keys fail each other).
-- The lock id mixes in the table's oid, so stores in two schemas never block each other.

CREATE FUNCTION tower_idempotency_claim_tx(
    p_lock bigint, p_scope text, p_key text, p_fingerprint bytea)
RETURNS TABLE (
    outcome          text,
    claimed_row      text,
    fingerprint      bytea,
    lease_token      bigint,
    lease_left_ms    bigint,
    response_status  smallint,
    response_headers bytea,
    response_body    bytea)
LANGUAGE plpgsql
AS $$
DECLARE
    found_row tid;
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock # 'tower_idempotency_keys'::regclass::oid::bigint) THEN
        RETURN QUERY SELECT 'held'::text, NULL::text, NULL::bytea, NULL::bigint, NULL::bigint,
                            NULL::smallint, NULL::bytea, NULL::bytea;
        RETURN;
    END IF;
    INSERT INTO tower_idempotency_keys AS k
           (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, 0, now(), now())
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.ctid INTO found_row;
    IF found_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET fingerprint = p_fingerprint, lease_token = 0, lease_expires_at = now(),
               expires_at = now(), created_at = now(), completed_at = NULL,
               response_status = NULL, response_headers = NULL, response_body = NULL
         WHERE k.scope = p_scope AND k.key = p_key
           AND (k.expires_at <= now()
                OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now()
                    AND k.fingerprint = p_fingerprint))
        RETURNING k.ctid INTO found_row;
    END IF;
    IF found_row IS NOT NULL THEN
        RETURN QUERY SELECT 'acquired'::text, found_row::text, NULL::bytea, NULL::bigint,
                            NULL::bigint, NULL::smallint, NULL::bytea, NULL::bytea;
        RETURN;
    END IF;
    RETURN QUERY
        SELECT 'record'::text, NULL::text, k.fingerprint, k.lease_token,
               (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint,
               k.response_status, k.response_headers, k.response_body
          FROM tower_idempotency_keys AS k
         WHERE k.scope = p_scope AND k.key = p_key;
END
$$;

-- The completion: the placeholder becomes the completed record. Its times come from the
-- completion's statement (statement_timestamp()), not from the transaction's start, so a
-- handler slower than the TTL still leaves a record that lives the TTL. Raises TI003 when the
-- placeholder is gone (it cannot be, short of a bug), so that the COMMIT after it never runs.
CREATE FUNCTION tower_idempotency_complete_tx(
    p_record text, p_scope text, p_key text, p_ttl_ms bigint,
    p_status smallint, p_headers bytea, p_body bytea)
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
END
$$;
