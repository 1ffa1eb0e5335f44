-- tx_insert.sql with the wake-up transactional mode sends after its COMMIT, in the same
-- message: the key's waiters looked for in a READ COMMITTED transaction of its own (no
-- waiter registered: no NOTIFY). Against tx_insert.sql, what looking after the commit adds.
-- Run with -M simple.
\set k random(1, 1000000000000)
BEGIN;
INSERT INTO payments (order_id, amount_cents, currency) VALUES (4711, 1999, 'EUR') RETURNING id;
COMMIT \; BEGIN ISOLATION LEVEL READ COMMITTED \; SELECT tower_idempotency_wake(:k) \; COMMIT;
