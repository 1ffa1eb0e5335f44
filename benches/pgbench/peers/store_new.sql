-- A first request as PostgresStore sends it by default (ClaimStrategy::Adaptive, while most
-- claims are first requests): the insert with a random token, then the completion that also
-- wakes waiters, each prepared once per connection with SQL PREPARE and run with EXECUTE over
-- the simple protocol behind the store's settings.
\set k random(1, 1000000000000)
\set token random(4611686018427387904, 9223372036854775807)
\if :prepared = 1
\else
PREPARE tower_idempotency_insert(text, text, bytea, bigint, bigint, bigint) AS INSERT INTO :schema.tower_idempotency_keys AS k (scope, key, fingerprint, lease_token, lease_expires_at, expires_at) VALUES ($1, $2, $3, $6, (:schema.tower_idempotency_now() OPERATOR(pg_catalog.+) ($4::pg_catalog.float8 OPERATOR(pg_catalog.*) interval '1 millisecond')), (:schema.tower_idempotency_now() OPERATOR(pg_catalog.+) ($5::pg_catalog.float8 OPERATOR(pg_catalog.*) interval '1 millisecond'))) ON CONFLICT (scope, key) DO NOTHING RETURNING k.lease_token AS inserted;
PREPARE tower_idempotency_complete(text, text, bigint, bigint, bigint, bytea, bytea, bigint) AS WITH done AS (UPDATE :schema.tower_idempotency_keys AS k SET lease_token = NULL, lease_expires_at = NULL, completed_at = :schema.tower_idempotency_now(), expires_at = (:schema.tower_idempotency_now() OPERATOR(pg_catalog.+) ($4::pg_catalog.float8 OPERATOR(pg_catalog.*) interval '1 millisecond')), response_status = $5, response_headers = $6, response_body = $7 WHERE k.scope OPERATOR(pg_catalog.=) $1 AND k.key OPERATOR(pg_catalog.=) $2 AND k.lease_token OPERATOR(pg_catalog.=) $3 RETURNING 1 AS changed), woken AS (SELECT pg_catalog.pg_notify('tower_idempotency', w.hash::pg_catalog.text) FROM :schema.tower_idempotency_waiting AS w WHERE w.hash OPERATOR(pg_catalog.=) $8 AND w.until OPERATOR(pg_catalog.>) :schema.tower_idempotency_now() AND EXISTS (SELECT FROM done)) SELECT d.changed FROM done AS d, (SELECT pg_catalog.count(*) FROM woken) AS n;
\set prepared 1
\endif
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SET LOCAL lock_timeout = 1000\; EXECUTE tower_idempotency_insert(E'', E'new-' || :k, pg_catalog.decode('2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881','hex'), 30000, 86400000, :token);
SET LOCAL transaction_isolation = 'read committed'\; SET LOCAL statement_timeout = 5000\; SET LOCAL lock_timeout = 1000\; SET LOCAL plan_cache_mode = force_generic_plan\; SET LOCAL enable_seqscan = off\; EXECUTE tower_idempotency_complete(E'', E'new-' || :k, :token, 86400000, 201, pg_catalog.decode('000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e','hex'), pg_catalog.decode('7b226964223a343731312c22737461747573223a2263726561746564222c227265636569766564223a313032347d','hex'), 4242);
