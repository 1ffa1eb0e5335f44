-- A replay as PostgresStore sends it by default (ClaimStrategy::Adaptive, once most claims
-- find their key): the read, prepared once per connection with SQL PREPARE (the store names
-- it by a digest of its text, its schema written in), run with EXECUTE over the simple
-- protocol behind the store's settings.
\set r random(0, :nkeys - 1)
\if :prepared = 1
\else
PREPARE tower_idempotency_read(text, text, bytea) AS SELECT k.fingerprint, k.lease_token, k.expires_at OPERATOR(pg_catalog.<=) :schema.tower_idempotency_now() AS expired, (k.expires_at OPERATOR(pg_catalog.<=) :schema.tower_idempotency_now() OR (k.lease_token IS NOT NULL AND k.lease_expires_at OPERATOR(pg_catalog.<=) :schema.tower_idempotency_now() AND k.fingerprint OPERATOR(pg_catalog.=) $3)) AS claimable, (pg_catalog.date_part('epoch', k.lease_expires_at OPERATOR(pg_catalog.-) :schema.tower_idempotency_now()) OPERATOR(pg_catalog.*) 1000)::pg_catalog.int8 AS lease_left_ms, k.response_status, k.response_headers, k.response_body FROM :schema.tower_idempotency_keys AS k WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2;
\set prepared 1
\endif
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SET LOCAL plan_cache_mode = force_generic_plan\; SET LOCAL enable_seqscan = off\; EXECUTE tower_idempotency_read(E'', E'replay-' || :r, pg_catalog.decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'));
