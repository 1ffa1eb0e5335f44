-- Phased mode's step and last-phase statements, again, with two changes.
--
-- * A step's record moves the record's life (expires_at) to at least its lease's end, as a
--   renewal does. The record must never count as expired while its lease holds: a record past
--   expires_at is taken over as a new request, its recovery points dropped, and the purge
--   deletes it, so the steps committed before would run again.
-- * Both count from the statement's time on the store's clock, not from the transaction's
--   start: a step that ran longer than its lease would otherwise commit a lease already over,
--   and a last phase longer than the TTL an answer already expired. (The clock hook is the
--   transaction's start by default; the transaction's age is added to it.)

CREATE OR REPLACE FUNCTION tower_idempotency_phase_record(
    p_scope text, p_key text, p_token bigint, p_phases bytea, p_lease_ms bigint, p_row tid,
    p_request bytea)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    t timestamptz := tower_idempotency_now() + (pg_catalog.statement_timestamp() - pg_catalog.now());
    lease_end timestamptz := t + p_lease_ms::float8 * interval '1 millisecond';
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = lease_end, expires_at = greatest(k.expires_at, lease_end)
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = lease_end, expires_at = greatest(k.expires_at, lease_end)
         WHERE k.ctid = p_row AND k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency key is no longer held by this request'
            USING ERRCODE = 'TI001';
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION tower_idempotency_phase_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_row tid, p_wake bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    t timestamptz := tower_idempotency_now() + (pg_catalog.statement_timestamp() - pg_catalog.now());
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = t,
               expires_at = t + p_ttl_ms::float8 * interval '1 millisecond',
               response_status = p_status, response_headers = p_headers, response_body = p_body
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = t,
               expires_at = t + p_ttl_ms::float8 * interval '1 millisecond',
               response_status = p_status, response_headers = p_headers, response_body = p_body
         WHERE k.ctid = p_row AND k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency key is no longer held by this request'
            USING ERRCODE = 'TI001';
    END IF;
    PERFORM tower_idempotency_wake(p_wake);
END
$$;

-- CREATE OR REPLACE drops a function's settings: the search_path of the functions replaced
-- here is set again, as the schema's first migration sets every function's.
DO $$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid
          FROM pg_catalog.pg_proc AS p
          JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = pg_catalog.current_schema()
           AND p.proname IN ('tower_idempotency_phase_record', 'tower_idempotency_phase_complete')
    LOOP
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f, pg_catalog.current_schema());
    END LOOP;
END
$$;
