-- tower-idempotency: plain mode's statements as functions.
--
-- The store sends its statements over the simple query protocol with the values written in
-- (so a pooler in transaction mode can carry them: no prepared statement outlives its
-- message). Postgres then parses and plans every statement it receives; a statement that
-- only calls a function costs little to plan, and PL/pgSQL keeps the plans of the statements
-- inside it for the session (the pooler's server connection). Each function bounds its own
-- lock waits: `p_lock_ms` becomes its lock_timeout (0: no bound), and the SET clause puts the
-- caller's lock_timeout back when it returns. Each runs with the caller's search_path.
--
-- The statements are those the store sent before, unchanged: see the constants of the same
-- names in src/store/postgres.rs for why each is written as it is.

-- The claim: the record (or a row of NULLs when the key is absent), and for an absent key the
-- token of the record inserted for this request (NULL when a concurrent claim inserted it
-- first).
CREATE FUNCTION tower_idempotency_plain_claim(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS TABLE (
    inserted         bigint,
    fingerprint      bytea,
    lease_token      bigint,
    expired          boolean,
    claimable        boolean,
    lease_left_ms    bigint,
    response_status  smallint,
    response_headers bytea,
    response_body    bytea)
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    RETURN QUERY
    SELECT CASE WHEN k.scope IS NULL
                THEN tower_idempotency_insert_key(
                         p_scope, p_key, p_fingerprint, p_lease_ms, p_ttl_ms) END,
           k.fingerprint, k.lease_token, k.expires_at <= now(),
           (k.expires_at <= now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now()
                AND k.fingerprint = p_fingerprint)),
           (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint,
           k.response_status, k.response_headers, k.response_body
      FROM (SELECT) AS one
      LEFT JOIN tower_idempotency_keys AS k ON k.scope = p_scope AND k.key = p_key;
END
$$;

-- The read alone (the ReadFirst and InsertFirst strategies): no row when the key is absent.
CREATE FUNCTION tower_idempotency_plain_read(
    p_scope text, p_key text, p_fingerprint bytea, p_lock_ms bigint)
RETURNS TABLE (
    fingerprint      bytea,
    lease_token      bigint,
    expired          boolean,
    claimable        boolean,
    lease_left_ms    bigint,
    response_status  smallint,
    response_headers bytea,
    response_body    bytea)
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    RETURN QUERY
    SELECT k.fingerprint, k.lease_token, k.expires_at <= now(),
           (k.expires_at <= now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now()
                AND k.fingerprint = p_fingerprint)),
           (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint,
           k.response_status, k.response_headers, k.response_body
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
END
$$;

-- The insert alone: the new record's token, or NULL when the key exists.
CREATE FUNCTION tower_idempotency_plain_insert(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    RETURN tower_idempotency_insert_key(p_scope, p_key, p_fingerprint, p_lease_ms, p_ttl_ms);
END
$$;

-- Takes over a record that is expired, or whose lease ran out (same payload): the new token,
-- or NULL when the condition no longer holds on the row's latest version.
CREATE FUNCTION tower_idempotency_plain_takeover(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
DECLARE
    token bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys AS k
       SET fingerprint = p_fingerprint,
           lease_token = nextval('tower_idempotency_lease_token_seq'),
           lease_expires_at = now() + p_lease_ms::float8 * interval '1 millisecond',
           expires_at = now() + p_ttl_ms::float8 * interval '1 millisecond',
           created_at = now(), completed_at = NULL,
           response_status = NULL, response_headers = NULL, response_body = NULL
     WHERE k.scope = p_scope AND k.key = p_key
       AND (k.expires_at <= now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now()
                AND k.fingerprint = p_fingerprint))
    RETURNING k.lease_token INTO token;
    RETURN token;
END
$$;

-- Stores the answer of the claim that holds `p_token`: 1 when it did, 0 when the token no
-- longer holds the record.
CREATE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
DECLARE
    changed bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys
       SET lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
           expires_at = now() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;

-- Deletes the record that `p_token` holds: 1 when it did, 0 otherwise.
CREATE FUNCTION tower_idempotency_plain_release(
    p_scope text, p_key text, p_token bigint, p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
DECLARE
    changed bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    DELETE FROM tower_idempotency_keys
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;

-- Extends the lease that `p_token` holds (and the record's life to at least its end): 1 when
-- it did, 0 otherwise.
CREATE FUNCTION tower_idempotency_plain_renew(
    p_scope text, p_key text, p_token bigint, p_lease_ms bigint, p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SET lock_timeout = 0
AS $$
DECLARE
    changed bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys
       SET lease_expires_at = now() + p_lease_ms::float8 * interval '1 millisecond',
           expires_at = greatest(expires_at,
                                 now() + p_lease_ms::float8 * interval '1 millisecond')
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;
