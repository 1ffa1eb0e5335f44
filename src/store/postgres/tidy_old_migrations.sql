-- tower-idempotency: brings a schema made by the thirteen migrations that
-- migrations/0001_schema.sql replaces to exactly the schema that file makes.
--
-- migrate() runs this once, in its transaction and under its lock, when the history table
-- records those thirteen with their checksums, and records 0001 in their place. Such a schema
-- already has every table, column, constraint, index and sequence of 0001, every one of its
-- functions with the same body but one, and their settings; it differs only in what follows.
-- tests/migrations.rs compares the two catalogs.

-- A function that nothing calls.
DROP FUNCTION tower_idempotency_claim_in_tx(bigint, text, text, bytea);

-- The takeover: the same statement, with the two assignments of the phases and the request on
-- lines of their own. (CREATE OR REPLACE keeps the function's owner and privileges, and sets
-- its settings to these; search_path is set below.)
CREATE OR REPLACE FUNCTION tower_idempotency_plain_takeover(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
SET enable_seqscan = off
AS $$
DECLARE
    token bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys AS k
       SET fingerprint = p_fingerprint,
           lease_token = nextval('tower_idempotency_lease_token_seq'),
           lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond',
           expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
           created_at = tower_idempotency_now(), completed_at = NULL,
           phases = CASE WHEN k.expires_at > tower_idempotency_now() THEN k.phases END,
           request = CASE WHEN k.expires_at > tower_idempotency_now() THEN k.request END,
           response_status = NULL, response_headers = NULL, response_body = NULL
     WHERE k.scope = p_scope AND k.key = p_key
       AND (k.expires_at <= tower_idempotency_now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now()
                AND k.fingerprint = p_fingerprint))
    RETURNING k.lease_token INTO token;
    RETURN token;
END
$$;

-- search_path as the last of each function's settings, as 0001 sets it: the phase functions
-- have it first, the takeover above has none yet. (The settings are the same either way; their
-- order is what the catalog shows.)
DO $$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid
          FROM pg_catalog.pg_proc AS p
          JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = pg_catalog.current_schema()
           AND p.proname LIKE 'tower\_idempotency\_%'
           AND p.proname <> 'tower_idempotency_now'
    LOOP
        EXECUTE pg_catalog.format('ALTER FUNCTION %s RESET search_path', f);
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f, pg_catalog.current_schema());
    END LOOP;
END
$$;
