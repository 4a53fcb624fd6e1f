"""Fixtures the unit tests share: a Redis of a test module's own, for what only Redis's
scripts decide (the whole stack is for tests/integration)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from gpusched_ops.testing import start_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this module's own, started as the local stack starts it (a failing start
    fails the tests that need it: only a machine without redis-server skips them)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (ops/scripts/install-redis.sh)")
    url, stop = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop()
