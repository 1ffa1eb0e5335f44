-- What the layer sends to replay a completed key (PostgresStore, ClaimStrategy::Combined,
-- the default): the store's CLAIM statement alone (src/store/postgres.rs, parameters
-- inlined); its insert part finds nothing to do. Keys replay-0 .. replay-(nkeys-1) were
-- completed by run.sh; pass -D nkeys=N.
\set r random(0, :nkeys - 1)
WITH cur AS (
    SELECT fingerprint, lease_token, expires_at <= now() AS expired,
           (expires_at <= now()
            OR (lease_token IS NOT NULL AND lease_expires_at <= now() AND fingerprint = '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea))
               AS claimable,
           (extract(epoch FROM lease_expires_at - now()) * 1000)::bigint AS lease_left_ms,
           response_status, response_headers, response_body
      FROM tower_idempotency_keys
     WHERE scope = '' AND key = ('replay-' || :r::text)
),
ins AS (
    INSERT INTO tower_idempotency_keys AS k
           (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
    SELECT '', ('replay-' || :r::text), '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, nextval('tower_idempotency_lease_token_seq'),
           now() + 30000::float8 * interval '1 millisecond',
           now() + 86400000::float8 * interval '1 millisecond'
     WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.lease_token
)
SELECT ins.lease_token AS inserted,
       cur.fingerprint, cur.lease_token, cur.expired, cur.claimable, cur.lease_left_ms,
       cur.response_status, cur.response_headers, cur.response_body
  FROM (SELECT 1) AS one
  LEFT JOIN ins ON true
  LEFT JOIN cur ON true;
