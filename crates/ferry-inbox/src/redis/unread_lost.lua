-- Entries of stream KEYS[1] that group ARGV[1] never read because they were
-- removed first: by MAXLEN or XTRIM, or by XDEL, which Redis does not tell
-- apart once the group has read past them. Redis 7 counts the entries added
-- to the stream (entries-added) and, per group, the entries read
-- (entries-read); `lag`, their difference, takes in the removed entries,
-- which a group reading past them never counts as read. Subtracting the
-- entries still present after the group's last-delivered id leaves the
-- loss. The group's counter is then set to the truth, in this same script,
-- so that each loss is reported once.
--
-- Redis cannot count a range of a stream without returning its entries, so
-- the script counts the smaller side of the last-delivered id, at most
-- ARGV[2] entries each: the entries after it (few when the group keeps up),
-- else those from the stream's first entry up to it (few when the group
-- trails a trimmed stream), the entries after it being the length less
-- those.
--
-- Returns {lost, last-delivered id, first entry id or ''} when entries were
-- lost; otherwise {0, '', ''}, or {-1, '', ''} when this Redis keeps no
-- counters (before 7.0), or {-2, '', ''} when Redis does not know the
-- group's read counter now and the group has entries to read (an entry
-- deleted with XDEL after the last-delivered id, or a group created or set
-- to an id without ENTRIESREAD that has not read since), or {-3,
-- last-delivered id, ''} when more than ARGV[2] entries lie on each side of
-- it.
local function field(reply, name)
  for i = 1, #reply, 2 do
    if reply[i] == name then return reply[i + 1] end
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, '', ''} end
local group
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  if field(g, 'name') == ARGV[1] then group = g end
end
if not group then return {0, '', ''} end
-- Absent before Redis 7.0; nil (false here) when Redis cannot compute them.
local lag, read = field(group, 'lag'), field(group, 'entries-read')
if lag == nil then return {-1, '', ''} end
-- Nothing left to read, so nothing lost unread. A group just created, or
-- set, at the stream's end (or on an empty stream) has no entries-read but
-- a lag of 0: nothing to warn of.
if lag == 0 then return {0, '', ''} end
if not lag or not read then return {-2, '', ''} end
local stream = redis.call('XINFO', 'STREAM', KEYS[1])
local length, added = field(stream, 'length'), field(stream, 'entries-added')
local last = field(group, 'last-delivered-id')
local after, first = length, ''
if length > 0 and #redis.call('XRANGE', KEYS[1], '-', last, 'COUNT', 1) == 0 then
  -- Every entry present follows the last-delivered id: any gap is ahead.
  first = field(stream, 'first-entry')[1]
elseif length > 0 then
  local limit = tonumber(ARGV[2])
  -- No more than `lag` entries follow the last-delivered id.
  after = #redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', math.min(limit, lag) + 1)
  if after > limit then
    local upto = #redis.call('XRANGE', KEYS[1], '-', last, 'COUNT', limit + 1)
    if upto > limit then return {-3, last, ''} end
    after = length - upto
  end
end
local lost = lag - after
if lost <= 0 then return {0, '', ''} end
redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', added - after)
return {lost, last, first}
