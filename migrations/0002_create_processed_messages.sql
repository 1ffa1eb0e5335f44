-- tower-idempotency inbox: one row per message a consumer has processed.
-- The row is inserted in the same transaction as the consumer's work, so a message
-- is recorded as processed exactly when its work is committed.

CREATE TABLE tower_idempotency_processed_messages (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX tower_idempotency_processed_messages_processed_at
    ON tower_idempotency_processed_messages (processed_at);
