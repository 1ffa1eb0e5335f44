-- Decomposing pg-tx: tx_claim_insert_complete.sql without the claim statement (BEGIN, the
-- payment INSERT, the completion INSERT, COMMIT): what the completion alone adds.
\set k random(1, 1000000000000)
\set lk random(1, 9000000000000000000)
BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
INSERT INTO tower_idempotency_keys AS k
       (scope, key, fingerprint, expires_at, completed_at,
        response_status, response_headers, response_body)
VALUES ('', :k::text, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea,
        now() + 86400000::float8 * interval '1 millisecond', now(), 201,
        '\x000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
        convert_to('{"payment_id":4711,"status":"created","received":1024}', 'UTF8'))
ON CONFLICT (scope, key) DO UPDATE
   SET fingerprint = EXCLUDED.fingerprint, lease_token = NULL, lease_expires_at = NULL,
       expires_at = EXCLUDED.expires_at, created_at = now(), completed_at = now(),
       response_status = EXCLUDED.response_status,
       response_headers = EXCLUDED.response_headers,
       response_body = EXCLUDED.response_body
 WHERE k.expires_at <= now()
    OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= now());
COMMIT;
