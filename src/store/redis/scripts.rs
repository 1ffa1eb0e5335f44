//! The Lua scripts behind [`RedisStore`](super::RedisStore): each operation of the
//! [`Store`](crate::Store) contract is one script, run atomically by the server.
//!
//! Every script gets the record's key as `KEYS[1]` and its fence's as `KEYS[2]` (one hash
//! tag, so one Cluster slot); the mark script of a `WAIT` round gets a key of the same hash
//! tag that never outlives it. Times are the server's: `TIME` in the script, turned into
//! milliseconds for leases and expiry (`PEXPIREAT`, `SET … PXAT`) and microseconds for
//! tokens. Numbers written into Redis are formatted with `%.0f`: Lua's `tostring` keeps 14
//! digits, and a token has 16.
//!
//! The record is a hash: `fp` (fingerprint), `tok` (the token of the claim that made it),
//! `exp` (its logical end, ms), and while in progress `lease` (the lease's end, ms); once
//! completed `status`, `headers` and, when the answer has one, `body`. A record is in
//! progress exactly when it has a `lease` field. The fence is a string: the last token given
//! for the key.

/// The server's time as `now_ms`, `now_us` (Lua numbers: exact below 2^53, and the time in
/// microseconds is about 2^51).
const NOW: &str = "
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now = math.floor(now_us / 1000)
";

/// `replication_id()`: the replication ID of the server running the script when it is a
/// master, else `''`.
///
/// A master's replication ID names its history of writes, which its replicas copy: a node
/// draws a new one when it becomes a master (a replica promoted at a failover) and when it
/// starts again (what it had not saved is gone), so two writes made under one ID were made by
/// one master process, in one stream, in the order it ran them. (A replica reports its
/// master's ID, hence the role.) `INFO` runs inside the script, atomically with its writes.
const REPLICATION_ID: &str = "
local function replication_id()
  local info = redis.call('INFO', 'replication')
  if string.match(info, 'role:(%a+)') ~= 'master' then return '' end
  return string.match(info, 'master_replid:(%x+)') or ''
end
";

/// `ARGV`: fingerprint, lease (ms), life (ms, `max(ttl, lease)`), grace (ms).
///
/// Returns `{'acquired', token, takeover}`, `{'in_flight', ms_left}`, `{'mismatch'}` or
/// `{'completed', status, headers, body or false}`.
const CLAIM_BODY: &str = "
local r = redis.call('HMGET', KEYS[1], 'fp', 'tok', 'lease', 'exp')
local takeover = 0
if r[1] and tonumber(r[4]) > now then
  if r[1] ~= ARGV[1] then return {'mismatch'} end
  if not r[3] then
    local a = redis.call('HMGET', KEYS[1], 'status', 'headers', 'body')
    return {'completed', a[1], a[2], a[3]}
  end
  local lease = tonumber(r[3])
  if lease > now then return {'in_flight', lease - now} end
  takeover = 1
end
-- The new token: past every token given for the key (the record's, the fence's) and at least
-- the server's time in microseconds, which is past every token of a fence that expired.
local last = tonumber(redis.call('GET', KEYS[2]) or '0')
if r[2] then last = math.max(last, tonumber(r[2])) end
local tok = string.format('%.0f', math.max(last + 1, now_us))
local life = tonumber(ARGV[3])
local gone = now + life + tonumber(ARGV[4])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'tok', tok,
  'lease', string.format('%.0f', now + tonumber(ARGV[2])),
  'exp', string.format('%.0f', now + life))
redis.call('PEXPIREAT', KEYS[1], gone)
redis.call('SET', KEYS[2], tok, 'PXAT', string.format('%.0f', gone + tonumber(ARGV[4])))
return {'acquired', tok, takeover}
";

