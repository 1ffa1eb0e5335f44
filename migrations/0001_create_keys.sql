-- tower-idempotency: one record per (scope, key).
--
-- A record is in progress while lease_token is set (a request holds it until
-- lease_expires_at), and completed once response_status is set. Every record
-- counts as absent after expires_at; purge_expired() deletes it later.
-- All times come from the database clock (now()), never from the application.

CREATE SEQUENCE tower_idempotency_lease_token_seq AS bigint;

CREATE TABLE tower_idempotency_keys (
    scope            text        NOT NULL,
    key              text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    lease_token      bigint,
    lease_expires_at timestamptz,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    response_status  smallint,
    response_headers bytea,
    -- NULL on a completed record whose body was larger than the storage limit.
    response_body    bytea,
    PRIMARY KEY (scope, key),
    CONSTRAINT tower_idempotency_keys_state CHECK (
        (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND response_status IS NULL)
        OR (lease_token IS NULL AND response_status IS NOT NULL AND response_headers IS NOT NULL)
    )
);

CREATE INDEX tower_idempotency_keys_expires_at ON tower_idempotency_keys (expires_at);
