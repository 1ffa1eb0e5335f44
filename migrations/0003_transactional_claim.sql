-- tower-idempotency, transactional mode: the claim travels in one message with the
-- transaction's BEGIN (and the completion with its COMMIT), so that a keyed request costs no
-- more round trips than the handler's own transaction. The claim is a function so that it
-- can end that batch with an error when the key is not free; the SQLSTATE names the case:
--   TI001  another transaction holds the key (it is in flight)
--   TI002  the key has a live record (completed, or claimed by a plain-mode request)

-- The claim. A key with a live record (a replay, a reused key) is answered by reading the
-- record after the batch, so it takes no lock. Otherwise it takes the key's
-- transaction-scoped advisory lock without waiting, and looks again: that look runs after the
-- lock is held, with a snapshot of its own (READ COMMITTED), so it sees the record of any
-- transaction that held the lock before. A stale record (expired, or an abandoned plain-mode
-- claim) is deleted in this transaction: the completion inserts the new record, and a
-- rollback brings the old one back. The lock id mixes in the table's oid, so that stores in
-- two schemas of one database never block each other.
CREATE FUNCTION tower_idempotency_claim_in_tx(
    p_lock bigint, p_scope text, p_key text, p_fingerprint bytea)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    -- NULL: no record; false: a stale record (expired, or a plain-mode claim whose lease ran
    -- out, with the same payload as plain mode requires for a takeover); true: a live one.
    live boolean;
BEGIN
    SELECT k.expires_at > now()
           AND (k.lease_token IS NULL OR k.lease_expires_at > now()
                OR k.fingerprint <> p_fingerprint)
      INTO live
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
    IF live THEN
        RAISE EXCEPTION 'tower_idempotency: the key has a record' USING ERRCODE = 'TI002';
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_lock # 'tower_idempotency_keys'::regclass::oid::bigint) THEN
        RAISE EXCEPTION 'tower_idempotency: the key is in flight' USING ERRCODE = 'TI001';
    END IF;
    -- The same look again, now that the lock is held.
    SELECT k.expires_at > now()
           AND (k.lease_token IS NULL OR k.lease_expires_at > now()
                OR k.fingerprint <> p_fingerprint)
      INTO live
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
    IF live THEN
        RAISE EXCEPTION 'tower_idempotency: the key has a record' USING ERRCODE = 'TI002';
    ELSIF NOT live THEN
        DELETE FROM tower_idempotency_keys AS k WHERE k.scope = p_scope AND k.key = p_key;
    END IF;
END
$$;
