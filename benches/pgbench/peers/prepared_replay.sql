-- A replay with PostgresStore::with_prepared_statements(true) and the default strategy, once
-- most claims find their key: a call of the read function, bound to a statement prepared once
-- per connection (run with -M prepared).
\set r random(0, :nkeys - 1)
SELECT * FROM tower_idempotency_plain_read('', 'replay-' || :r::text, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 1000);
