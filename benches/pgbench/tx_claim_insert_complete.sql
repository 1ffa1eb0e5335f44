-- What the layer sends for a request with a new key in transactional mode (the pg-tx
-- scenario), message by message (run with -M simple, as the layer sends its batches):
-- the claim with BEGIN, the handler's payment INSERT, the completion with COMMIT (and the
-- BEGIN of the empty transaction that sqlx rolls back as the connection returns to the pool),
-- then that ROLLBACK. The batches are copied from src/transactional.rs (claim_batch,
-- completion_batch). Parameters: scope '' (no scope function), key :k, lock id :lk (the
-- layer hashes scope and key into it), fingerprint FP (32 bytes), TTL 24 h; the answer is
-- 201 with one header and a small JSON body.
\set k random(1, 1000000000000)
\set lk random(1, 9000000000000000000)
SELECT tower_idempotency_claim_in_tx(:lk, E'', E'' || :k, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex')) \; BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
INSERT INTO tower_idempotency_keys (scope, key, fingerprint, expires_at, completed_at, response_status, response_headers, response_body) VALUES (E'', E'' || :k, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'), now()+86400000*interval '1 millisecond', now(), 201, decode('000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e','hex'), decode('7b227061796d656e745f6964223a343731312c22737461747573223a2263726561746564222c227265636569766564223a313032347d','hex')) \; COMMIT \; BEGIN;
ROLLBACK;
