-- The load harness's pg-tx baseline: the same payment row in a transaction of its own,
-- without idempotency.
BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
COMMIT;
