-- tower-idempotency: recovery points for phased mode, and leased claims of messages.
--
-- Phased mode commits a keyed request's work in phases, each in a short transaction of its
-- own, and records each committed phase (its name and a small state) on the key's record, in
-- the same transaction. A request that takes the key over after the lease (the first one's
-- process died, or it answered 5xx after some phases) reads them back and resumes after the
-- last one. `phases` holds them, encoded by the crate (a list of name and state pairs); it
-- is NULL on a record without phases and on every completed record. `request` keeps, when
-- the layer is asked to (`Phased::with_resumable_requests`), the request itself, written with
-- its first phase, so that a completer can run it again when no retry comes; NULL otherwise
-- and once completed. The partial index finds the records a completer looks for.
--
-- A takeover of an abandoned record (same fingerprint, lease run out) is a resume: it keeps
-- the phases. A takeover of an expired record is a new claim: the request is treated as new,
-- so the phases of the request before it must not be resumed. The takeover function is
-- rewritten from its definition as it stands with that one change; its settings are kept.

ALTER TABLE tower_idempotency_keys ADD COLUMN phases bytea, ADD COLUMN request bytea;

CREATE INDEX tower_idempotency_keys_phased ON tower_idempotency_keys (lease_expires_at)
    WHERE phases IS NOT NULL;

DO $$
DECLARE
    definition text;
    changed text;
BEGIN
    definition := pg_catalog.pg_get_functiondef(pg_catalog.to_regprocedure(pg_catalog.format(
        '%I.tower_idempotency_plain_takeover(text, text, bytea, bigint, bigint, bigint)',
        pg_catalog.current_schema())));
    changed := pg_catalog.replace(definition, 'completed_at = NULL,',
        'completed_at = NULL, phases = CASE WHEN k.expires_at > tower_idempotency_now() '
        'THEN k.phases END, request = CASE WHEN k.expires_at > tower_idempotency_now() '
        'THEN k.request END,');
    IF changed = definition THEN
        RAISE EXCEPTION 'tower_idempotency_plain_takeover has an unexpected definition';
    END IF;
    EXECUTE changed;
END
$$;

-- A message claimed with a lease (`Inbox::claim`): its row is in the processed-messages table
-- from the claim on, with the claim's token and the lease's end, so that a redelivery while
-- the work runs is told the message is in progress. The work's commit clears both: a row
-- without a token is a processed message.
ALTER TABLE tower_idempotency_processed_messages
    ADD COLUMN lease_token bigint,
    ADD COLUMN lease_expires_at timestamptz,
    ADD CONSTRAINT tower_idempotency_processed_messages_lease
        CHECK ((lease_token IS NULL) = (lease_expires_at IS NULL));

-- A phase's statements on the key's record, each while the claim's token holds it: they
-- raise SQLSTATE TI001 when it does not (the lease was lost to another request), so that the
-- phase's transaction cannot commit its writes without them. `p_row` is the record's row id
-- when the caller found it beforehand (under SERIALIZABLE a lookup through the primary key
-- would predicate-lock an index page, which other keys' phases then conflict with); NULL
-- looks it up by key.

-- Records the phases committed so far (all of them, encoded by the crate), and the request
-- when given, and extends the lease to p_lease_ms from now.
CREATE FUNCTION tower_idempotency_phase_record(
    p_scope text, p_key text, p_token bigint, p_phases bytea, p_lease_ms bigint, p_row tid,
    p_request bytea)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond'
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond'
         WHERE k.ctid = p_row AND k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency key is no longer held by this request'
            USING ERRCODE = 'TI001';
    END IF;
END
$$;

-- Whether the token still holds the record: the look a phase opens with.
CREATE FUNCTION tower_idempotency_phase_held(p_scope text, p_key text, p_token bigint)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT EXISTS (SELECT FROM tower_idempotency_keys AS k
                    WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token)
$$;

-- Stores the answer: the record becomes completed, its phases dropped, living p_ttl_ms; then
-- wakes the key's waiters (p_wake, the key's hash; NULL: none to wake here).
CREATE FUNCTION tower_idempotency_phase_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_row tid, p_wake bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = tower_idempotency_now(),
               expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
               response_status = p_status, response_headers = p_headers, response_body = p_body
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = tower_idempotency_now(),
               expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
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

-- As every function of the store: its names resolve in its own schema, and lookups by key
-- use the primary key whatever the statistics say.
DO $$
DECLARE
    f text;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'tower_idempotency_phase_record(text, text, bigint, bytea, bigint, tid, bytea)',
        'tower_idempotency_phase_held(text, text, bigint)',
        'tower_idempotency_phase_complete(text, text, bigint, bigint, smallint, bytea, bytea, tid, bigint)']
    LOOP
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f, pg_catalog.current_schema());
        EXECUTE pg_catalog.format('ALTER FUNCTION %s SET enable_seqscan = off', f);
    END LOOP;
END
$$;
