-- Replay buckets of one study (aggregator/replay.py). A bucket is a list holding one blob per
-- fold: the first 8 bytes of every record id that fold accepted. Membership is decided by the
-- aggregator on its in-memory copy; this script only ships what is new and appends.
--
--   read: KEYS[1] = legacy sorted set, KEYS[2] = index hash, KEYS[3..] = bucket lists
--         ARGV[1] = 16-byte ids of the batch (checked against the legacy set while it exists),
--         then per bucket: its end, blobs already known, sha1 of the last known blob ('' if none)
--         -> { legacy '0'/'1' per id ('' when the set is gone; '?' when ARGV[1] is empty but the
--              set exists: call again with the ids), the index's bucket ends, then per bucket:
--              first index returned, blobs }
--         A bucket whose known blobs are no longer its prefix is returned whole (first index 0).
--         If the index names a bucket that was not passed, only the first two are returned:
--         call again with every bucket of the index.
--   add:  KEYS[1] = index hash, KEYS[2] = bucket list, KEYS[3] = legacy sorted set,
--         KEYS[4..] = expired bucket lists
--         ARGV[1] = bucket end (ms), ARGV[2] = blob of 8-byte ids, ARGV[3] = drop legacy ids
--         folded before this (ms), ARGV[4..] = index fields of the expired buckets
local mode = ARGV[#ARGV]
if mode == 'read' then
  local out, ids, flags = {}, ARGV[1], {}
  if #ids == 0 and redis.call('EXISTS', KEYS[1]) == 1 then
    flags[1] = '?'
  elseif #ids > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
    local chunk = {}
    local function flush()
      local scores = redis.call('ZMSCORE', KEYS[1], unpack(chunk))
      for j = 1, #chunk do
        flags[#flags + 1] = scores[j] and '1' or '0'
      end
      chunk = {}
    end
    for i = 1, #ids, 16 do
      chunk[#chunk + 1] = string.sub(ids, i, i + 15)
      if #chunk >= 4000 then
        flush()
      end
    end
    if #chunk > 0 then
      flush()
    end
  end
  out[1] = table.concat(flags)
  local ends = redis.call('HKEYS', KEYS[2])
  out[2] = ends
  local passed = {}
  for k = 3, #KEYS do
    passed[ARGV[3 * k - 7]] = true
  end
  for _, e in ipairs(ends) do
    if not passed[e] then
      return out
    end
  end
  for k = 3, #KEYS do
    local known, digest = tonumber(ARGV[3 * k - 6]), ARGV[3 * k - 5]
    local start = known
    if known > 0 then
      local last = redis.call('LINDEX', KEYS[k], known - 1)
      if not last or redis.sha1hex(last) ~= digest then
        start = 0
      end
    end
    out[#out + 1] = start
    out[#out + 1] = redis.call('LRANGE', KEYS[k], start, -1)
  end
  return out
end
-- The mode is the call's last argument: anything but the two named is a caller's error,
-- never an append.
if mode ~= 'add' then
  return redis.error_reply('replay.lua: unknown mode ' .. tostring(mode))
end
if #ARGV[2] > 0 then
  redis.call('RPUSH', KEYS[2], ARGV[2])
  -- Every add writes the index, so a fold that read it under WATCH sees any concurrent add.
  redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
end
for k = 4, #KEYS do
  redis.call('DEL', KEYS[k])
  redis.call('HDEL', KEYS[1], ARGV[k])
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. ARGV[3])
return #ARGV[2] / 8
