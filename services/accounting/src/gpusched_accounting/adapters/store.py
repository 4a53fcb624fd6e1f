"""Redis store of usage rollups. A batch of usage rows is applied by one Lua script: for each
row it marks the event id in the request's hash and, only if it was new, adds the row to the
minute, hour and day buckets of its tenant and of all tenants, all in one atomic step.

Layout (all counters packed "prompt completion requests gpu_us cost_nusd", integers):
  gpusched:usage:req:<request_id>      hash: e:<event>|~<suffix> (applied event ids), u (the
                                       request's totals), k ("tenant model"), f (a final
                                       record was seen), r (request counted); TTL dedup_ttl_s
  gpusched:usage:t:<tenant>:<g>:<s>    hash per tenant and bucket (g = m|h|d, s = start, epoch
                                       seconds): t, m:<model>, n:<node>, g:<gpu>, c:<class>
  gpusched:usage:all:<g>:<s>           the same over all tenants, plus u:<tenant>
  gpusched:usage:tenants               set of tenants ever billed
Buckets expire `retention` after their end; request hashes `dedup_ttl_s` after their last
record. Rows older than the dedup window are refused (-1): they could be duplicates that
can no longer be recognised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from gpusched_accounting.domain.budgets import EXHAUSTED_KEY
from gpusched_accounting.domain.usage import (
    GRANULARITY_CODE,
    TOTAL_FIELD,
    Granularity,
    Totals,
    UsageRow,
    unpack,
)

TENANTS_KEY = "gpusched:usage:tenants"
REQUEST_KEY = "gpusched:usage:req:{}"
APPLIED, DUPLICATE, STALE = 1, 0, -1

_APPLY = """
local rows = cjson.decode(ARGV[1])
local now_ms = tonumber(ARGV[2])
local dedup_ttl = tonumber(ARGV[3])
local grans = {{'m', 60, tonumber(ARGV[4])}, {'h', 3600, tonumber(ARGV[5])},
               {'d', 86400, tonumber(ARGV[6])}}
local oldest_ms = now_ms - dedup_ttl * 1000
local fmt = '%d %d %d %d %d'
local pat = '^(%d+) (%d+) (%d+) (%d+) (%d+)$'
local agg, names, expire_at, tenants, out = {}, {}, {}, {}, {}
local per_minute, minute_of = {}, {}

-- rows add into (tenant, minute) tables first; hours, days and the all-tenants scope are
-- derived from those once per batch, so the per-row work does not grow with them
local function add(key, field, p, c, r, g, n)
  local h = per_minute[key]
  local v = h[field]
  if v then
    v[1] = v[1] + p; v[2] = v[2] + c; v[3] = v[3] + r; v[4] = v[4] + g; v[5] = v[5] + n
  else
    h[field] = {p, c, r, g, n}
  end
end

