-- Admit one request against every token bucket and quota of a tenant in one atomic step.
--
-- KEYS[i]  one hash per check; all carry the tenant's {hash tag}, so this also runs on a cluster
-- ARGV[1]  clock override in microseconds, or "" for Redis TIME (only tests override it)
-- ARGV[2]  units this request costs
-- ARGV[3]  "1": charge every check when all pass; "0": only read (the usage endpoint);
--          "2": refund ARGV[2] units an earlier admission charged (a bucket gains them up to its
--          burst; a quota counter loses them, never below 0, only if it still counts the window
--          that was charged)
-- ARGV[4]  with ARGV[3] "1": the deadline in microseconds of this clock, or "" for none. The
--          caller stops waiting then and refuses the request, so a call that runs after it (it
--          waited in a stalled Redis) charges nothing and answers allowed 2: late
-- ARGV[3i+2], ARGV[3i+3], ARGV[3i+4] describe KEYS[i]:
--          "bucket", rate_per_s, burst   or   "day" | "month", limit, 0 (refund: the charge's
--          Unix time in seconds, naming the window it charged)
-- Returns {allowed (0|1|2), now_us, then for each KEYS[i]: level, window_end_s, garbage (0|1)}.
-- Numbers travel as %.17g strings because Redis truncates Lua numbers in replies to integers. A
-- bucket's level is its tokens before this request; a quota's level is the units used before it.
--
-- Stored values are untrusted: anyone who can write to Redis may have planted a key. A key that
-- is not a hash, lacks a field, or holds anything but a finite number in range (tonumber takes
-- "nan", "inf", "1e999") is garbage: it is deleted, its check starts fresh (a full bucket, an
-- unused quota) and the reply flags it, so the server logs and counts it.
--
-- Mirrors engine/limits/bucket.py and engine/limits/quota.py; the tests keep them in step.

local function fmt(x)
  return string.format("%.17g", x)
end

-- Doubles count units exactly up to 2^53; a stored counter above that was not written by us.
local MAX_COUNT = 9007199254740992

-- The longest a key lives, in milliseconds (about 285,000 years): Redis hands a script's number
-- to a command as "%.17g", which writes 1e17 and more with an exponent that PEXPIRE refuses. A
-- bucket that takes longer than this to refill (a tiny rate_per_s) is kept this long.
local MAX_TTL_MS = 9007199254740992

-- x is a number, not NaN (the one value unequal to itself) and not infinite.
local function finite(x)
  return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge
end

local function whole(x)
  return finite(x) and math.floor(x) == x
end

-- The two fields of the hash at key as numbers (nil where absent or not numeric), whether a
-- key exists at all, and whether it is of the wrong type (then it is garbage already).
local function read(key, first, second)
  local kind = redis.call("TYPE", key)["ok"]
  if kind == "none" then
    return nil, nil, false, false
  end
  if kind ~= "hash" then
    return nil, nil, true, true
  end
  local stored = redis.call("HMGET", key, first, second)
  return tonumber(stored[1]), tonumber(stored[2]), true, false
end

-- Howard Hinnant's civil_from_days / days_from_civil (proleptic Gregorian calendar, UTC).
local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor(
    (doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400
  if month <= 2 then
    year = year + 1
  end
  return year, month
end

local function days_from_civil(year, month, day)
  if month <= 2 then
    year = year - 1
  end
  local era = math.floor(year / 400)
  local yoe = year - era * 400
  local mp = month > 2 and month - 3 or month + 9
  local doy = math.floor((153 * mp + 2) / 5) + day - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- The quota window containing now_s: its id and its end in Unix seconds.
local function window(kind, now_s)
  local day = math.floor(now_s / 86400)
  if kind == "day" then
    return day, (day + 1) * 86400
  end
  local year, month = civil_from_days(day)
  local next_year, next_month = year, month + 1
  if next_month == 13 then
    next_year, next_month = year + 1, 1
  end
  return year * 12 + month - 1, days_from_civil(next_year, next_month, 1) * 86400
end

local now_us
if ARGV[1] == "" then
  local time = redis.call("TIME")
  now_us = tonumber(time[1]) * 1000000 + tonumber(time[2])
else
  now_us = tonumber(ARGV[1])
end
local now_s = now_us / 1000000
local units = tonumber(ARGV[2])
local refund = ARGV[3] == "2"
local late = ARGV[3] == "1" and ARGV[4] ~= "" and now_us > tonumber(ARGV[4])
local allowed = 1
local reply = {0, fmt(now_us)}
local writes = {}

for i, key in ipairs(KEYS) do
  local kind = ARGV[3 * i + 2]
  local a = tonumber(ARGV[3 * i + 3])
  local b = tonumber(ARGV[3 * i + 4])
  local garbage
  if kind == "bucket" then
    local level, ts, exists
    level, ts, exists, garbage = read(key, "tokens", "ts")
    local tokens = b
    if exists and not garbage then
      -- A stamp later than one full refill from now cannot come from a clock step; left alone
      -- it would keep the bucket empty for as long as it says.
      garbage = not (finite(level) and finite(ts) and level >= 0 and ts >= 0
                     and ts <= now_us + b / a * 1000000)
      if not garbage then
        tokens = math.min(b, level + math.max(0, now_us - ts) / 1000000 * a)
      end
    end
    if units > tokens then
      allowed = 0
    end
    reply[#reply + 1] = fmt(tokens)
    reply[#reply + 1] = "0"
    -- Once a bucket is full again its key means nothing: let it expire then.
    local after = refund and math.min(b, tokens + units) or tokens - units
    writes[i] = {"tokens", fmt(after), "ts", fmt(now_us),
                 math.min(math.ceil(b / a * 1000) + 1000, MAX_TTL_MS)}
  else
    local id, end_s = window(kind, now_s)
    local stored_id, count, exists
    stored_id, count, exists, garbage = read(key, "window", "used")
    local used = 0
    if exists and not garbage then
      garbage = not (whole(stored_id) and whole(count) and count >= 0 and count <= MAX_COUNT)
      if not garbage and stored_id == id then
        used = count
      end
    end
    if used + units > a then
      allowed = 0
    end
    reply[#reply + 1] = fmt(used)
    reply[#reply + 1] = fmt(end_s)
    if not refund then
      writes[i] = {"window", fmt(id), "used", fmt(used + units),
                   math.ceil((end_s - now_s) * 1000) + 1000}
    elseif used > 0 and window(kind, b) == id then
      writes[i] = {"window", fmt(id), "used", fmt(math.max(0, used - units)),
                   math.ceil((end_s - now_s) * 1000) + 1000}
    end
  end
  reply[#reply + 1] = garbage and "1" or "0"
  if garbage then
    -- A missing key is a fresh bucket or counter: deleting is the repair, also on a read.
    redis.call("DEL", key)
  end
end

if refund then
  allowed = 1 -- a refund always applies (it may only give units back)
end
if late then
  allowed = 2 -- evaluated, not charged: the caller has given up on this call
end
reply[1] = allowed
if allowed == 1 and (ARGV[3] == "1" or refund) then
  for i, key in ipairs(KEYS) do
    local w = writes[i]
    if w then
      redis.call("HSET", key, w[1], w[2], w[3], w[4])
      redis.call("PEXPIRE", key, w[5])
    end
  end
end
return reply
