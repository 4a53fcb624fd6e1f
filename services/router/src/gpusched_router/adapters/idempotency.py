"""Idempotency keys in Redis: `gpusched:router:idempotency:<tenant>:<sha256 of key>` holds
the key's first use (`FirstUse`), for as long as statuses are kept."""

from __future__ import annotations

import hashlib

from redis.asyncio import Redis

from gpusched_router.domain.idempotency import FirstUse

KEY = "gpusched:router:idempotency:{}:{}"
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class IdempotencyKeys:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s
        self._replace = redis.register_script(_REPLACE)
        self._release = redis.register_script(_RELEASE)

    async def claim(self, tenant: str, key: str, use: FirstUse) -> FirstUse | None:
        """None when `use` is the key's first use (it now holds the key); else the holder.
        Atomic (SET NX GET), so of two concurrent uses exactly one runs."""
        held = await self._redis.set(self._name(tenant, key), str(use), nx=True,
                                     ex=self._ttl_s, get=True)
        return None if held is None else FirstUse.parse(held.decode())

    async def holder(self, tenant: str, key: str) -> FirstUse | None:
        held = await self._redis.get(self._name(tenant, key))
        return None if held is None else FirstUse.parse(held.decode())

    async def take_over(self, tenant: str, key: str, holder: FirstUse, use: FirstUse) -> bool:
        """Give the key to `use` (`holder`'s request claimed afresh, or a new request), if
        `holder` still holds it; of several retries taking over at once, exactly one gets
        True. The key is kept as long as a first use's from now: the request it stands for
        starts now (with the first use's time left, a key taken over late in its day
        expired while its request ran, and a retry ran the request again)."""
        return bool(await self._replace(keys=[self._name(tenant, key)],
                                        args=[str(holder), str(use), self._ttl_s]))

    async def release(self, tenant: str, key: str, use: FirstUse) -> None:
        """Give the key up, if `use` still holds it: its request was never taken in, so a
        retry with the key must run."""
        await self._release(keys=[self._name(tenant, key)], args=[str(use)])

    @staticmethod
    def _name(tenant: str, key: str) -> str:
        return KEY.format(tenant, hashlib.sha256(key.encode()).hexdigest())
