-- A replay with ClaimStrategy::Combined: the claim function, called over the simple protocol.
\set r random(0, :nkeys - 1)
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SELECT * FROM tower_idempotency_plain_claim(E'', E'replay-' || :r, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'), 30000, 86400000, 1000);
