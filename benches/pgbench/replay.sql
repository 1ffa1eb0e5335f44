-- What the layer sends to replay a completed key (PostgresStore, ClaimStrategy::Combined,
-- the default): the store's CLAIM statement alone (src/store/postgres.rs, parameters
-- inlined); the record is found, so the insert function is not called. Keys replay-0 ..
-- replay-(nkeys-1) were completed by run.sh; pass -D nkeys=N.
\set r random(0, :nkeys - 1)
SELECT CASE WHEN scope IS NULL
            THEN tower_idempotency_insert_key('', ('replay-' || :r::text), '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, 30000, 86400000) END
           AS inserted,
       fingerprint, lease_token, expires_at <= now() AS expired,
       (expires_at <= now()
        OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea))
           AS claimable,
       (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       response_status, response_headers, response_body
  FROM (SELECT) AS one
  LEFT JOIN tower_idempotency_keys ON scope = '' AND key = ('replay-' || :r::text);
