"""The simulated executor: produces deterministic text with the timing of the performance
model (domain/perf_model.py), sped up or slowed down by `time_scale`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable

from gpusched_agent.domain import perf_model
from gpusched_common.catalog import GpuType, ModelSpec
from gpusched_common.contracts import InferenceRequest

_WORDS = ("the", "scheduler", "packs", "tokens", "into", "GPU", "memory", "while", "tenants",
          "share", "a", "fleet", "of", "accelerators", "and", "every", "request", "is", "billed",
          "once", "kernel", "batch", "prefill", "decode", "cache", "model", "fast", "fair")


class SimulatedExecutor:
    """Yields one token's text at a time; `kv_tokens` reports the GPU's batch size in cached
    tokens at each step, so concurrent requests slow each other as on a real GPU."""

    def __init__(self, time_scale: float, seed: int,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._scale = time_scale
        self._seed = seed
        self._sleep = sleep

    async def load(self, model: ModelSpec) -> None:
        await self._sleep(perf_model.load_s(model) * self._scale)

    async def generate(self, request: InferenceRequest, prompt_tokens: int, model: ModelSpec,
                       gpu: GpuType, kv_tokens: Callable[[], int]) -> AsyncIterator[str]:
        rng = random.Random(f"{self._seed}:{request.seed}:{request.request_id}"
                            if request.seed is None else f"{self._seed}:{request.seed}")
        await self._sleep(perf_model.prefill_s(prompt_tokens, model, gpu) * self._scale)
        for _ in range(request.max_tokens):
            await self._sleep(perf_model.decode_step_s(model, gpu, kv_tokens()) * self._scale)
            yield " " + rng.choice(_WORDS)
