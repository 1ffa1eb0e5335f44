-- tower-idempotency: plain mode's claim and completion, each one function doing one thing.
--
-- The store sends every statement over the simple query protocol, so each request pays the
-- server's per-statement work (parse, plan, portal) twice; what the functions do inside is
-- the rest of the database's time, and it is kept to the least:
--
-- * The claim reads the record by its key into the function's result and, only when the key
--   is absent, inserts it, in the same function: no nested call, no set-returning function
--   (it returns one row), and the lock bound is set only on the path that can wait for a lock
--   (the insert waits for a concurrent insert of the same key to commit or roll back).
-- * The completion stores the answer and, when its key's waiters registered the key's hash,
--   notifies them, in one function: every nested call would set and restore its own
--   settings on entry and return.
--
-- The lock bound is a local setting (`set_config(…, true)`) that ends with the statement's
-- transaction: the store runs these functions alone in a message of their own, never inside a
-- caller's transaction, so they no longer carry a `lock_timeout` setting of their own to put
-- the caller's back on return. Each keeps the settings that make its lookups by key whatever
-- the statistics say (`enable_seqscan = off`) and its names resolved in its own schema
-- (`search_path = pg_catalog, <schema>, pg_temp`), and reads the time through
-- tower_idempotency_now().
--
-- The claim's result is one row, read with `SELECT * FROM tower_idempotency_plain_claim(…)`.

DROP FUNCTION tower_idempotency_plain_claim(text, text, bytea, bigint, bigint, bigint);

CREATE FUNCTION tower_idempotency_plain_claim(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint,
    OUT inserted bigint, OUT fingerprint bytea, OUT lease_token bigint, OUT expired boolean,
    OUT claimable boolean, OUT lease_left_ms bigint, OUT response_status smallint,
    OUT response_headers bytea, OUT response_body bytea)
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    t timestamptz := tower_idempotency_now();
    record_expires timestamptz;
    lease_expires timestamptz;
    ignored text;
BEGIN
    SELECT k.fingerprint, k.lease_token, k.expires_at, k.lease_expires_at,
           k.response_status, k.response_headers, k.response_body
      INTO fingerprint, lease_token, record_expires, lease_expires,
           response_status, response_headers, response_body
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        ignored := set_config('lock_timeout', p_lock_ms::text, true);
        INSERT INTO tower_idempotency_keys AS k
               (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
        VALUES (p_scope, p_key, p_fingerprint, nextval('tower_idempotency_lease_token_seq'),
                t + p_lease_ms::float8 * interval '1 millisecond',
                t + p_ttl_ms::float8 * interval '1 millisecond')
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING k.lease_token INTO inserted;
        RETURN;
    END IF;
    expired := record_expires <= t;
    claimable := expired
        OR (lease_token IS NOT NULL AND lease_expires <= t AND fingerprint = p_fingerprint);
    lease_left_ms := (extract(epoch FROM lease_expires - t) * 1000)::bigint;
END
$$;

CREATE OR REPLACE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint, p_wake bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    changed bigint;
    ignored text := set_config('lock_timeout', p_lock_ms::text, true);
BEGIN
    UPDATE tower_idempotency_keys
       SET lease_token = NULL, lease_expires_at = NULL, completed_at = tower_idempotency_now(),
           expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed > 0 AND p_wake IS NOT NULL AND EXISTS (
        SELECT 1 FROM tower_idempotency_waiting
         WHERE hash = p_wake AND until > tower_idempotency_now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_wake::text);
    END IF;
    RETURN changed;
END
$$;

-- Without notifications (PostgresStore::with_notifications(false)) the store completes
-- through this one, which wakes nobody.
CREATE OR REPLACE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint)
RETURNS bigint
LANGUAGE sql VOLATILE
AS $$
    SELECT tower_idempotency_plain_complete(
        p_scope, p_key, p_token, p_ttl_ms, p_status, p_headers, p_body, p_lock_ms, NULL)
$$;

DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'tower_idempotency_plain_claim(text, text, bytea, bigint, bigint, bigint)',
        'tower_idempotency_plain_complete(text, text, bigint, bigint, smallint, bytea, bytea, bigint)',
        'tower_idempotency_plain_complete(text, text, bigint, bigint, smallint, bytea, bytea, bigint, bigint)']
    LOOP
        f := pg_catalog.format('%I.%s', pg_catalog.current_schema(), f);
        EXECUTE pg_catalog.format('ALTER FUNCTION %s RESET ALL', f);
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET enable_seqscan = off', f);
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f, pg_catalog.current_schema());
    END LOOP;
END
$$;
