-- tower-idempotency: the store's functions resolve names in their own schema, whatever the
-- caller's search_path.
--
-- A function's statements resolve unqualified names (its tables, now(),
-- pg_try_advisory_xact_lock) through the search_path in force when it runs: the caller's. An
-- application schema ahead on that path, with a table named like the store's or (named before
-- pg_catalog) its own now(), would silently change where records go and what leases, fences
-- and expiry mean. Each function of the store now runs with
--     search_path = pg_catalog, <the schema it lives in>, pg_temp
-- built-ins first, then the store's own tables, temporary tables last (where they cannot stand
-- in for the store's).
--
-- The store reads the time through tower_idempotency_now(), one function in its schema that
-- returns pg_catalog.now(). Each function calls it instead of now(), as do the store's own
-- statements, so a test can move the store's clock by replacing that one function, without
-- shadowing pg_catalog. The bodies are rewritten from their definitions as they stand, now()
-- for tower_idempotency_now(), nothing else changed; their settings (enable_seqscan) are kept.
-- tests/postgres.rs::functions_ignore_an_application_schema_ahead_on_the_search_path checks it.

CREATE FUNCTION tower_idempotency_now()
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT pg_catalog.now()';

DO $$
DECLARE
    f record;
BEGIN
    FOR f IN
        SELECT p.oid::pg_catalog.regprocedure AS signature,
               pg_catalog.pg_get_functiondef(p.oid) AS definition
          FROM pg_catalog.pg_proc AS p
          JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = pg_catalog.current_schema()
           AND p.proname LIKE 'tower\_idempotency\_%'
           AND p.proname <> 'tower_idempotency_now'
    LOOP
        EXECUTE pg_catalog.replace(f.definition, 'now()', 'tower_idempotency_now()');
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f.signature, pg_catalog.current_schema());
    END LOOP;
END
$$;
