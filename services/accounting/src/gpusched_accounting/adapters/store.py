"""Redis store of usage counters: each event applied atomically and at most once (a Lua
script marks the event id and bumps every counter in one step)."""

from __future__ import annotations

from redis.asyncio import Redis

from gpusched_accounting.domain.usage import (
    MODELS_KEY,
    TENANTS_KEY,
    Increment,
    tenant_key,
    tenant_model_key,
    totals_from_hash,
)

# KEYS: dedup key, tenants set, models-of-tenant set, counter hashes...
# ARGV: ttl seconds, tenant, model, number of fields, field, value, field, value, ...
# Returns 1 when applied, 0 when the event id was applied before.
_APPLY = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) then return 0 end
redis.call('SADD', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[3])
local n = tonumber(ARGV[4])
for i = 4, #KEYS do
  for j = 0, n - 1 do
    local v = tonumber(ARGV[6 + 2 * j])
    if v ~= 0 then redis.call('HINCRBY', KEYS[i], ARGV[5 + 2 * j], v) end
  end
end
return 1
"""


class UsageStore:
    def __init__(self, redis: Redis, dedup_ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = dedup_ttl_s
        self._apply = redis.register_script(_APPLY)

    async def apply(self, increments: list[tuple[Increment, str]]) -> int:
        """Apply (increment, model) pairs in one pipelined round trip; returns how many were
        new. Safe to repeat: already-applied event ids change nothing."""
        if not increments:
            return 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for inc, model in increments:
                args: list[str | int] = [self._ttl_s, inc.tenant, model, len(inc.fields)]
                for name, value in inc.fields:
                    args += [name, value]
                await self._apply(keys=[inc.dedup_key, TENANTS_KEY, MODELS_KEY.format(inc.tenant),
                                        *inc.hashes], args=args, client=pipe)
            results = await pipe.execute()
        return sum(int(r) for r in results)

    async def tenants(self) -> list[str]:
        return sorted(m.decode() for m in await self._redis.smembers(TENANTS_KEY))

    async def tenant_totals(self, tenant: str, by_model: bool) -> dict:
        out: dict = {"tenant": tenant, "totals": totals_from_hash(
            await self._redis.hgetall(tenant_key(tenant)))}
        if by_model:
            models = sorted(m.decode() for m in
                            await self._redis.smembers(MODELS_KEY.format(tenant)))
            async with self._redis.pipeline(transaction=False) as pipe:
                for model in models:
                    pipe.hgetall(tenant_model_key(tenant, model))
                rows = await pipe.execute()
            out["by_model"] = [{"model": m, **totals_from_hash(r)} for m, r in zip(models, rows)]
        return out
