-- What the layer sends for a request with a new key (PostgresStore, plain mode,
-- ClaimStrategy::Combined, the default): the store's CLAIM statement, then its COMPLETE
-- statement, copied from src/store/postgres.rs. Parameters: scope '' (no scope function),
-- key :k, fingerprint FP (32 bytes), lease 30 s, TTL 24 h; the answer is 201 with one header
-- and a small JSON body.
\set k random(1, 1000000000000)
SELECT CASE WHEN scope IS NULL
            THEN tower_idempotency_insert_key('', :k::text, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 30000, 86400000) END
           AS inserted,
       fingerprint, lease_token, expires_at <= now() AS expired,
       (expires_at <= now()
        OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea))
           AS claimable,
       (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       response_status, response_headers, response_body
  FROM (SELECT) AS one
  LEFT JOIN tower_idempotency_keys ON scope = '' AND key = :k::text
\gset claim_
UPDATE tower_idempotency_keys
   SET lease_token = NULL, lease_expires_at = NULL, completed_at = now(),
       expires_at = now() + 86400000::float8 * interval '1 millisecond',
       response_status = 201, response_headers = '\x000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea,
       response_body = convert_to('{"id":4711,"status":"created","received":1024}', 'UTF8')
 WHERE scope = '' AND key = :k::text AND lease_token = :claim_inserted;
