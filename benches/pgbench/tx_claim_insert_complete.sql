-- What the layer sends for a request with a new key in transactional mode (the pg-tx
-- scenario): BEGIN, the claim statement (advisory lock + lookup), the handler's payment
-- INSERT, the completion INSERT, COMMIT. The claim and completion are copied from
-- src/transactional.rs (TX_CLAIM, TX_COMPLETE). Parameters: scope '' (no scope function),
-- key :k, lock id :lk (the layer hashes scope and key into it), fingerprint FP (32 bytes),
-- TTL 24 h; the answer is 201 with one header and a small JSON body.
\set k random(1, 1000000000000)
\set lk random(1, 9000000000000000000)
BEGIN;
SELECT pg_try_advisory_xact_lock(:lk::bigint # 'tower_idempotency_keys'::regclass::oid::bigint) AS locked,
       k.fingerprint, k.lease_token,
       (extract(epoch FROM k.lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       k.response_status, k.response_headers, k.response_body
  FROM (SELECT 1) AS one
  LEFT JOIN tower_idempotency_keys AS k
         ON k.scope = '' AND k.key = :k::text AND k.expires_at > now();
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
