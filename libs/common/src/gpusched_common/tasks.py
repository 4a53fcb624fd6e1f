"""Stopping background tasks for good: one cancel is not always enough on Python 3.11."""

from __future__ import annotations

import asyncio
import contextlib

RECANCEL_S = 0.1


async def cancelled(*tasks: asyncio.Task) -> None:
    """Cancel `tasks` and wait for each to end, cancelling again every RECANCEL_S until it
    does. On Python 3.11, asyncio.wait_for (which redis-py writes every command under, a
    socket time-out being set) swallows a cancel that comes as its write is done: the loop
    the task ran went on, and a shutdown waiting for it hung (the scheduler's lease loop
    renewed the lease for good, and no standby took over)."""
    for task in tasks:
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=RECANCEL_S)
        with contextlib.suppress(asyncio.CancelledError):
            await task
