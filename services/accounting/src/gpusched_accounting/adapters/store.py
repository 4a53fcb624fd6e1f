"""Redis store of usage rollups. A batch of usage rows is applied by one Lua script that
marks each new event id in its request's hash and adds the batch's new rows to the minute,
hour and day buckets of their tenants and of all tenants, all in one atomic step.

Layout (counters are packed as five little-endian int64: prompt tokens, completion tokens,
requests, gpu_us, cost_nusd; `domain.usage.unpack` reads them):
  gpusched:usage:req:<request_id>      string: the request's counters, a final record seen
                                       (byte), request counted (byte), "tenant model" (length
                                       uint16, then text), a newline, the token positions
                                       billed when any were (byte 0xFE, the prompt's spans,
                                       ';', the reply's: from,to,from,to..., a newline), then
                                       the applied event ids, each followed by a newline,
                                       then its content digest as a line of its own: byte
                                       0xFF, 16 hex digits, a newline (absent for ids applied
                                       before digests were kept); TTL dedup_ttl_s
                                       + DEDUP_MARGIN_S
  gpusched:usage:t:<tenant>:<g>:<s>    hash per tenant and bucket (g = m|h|d, s = start, epoch
                                       seconds): t, m:<model>, n:<node>, g:<gpu>, c:<class>
  gpusched:usage:all:<g>:<s>           the same over all tenants, plus u:<tenant>
  gpusched:usage:tenants               set of tenants ever billed
Buckets expire `retention` after their end; request records `dedup_ttl_s` + DEDUP_MARGIN_S
after their last record. Rows older than the dedup window whose event id is no longer kept
are refused (-1): they could be duplicates that can no longer be recognised (one still kept
is a duplicate, as any). A row whose event id was applied with another content digest is
refused too (-2, a conflict): it is another record under a reused id, not a redelivery.
A digest line starts with a byte UTF-8 never holds, so no id ever matches it, and a
release that keeps no digests still finds every id (a rolling upgrade); so does the
positions line, which a release that keeps no positions leaves as it is.

A record with positions bills only the prompt and completion positions its request has not
billed yet (`domain.usage.billed`): a request started over after its node died bills its
prompt and each reply position once.

Speed: Redis runs scripts one at a time, so the script does as little as it can. Python
guesses each row's outcome (new and counting its request, new, duplicate, stale, conflict)
and what each bills (every token, but for positions repeated in the batch), and sums the
bucket deltas of that guess; the script checks the guess against the request records and
applies it only if every row matches, else changes nothing and answers the true
outcomes, and Python sums again. Redelivered or concurrent batches cost one more round
trip, never a wrong count.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pydantic_core
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import NoScriptError

from gpusched_accounting.domain.usage import (
    COUNTED,
    COUNTERS_SIZE,
    DEDUP_MARGIN_S,
    GRANULARITY_CODE,
    NEW,
    TOTAL_FIELD,
    Billed,
    Granularity,
    Totals,
    UsageRow,
    bill_of,
    bucket_deltas,
    content_digest,
    guess_billed,
    guess_outcomes,
    unpack,
)
from gpusched_common.redis_keys import BUDGET_EXHAUSTED_KEY

TENANTS_KEY = "gpusched:usage:tenants"
REQUEST_KEY = "gpusched:usage:req:{}"
_REQUEST_PREFIX = REQUEST_KEY.format("")
APPLIED = NEW
"""Status `apply` gives a row it added (counting its request or not); the others are
`domain.usage.DUPLICATE`, `STALE` and `CONFLICT`."""
_MAX_ATTEMPTS = 5

_APPLY = r"""
local rows = cjson.decode(ARGV[1])
local want = cjson.decode(ARGV[2])
local now_ms = tonumber(ARGV[3])
local dedup_ttl = tonumber(ARGV[4])
local guessed = {}  -- row -> {prompt, completion, cost} it bills, where not all it carries
do
  local g = cjson.decode(ARGV[7])
  for j = 1, #g, 4 do guessed[g[j]] = {g[j + 1], g[j + 2], g[j + 3]} end
