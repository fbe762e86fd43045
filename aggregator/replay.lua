-- Replay detection over a sorted set of 16-byte record ids (score: the fold time in ms).
-- The ids travel as one binary blob so that a batch costs one round trip and no per-id
-- protocol work in the client.
--   check: KEYS[1] = seen set, ARGV[1] = ids blob            -> one '0'/'1' per id (1 = seen)
--   add:   KEYS[1] = seen set, ARGV[1] = ids blob, ARGV[2] = score, ARGV[3] = expire-before score
local mode = ARGV[#ARGV]
local key, ids = KEYS[1], ARGV[1]
if mode == 'check' then
  local out, chunk = {}, {}
  local function flush()
    local scores = redis.call('ZMSCORE', key, unpack(chunk))
    for j = 1, #chunk do
      out[#out + 1] = scores[j] and '1' or '0'
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
  return table.concat(out)
end
local score, chunk = ARGV[2], {}
for i = 1, #ids, 16 do
  chunk[#chunk + 1] = score
  chunk[#chunk + 1] = string.sub(ids, i, i + 15)
  if #chunk >= 4000 then
    redis.call('ZADD', key, unpack(chunk))
    chunk = {}
  end
end
if #chunk > 0 then
  redis.call('ZADD', key, unpack(chunk))
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', '(' .. ARGV[3])
return #ids / 16
