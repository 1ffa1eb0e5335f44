-- Decomposing pg-tx: tx_claim_insert_complete.sql without the claim (BEGIN, the payment
-- INSERT, the completion INSERT with COMMIT): what the completion alone adds. Run with
-- -M simple.
\set k random(1, 1000000000000)
BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
INSERT INTO tower_idempotency_keys (scope, key, fingerprint, expires_at, completed_at, response_status, response_headers, response_body) VALUES (E'', E'' || :k, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'), now()+86400000*interval '1 millisecond', now(), 201, decode('000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e','hex'), decode('7b227061796d656e745f6964223a343731312c22737461747573223a2263726561746564222c227265636569766564223a313032347d','hex')) \; COMMIT;
