-- tower-idempotency: the store's schema, in the first schema of the connection's search_path.
--
-- PostgresStore::migrate() (and Inbox::migrate()) runs this file once, in one transaction,
-- and records it in tower_idempotency_migrations; it may also be applied with another tool
-- (psql -f), in the schema the store's connections will have first on their search_path.
--
-- What holds throughout:
--
-- * Every time (leases, expiry, the inbox's ages) comes from the database, read through one
--   function, tower_idempotency_now(), never from the application: app instances with skewed
--   clocks agree, and a test can move the store's clock by replacing that one function.
-- * Every function except tower_idempotency_now() runs with
--       search_path = pg_catalog, <the schema it lives in>, pg_temp
--   (set at the end of this file): built-ins first, then the store's own tables, temporary
--   tables last. An application schema ahead on the caller's path, with a table named like the
--   store's or a now() of its own named before pg_catalog, cannot change where records go or
--   what leases, fences and expiry mean.
-- * Every function that looks a record up by its key plans with `enable_seqscan = off`. PL/pgSQL
--   keeps each statement's plan for the life of the connection, and after five calls that plan
--   is a generic one made on the table's statistics of that moment: a table analyzed while it
--   was empty (just migrated; autovacuum off or not yet run) makes a sequential scan look
--   cheapest, and that kept plan would read the whole table on every request once the table
--   has grown. A lookup by key has one right plan, the primary key. (tests/plans.rs)


-- The clock. Also used as a column default below, so it comes first.
CREATE FUNCTION tower_idempotency_now()
RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE
AS 'SELECT pg_catalog.now()';


-- Keys: one record per (scope, key).
--
-- A record is in progress while lease_token is set (a request holds it until
-- lease_expires_at), and completed once response_status is set. Every record counts as absent
-- after expires_at; purge_expired() deletes it later. The lease token fences the request that
-- holds the record: each of its later statements names the token, so a request that lost its
-- lease to another cannot renew, complete or release the record.
--
-- Phased mode records each committed phase of an in-progress request on its record (`phases`,
-- encoded by the crate: a list of name and state pairs) so that a request taking the key over
-- after the lease resumes after the last one, and with `Phased::with_resumable_requests` the
-- request itself (`request`), so that a completer can run it again when no retry comes. Both
-- are NULL on a record without phases and on every completed record; the partial index finds
-- the records a completer looks for.
CREATE SEQUENCE tower_idempotency_lease_token_seq AS bigint;

CREATE TABLE tower_idempotency_keys (
    scope            text        NOT NULL,
    key              text        NOT NULL,
    fingerprint      bytea       NOT NULL,
    lease_token      bigint,
    lease_expires_at timestamptz,
    expires_at       timestamptz NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    completed_at     timestamptz,
    response_status  smallint,
    response_headers bytea,
    -- NULL on a completed record whose body was larger than the storage limit.
    response_body    bytea,
    phases           bytea,
    request          bytea,
    PRIMARY KEY (scope, key),
    CONSTRAINT tower_idempotency_keys_state CHECK (
        (lease_token IS NOT NULL AND lease_expires_at IS NOT NULL AND response_status IS NULL)
        OR (lease_token IS NULL AND response_status IS NOT NULL AND response_headers IS NOT NULL)
    )
);

CREATE INDEX tower_idempotency_keys_expires_at ON tower_idempotency_keys (expires_at);

CREATE INDEX tower_idempotency_keys_phased ON tower_idempotency_keys (lease_expires_at)
    WHERE phases IS NOT NULL;


-- The keys that duplicates are waiting for (IdempotencyLayer::with_wait_for_completion on a
-- PostgresStore with notifications). A waiting duplicate registers the 64-bit hash of its
-- (scope, key) here, for a while, before it claims the key again. A completion, a release or
-- a rollback of that key looks the hash up in the same transaction and sends
-- NOTIFY tower_idempotency only when a row is there, so requests nobody waits for pay one
-- primary-key probe of this small table, not a NOTIFY (which would serialize their commits).
-- Rows past their time are deleted by the purge.
CREATE TABLE tower_idempotency_waiting (
    hash  bigint      PRIMARY KEY,
    until timestamptz NOT NULL
);


-- The inbox: one row per message a consumer has processed, inserted in the same transaction
-- as the consumer's work, so a message is recorded as processed exactly when its work is
-- committed. A message claimed with a lease (`Inbox::claim`) has its row from the claim on,
-- with the claim's token and the lease's end, so that a redelivery while the work runs is told
-- the message is in progress; the work's commit clears both: a row without a token is a
-- processed message.
CREATE TABLE tower_idempotency_processed_messages (
    consumer         text        NOT NULL,
    message_id       text        NOT NULL,
    processed_at     timestamptz NOT NULL DEFAULT now(),
    lease_token      bigint,
    lease_expires_at timestamptz,
    PRIMARY KEY (consumer, message_id),
    CONSTRAINT tower_idempotency_processed_messages_lease
        CHECK ((lease_token IS NULL) = (lease_expires_at IS NULL))
);

CREATE INDEX tower_idempotency_processed_messages_processed_at
    ON tower_idempotency_processed_messages (processed_at);

-- Positions: the last applied position (a producer's per-entity sequence, a stream sequence,
-- a partition's offset) of each ordering key of a consumer. The work's transaction moves it
-- forward together with the work's writes, and only forward: a message at or below it is
-- stale and its work never runs. Where the broker orders a partition, its position alone says
-- where to resume, in one row per partition.
CREATE TABLE tower_idempotency_positions (
    consumer     text        NOT NULL,
    key          text        NOT NULL,
    position     bigint      NOT NULL,
    updated_at   timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    PRIMARY KEY (consumer, key)
);

-- Failed attempts of a message's work: how many, and the last one's reason. A message whose
-- work failed as often as the consumer allows is parked (`parked_at`, with its payload when
-- the consumer gives it): its ID is recorded as processed in the same transaction, so it is
-- acknowledged and never applied; the parked rows are the consumer's dead letters.
CREATE TABLE tower_idempotency_message_failures (
    consumer        text        NOT NULL,
    message_id      text        NOT NULL,
    attempts        integer     NOT NULL CHECK (attempts > 0),
    reason          text        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    last_failed_at  timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    parked_at       timestamptz,
    payload         bytea,
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX tower_idempotency_message_failures_parked
    ON tower_idempotency_message_failures (consumer, parked_at)
    WHERE parked_at IS NOT NULL;

-- The inbox in daily partitions (`DailyInbox`), for retention by dropping a day's partition
-- instead of deleting its rows. A partitioned table's unique key must include the partition
-- key, so it is unique within a day only; `day` is therefore a function of the message, not
-- of the time it is processed: the UTC day the producer first sent the logical message, which
-- every delivery and every republish of it carries. All deliveries of a message thus land in
-- one partition, where the primary key catches each duplicate as the unpartitioned table's
-- does. A message whose day has no partition (older than the retention, or too far ahead) is
-- refused, never applied. The partitions are created ahead and dropped by the crate.
CREATE TABLE tower_idempotency_processed_messages_daily (
    consumer     text        NOT NULL,
    message_id   text        NOT NULL,
    day          date        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT tower_idempotency_now(),
    PRIMARY KEY (consumer, message_id, day)
) PARTITION BY RANGE (day);


-- Plain mode.
--
-- The store sends its statements over the simple query protocol with the values written in
-- (so a pooler in transaction mode can carry them: no prepared statement outlives its
-- message). Postgres then parses and plans every statement it receives; a statement that only
-- calls a function costs little to plan, and PL/pgSQL keeps the plans of the statements inside
-- it for the session (the pooler's server connection). The claim and the completion each do
-- their work in one function with no nested call: every nested call would set and restore its
-- own settings on entry and return.
--
-- `p_lock_ms` bounds a function's lock waits: it becomes the local lock_timeout (0: no bound)
-- of the statements that can wait for a row lock. Functions with `SET lock_timeout = 0` put
-- the caller's lock_timeout back when they return; the claim and the completion run alone in
-- a message of their own, never inside a caller's transaction, so their bound simply ends with
-- the statement's transaction.

-- The claim (ClaimStrategy::Combined), read with `SELECT * FROM tower_idempotency_plain_claim(…)`:
-- one row, the record as it is (all NULL when the key is absent), and for an absent key
-- `inserted`, the token of the record inserted for this request (NULL when a concurrent claim
-- inserted it first: ON CONFLICT makes the insert the one atomic decision between racing
-- first requests). A replay costs the database the read alone. The lock bound is set only on
-- the path that can wait for a lock (the insert waits for a concurrent insert of the same key
-- to commit or roll back).
CREATE FUNCTION tower_idempotency_plain_claim(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint,
    OUT inserted bigint, OUT fingerprint bytea, OUT lease_token bigint, OUT expired boolean,
    OUT claimable boolean, OUT lease_left_ms bigint, OUT response_status smallint,
    OUT response_headers bytea, OUT response_body bytea)
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    t timestamptz := tower_idempotency_now();
    record_expires timestamptz;
    lease_expires timestamptz;
    ignored text;
BEGIN
    SELECT k.fingerprint, k.lease_token, k.expires_at, k.lease_expires_at,
           k.response_status, k.response_headers, k.response_body
      INTO fingerprint, lease_token, record_expires, lease_expires,
           response_status, response_headers, response_body
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
    IF NOT FOUND THEN
        ignored := set_config('lock_timeout', p_lock_ms::text, true);
        INSERT INTO tower_idempotency_keys AS k
               (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
        VALUES (p_scope, p_key, p_fingerprint, nextval('tower_idempotency_lease_token_seq'),
                t + p_lease_ms::float8 * interval '1 millisecond',
                t + p_ttl_ms::float8 * interval '1 millisecond')
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING k.lease_token INTO inserted;
        RETURN;
    END IF;
    expired := record_expires <= t;
    claimable := expired
        OR (lease_token IS NOT NULL AND lease_expires <= t AND fingerprint = p_fingerprint);
    lease_left_ms := (extract(epoch FROM lease_expires - t) * 1000)::bigint;
END
$$;

-- The read alone (ClaimStrategy::ReadFirst and InsertFirst): no row when the key is absent.
CREATE FUNCTION tower_idempotency_plain_read(
    p_scope text, p_key text, p_fingerprint bytea, p_lock_ms bigint)
RETURNS TABLE (
    fingerprint      bytea,
    lease_token      bigint,
    expired          boolean,
    claimable        boolean,
    lease_left_ms    bigint,
    response_status  smallint,
    response_headers bytea,
    response_body    bytea)
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
SET enable_seqscan = off
AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    RETURN QUERY
    SELECT k.fingerprint, k.lease_token, k.expires_at <= tower_idempotency_now(),
           (k.expires_at <= tower_idempotency_now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now()
                AND k.fingerprint = p_fingerprint)),
           (extract(epoch FROM k.lease_expires_at - tower_idempotency_now()) * 1000)::bigint,
           k.response_status, k.response_headers, k.response_body
      FROM tower_idempotency_keys AS k
     WHERE k.scope = p_scope AND k.key = p_key;
END
$$;

-- The insert of a new key's record: its lease token, or NULL when the key exists (a concurrent
-- claim inserted it after the caller looked). Arguments: scope, key, fingerprint, then the
-- lease and the time to live in milliseconds.
CREATE FUNCTION tower_idempotency_insert_key(
    p_scope       text,
    p_key         text,
    p_fingerprint bytea,
    p_lease_ms    bigint,
    p_ttl_ms      bigint
) RETURNS bigint
LANGUAGE plpgsql
VOLATILE
AS $$
DECLARE
    token bigint;
BEGIN
    INSERT INTO tower_idempotency_keys AS k
           (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
    VALUES (p_scope, p_key, p_fingerprint, nextval('tower_idempotency_lease_token_seq'),
            tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond',
            tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond')
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING k.lease_token INTO token;
    RETURN token;
END
$$;

-- The insert alone (ClaimStrategy::ReadFirst, after a read that found nothing), under the lock
-- bound.
CREATE FUNCTION tower_idempotency_plain_insert(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
AS $$
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    RETURN tower_idempotency_insert_key(p_scope, p_key, p_fingerprint, p_lease_ms, p_ttl_ms);
END
$$;

-- Takes over a record that is expired, or whose lease ran out with the same payload: the new
-- token, or NULL when the condition no longer holds on the row's latest version (of two
-- requests taking over at once, one wins). Taking over an abandoned record is a resume: it
-- keeps the recorded phases and request. Taking over an expired one is a new claim: the
-- phases of the request before it must not be resumed.
CREATE FUNCTION tower_idempotency_plain_takeover(
    p_scope text, p_key text, p_fingerprint bytea, p_lease_ms bigint, p_ttl_ms bigint,
    p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
SET enable_seqscan = off
AS $$
DECLARE
    token bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys AS k
       SET fingerprint = p_fingerprint,
           lease_token = nextval('tower_idempotency_lease_token_seq'),
           lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond',
           expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
           created_at = tower_idempotency_now(), completed_at = NULL,
           phases = CASE WHEN k.expires_at > tower_idempotency_now() THEN k.phases END,
           request = CASE WHEN k.expires_at > tower_idempotency_now() THEN k.request END,
           response_status = NULL, response_headers = NULL, response_body = NULL
     WHERE k.scope = p_scope AND k.key = p_key
       AND (k.expires_at <= tower_idempotency_now()
            OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now()
                AND k.fingerprint = p_fingerprint))
    RETURNING k.lease_token INTO token;
    RETURN token;
END
$$;

-- Wakes the waiters of the key whose hash is `p_hash` (NULL: nobody asked): a NOTIFY when a
-- waiter registered the hash, nothing otherwise.
CREATE FUNCTION tower_idempotency_wake(p_hash bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    IF p_hash IS NOT NULL AND EXISTS (
        SELECT 1 FROM tower_idempotency_waiting WHERE hash = p_hash AND until > tower_idempotency_now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_hash::text);
    END IF;
END
$$;

-- Stores the answer of the claim that holds `p_token`, living p_ttl_ms: 1 when it did, 0 when
-- the token no longer holds the record. When its key's waiters registered the key's hash
-- (`p_wake`), notifies them.
CREATE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint, p_wake bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    changed bigint;
    ignored text := set_config('lock_timeout', p_lock_ms::text, true);
BEGIN
    UPDATE tower_idempotency_keys
       SET lease_token = NULL, lease_expires_at = NULL, completed_at = tower_idempotency_now(),
           expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed > 0 AND p_wake IS NOT NULL AND EXISTS (
        SELECT 1 FROM tower_idempotency_waiting
         WHERE hash = p_wake AND until > tower_idempotency_now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_wake::text);
    END IF;
    RETURN changed;
END
$$;

-- The completion without waking anyone (PostgresStore::with_notifications(false)).
CREATE FUNCTION tower_idempotency_plain_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_lock_ms bigint)
RETURNS bigint
LANGUAGE sql VOLATILE
SET enable_seqscan = off
AS $$
    SELECT tower_idempotency_plain_complete(
        p_scope, p_key, p_token, p_ttl_ms, p_status, p_headers, p_body, p_lock_ms, NULL)
$$;

-- Deletes the record that `p_token` holds: 1 when it did, 0 otherwise.
CREATE FUNCTION tower_idempotency_plain_release(
    p_scope text, p_key text, p_token bigint, p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
SET enable_seqscan = off
AS $$
DECLARE
    changed bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    DELETE FROM tower_idempotency_keys
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;

-- The release that also wakes the key's waiters (`p_wake`, the key's hash).
CREATE FUNCTION tower_idempotency_plain_release(
    p_scope text, p_key text, p_token bigint, p_lock_ms bigint, p_wake bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
DECLARE
    changed bigint;
BEGIN
    changed := tower_idempotency_plain_release(p_scope, p_key, p_token, p_lock_ms);
    IF changed > 0 THEN
        PERFORM tower_idempotency_wake(p_wake);
    END IF;
    RETURN changed;
END
$$;

-- Extends the lease that `p_token` holds (and the record's life to at least its end): 1 when
-- it did, 0 otherwise.
CREATE FUNCTION tower_idempotency_plain_renew(
    p_scope text, p_key text, p_token bigint, p_lease_ms bigint, p_lock_ms bigint)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET lock_timeout = 0
SET enable_seqscan = off
AS $$
DECLARE
    changed bigint;
BEGIN
    PERFORM set_config('lock_timeout', p_lock_ms::text, true);
    UPDATE tower_idempotency_keys
       SET lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond',
           expires_at = greatest(expires_at,
                                 tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond')
     WHERE scope = p_scope AND key = p_key AND lease_token = p_token;
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;


-- Transactional mode: the claim travels in one message with the request's BEGIN, the
-- completion with its COMMIT, so a keyed request costs no more round trips than the handler's
-- own transaction, and no server-side ERROR for the normal outcomes (replay, in flight,
-- mismatch).
--
-- The claim runs inside the request's transaction, at whatever isolation level it has, so it
-- never decides from a snapshot alone:
--   1. it takes the key's transaction-scoped advisory lock without waiting ('held' when another
--      transaction has it). The lock id mixes in the table's oid, so that stores in two
--      schemas of one database never block each other;
--   2. it inserts the key's record as an in-progress placeholder (lease token 0). The unique
--      check of the insert sees every committed record, whatever the snapshot: a record
--      committed after the snapshot (REPEATABLE READ, SERIALIZABLE) makes the insert fail with
--      40001, which the caller answers by claiming again; a visible one makes it do nothing;
--   3. a record that is there and stale (expired, or a plain-mode claim whose lease ran out,
--      with the same payload) is taken over in place;
--   4. otherwise the record is returned for the caller to classify ('record').
-- A purge locks the expired records of its batch before it deletes them: a takeover that
-- waited for such a purge finds, at READ COMMITTED, the record gone, and then inserts once
-- more (the second pass); the key is free, so the insert takes it.
-- The placeholder is never seen by others: the completion turns it into the completed record
-- in the same transaction, a rollback removes it. It is found again by its ctid, so the
-- completion reads no index (under SERIALIZABLE, an index read would take predicate locks
-- that make concurrent requests with other keys fail each other).
CREATE FUNCTION tower_idempotency_claim_tx(
    p_lock bigint, p_scope text, p_key text, p_fingerprint bytea)
RETURNS TABLE (
    outcome          text,
    claimed_row      text,
    fingerprint      bytea,
    lease_token      bigint,
    lease_left_ms    bigint,
    response_status  smallint,
    response_headers bytea,
    response_body    bytea)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
DECLARE
    found_row tid;
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock # 'tower_idempotency_keys'::regclass::oid::bigint) THEN
        RETURN QUERY SELECT 'held'::text, NULL::text, NULL::bytea, NULL::bigint, NULL::bigint,
                            NULL::smallint, NULL::bytea, NULL::bytea;
        RETURN;
    END IF;
    -- A second pass only when the record vanished between the insert and the takeover.
    FOR pass IN 1..2 LOOP
        INSERT INTO tower_idempotency_keys AS k
               (scope, key, fingerprint, lease_token, lease_expires_at, expires_at)
        VALUES (p_scope, p_key, p_fingerprint, 0, tower_idempotency_now(), tower_idempotency_now())
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING k.ctid INTO found_row;
        IF found_row IS NULL THEN
            UPDATE tower_idempotency_keys AS k
               SET fingerprint = p_fingerprint, lease_token = 0, lease_expires_at = tower_idempotency_now(),
                   expires_at = tower_idempotency_now(), created_at = tower_idempotency_now(), completed_at = NULL,
                   response_status = NULL, response_headers = NULL, response_body = NULL
             WHERE k.scope = p_scope AND k.key = p_key
               AND (k.expires_at <= tower_idempotency_now()
                    OR (k.lease_token IS NOT NULL AND k.lease_expires_at <= tower_idempotency_now()
                        AND k.fingerprint = p_fingerprint))
            RETURNING k.ctid INTO found_row;
        END IF;
        IF found_row IS NOT NULL THEN
            RETURN QUERY SELECT 'acquired'::text, found_row::text, NULL::bytea, NULL::bigint,
                                NULL::bigint, NULL::smallint, NULL::bytea, NULL::bytea;
            RETURN;
        END IF;
        RETURN QUERY
            SELECT 'record'::text, NULL::text, k.fingerprint, k.lease_token,
                   (extract(epoch FROM k.lease_expires_at - tower_idempotency_now()) * 1000)::bigint,
                   k.response_status, k.response_headers, k.response_body
              FROM tower_idempotency_keys AS k
             WHERE k.scope = p_scope AND k.key = p_key;
        IF FOUND THEN
            RETURN;
        END IF;
    END LOOP;
END
$$;

-- The completion: the placeholder becomes the completed record. Its times come from the
-- completion's statement (statement_timestamp()), not from the transaction's start, so a
-- handler slower than the TTL still leaves a record that lives the TTL. Raises TI003 when the
-- placeholder is gone (it cannot be, short of a bug), so that the COMMIT after it never runs.
CREATE FUNCTION tower_idempotency_complete_tx(
    p_record text, p_scope text, p_key text, p_ttl_ms bigint,
    p_status smallint, p_headers bytea, p_body bytea)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE tower_idempotency_keys AS k
       SET lease_token = NULL, lease_expires_at = NULL,
           completed_at = statement_timestamp(),
           expires_at = statement_timestamp() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE k.ctid = p_record::tid AND k.scope = p_scope AND k.key = p_key
       AND k.lease_token = 0;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tower_idempotency: the claimed record is gone' USING ERRCODE = 'TI003';
    END IF;
END
$$;

-- The completion that also wakes the key's waiters (`p_wake`, the key's hash; the NOTIFY is
-- delivered when the request's transaction commits). Its body is the completion's, not a call
-- of it: this runs once per request.
CREATE FUNCTION tower_idempotency_complete_tx(
    p_record text, p_scope text, p_key text, p_ttl_ms bigint,
    p_status smallint, p_headers bytea, p_body bytea, p_wake bigint)
RETURNS void
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    UPDATE tower_idempotency_keys AS k
       SET lease_token = NULL, lease_expires_at = NULL,
           completed_at = statement_timestamp(),
           expires_at = statement_timestamp() + p_ttl_ms::float8 * interval '1 millisecond',
           response_status = p_status, response_headers = p_headers, response_body = p_body
     WHERE k.ctid = p_record::tid AND k.scope = p_scope AND k.key = p_key
       AND k.lease_token = 0;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'tower_idempotency: the claimed record is gone' USING ERRCODE = 'TI003';
    END IF;
    IF EXISTS (SELECT 1 FROM tower_idempotency_waiting WHERE hash = p_wake AND until > tower_idempotency_now())
    THEN
        PERFORM pg_notify('tower_idempotency', p_wake::text);
    END IF;
END
$$;


-- Phased mode: a phase's statements on the key's record, each while the claim's token holds
-- it. They raise SQLSTATE TI001 when it does not (the lease was lost to another request), so
-- that the phase's transaction cannot commit its writes without them. `p_row` is the record's
-- row id when the caller found it beforehand (under SERIALIZABLE a lookup through the primary
-- key would predicate-lock an index page, which other keys' phases then conflict with); NULL
-- looks it up by key.

-- Records the phases committed so far (all of them, encoded by the crate), and the request
-- when given, and extends the lease to p_lease_ms from now.
CREATE FUNCTION tower_idempotency_phase_record(
    p_scope text, p_key text, p_token bigint, p_phases bytea, p_lease_ms bigint, p_row tid,
    p_request bytea)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond'
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET phases = p_phases, request = coalesce(p_request, k.request),
               lease_expires_at = tower_idempotency_now() + p_lease_ms::float8 * interval '1 millisecond'
         WHERE k.ctid = p_row AND k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency key is no longer held by this request'
            USING ERRCODE = 'TI001';
    END IF;
END
$$;

-- Whether the token still holds the record: the look a phase opens with.
CREATE FUNCTION tower_idempotency_phase_held(p_scope text, p_key text, p_token bigint)
RETURNS boolean
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    SELECT EXISTS (SELECT FROM tower_idempotency_keys AS k
                    WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token)
$$;

-- Stores the answer: the record becomes completed, its phases dropped, living p_ttl_ms; then
-- wakes the key's waiters (p_wake, the key's hash; NULL: none to wake here).
CREATE FUNCTION tower_idempotency_phase_complete(
    p_scope text, p_key text, p_token bigint, p_ttl_ms bigint, p_status smallint,
    p_headers bytea, p_body bytea, p_row tid, p_wake bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET enable_seqscan = off
AS $$
BEGIN
    IF p_row IS NULL THEN
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = tower_idempotency_now(),
               expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
               response_status = p_status, response_headers = p_headers, response_body = p_body
         WHERE k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    ELSE
        UPDATE tower_idempotency_keys AS k
           SET lease_token = NULL, lease_expires_at = NULL, phases = NULL, request = NULL,
               completed_at = tower_idempotency_now(),
               expires_at = tower_idempotency_now() + p_ttl_ms::float8 * interval '1 millisecond',
               response_status = p_status, response_headers = p_headers, response_body = p_body
         WHERE k.ctid = p_row AND k.scope = p_scope AND k.key = p_key AND k.lease_token = p_token;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'the idempotency key is no longer held by this request'
            USING ERRCODE = 'TI001';
    END IF;
    PERFORM tower_idempotency_wake(p_wake);
END
$$;


-- The inbox's functions. They run inside the consumer's transaction, with the work, so each
-- saves the caller's lock_timeout and puts it back.

-- Records a message's ID for `Inbox::process`, waiting at most p_lock_ms for a concurrent
-- delivery of the same message (the only wait: an insert of the same ID by a transaction
-- still open). True when the ID is new. One call, planned once per session: the bound and the
-- insert as separate statements would be four, each parsed on every delivery.
CREATE FUNCTION tower_idempotency_record_message(
    p_consumer text, p_message_id text, p_lock_ms bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved text := pg_catalog.current_setting('lock_timeout');
    inserted bigint;
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_ms::text || 'ms', true);
    INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    GET DIAGNOSTICS inserted = ROW_COUNT;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
    RETURN inserted = 1;
END
$$;

-- As above, for a message at p_position of the ordering key p_key: when the ID is new, the
-- key's position moves to p_position in the same call, if it is below it (the key's row is
-- locked either way). 0: the ID was recorded before; 1: recorded, and the position moved;
-- 2: recorded, and the message is stale (at or below the position).
CREATE FUNCTION tower_idempotency_record_message(
    p_consumer text, p_message_id text, p_lock_ms bigint, p_key text, p_position bigint)
RETURNS smallint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    saved text := pg_catalog.current_setting('lock_timeout');
    seen_before CONSTANT smallint := 0;
    changed bigint;
BEGIN
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_ms::text || 'ms', true);
    INSERT INTO tower_idempotency_processed_messages (consumer, message_id)
    VALUES (p_consumer, p_message_id)
    ON CONFLICT (consumer, message_id) DO NOTHING;
    GET DIAGNOSTICS changed = ROW_COUNT;
    IF changed = 0 THEN
        PERFORM pg_catalog.set_config('lock_timeout', saved, true);
        RETURN seen_before;
    END IF;
    INSERT INTO tower_idempotency_positions AS p (consumer, key, position)
    VALUES (p_consumer, p_key, p_position)
    ON CONFLICT (consumer, key) DO UPDATE
       SET position = EXCLUDED.position, updated_at = tower_idempotency_now()
     WHERE p.position < EXCLUDED.position;
    GET DIAGNOSTICS changed = ROW_COUNT;
    PERFORM pg_catalog.set_config('lock_timeout', saved, true);
    RETURN CASE WHEN changed = 1 THEN 1 ELSE 2 END;
END
$$;


-- Every function above but the clock resolves names in its own schema. The schema is the one
-- this file runs in, known only when it runs, so the setting is added here, after each
-- function's own settings. tower_idempotency_now() names pg_catalog.now() itself, and a SQL
-- function with a setting could not be inlined into the statements that call it.
DO $$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid
          FROM pg_catalog.pg_proc AS p
          JOIN pg_catalog.pg_namespace AS n ON n.oid = p.pronamespace
         WHERE n.nspname = pg_catalog.current_schema()
           AND p.proname LIKE 'tower\_idempotency\_%'
           AND p.proname <> 'tower_idempotency_now'
    LOOP
        EXECUTE pg_catalog.format(
            'ALTER FUNCTION %s SET search_path = pg_catalog, %I, pg_temp',
            f, pg_catalog.current_schema());
    END LOOP;
END
$$;
