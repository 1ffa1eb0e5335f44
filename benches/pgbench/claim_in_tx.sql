-- A transactional claim that the crate does not ship, created by run.sh for its two
-- tx_claim_* scripts: the claim those scripts measure, whose figures are in BENCHMARKS.md
-- ("pg-tx: where the time goes"). The crate's own claim is tower_idempotency_claim_tx.
--
-- It raises TI002 when the key has a live record (before taking any lock), TI001 when another
-- transaction holds the key's advisory lock, and otherwise takes the lock, looks again and
-- deletes a stale record (expired, or a plain-mode claim whose lease ran out with the same
-- payload). It runs with the settings of the crate's functions (migrations/0001_schema.sql).
CREATE FUNCTION tower_idempotency_claim_in_tx(
    p_lock bigint, p_scope text, p_key text, p_fingerprint bytea)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    -- NULL: no record; false: a stale record; true: a live one.
    live boolean;
BEGIN
    SELECT k.expires_at > tower_idempotency_now()
           AND (k.lease_token IS NULL OR k.lease_expires_at > tower_idempotency_now()
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
    SELECT k.expires_at > tower_idempotency_now()
           AND (k.lease_token IS NULL OR k.lease_expires_at > tower_idempotency_now()
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

DO $$
BEGIN
    EXECUTE pg_catalog.format(
        'ALTER FUNCTION tower_idempotency_claim_in_tx(bigint, text, text, bytea) '
        'SET search_path = pg_catalog, %I, pg_temp',
        pg_catalog.current_schema());
END
$$;