/// `ARGV`: token, ttl (ms), status, headers, body, has body (`1`/`0`), grace (ms), channel
/// (empty: none), message, name the history (`1`/`0`).
///
/// Returns 0 when the token no longer holds the record; when stored, 1, or (asked to name
/// the history) the replication ID of the master that stored it ([`REPLICATION_ID`]), so that
/// the `WAIT` round that confirms it can be checked to run in the same history.
const COMPLETE_BODY: &str = "
local r = redis.call('HMGET', KEYS[1], 'tok', 'lease')
if r[1] ~= ARGV[1] or not r[2] then return 0 end
local exp = now + tonumber(ARGV[2])
redis.call('HDEL', KEYS[1], 'lease')
redis.call('HSET', KEYS[1], 'exp', string.format('%.0f', exp), 'status', ARGV[3],
  'headers', ARGV[4])
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'body', ARGV[5]) end
redis.call('PEXPIREAT', KEYS[1], exp)
redis.call('SET', KEYS[2], ARGV[1], 'PXAT', string.format('%.0f', exp + tonumber(ARGV[7])))
if ARGV[8] ~= '' then redis.call('PUBLISH', ARGV[8], ARGV[9]) end
if ARGV[10] == '1' then return replication_id() end
return 1
";

/// `ARGV`: token, grace (ms), channel (empty: none), message.
///
/// Returns 1 when deleted, 0 when the token no longer holds the record.
const RELEASE_BODY: &str = "
local r = redis.call('HMGET', KEYS[1], 'tok', 'lease')
if r[1] ~= ARGV[1] or not r[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], ARGV[1], 'PXAT', string.format('%.0f', now + tonumber(ARGV[2])))
if ARGV[3] ~= '' then redis.call('PUBLISH', ARGV[3], ARGV[4]) end
return 1
";

/// `ARGV`: token, lease (ms), grace (ms).
///
/// Returns 1 when renewed, 0 when the token no longer holds the record.
const RENEW_BODY: &str = "
local r = redis.call('HMGET', KEYS[1], 'tok', 'lease', 'exp')
if r[1] ~= ARGV[1] or not r[2] then return 0 end
local lease = now + tonumber(ARGV[2])
local exp = math.max(tonumber(r[3]), lease)
local gone = exp + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lease', string.format('%.0f', lease),
  'exp', string.format('%.0f', exp))
redis.call('PEXPIREAT', KEYS[1], gone)
redis.call('SET', KEYS[2], ARGV[1], 'PXAT', string.format('%.0f', gone + tonumber(ARGV[3])))
return 1
";

/// `ARGV`: grace (ms). Deletes an in-progress record past its logical end (the fence stays);
/// completed records leave by Redis's own expiry at their end.
///
/// Returns 1 when deleted.
const PURGE_BODY: &str = "
local r = redis.call('HMGET', KEYS[1], 'tok', 'lease', 'exp')
if not r[1] or not r[2] or tonumber(r[3]) > now then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], r[1], 'PXAT', string.format('%.0f', now + tonumber(ARGV[1])))
return 1
";

/// `KEYS[1]`: the mark key of a record's slot (`…:w`); no `ARGV`.
///
/// A write of nothing that lasts (the key is set and deleted), which the master sends to its
/// replicas all the same: the connection that runs it has then written at the end of the
/// server's stream, past every write the server made before, and a `WAIT` that follows on the
/// same connection waits for the replicas to acknowledge all of them. Returns
/// `replication_id()`.
const MARK_BODY: &str = "
redis.call('SET', KEYS[1], '1')
redis.call('DEL', KEYS[1])
return replication_id()
";

/// The scripts, each built once per store (a [`redis::Script`] knows its SHA1 and sends
/// `EVALSHA`, loading the script again when the server's cache lost it).
pub(super) struct Scripts {
    pub(super) claim: redis::Script,
    pub(super) complete: redis::Script,
    pub(super) release: redis::Script,
    pub(super) renew: redis::Script,
    pub(super) purge: redis::Script,
    /// The source of the mark script ([`MARK_BODY`]), sent with `EVAL` in the same pipeline
    /// as the `WAIT` it serves.
    pub(super) mark: String,
}

impl Scripts {
    pub(super) fn new() -> Self {
        let script = |body: &str| redis::Script::new(&format!("{NOW}{body}"));
        Self {
            claim: script(CLAIM_BODY),
            complete: redis::Script::new(&format!("{NOW}{REPLICATION_ID}{COMPLETE_BODY}")),
            release: script(RELEASE_BODY),
            renew: script(RENEW_BODY),
            purge: script(PURGE_BODY),
            mark: format!("{REPLICATION_ID}{MARK_BODY}"),
        }
    }
}
