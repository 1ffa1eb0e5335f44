-- The load harness's pg-replay baseline, by hand: one SELECT of the completed record.
-- Pass -D nkeys=N (the number of keys run.sh completed).
\set r random(0, :nkeys - 1)
SELECT fingerprint, lease_token, expires_at <= now() AS expired,
       response_status, response_headers, response_body
  FROM tower_idempotency_keys
 WHERE scope = '' AND key = ('replay-' || :r::text);
