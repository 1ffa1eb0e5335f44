-- tower-idempotency: the transactional claim of an expired record that a purge deletes
-- while the claim waits to take it over.
--
-- The claim (migration 5) inserts the key's placeholder, and when an expired record is there
-- it takes that record over with an UPDATE. A purge locks the expired records of its batch
-- (FOR UPDATE SKIP LOCKED) before it deletes them; a takeover that reaches such a record
-- waits for the purge's transaction, and at READ COMMITTED finds the record gone when the
-- wait ends: no row to update, none to return, and the request was answered 503. Now the
-- claim then inserts again, once: the key is free, so the insert takes it. (At REPEATABLE
-- READ and SERIALIZABLE the takeover fails with 40001 instead, and the caller claims again
-- in a new transaction, as before.) Unchanged otherwise, sequential scans off as migration 8
-- set them. tests/transactional.rs::an_expired_record_purged_during_its_takeover_is_claimed_anew
-- checks it.

CREATE OR REPLACE FUNCTION tower_idempotency_claim_tx(
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
LANGUAGE plpgsql SET enable_seqscan = off
AS $$
DECLARE
    found_row tid;
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock # 'tower_idempotency_keys'::regclass::oid::bigint) THEN
        RETURN QUERY SELECT 'held'::text, NULL::text, NULL::bytea, NULL::bigint, NULL::bigint,
                            NULL::smallint, NULL::bytea, NULL::bytea;
        RETURN;
    END IF;
    -- A second pass only when the record vanished between the insert and the takeover.
    FOR pass IN 1..2 LOOP
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
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END
$$;
