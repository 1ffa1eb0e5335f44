-- tower-idempotency: recovery points for phased mode, and leased claims of messages.
--
-- Phased mode commits a keyed request's work in phases, each in a short transaction of its
-- own, and records each committed phase (its name and a small state) on the key's record, in
-- the same transaction. A request that takes the key over after the lease (the first one's
-- process died, or it answered 5xx after some phases) reads them back and resumes after the
-- last one. `phases` holds them, encoded by the crate (a list of name and state pairs); it
-- is NULL on a record without phases and on every completed record.
--
-- A takeover of an abandoned record (same fingerprint, lease run out) is a resume: it keeps
-- the phases. A takeover of an expired record is a new claim: the request is treated as new,
-- so the phases of the request before it must not be resumed. The takeover function is
-- rewritten from its definition as it stands with that one change; its settings are kept.

ALTER TABLE tower_idempotency_keys ADD COLUMN phases bytea;

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
        'THEN k.phases END,');
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
