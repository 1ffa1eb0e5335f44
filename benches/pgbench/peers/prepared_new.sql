-- A first request with PostgresStore::with_prepared_statements(true) and the default strategy,
-- while most claims are first requests: calls of the insert and completion functions, bound to
-- statements prepared once per connection (run with -M prepared).
\set k random(1, 1000000000000)
SELECT tower_idempotency_plain_insert('', 'new-' || :k::text, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 30000, 86400000, 1000) AS inserted
\gset claim_
SELECT tower_idempotency_plain_complete('', 'new-' || :k::text, :claim_inserted, 86400000, 201::smallint, '\x000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, convert_to('{"id":4711,"status":"created","received":1024}', 'UTF8'), 1000, 4242);
