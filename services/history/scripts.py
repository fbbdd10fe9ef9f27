"""The history store's Lua scripts, each run next to the data in one round trip per prompt
(store.py says why Lua), and the SHA that names a script on the server. The key layout
they walk is in keys.py."""

from __future__ import annotations

import hashlib

# Sets the TTL of the prompt's epoch list and of every epoch it keeps.
_REFRESH_TTL = """
local function refresh_ttl(epochs, stem, ttl)
  redis.call('EXPIRE', epochs, ttl)
  for _, step in ipairs(redis.call('ZRANGE', epochs, 0, -1)) do
    redis.call('EXPIRE', stem .. step, ttl)
  end
end
"""

# KEYS: epochs zset, then one epoch hash per step group.
# ARGV: stem, K, ttl, then per step group: step_id, policy_version, num_samples,
#       and num_samples pairs (sample_index, packed tokens).
# Returns the number of samples newly stored.
PUT_ROLLOUTS = _REFRESH_TTL + """
local epochs, stem = KEYS[1], ARGV[1]
local num_epochs, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local num_written, a = 0, 4
for g = 2, #KEYS do
  local key, step, version, num_samples = KEYS[g], ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 3
  if not redis.call('ZSCORE', epochs, step) then
    local newest = redis.call('ZRANGE', epochs, -1, -1, 'WITHSCORES')
    redis.call('ZADD', epochs, newest[2] and tonumber(newest[2]) + 1 or 1, step)
  end
  redis.call('HSETNX', key, 'version', version)
  local new_lengths = {}
  for _ = 1, num_samples do
    local i, tokens = ARGV[a], ARGV[a + 1]
    a = a + 2
    if redis.call('HSETNX', key, 'tok:' .. i, tokens) == 1 then
      new_lengths[#new_lengths + 1] = struct.pack('<i4i4', tonumber(i), math.floor(#tokens / 4))
    end
  end
  if #new_lengths > 0 then
    local lengths = redis.call('HGET', key, 'lengths') or ''
    redis.call('HSET', key, 'lengths', lengths .. table.concat(new_lengths))
    num_written = num_written + #new_lengths
  end
end
local num_evicted = redis.call('ZCARD', epochs) - num_epochs
if num_evicted > 0 then
  for _, step in ipairs(redis.call('ZRANGE', epochs, 0, num_evicted - 1)) do
    redis.call('DEL', stem .. step)
  end
  redis.call('ZREMRANGEBYRANK', epochs, 0, num_evicted - 1)
end
refresh_ttl(epochs, stem, ttl)
return num_written
"""

# KEYS: epochs zset, then the epoch hash of each reward.
# ARGV: stem, ttl, then per reward: sample_index, packed float32.
# Returns the number of rewards newly stored. A reward may arrive before its
# rollout; it then waits in the epoch hash (with the TTL) for the rollout.
PUT_REWARDS = _REFRESH_TTL + """
local stem, ttl = ARGV[1], tonumber(ARGV[2])
local num_written = 0
for r = 2, #KEYS do
  num_written = num_written + redis.call('HSET', KEYS[r], 'rew:' .. ARGV[2 * r - 1], ARGV[2 * r])
  redis.call('EXPIRE', KEYS[r], ttl)
end
refresh_ttl(KEYS[1], stem, ttl)
return num_written
"""

# KEYS: epochs zset. ARGV: stem, max_epochs (0 = all), include_tokens ('1'/'0').
# Returns, newest epoch first: {step_id, version, packed (index, length) pairs,
# packed float32 rewards (NaN where missing), per-sample packed tokens (empty
# unless include_tokens)}, samples in the order of the pairs. Tokens stay one
# bulk string per sample: concatenating them in Lua costs Redis twice the time.
# The epoch keys are not in KEYS because they are only known here; they share
# the prompt's hash tag, hence its cluster slot.
GET_HISTORY = """
local NAN = '\\0\\0\\192\\127'  -- float32 quiet NaN, little-endian
local function hmget(key, fields)  -- unpack() is bounded by the Lua C stack: chunk
  local values = {}
  for first = 1, #fields, 1024 do
    for _, v in ipairs(redis.call('HMGET', key, unpack(fields, first, math.min(first + 1023, #fields)))) do
      values[#values + 1] = v
    end
  end
  return values
end
local stem, max_epochs, with_tokens = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local out = {}
for _, step in ipairs(redis.call('ZRANGE', KEYS[1], 0, max_epochs - 1, 'REV')) do
  local key = stem .. step
  local meta = redis.call('HMGET', key, 'version', 'lengths')
  if meta[1] and meta[2] then
    local reward_fields, token_fields = {}, {}
    for p = 1, #meta[2], 8 do
      local i = struct.unpack('<i4', meta[2], p)
      reward_fields[#reward_fields + 1] = 'rew:' .. i
      token_fields[#token_fields + 1] = 'tok:' .. i
    end
    local rewards = hmget(key, reward_fields)
    for n = 1, #rewards do
      rewards[n] = rewards[n] or NAN
    end
    local tokens = with_tokens and hmget(key, token_fields) or {}
    out[#out + 1] = {step, meta[1], meta[2], table.concat(rewards), tokens}
  end
end
return out
"""


class Script:
    """A script's text and its SHA-1, the name EVALSHA calls it by."""

    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
