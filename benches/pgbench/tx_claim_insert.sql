-- Decomposing pg-tx: tx_claim_insert_complete.sql without the completion INSERT (BEGIN, the
-- claim statement, the payment INSERT, COMMIT): what the claim alone adds.
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
COMMIT;
