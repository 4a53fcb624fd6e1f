"""The Redis client every service uses: reconnects and retries a command that failed on a
dropped connection (a Redis restart), instead of failing the request that met it."""

from __future__ import annotations

import logging

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, RedisError

from gpusched_common.settings import RedisSettings

log = logging.getLogger(__name__)


def make_redis(settings: RedisSettings) -> Redis:
    """A command that meets a dropped or refused connection is retried up to 5 times over
    about 3 s. Our writes are idempotent (SET NX claims, HSET of whole values, Lua scripts
    keyed by event id), so a retry is safe. A command that gets no answer within `timeout_s`
    fails the caller at once: a Redis that stalls (paused, swapping, a network partition)
    would not answer a retry either, and retrying made callers wait six time-outs (32 s).

    A burst beyond `max_connections` concurrent commands waits for a free connection, up to
    `timeout_s`: redis-py's default pool fails them at once (MaxConnectionsError), which
    answered every HTTP request past the 100th of a burst with a 503."""
    return Redis.from_pool(BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.max_connections,
        timeout=settings.timeout_s,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5,
                    supported_errors=(ConnectionError,)),  # its default adds TimeoutError
        health_check_interval=30,
        socket_timeout=settings.timeout_s,
        socket_connect_timeout=settings.timeout_s,
    ))


async def durability_problems(redis: Redis) -> list[str]:
    """What in this Redis's configuration breaks "nothing counted twice": the ids of applied
    usage and claimed placements must survive a restart (AOF on) and never be evicted
    (maxmemory-policy noeviction), or a record Kafka delivers again is applied again. Read
    from INFO, which managed Redis services answer; empty when all is well or unreadable."""
    try:
        persistence = await redis.info("persistence")
        memory = await redis.info("memory")
    except RedisError as exc:
        log.info("could not read Redis's configuration to check it: %r", exc)
        return []
    problems = []
    if str(persistence.get("aof_enabled", "1")) != "1":
        problems.append("AOF is off (appendonly no): a restart loses the ids of what was "
                        "applied, and Kafka's redelivery is applied again; run Redis with "
                        "--appendonly yes")
    policy = memory.get("maxmemory_policy", "noeviction")
    if policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy}: Redis may evict the ids of what was "
                        "applied, and a redelivered record is applied again; set it to "
                        "noeviction")
    return problems


async def warn_unless_durable(redis: Redis) -> None:
    """Log each of `durability_problems` as a warning (at start-up: the service still runs,
    as the local stack's and compose's Redis are configured right and a managed one may
    report otherwise than it behaves)."""
    for problem in await durability_problems(redis):
        log.warning("Redis: %s", problem)
