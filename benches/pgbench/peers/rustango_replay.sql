-- rustango 0.62's DatabaseCache on a replay: its one lookup by key (LIMIT 1), as sqlx sends
-- it (prepared), against a table shaped like its cache table.
\set r random(0, :nkeys - 1)
SELECT value, expires FROM rustango_cache WHERE cache_key = 'idem_replay-' || :r::text LIMIT 1;
