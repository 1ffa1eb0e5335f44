-- tower-idempotency: the insert that claims a new key, as a function.
--
-- The claim statement (CLAIM in src/store/postgres.rs) is a plain SELECT of the record that
-- calls this function only when the key is absent. A replay therefore costs the database a
-- plain read: an INSERT written into the statement itself (a data-modifying CTE) is set up
-- on every execution, even when it has nothing to insert. PL/pgSQL keeps the INSERT's plan
-- for the session, and the function runs with the caller's search_path and privileges.
--
-- Arguments: scope, key, fingerprint, then the lease and the time to live in milliseconds.
-- Returns the new record's lease token, or NULL when the key exists: a concurrent claim
-- inserted it after the calling statement's snapshot (ON CONFLICT makes this insert the one
-- atomic decision between racing first requests).

CREATE FUNCTION tower_idempotency_insert_key(
    p_scope       text,
    p_key         text,
    p_fingerprint bytea,
    p_lease_ms    bigint,
    p_ttl_ms      bigint
) RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token bigint;
BEGIN
    INSERT INTO tower_idempotency_keys AS k
           (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, nextval('tower_idempotency_lease_token_seq'),
            now() + p_lease_ms::float8 * interval '1 millisecond',
            now() + p_ttl_ms::float8 * interval '1 millisecond')
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.lease_token INTO token;
    RETURN token;
END
$$;
