-- tower-idempotency: what a message consumer keeps besides the IDs it processed.
--
-- Positions: the last applied position (a producer's per-entity sequence, a stream sequence,
-- a partition's offset) of each ordering key of a consumer. The work's transaction moves it
-- forward together with the work's writes, and only forward: a message at or below it is
-- stale and its work never runs. Where the broker orders a partition, its position alone says
-- where to resume, in one row per partition.
CREATE TABLE tower_idempotency_positions (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    position     bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    PRIMARY KEY (consumer, key)
);

-- Failed attempts of a message's work: how many, and the last one's reason. A message whose
-- work failed as often as the consumer allows is parked (`parked_at`, with its payload when
-- the consumer gives it): its ID is recorded as processed in the same transaction, so it is
-- acknowledged and never applied; the parked rows are the consumer's dead letters.
CREATE TABLE tower_idempotency_message_failures (
    consumer        text        NOT NULL,
    message_id      text        NOT NULL,
    attempts        integer     NOT NULL CHECK (attempts > 0),
    reason          text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    last_failed_at  timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    parked_at       timestamptz,
    payload         bytea,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX tower_idempotency_message_failures_parked
    ON tower_idempotency_message_failures (consumer, parked_at)
    WHERE parked_at IS NOT NULL;

-- The inbox in daily partitions (`DailyInbox`), for retention by dropping a day's partition
-- instead of deleting its rows. A partitioned table's unique key must include the partition
-- key, so it is unique within a day only; `day` is therefore a function of the message, not
-- of the time it is processed: the UTC day the producer first sent the logical message, which
-- every delivery and every republish of it carries. All deliveries of a message thus land in
-- one partition, where the primary key catches each duplicate as the unpartitioned table's
-- does. A message whose day has no partition (older than the retention, or too far ahead) is
-- refused, never applied. The partitions are created ahead and dropped by the crate.
CREATE TABLE tower_idempotency_processed_messages_daily (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    day          date        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    PRIMARY KEY (consumer, message_id, day)
) PARTITION BY RANGE (day);

-- Records a message's ID for `Inbox::process`, in the work's transaction, waiting at most
-- p_lock_ms for a concurrent delivery of the same message (the only wait: an insert of the
-- same ID by a transaction still open); the caller's lock_timeout is put back after. True when
-- the ID is new. One call, planned once per session: the bound and the insert as separate
-- statements would be four, each parsed on every delivery.
CREATE FUNCTION tower_idempotency_record_message(
    p_consumer text, p_message_id text, p_lock_ms bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved text := pg_catalog.current_setting('lock_timeout');
    inserted bigint;
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_ms::text || 'ms', true);
    INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
    RETURN inserted = 1;
END
$$;

DO $$
BEGIN
    EXECUTE pg_catalog.format(
        'ALTER FUNCTION %I.tower_idempotency_record_message(text, text, bigint) '
        'SET search_path = pg_catalog, %I, pg_temp',
        pg_catalog.current_schema(), pg_catalog.current_schema());
END
$$;

-- As tower_idempotency_record_message, for a message at p_position of the ordering key p_key:
-- when the ID is new, the key's position moves to p_position in the same call, if it is below
-- it (the key's row is locked either way). 0: the ID was recorded before; 1: recorded, and
-- the position moved; 2: recorded, and the message is stale (at or below the position).
CREATE FUNCTION tower_idempotency_record_message(
    p_consumer text, p_message_id text, p_lock_ms bigint, p_key text, p_position bigint)
RETURNS smallint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved text := pg_catalog.current_setting('lock_timeout');
    seen_before CONSTANT smallint := 0;
    changed bigint;
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_ms::text || 'ms', true);
    INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed = 0 THEN
        PERFORM pg_catalog.set_config('lock_timeout', saved, true);
        RETURN seen_before;
    END IF;
    INSERT INTO tower_idempotency_positions AS p (consumer, key, position)
    VALUES (p_consumer, p_key, p_position)
    ON CONFLICT (consumer, key) DO UPDATE
       SET position = EXCLUDED.position, updated_at = tower_idempotency_now()
     WHERE p.position < EXCLUDED.position;
    GET DIAGNOSTICS changed = ROW_COUNT;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
    RETURN CASE WHEN changed = 1 THEN 1 ELSE 2 END;
END
$$;

DO $$
BEGIN
    EXECUTE pg_catalog.format(
        'ALTER FUNCTION %I.tower_idempotency_record_message(text, text, bigint, text, bigint) '
        'SET search_path = pg_catalog, %I, pg_temp',
        pg_catalog.current_schema(), pg_catalog.current_schema());
END
$$;
