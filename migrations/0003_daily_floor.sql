-- The daily inbox's floor: the first day whose partition `DailyInbox` may still make and
-- record messages in. A day below it was dropped (or, below the first day ever made, never
-- held IDs that anything can tell from a dropped day's), so its messages are refused, never
-- applied again. Without it, a partition dropped past the retention was made again, empty,
-- when the retention was raised, when two instances with different retentions ran
-- `maintain`, or when the database's clock jumped ahead and back; the dropped day's messages
-- were then applied a second time.
--
-- One row. `maintain` only ever raises `first_day` (to the first day of its retention,
-- before it drops anything below it), and every delivery reads it in the statement that
-- records its ID. NULL: no floor yet.
CREATE TABLE tower_idempotency_daily_floor (
    only_row  boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    first_day date
);

-- A schema whose partitions were made (and perhaps dropped) before this table: the first day
-- it has is the floor, since every day below it was dropped or never made. The day is read
-- from each partition's lower bound (written and read back in the session's DateStyle); a
-- default partition, or one from MINVALUE, has none and is left out.
INSERT INTO tower_idempotency_daily_floor (first_day)
SELECT min(substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid)
                     FROM $$FROM \('([^']*)'\)$$)::date)
  FROM pg_catalog.pg_inherits AS i
  JOIN pg_catalog.pg_class AS c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'tower_idempotency_processed_messages_daily'::regclass;
