-- cratestack-sqlx 0.8's SqlxIdempotencyStore on a new key as sqlx sends it (prepared, values
-- bound; run with -M prepared): its reserve upsert, then its complete UPDATE, copied from its
-- source.
\set k random(1, 1000000000000)
INSERT INTO cratestack_idempotency (principal_fingerprint, key, request_hash, reservation_id, expires_at) VALUES ('fp', 'new-' || :k::text, '\x2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881'::bytea, gen_random_uuid(), now() + interval '1 day') ON CONFLICT (principal_fingerprint, key) DO UPDATE SET request_hash = EXCLUDED.request_hash, reservation_id = EXCLUDED.reservation_id, response_status = NULL, response_headers = NULL, response_body = NULL, created_at = NOW(), expires_at = EXCLUDED.expires_at WHERE cratestack_idempotency.expires_at <= NOW() RETURNING request_hash, reservation_id, response_status, response_headers, response_body, created_at, expires_at, (xmax = 0) AS was_inserted, reservation_id::text AS rid
\gset r_
UPDATE cratestack_idempotency SET response_status = 201, response_headers = '\x000c636f6e74656e742d74797065000000106170706c69636174696f6e2f6a736f6e'::bytea, response_body = convert_to('{"id":4711,"status":"created","received":1024}', 'UTF8') WHERE principal_fingerprint = 'fp' AND key = 'new-' || :k::text AND reservation_id = :r_rid::uuid AND response_body IS NULL;
