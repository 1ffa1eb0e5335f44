-- A first request as PostgresStore sends it by default (simple protocol, values written in,
-- the store's bounds in front): the claim, then the completion that also wakes waiters.
\set k random(1, 1000000000000)
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SELECT * FROM tower_idempotency_plain_claim(E'', E'new-' || :k, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'), 30000, 86400000, 1000)
\gset claim_
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SELECT tower_idempotency_plain_complete(E'', E'new-' || :k, :claim_inserted, 86400000, 201::smallint, decode('000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e','hex'), decode('7b226964223a343731312c22737461747573223a2263726561746564222c227265636569766564223a313032347d','hex'), 1000, 4242);
