"""The Redis client every service uses: reconnects and retries a command that failed on a
dropped connection (a Redis restart), instead of failing the request that met it."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError

from gpusched_common.settings import RedisSettings


def make_redis(settings: RedisSettings) -> Redis:
    """Commands are retried up to 5 times over about 3 s. Our writes are idempotent (SET NX
    claims, HSET of whole values, Lua scripts keyed by event id), so a retry is safe. Each
    try waits at most `timeout_s`: a Redis that stalls fails the caller, never hangs it."""
    return Redis.from_url(
        settings.url,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=5),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
        socket_timeout=settings.timeout_s,
        socket_connect_timeout=settings.timeout_s,
    )
