"""The Redis client every service shares (`make_redis`), against the real Redis."""

from __future__ import annotations

import asyncio
import uuid

from gpusched_common.redis_client import make_redis
from gpusched_common.settings import RedisSettings


async def test_a_burst_beyond_the_pools_connections_waits_for_one_instead_of_failing(
        stack) -> None:
    """250 commands at once, each holding its connection for 0.3 s (as a router holds one per
    request in flight): the 50 beyond the 200 connections wait for a free one. Before, the
    pool refused them at once (MaxConnectionsError past redis-py's 100), and the router
    answered every HTTP request past the 100th of a burst with a 503."""
    redis = make_redis(RedisSettings(url=stack.endpoints.redis_url))
    empty = f"gpusched:test:empty:{uuid.uuid4().hex}"
    try:
        replies = await asyncio.gather(*(redis.blpop([empty], timeout=0.3) for _ in range(250)),
                                       return_exceptions=True)
    finally:
        await redis.aclose()
    assert [r for r in replies if r is not None] == []
