-- A replay with the same bounds, over the extended protocol in one flight (unnamed statements,
-- pooler-safe): SET LOCAL has no transaction block there, so the bounds take an explicit one.
\set r random(0, :nkeys - 1)
\startpipeline
BEGIN ISOLATION LEVEL READ COMMITTED;
SELECT set_config('statement_timeout', '5000', true);
SELECT * FROM tower_idempotency_plain_claim('', 'replay-' || :r, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 30000, 86400000, 1000);
COMMIT;
\endpipeline
