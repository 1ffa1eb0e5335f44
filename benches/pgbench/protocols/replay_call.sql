-- A replay: plain mode's claim of a completed key (PostgresStore's CLAIM, a call of migration
-- 6's function), with nothing around it. protocols.sh sends it prepared, extended (unnamed,
-- one flight) and simple.
\set r random(0, :nkeys - 1)
SELECT * FROM tower_idempotency_plain_claim('', 'replay-' || :r, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 30000, 86400000, 1000);
