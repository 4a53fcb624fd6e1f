"""Idempotency keys in Redis: `gpusched:router:idempotency:<tenant>:<sha256 of key>` holds
the request id and request digest of the key's first use, for as long as statuses are kept."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from redis.asyncio import Redis

KEY = "gpusched:router:idempotency:{}:{}"


@dataclass(frozen=True)
class FirstUse:
    request_id: str
    digest: str


class IdempotencyKeys:
    def __init__(self, redis: Redis, ttl_s: int) -> None:
        self._redis = redis
        self._ttl_s = ttl_s

    async def claim(self, tenant: str, key: str, request_id: str, digest: str
                    ) -> FirstUse | None:
        """None when this request is the key's first use (it now holds the key); else the
        first use. Atomic (SET NX GET), so of two concurrent uses exactly one runs."""
        earlier = await self._redis.set(self._name(tenant, key), f"{request_id} {digest}",
                                        nx=True, ex=self._ttl_s, get=True)
        if earlier is None:
            return None
        request_id, _, digest = earlier.decode().partition(" ")
        return FirstUse(request_id, digest)

    async def release(self, tenant: str, key: str, request_id: str) -> None:
        """Give the key up, if `request_id` still holds it: its request was never taken in,
        so a retry with the key must run."""
        name = self._name(tenant, key)
        held = await self._redis.get(name)
        if held is not None and held.decode().partition(" ")[0] == request_id:
            await self._redis.delete(name)

    @staticmethod
    def _name(tenant: str, key: str) -> str:
        return KEY.format(tenant, hashlib.sha256(key.encode()).hexdigest())
