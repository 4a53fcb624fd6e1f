"""The simulated executor: deterministic text with the timing of the performance model
(domain/perf_model.py), continuously batched per GPU, sped up or slowed by `time_scale`."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, Awaitable, Callable

from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence
from gpusched_agent.adapters.executor import Job
from gpusched_agent.domain import perf_model
from gpusched_common.catalog import ModelSpec

WORDS = ("the", "scheduler", "packs", "tokens", "into", "GPU", "memory", "while", "tenants",
         "share", "a", "fleet", "of", "accelerators", "and", "every", "request", "is", "billed",
         "once", "kernel", "batch", "prefill", "decode", "cache", "model", "fast", "fair")


class SimulatedExecutor:
    """One batch per (GPU, model); a decode step takes the time of reading the weights once
    plus the KV cache of every request running on that GPU, and yields a token for each."""

    name = "simulated"
    refuses: frozenset[int] = frozenset()

    def __init__(self, time_scale: float, seed: int,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.time_scale = time_scale
        self._seed = seed
        self._sleep = sleep
        self._batches: dict[tuple[int, str], ContinuousBatcher] = {}

    async def load(self, model: ModelSpec, gpu_index: int) -> None:
        await self._sleep(perf_model.load_s(model) * self.time_scale)

    async def unload(self, model_name: str, gpu_index: int) -> None:
        batch = self._batches.pop((gpu_index, model_name), None)
        if batch is not None:
            await batch.close()

    def _gpu_kv_tokens(self, gpu_index: int) -> int:
        return sum(b.kv_tokens for (g, _), b in self._batches.items() if g == gpu_index)

    def _batch(self, job: Job) -> ContinuousBatcher:
        key = (job.gpu_index, job.model.name)
        batch = self._batches.get(key)
        if batch is None:
            model, gpu = job.model, job.gpu_type

            async def prefill(seq: Sequence) -> str:
                await self._sleep(perf_model.prefill_s(seq.kv_tokens, model, gpu)
                                  * self.time_scale)
                return " " + seq.state.choice(WORDS)

            async def step(seqs: list[Sequence]) -> list[str]:
                step_s = perf_model.decode_step_s(model, gpu, self._gpu_kv_tokens(job.gpu_index))
                await self._sleep(step_s * self.time_scale)
                return [" " + s.state.choice(WORDS) for s in seqs]

            batch = self._batches[key] = ContinuousBatcher(prefill, step)
        return batch

    def generate(self, job: Job) -> AsyncGenerator[str, None]:
        request = job.request
        rng = random.Random(f"{self._seed}:{request.request_id}" if request.seed is None
                            else f"{self._seed}:{request.seed}")
        seq = Sequence(job.key, request.max_tokens, job.prompt_tokens, state=rng)
        return self._batch(job).run(seq)

    async def health(self) -> str | None:
        """Runs in the agent's own process: up while the agent is."""
        return None

    def served_models(self) -> None:
        """It runs whatever catalog model it is given."""
        return None

    async def close(self) -> None:
        for batch in self._batches.values():
            await batch.close()
        self._batches.clear()
