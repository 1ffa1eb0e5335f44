-- The load harness's pg-replay baseline, by hand: the store's READ statement, one plain
-- SELECT of the completed record (src/store/postgres.rs, parameters inlined). It is also all
-- that ClaimStrategy::ReadFirst sends for a replay. Pass -D nkeys=N (the number of keys
-- run.sh completed).
\set r random(0, :nkeys - 1)
SELECT fingerprint, lease_token, expires_at <= now() AS expired,
       (expires_at <= now()
        OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea))
           AS claimable,
       (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
       response_status, response_headers, response_body
  FROM tower_idempotency_keys
 WHERE scope = '' AND key = ('replay-' || :r::text);
