"""The Redis client every service uses: reconnects and retries a command that failed on a
dropped connection (a Redis restart), instead of failing the request that met it."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError

from gpusched_common.settings import RedisSettings


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
