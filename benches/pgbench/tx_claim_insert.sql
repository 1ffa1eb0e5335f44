-- Decomposing pg-tx: tx_claim_insert_complete.sql without the completion INSERT (the claim
-- with BEGIN, the payment INSERT, COMMIT): what the claim alone adds. Run with -M simple.
\set k random(1, 1000000000000)
\set lk random(1, 9000000000000000000)
SELECT tower_idempotency_claim_in_tx(:lk, E'', E'' || :k, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex')) \; BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
COMMIT;
