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
