-- wrk script: POST /payments with a new Idempotency-Key per request (unique across wrk's
-- threads and runs), as a client paying new orders does. Used by benches/wrk/payments.sh.
local counter = 0
thread_id = 0 -- set per thread by setup() (a global: thread:set writes globals)
local run = tostring(os.time())
local threads = {}

function setup(thread)
  thread:set("thread_id", #threads)
  table.insert(threads, thread)
end

function request()
  counter = counter + 1
  local key = "wrk-" .. run .. "-" .. thread_id .. "-" .. counter
  local body = '{"order_id": ' .. (counter % 1000 + 1) .. ', "amount_cents": 1999}'
  return wrk.format("POST", "/payments", {
    ["Idempotency-Key"] = key,
    ["Content-Type"] = "application/json",
  }, body)
end

local bad = 0
function response(status, headers, body)
  if status ~= 201 then
    bad = bad + 1
    if bad <= 3 then io.stderr:write("unexpected status " .. status .. ": " .. body .. "\n") end
  end
end
