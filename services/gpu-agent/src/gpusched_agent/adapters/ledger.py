"""Where the agent checks placement claims and the scheduler's fencing token (Redis), plus
an in-memory twin for tests and benchmarks."""

from __future__ import annotations

from typing import Protocol

from redis.asyncio import Redis

PLACEMENT_KEY = "gpusched:agent:placement:{}"
EPOCH_KEY = "gpusched:scheduler:epoch"
CLAIM_TTL_S = 7 * 86_400


class PlacementLedger(Protocol):
    async def claim(self, placement_id: str, node_id: str) -> bool:
        """True for the first claim of `placement_id` ever (across redeliveries and agent
        restarts); False for every later one."""

    async def leader_epoch(self) -> int | None:
        """The current scheduler leader's fencing token, None when none is recorded."""


class RedisLedger:
    def __init__(self, redis: Redis) -> None:
        self._redis = redis

    async def claim(self, placement_id: str, node_id: str) -> bool:
        return bool(await self._redis.set(PLACEMENT_KEY.format(placement_id), node_id, nx=True,
                                          ex=CLAIM_TTL_S))

    async def leader_epoch(self) -> int | None:
        raw = await self._redis.get(EPOCH_KEY)
        return None if raw is None else int(raw)


class MemoryLedger:
    def __init__(self, leader_epoch: int | None = None) -> None:
        self.claims: dict[str, str] = {}
        self.epoch = leader_epoch

    async def claim(self, placement_id: str, node_id: str) -> bool:
        if placement_id in self.claims:
            return False
        self.claims[placement_id] = node_id
        return True

    async def leader_epoch(self) -> int | None:
        return self.epoch
