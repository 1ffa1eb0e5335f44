-- A replay as PostgresStore sends it with ClaimStrategy::ReadFirst: the read, prepared once
-- per connection with SQL PREPARE (the store names it by a digest of its text), then run with
-- EXECUTE over the simple protocol behind the store's settings.
\set r random(0, :nkeys - 1)
\if :prepared = 1
\else
PREPARE tower_idempotency_read(text, text, bytea) AS SELECT k.fingerprint, k.lease_token, k.expires_at <= tower_idempotency_now() AS expired, (k.expires_at <= tower_idempotency_now() OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now() AND k.fingerprint = $3)) AS claimable, (extract(epoch FROM k.lease_expires_at - tower_idempotency_now()) * 1000)::bigint AS lease_left_ms, k.response_status, k.response_headers, k.response_body FROM tower_idempotency_keys AS k WHERE k.scope = $1 AND k.key = $2;
\set prepared 1
\endif
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL search_path = pg_catalog, :schema, pg_temp\; SET LOCAL statement_timeout = 5000\; SET LOCAL plan_cache_mode = force_generic_plan\; SET LOCAL enable_seqscan = off\; EXECUTE tower_idempotency_read(E'', E'replay-' || :r, decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'));