end
local oldest_ms = now_ms - dedup_ttl * 1000
local keep_ids_s = dedup_ttl + tonumber(ARGV[8])  -- the window and DEDUP_MARGIN_S
local HEAD = '<lllllBBH'

-- the twin of domain/usage.py:take: adds positions [start, start + n) to spans (sorted
-- disjoint [from, to) ranges, flattened; touching ones merged) and answers how many of them
-- it did not hold, and the new spans
local function take(spans, start, n)
  if n <= 0 then return 0, spans end
  local last = #spans
  if last == 0 or start > spans[last] then  -- after every span: the common cases
    spans[last + 1] = start; spans[last + 2] = start + n
    return n, spans
  elseif start == spans[last] then
    spans[last] = start + n
    return n, spans
  end
  local stop, lo, hi, covered, out, placed = start + n, start, start + n, 0, {}, false
  for i = 1, #spans, 2 do
    local a, b = spans[i], spans[i + 1]
    if b < lo or a > hi then
      if a > hi and not placed then out[#out + 1] = lo; out[#out + 1] = hi; placed = true end
      out[#out + 1] = a; out[#out + 1] = b
    else
      covered = covered + math.max(0, math.min(b, stop) - math.max(a, start))
      lo = math.min(lo, a); hi = math.max(hi, b)
    end
  end
  if not placed then out[#out + 1] = lo; out[#out + 1] = hi end
  return n - covered, out
end

local function spans_of(text)
  local t = {}
  for n in string.gmatch(text, '%d+') do t[#t + 1] = tonumber(n) end
  return t
end


-- 1. the true outcome of every row: -2 conflict, -1 stale, 0 duplicate, 1 new, 2 new and
-- first to count its request, and the prompt and completion tokens it bills; reads only,
-- so a wrong guess leaves Redis untouched
local outcome, billed_p, billed_c, req, same = {}, {}, {}, {}, true
for i, e in ipairs(rows) do
  local s
  local bp, bc = 0, 0
  local rkey = e[2]
  local q = req[rkey]
  if not q then
    local v = redis.call('GET', rkey)
    if v then
      local p, c, r, g, n, f, counted, klen, at = struct.unpack(HEAD, v)
      q = {p, c, r, g, n, f, counted, string.sub(v, at, at + klen - 1),
           string.sub(v, at + klen)}
    else
      q = {0, 0, 0, 0, 0, 0, 0, false, '\n'}  -- its owner: its first row not stale
    end
    if string.byte(q[9], 2) == 254 then  -- the prompt and completion positions billed
      local nl = string.find(q[9], '\n', 3, true)
      local ps, cs = string.match(string.sub(q[9], 3, nl - 1), '^([%d,]*);([%d,]*)$')
      q[12], q[13] = spans_of(ps), spans_of(cs)
      q[9] = string.sub(q[9], nl)
    end
    req[rkey] = q
  end
  local id = '\n' .. e[1] .. '\n'
  local at = string.find(q[9], id, 1, true)
  if not at and e[9] < oldest_ms then
    -- an id not kept, of a record too old for its id to be kept still: it cannot be told
    -- apart from a duplicate whose id was forgotten. One kept is judged as any other.
    s = -1
  else
    q[8] = q[8] or e[3]
    if q[8] ~= e[3] then
      s = -2  -- another tenant's or model's record under this request id: a reused id
    elseif at then
      -- applied before: a duplicate, unless its digest (the line after it) is another
      -- one's; an id kept without a digest (an older release's) is a duplicate
      local d = at + #id
      if string.byte(q[9], d) == 255 and string.sub(q[9], d + 1, d + #e[10]) ~= e[10]
         and (e[4] ~= 0 or e[5] ~= 0 or e[6] ~= 0 or e[8] == 1) then
        s = -2
      else
        s = 0
      end
    else
      q[9] = q[9] .. e[1] .. '\n\255' .. e[10] .. '\n'
      s = 1
      if e[8] == 1 and q[7] == 0 then s = 2; q[7] = 1 end
      bp, bc = e[4], e[5]
      if e[11] >= 0 then  -- positions its request billed before are not billed again
        bp, q[12] = take(q[12] or {}, e[11], e[4])
        bc, q[13] = take(q[13] or {}, e[12], e[5])
      end
      -- the guess's tokens; their cost is the guess's (the caller's prices): a wrong guess
      -- of the tokens writes nothing, and a right one has the right cost
      local gp, gc, cost = e[4], e[5], e[13]
      local g = guessed[i]
      if g then gp, gc, cost = g[1], g[2], g[3] end
      if bp ~= gp or bc ~= gc then same = false end
      q[1] = q[1] + bp; q[2] = q[2] + bc; q[3] = q[3] + (s == 2 and 1 or 0)
      q[4] = q[4] + e[6]; q[5] = q[5] + cost
      if e[7] == 1 then q[6] = 1 end
      q[10] = true
      -- a record ending after now (its agent's clock is ahead) stays redeliverable until
      -- its end + the window: its ids must be kept as long
      if e[9] > now_ms then q[11] = math.max(q[11] or 0, e[9]) end
    end
  end
  outcome[i] = s
  billed_p[i] = bp; billed_c[i] = bc
  if s ~= want[i] then same = false end
end
if not same then return {0, outcome, billed_p, billed_c} end

-- 2. the requests' new totals and event ids
for rkey, q in pairs(req) do
  if q[10] then
    -- never shorter than it is: an earlier record ending ahead may need its id kept longer
    -- (domain/usage.py:dedup_expires_at_ms states this rule, which recompute follows)
    local ttl = math.max(keep_ids_s + math.ceil(((q[11] or now_ms) - now_ms) / 1000),
                         redis.call('TTL', rkey))
    local pos = ''
    if q[12] and (#q[12] > 0 or #q[13] > 0) then
      pos = '\n\254' .. table.concat(q[12], ',') .. ';' .. table.concat(q[13], ',')
    end
    redis.call('SET', rkey, struct.pack(HEAD, q[1], q[2], q[3], q[4], q[5], q[6], q[7], #q[8])
               .. q[8] .. pos .. q[9], 'EX', ttl)
  end
end

-- 3. add the bucket deltas summed by the caller for exactly these outcomes
local COUNTERS = '<lllll'
local deltas = cjson.decode(ARGV[5])
local CHUNK = 1000
for _, d in ipairs(deltas) do
  local key, n = d[1], (#d - 2) / 6
  for first = 0, n - 1, CHUNK do
    local last = math.min(first + CHUNK, n) - 1
    local names = {}
    for j = first, last do names[#names + 1] = d[3 + j * 6] end
    local cur = redis.call('HMGET', key, unpack(names))
    local args = {}
    for j = first, last do
      local o = 3 + j * 6
      local p, c, r, g, m = d[o + 1], d[o + 2], d[o + 3], d[o + 4], d[o + 5]
      local s = cur[j - first + 1]
      if s then
        local b1, b2, b3, b4, b5 = struct.unpack(COUNTERS, s)
        p = p + b1; c = c + b2; r = r + b3; g = g + b4; m = m + b5
      end
      args[#args + 1] = d[o]
      args[#args + 1] = struct.pack(COUNTERS, p, c, r, g, m)
    end
    redis.call('HSET', key, unpack(args))
  end
  redis.call('EXPIREAT', key, d[2])
end
local tenants = cjson.decode(ARGV[6])
for first = 1, #tenants, CHUNK do
  redis.call('SADD', 'gpusched:usage:tenants',
             unpack(tenants, first, math.min(first + CHUNK - 1, #tenants)))
end
return {1, outcome}
"""
"""ARGV: rows as JSON (`_lua_row`), the guessed outcome of each row (JSON), now_ms,
dedup_ttl_s, the bucket deltas of that guess as JSON ([key, expire_at_s, field, prompt,
completion, requests, gpu_us, cost_nusd, field, ...], ...), the tenants with a new row
(JSON), what the new rows that do not bill all they carry bill in that guess (JSON,
[row (1-based), prompt, completion, cost_nusd, row, ...]) and DEDUP_MARGIN_S.
Returns {1, outcomes} when the guess was right and applied, else {0, true outcomes, true
prompt tokens billed, true completion tokens billed} and nothing changed. Keys are built by
the caller, so this needs one Redis (or a cluster slot per batch), not Redis Cluster across
slots."""


_WINDOW = """
local prefix = ARGV[1]
local plen = #prefix
local COUNTERS = '<lllll'
local sums, order = {}, {}
for _, key in ipairs(KEYS) do
  local flat
  if plen == 0 then
    local v = redis.call('HGET', key, 't')
    flat = v and {'t', v} or {}
  else
    flat = redis.call('HGETALL', key)
  end
  for j = 1, #flat, 2 do
    local f = flat[j]
    if f == 't' or string.sub(f, 1, plen) == prefix then
      local a, b, c, d, e = struct.unpack(COUNTERS, flat[j + 1])
      local v = sums[f]
      if v then
        v[1] = v[1] + a; v[2] = v[2] + b; v[3] = v[3] + c; v[4] = v[4] + d; v[5] = v[5] + e
      else
        sums[f] = {a + 0, b + 0, c + 0, d + 0, e + 0}
        order[#order + 1] = f
      end
    end
  end
end
local out = {}
for _, f in ipairs(order) do
  local v = sums[f]
  out[#out + 1] = f
  out[#out + 1] = struct.pack(COUNTERS, v[1], v[2], v[3], v[4], v[5])
end
return out
"""
"""KEYS: bucket hashes; ARGV[1]: field prefix ('' = totals only). Returns the summed total
and prefixed fields, packed: one round trip and a small reply for a window of any size."""


_BUDGET_FLAG = """
local old = redis.call('GET', KEYS[1])
local ok, flag = false, nil
if old then ok, flag = pcall(cjson.decode, old) end
if not ok or type(flag) ~= 'table' then flag = nil end  -- none, or not ours: replaced
if flag and (tonumber(flag.period_start_ms) or 0) > tonumber(ARGV[2]) then
  return -1  -- a check of a later moment set it: this one judged a period already over
end
local read = flag and cjson.decode(ARGV[7])[tostring(flag.period) .. ' ' .. tostring(flag.unit)]
if read and tonumber(flag.spent) and tonumber(flag.spent) > tonumber(read) then
  return -1  -- set from a later reading of its period (spending only grows): it stands
end
if ARGV[1] == 'clear' then
  redis.call('DEL', KEYS[1])
  return 0
end
local same = flag ~= nil and flag.period == ARGV[3]
if ARGV[1] == 'announced' and old ~= ARGV[4] then
  return -1  -- replaced or cleared since it was set: not written back
end
local clock = redis.call('TIME')
if tonumber(ARGV[6]) <= tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000) then
  return -1  -- its period is over by Redis's clock (the checker's is behind): no flag
end
-- a flag of the same period without the mark is an older release's, which published first
local told = ARGV[1] == 'announced' or (same and flag.announced ~= false)
redis.call('SET', KEYS[1], told and ARGV[5] or ARGV[4], 'PXAT', ARGV[6])
return told and 0 or 1
"""
"""KEYS: a tenant's budget flag. ARGV: 1 what to do ('set', 'announced' or 'clear'), 2 the
moment the budgets were judged at (ms), 3 the period judged, 4 and 5 the flag as stored with
its event still to go out and with it out, 6 when it expires (ms), 7 what the check read as
spent, by "<period> <unit>" (JSON). Leaves the flag as it is (-1) where its period starts
after the moment judged (a check of an earlier moment, a batch begun before midnight or a
replica whose clock is behind, would clear it or replace it with a flag of a period already
over), or where its spending is above what the check read of its period and unit (another
instance read it later: spending only grows; a check from the older reading lifted a spent
budget, or shortened a month's flag to a day's, announcing both again). 'set' answers 1
where the flag's event is still to be published, 0 where it is out; 'announced' marks the
flag as 'set' wrote it, if nobody replaced it since. A flag whose period is over by Redis's
clock is neither set nor marked (-1): set for an instant, it was gone at once and its event
published again each check."""


Readings = dict[tuple[str, str], float]
"""What a budget check read as spent, by (period label, unit)."""


@dataclass(frozen=True)
class Retention:
    """How long buckets are kept after they end, seconds."""

    minute_s: int
    hour_s: int
    day_s: int

    def as_dict(self) -> dict[Granularity, int]:
        return {"minute": self.minute_s, "hour": self.hour_s, "day": self.day_s}


def _dedup_field(row: UsageRow) -> str:
    """The event id as stored in its request's record: without the request id prefix that
    event ids usually carry (memory), prefixed so the forms never collide, and hashed when it
    holds a newline (the separator of the stored ids)."""
    if "\n" in row.event_id:
        return "#" + hashlib.sha256(row.event_id.encode()).hexdigest()
    if row.event_id.startswith(row.request_id):
        return "~" + row.event_id[len(row.request_id):]
    return "e:" + row.event_id


def _lua_row(row: UsageRow) -> list[str | int]:
    """What the Lua apply reads of a row (1-based there): 1 dedup field, 2 request key,
    3 "tenant model", 4-6 prompt, completion, gpu_us, 7 final, 8 counts the request,
    9 ended_at_ms, 10 content digest, 11-12 prompt_from, completion_from, 13 cost_nusd."""
    return [_dedup_field(row), _REQUEST_PREFIX + row.request_id, row.tenant + " " + row.model,
            row.prompt_tokens, row.completion_tokens, row.gpu_us, int(row.final),
            int(row.counts_request), row.ended_at_ms, content_digest(row), row.prompt_from,
            row.completion_from, row.cost_nusd]


def _partly(rows: Sequence[UsageRow], outcomes: Sequence[int],
            bills: Sequence[Billed | UsageRow]) -> list[int]:
    """The apply script's guess of what new rows bill, where one does not bill all its
    tokens (the script takes the others' as they are): [row (1-based), prompt, completion,
    cost, ...]."""
    out: list[int] = []
    for i, (row, outcome, bill) in enumerate(zip(rows, outcomes, bills), 1):
        if outcome >= NEW and (bill.prompt_tokens != row.prompt_tokens
                               or bill.completion_tokens != row.completion_tokens):
            out += (i, bill.prompt_tokens, bill.completion_tokens, bill.cost_nusd)
    return out


def bucket_key(tenant: str | None, granularity: Granularity, start_s: int) -> str:
    """A tenant's bucket, or the all-tenants bucket when tenant is None."""
    suffix = f"{GRANULARITY_CODE[granularity]}:{start_s}"
    return f"gpusched:usage:all:{suffix}" if tenant is None else \
        f"gpusched:usage:t:{tenant}:{suffix}"


class PendingApply:
    """An apply whose script was sent to Redis: Redis runs it while the caller goes on (the
    consumer parses the next chunk); `result` reads the outcome. Holds one connection of the
    pool until `result` or `abandon`."""

    def __init__(self, store: UsageStore, rows: Sequence[UsageRow], now_ms: int) -> None:
        self._store, self._rows, self._now_ms = store, rows, now_ms
        self._payload = pydantic_core.to_json([_lua_row(r) for r in rows])
        self._outcomes = guess_outcomes(rows, now_ms - store.dedup_ttl_s * 1000)
        self._bills = guess_billed(rows, self._outcomes)
        self._conn: Connection | None = None

    async def send(self) -> None:
        pool = self._store.redis.connection_pool
        self._conn = await pool.get_connection()
        try:
            await self._send()
        except BaseException:
            await self.abandon()
            raise

    async def _send(self) -> None:
        assert self._conn is not None
        buckets, tenants = bucket_deltas(self._rows, self._outcomes, self._bills,
                                         self._store.retention.as_dict())
        deltas = []
        for bucket, (expire_at_s, fields) in buckets.items():
            flat: list[str | int] = [bucket_key(*bucket), expire_at_s]
            for name, v in fields.items():
                flat.append(name)
                flat.extend(v)
            deltas.append(flat)
        await self._conn.send_command(
            "EVALSHA", await self._store.apply_sha(), 0, self._payload,
            pydantic_core.to_json(self._outcomes), self._now_ms, self._store.dedup_ttl_s,
            pydantic_core.to_json(deltas), pydantic_core.to_json(tenants),
            pydantic_core.to_json(_partly(self._rows, self._outcomes, self._bills)),
            DEDUP_MARGIN_S)

    async def result(self) -> list[int]:
        """Statuses per row (APPLIED, DUPLICATE, STALE, CONFLICT), once the rows are
        applied."""
        assert self._conn is not None, "send() first"
        try:
            for _ in range(_MAX_ATTEMPTS):
                try:
                    done, outcomes, *bills = await self._conn.read_response()
                except NoScriptError:  # Redis restarted and lost its script cache
                    await self._store.apply_sha(reload=True)
                    await self._send()
                    continue
                self._outcomes = [int(o) for o in outcomes]
                if bills:
                    self._bills = [bill_of(row, int(p), int(c))
                                   for row, p, c in zip(self._rows, *bills)]
                if done:
                    return [APPLIED if o in (NEW, COUNTED) else o for o in self._outcomes]
                await self._send()  # a guess was wrong: nothing was written; sum again
            raise RuntimeError(f"usage batch kept changing under the apply ({_MAX_ATTEMPTS} "
                               "attempts): another writer applies the same events")
        except BaseException:
            await self.abandon()
            raise
        finally:
            await self._release()

    async def abandon(self) -> None:
        """Drop the connection (its reply would be stale) and hand it back."""
        if self._conn is not None:
            await self._conn.disconnect()
            await self._release()

    async def _release(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await self._store.redis.connection_pool.release(conn)


class UsageStore:
    def __init__(self, redis: Redis, dedup_ttl_s: int, retention: Retention) -> None:
        self.redis = redis
        self.dedup_ttl_s = dedup_ttl_s
        self.retention = retention
        self._apply_sha: str | None = None
        self._window = redis.register_script(_WINDOW)
        self._budget_flag = redis.register_script(_BUDGET_FLAG)

    async def apply_sha(self, reload: bool = False) -> str:
        if self._apply_sha is None or reload:
            self._apply_sha = await self.redis.script_load(_APPLY)
        return self._apply_sha

    async def send_apply(self, rows: Sequence[UsageRow], now_ms: int) -> PendingApply:
        """Send the apply of `rows` (one atomic script) and return at once; Redis works on
        it while the caller goes on. Await `result()` of the answer (exactly once)."""
        pending = PendingApply(self, rows, now_ms)
        await pending.send()
        return pending

    async def apply(self, rows: Sequence[UsageRow], now_ms: int) -> list[int]:
        """Apply rows in one atomic script (one round trip, two when a row was seen before);
        returns a status per row (APPLIED, DUPLICATE, STALE, CONFLICT). Safe to repeat:
        applied event ids change nothing."""
        if not rows:
            return []
        return await (await self.send_apply(rows, now_ms)).result()

    async def tenants(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(TENANTS_KEY))

    async def buckets(self, tenant: str | None, buckets: Iterable[tuple[Granularity, int]],
                      only_total: bool = False) -> list[dict[str, Totals]]:
        """Each bucket's fields (or just its total), in order; an absent bucket is empty."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for g, start in buckets:
                key = bucket_key(tenant, g, start)
                if only_total:
                    pipe.hget(key, TOTAL_FIELD)
                else:
                    pipe.hgetall(key)
            raw = await pipe.execute()
        if only_total:
            return [{TOTAL_FIELD: unpack(v)} if v else {} for v in raw]
        return [{k.decode(): unpack(v) for k, v in h.items()} for h in raw]

    async def window(self, tenant: str | None, buckets: Sequence[tuple[Granularity, int]],
                     prefix: str | None) -> tuple[Totals, dict[str, Totals]]:
        """Totals over buckets, and per value of one dimension (fields starting with
        `prefix`, e.g. 'm:'); prefix None reads only the totals."""
        if not buckets:
            return Totals(), {}
        flat = await self._window(keys=[bucket_key(tenant, g, s) for g, s in buckets],
                                  args=[prefix or ""])
        total, groups = Totals(), {}
        for name, value in zip(flat[::2], flat[1::2]):
            name = name.decode()
            if name == TOTAL_FIELD:
                total = unpack(value)
            else:
                groups[name[len(prefix or ""):]] = unpack(value)
        return total, groups

    async def request_usage(self, request_id: str) -> dict | None:
        raw = await self.redis.get(REQUEST_KEY.format(request_id))
        if raw is None:
            return None
        final, _, k_len = struct.unpack_from("<BBH", raw, COUNTERS_SIZE)
        start = COUNTERS_SIZE + 4
        tenant, _, model = raw[start:start + k_len].decode().partition(" ")
        return {"request_id": request_id, "tenant": tenant, "model": model,
                "final": bool(final), **unpack(raw[:COUNTERS_SIZE]).public()}

    async def spending(self, tenant: str, day_starts_s: Sequence[int]) -> Totals:
        """A tenant's totals over the given day buckets (a budget period)."""
        total = Totals()
        for fields in await self.buckets(tenant, [("day", s) for s in day_starts_s],
                                         only_total=True):
            total = total + fields.get(TOTAL_FIELD, Totals())
        return total

    async def set_exhausted(self, tenant: str, value: dict, until_ms: int,
                            judged_at_ms: int, read: Readings | None = None) -> bool:
        """Flag the tenant's budget as spent until `until_ms` (the end of `value`'s `period`,
        which starts at its `period_start_ms`), as judged at `judged_at_ms` from `read`
        (what the check read as spent, by period label and unit), replacing a flag set
        before unless it is of a later period or from a later reading (`_BUDGET_FLAG`); True
        while its `budget_exhausted` event is still to be published: newly flagged, flagged
        before for another period, or its event not out yet (`announced` says it is). False
        where the flag was left as it was."""
        return await self._flag("set", tenant, judged_at_ms, value, until_ms, read) == 1

    async def announced(self, tenant: str, value: dict, until_ms: int) -> None:
        """Mark the flag `set_exhausted` wrote, if it is still as it wrote it: its event is
        out."""
        await self._flag("announced", tenant, value["period_start_ms"], value, until_ms)

    async def clear_exhausted(self, tenant: str, judged_at_ms: int,
                              read: Readings | None = None) -> None:
        """Clear the tenant's flag, unless it is of a period starting after `judged_at_ms`
        or from a later reading than `read` (none: a tenant without budgets)."""
        await self._flag("clear", tenant, judged_at_ms, read=read)

    async def _flag(self, op: str, tenant: str, judged_at_ms: int, value: dict | None = None,
                    until_ms: int = 0, read: Readings | None = None) -> int:
        flag = ("", "", "") if value is None else (
            value["period"], json.dumps(value | {"announced": False}),
            json.dumps(value | {"announced": True}))
        readings = json.dumps({f"{period} {unit}": spent
                               for (period, unit), spent in (read or {}).items()})
        return await self._budget_flag(keys=[BUDGET_EXHAUSTED_KEY.format(tenant)],
                                       args=[op, judged_at_ms, *flag, until_ms, readings])

    async def exhausted_tenants(self) -> set[str]:
        """The tenants flagged now."""
        prefix = BUDGET_EXHAUSTED_KEY.format("")
        return {key.decode()[len(prefix):] async for key in
                self.redis.scan_iter(match=prefix + "*", count=1000)}