local function add_to(key, field, w)
  local h = agg[key]
  if not h then h = {}; agg[key] = h; names[key] = {} end
  local v = h[field]
  if v then
    v[1] = v[1] + w[1]; v[2] = v[2] + w[2]; v[3] = v[3] + w[3]; v[4] = v[4] + w[4]
    v[5] = v[5] + w[5]
  else
    h[field] = {w[1], w[2], w[3], w[4], w[5]}
    local list = names[key]
    list[#list + 1] = field
  end
end

for i, e in ipairs(rows) do
  local ended_ms = e[14]
  local rkey = 'gpusched:usage:req:' .. e[2]
  if ended_ms < oldest_ms then
    out[i] = -1
  elseif redis.call('HSETNX', rkey, e[1], 1) == 0 then
    out[i] = 0
  else
    out[i] = 1
    local tenant = e[3]
    local p, c, g, n = e[8], e[9], e[10], e[11]
    local r = 0
    if e[13] == 1 and redis.call('HSETNX', rkey, 'r', 1) == 1 then r = 1 end
    local a1, a2, a3, a4, a5 = 0, 0, 0, 0, 0
    local prev = redis.call('HGET', rkey, 'u')
    if prev then
      a1, a2, a3, a4, a5 = string.match(prev, pat)
    end
    local packed = string.format(fmt, a1 + p, a2 + c, a3 + r, a4 + g, a5 + n)
    if e[12] == 1 then
      redis.call('HSET', rkey, 'u', packed, 'k', tenant .. ' ' .. e[4], 'f', 1)
    else
      redis.call('HSET', rkey, 'u', packed, 'k', tenant .. ' ' .. e[4])
    end
    redis.call('EXPIRE', rkey, dedup_ttl)
    local sec = math.floor(ended_ms / 1000)
    local minute = sec - sec % 60
    local mk = tenant .. ' ' .. minute
    if not per_minute[mk] then
      per_minute[mk] = {}
      minute_of[mk] = {tenant, minute}
      tenants[tenant] = true
    end
    add(mk, 't', p, c, r, g, n); add(mk, 'm:' .. e[4], p, c, r, g, n)
    add(mk, 'n:' .. e[5], p, c, r, g, n); add(mk, 'g:' .. e[6], p, c, r, g, n)
    add(mk, 'c:' .. e[7], p, c, r, g, n)
  end
end

for mk, h in pairs(per_minute) do
  local tenant, minute = minute_of[mk][1], minute_of[mk][2]
  local fu = 'u:' .. tenant
  for _, gr in ipairs(grans) do
    local start = minute - minute % gr[2]
    local suffix = gr[1] .. ':' .. start
    local tk = 'gpusched:usage:t:' .. tenant .. ':' .. suffix
    local ak = 'gpusched:usage:all:' .. suffix
    if not expire_at[tk] then
      expire_at[tk] = start + gr[2] + gr[3]
      expire_at[ak] = start + gr[2] + gr[3]
    end
    for f, v in pairs(h) do
      add_to(tk, f, v); add_to(ak, f, v)
    end
    add_to(ak, fu, h['t'])
  end
end

local CHUNK = 1000
for key, h in pairs(agg) do
  local list = names[key]
  for first = 1, #list, CHUNK do
    local last = math.min(first + CHUNK - 1, #list)
    local cur = redis.call('HMGET', key, unpack(list, first, last))
    local args = {}
    for j = first, last do
      local f = list[j]
      local v = h[f]
      local s = cur[j - first + 1]
      if s then
        local b1, b2, b3, b4, b5 = string.match(s, pat)
        v[1] = v[1] + b1; v[2] = v[2] + b2; v[3] = v[3] + b3; v[4] = v[4] + b4
        v[5] = v[5] + b5
      end
      args[#args + 1] = f
      args[#args + 1] = string.format(fmt, v[1], v[2], v[3], v[4], v[5])
    end
    redis.call('HSET', key, unpack(args))
  end
  redis.call('EXPIREAT', key, expire_at[key])
end
for t in pairs(tenants) do redis.call('SADD', 'gpusched:usage:tenants', t) end
return out
"""
"""ARGV: rows as JSON (`_lua_row`), now_ms, dedup_ttl_s, then the retention in seconds of
minute, hour and day buckets. Returns one status per row: 1 applied, 0 applied before (no
change), -1 older than the dedup window (not applied). Keys are built inside the script, so
this needs one Redis (or a cluster slot per batch), not Redis Cluster across slots."""


_WINDOW = """
local prefix = ARGV[1]
local plen = #prefix
local pat = '^(%d+) (%d+) (%d+) (%d+) (%d+)$'
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
      local a, b, c, d, e = string.match(flat[j + 1], pat)
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
  out[#out + 1] = string.format('%d %d %d %d %d', v[1], v[2], v[3], v[4], v[5])
end
return out
"""
"""KEYS: bucket hashes; ARGV[1]: field prefix ('' = totals only). Returns the summed total
and prefixed fields, packed: one round trip and a small reply for a window of any size."""


@dataclass(frozen=True)
class Retention:
    """How long buckets are kept after they end, seconds."""

    minute_s: int
    hour_s: int
    day_s: int

    def as_dict(self) -> dict[Granularity, int]:
        return {"minute": self.minute_s, "hour": self.hour_s, "day": self.day_s}


def _dedup_field(row: UsageRow) -> str:
    """The event id as a field of its request's hash: without the request id prefix that
    event ids usually carry (memory), and prefixed so the two forms never collide."""
    if row.event_id.startswith(row.request_id):
        return "~" + row.event_id[len(row.request_id):]
    return "e:" + row.event_id


def _lua_row(row: UsageRow) -> list[str | int]:
    out = row.as_json_row()
    out[0] = _dedup_field(row)
    return out


def bucket_key(tenant: str | None, granularity: Granularity, start_s: int) -> str:
    """A tenant's bucket, or the all-tenants bucket when tenant is None."""
    suffix = f"{GRANULARITY_CODE[granularity]}:{start_s}"
    return f"gpusched:usage:all:{suffix}" if tenant is None else \
        f"gpusched:usage:t:{tenant}:{suffix}"


class UsageStore:
    def __init__(self, redis: Redis, dedup_ttl_s: int, retention: Retention) -> None:
        self._redis = redis
        self.dedup_ttl_s = dedup_ttl_s
        self.retention = retention
        self._apply = redis.register_script(_APPLY)
        self._window = redis.register_script(_WINDOW)

    async def apply(self, rows: Sequence[UsageRow], now_ms: int) -> list[int]:
        """Apply rows in one atomic script (one round trip); returns a status per row
        (APPLIED, DUPLICATE, STALE). Safe to repeat: applied event ids change nothing."""
        if not rows:
            return []
        payload = json.dumps([_lua_row(r) for r in rows], separators=(",", ":"))
        r = self.retention
        result = await self._apply(args=[payload, now_ms, self.dedup_ttl_s, r.minute_s, r.hour_s,
                                         r.day_s])
        return [int(s) for s in result]

    async def tenants(self) -> list[str]:
        return sorted(m.decode() for m in await self._redis.smembers(TENANTS_KEY))

    async def buckets(self, tenant: str | None, buckets: Iterable[tuple[Granularity, int]],
                      only_total: bool = False) -> list[dict[str, Totals]]:
        """Each bucket's fields (or just its total), in order; an absent bucket is empty."""
        async with self._redis.pipeline(transaction=False) as pipe:
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
        raw = await self._redis.hmget(REQUEST_KEY.format(request_id), ["u", "k", "f"])
        if raw[1] is None:
            return None
        tenant, _, model = raw[1].decode().partition(" ")
        return {"request_id": request_id, "tenant": tenant, "model": model,
                "final": raw[2] is not None, **unpack(raw[0]).public()}

    async def spending(self, tenant: str, day_starts_s: Sequence[int]) -> Totals:
        """A tenant's totals over the given day buckets (a budget period)."""
        total = Totals()
        for fields in await self.buckets(tenant, [("day", s) for s in day_starts_s],
                                         only_total=True):
            total = total + fields.get(TOTAL_FIELD, Totals())
        return total

    async def set_exhausted(self, tenant: str, value: dict, until_ms: int) -> bool:
        """Flag the tenant's budget as spent until `until_ms`; True if newly flagged."""
        return bool(await self._redis.set(EXHAUSTED_KEY.format(tenant), json.dumps(value),
                                          nx=True, pxat=until_ms))

    async def clear_exhausted(self, tenant: str) -> None:
        await self._redis.delete(EXHAUSTED_KEY.format(tenant))
