"""The torch executor: really runs a small seeded transformer (adapters/torch_model.py) on
CPU or CUDA, token by token, continuously batched per (device, model).

Every catalog model is stood in for by a `TinyLM` seeded from its name, so generation,
memory and tokens/s are real while the catalog's sizes keep driving admission. Compute runs
in a worker thread so the event loop keeps streaming and heartbeating.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import torch

from gpusched_agent.adapters.batching import ContinuousBatcher, Sequence
from gpusched_agent.adapters.executor import ExecutorError, ExecutorRefused, Job
from gpusched_agent.adapters.torch_model import VOCAB, TinyConfig, TinyLM, parameter_bytes, tokenize
from gpusched_agent.domain.inventory import UNREADABLE_UUID_PREFIX, GpuInfo
from gpusched_common.catalog import ModelSpec

log = logging.getLogger(__name__)

# GPU i of the agent's inventory is NVML's device i, numbered in PCI bus order; CUDA numbers
# the fastest device first unless told otherwise, so on a node of mixed GPUs "cuda:i" could
# be another GPU than the one the scheduler placed the request on. Read at CUDA's start.
os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def bare_uuid(uuid: object) -> str:
    """A GPU UUID as CUDA and NVML both can write it (NVML adds 'GPU-')."""
    return str(uuid).lower().removeprefix("gpu-")


GREEDY_BELOW = 1e-5
"""A temperature below this decodes greedily, as vLLM does: logits divided by 1e-38 overflow
to infinity and sampling them fails."""


@dataclass
class _SeqState:
    tokens: list[int]
    capacity: int
    """Positions its KV cache holds (prompt + max_tokens), made at its prefill."""
    generator: torch.Generator
    temperature: float
    top_p: float
    next_token: int = 0
    cache: torch.Tensor | None = None


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """`logits`, or ExecutorError when some are not finite (sampling them would fail, in a
    step after the batch's other sequences had drawn from their generators)."""
    if not bool(torch.isfinite(logits).all()):
        raise ExecutorError("the model's logits are not finite (inf or NaN)")
    return logits


class TorchExecutor:
    name = "torch"
    time_scale = 1.0
    refuses = frozenset({400})
    """A request beyond the model's positions (`generate`)."""

    def __init__(self, device: str = "auto", seed: int = 0, config: TinyConfig = TinyConfig(),
                 threads: int = 0, temperature: float = 1.0) -> None:
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("GPUSCHED_TORCH_DEVICE=cuda but torch sees no CUDA device; use "
                             "'cpu' or install a CUDA build of torch")
        if threads > 0:
            torch.set_num_threads(threads)
        self.device_kind = device
        self._seed = seed
        self._config = config
        self._temperature = temperature
        self._models: dict[tuple[int, str], TinyLM] = {}
        self._batches: dict[tuple[int, str], ContinuousBatcher] = {}
        self._lock = asyncio.Lock()

    def devices_problem(self, gpus: tuple[GpuInfo, ...]) -> str | None:
        """Why this executor's `cuda:i` is not NVML's GPU i of `gpus` (the inventory), or
        None when they match or it does not run on CUDA. With MIG on there is nothing to
        compare (CUDA shows a process one MIG instance at most): None, with a warning. A
        GPU NVML could not name (`UNREADABLE_UUID_PREFIX`) is not compared, only counted:
        it is unhealthy and gets no work."""
        if not self.device_kind.startswith("cuda") or ":" in self.device_kind:
            return None
        if any(g.mig_parent_uuid for g in gpus):
            log.warning("MIG is on: the torch executor runs GPU i's work on cuda:i unchecked")
            return None
        cuda = [bare_uuid(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())]
        nvml = [bare_uuid(g.uuid) for g in gpus]
        unread = [g.uuid.startswith(UNREADABLE_UUID_PREFIX) for g in gpus]
        if len(cuda) == len(nvml) and all(
                c == n or skip for c, n, skip in zip(cuda, nvml, unread, strict=True)):
            if any(unread):
                log.warning("GPUs %s: NVML cannot read them, so they are not compared with "
                            "CUDA's", [g.index for g, skip in zip(gpus, unread) if skip])
            return None
        return (f"CUDA's devices {cuda} are not NVML's GPUs {nvml} in order: the torch "
                "executor runs GPU i's work on cuda:i. Leave CUDA_VISIBLE_DEVICES unset (the "
                "agent uses every GPU NVML sees; give it fewer with the container's devices) "
                "and CUDA_DEVICE_ORDER unset or PCI_BUS_ID")

    def _device(self, gpu_index: int) -> torch.device:
        if self.device_kind.startswith("cuda") and ":" not in self.device_kind:
            return torch.device("cuda", gpu_index % max(1, torch.cuda.device_count()))
        return torch.device(self.device_kind)

    def _dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.device_kind.startswith("cuda") else torch.float32

    async def load(self, model: ModelSpec, gpu_index: int) -> None:
        key = (gpu_index, model.name)
        async with self._lock:
            if key in self._models:
                return
            seed = self._seed ^ int(hashlib.sha256(model.name.encode()).hexdigest()[:8], 16)
            self._models[key] = await asyncio.to_thread(
                TinyLM, self._config, seed, self._device(gpu_index), self._dtype())

    async def unload(self, model_name: str, gpu_index: int) -> None:
        # both gone before the first await: a load meanwhile must find the model unloaded
        batch = self._batches.pop((gpu_index, model_name), None)
        self._models.pop((gpu_index, model_name), None)
        if batch is not None:
            await batch.close()
        if self.device_kind.startswith("cuda"):
            torch.cuda.empty_cache()

    def memory_bytes(self) -> dict[str, int]:
        """Weights and KV caches held now (CUDA: what the allocator has handed out)."""
        weights = sum(parameter_bytes(m) for m in self._models.values())
        kv = sum(s.state.cache.numel() * s.state.cache.element_size()
                 for b in self._batches.values() for s in b.active if s.state.cache is not None)
        out = {"weights": weights, "kv_cache": kv}
        if self.device_kind.startswith("cuda"):  # every device's: GPU i's work is on cuda:i
            devices = range(torch.cuda.device_count())
            out["cuda_allocated"] = sum(int(torch.cuda.memory_allocated(d)) for d in devices)
            out["cuda_peak_allocated"] = sum(int(torch.cuda.max_memory_allocated(d))
                                             for d in devices)
        return out

    def loaded_device(self, model_name: str, gpu_index: int) -> torch.device | None:
        """Where GPU `gpu_index`'s copy of the model is, or None when it is not loaded."""
        lm = self._models.get((gpu_index, model_name))
        return None if lm is None else lm.device

    @staticmethod
    def _sample(logits: torch.Tensor, st: _SeqState) -> int:
        if st.temperature < GREEDY_BELOW:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / st.temperature, dim=-1).cpu()
        if st.top_p < 1:  # the likeliest tokens until their mass reaches top_p (at least one)
            ranked, order = probs.sort(descending=True)
            keep = ranked.cumsum(0) - ranked < st.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], ranked[keep])
        return int(torch.multinomial(probs, 1, generator=st.generator))

    def _batch(self, job: Job) -> ContinuousBatcher:
        key = (job.gpu_index, job.model.name)
        batch = self._batches.get(key)
        if batch is not None:
            return batch
        lm = self._models.get(key)
        if lm is None:
            raise ExecutorError(f"model {job.model.name} is not loaded on GPU {job.gpu_index}")

        def prefill_sync(seq: Sequence) -> str:
            st: _SeqState = seq.state
            # made here, in the worker thread: zeroing a long request's cache on the event
            # loop held heartbeats and streams (about 27 ms for 8,192 positions on a CPU)
            st.cache = lm.new_cache(st.capacity)
            st.next_token = self._sample(_finite(lm.prefill(st.tokens, st.cache)), st)
            return VOCAB[st.next_token]

        def step_sync(seqs: list[Sequence]) -> list[str]:
            states: list[_SeqState] = [s.state for s in seqs]
            logits = lm.decode([st.next_token for st in states],
                               [s.kv_tokens - 1 for s in seqs], [st.cache for st in states])
            # one copy to the host per step, not one wait on the device per sequence; checked
            # before any sequence draws from its generator, so a step that raises can run
            # again and draw the same tokens
            rows = _finite(logits.float().cpu())
            sampled = [self._sample(row, st) for st, row in zip(states, rows)]
            for st, token in zip(states, sampled):  # only now: a step that raised runs again
                st.next_token = token
            return [VOCAB[token] for token in sampled]

        async def prefill(seq: Sequence) -> str:
            return await asyncio.to_thread(prefill_sync, seq)

        async def step(seqs: list[Sequence]) -> list[str]:
            return await asyncio.to_thread(step_sync, seqs)

        batch = self._batches[key] = ContinuousBatcher(prefill, step)
        return batch

    def generate(self, job: Job) -> AsyncGenerator[str, None]:
        request = job.request
        limit = self._config.max_positions
        if job.prompt_tokens + request.max_tokens > limit:  # its context, below the catalog's:
            # a 400 the client can act on, as an engine's own, and no prompt billed (an
            # openai node of a mixed fleet might run it: README and the alert say so)
            raise ExecutorRefused(f"prompt ({job.prompt_tokens}) + max_tokens "
                                  f"({request.max_tokens}) exceed the torch model's maximum "
                                  f"context length of {limit} positions; send a shorter "
                                  "request", 400)
        batch = self._batch(job)
        gen = torch.Generator().manual_seed(
            request.seed if request.seed is not None
            else int(hashlib.sha256(request.request_id.encode()).hexdigest()[:8], 16))
        temperature = self._temperature if request.temperature is None else request.temperature
        state = _SeqState(tokens=tokenize(request.prompt, job.prompt_tokens),
                          capacity=job.prompt_tokens + request.max_tokens, generator=gen,
                          temperature=temperature,
                          top_p=1.0 if request.top_p is None else request.top_p)
        # kv_tokens counts the prompt; the token sampled at prefill enters the cache at the
        # first decode step, at position kv_tokens - 1 after the batcher's increment.
        seq = Sequence(job.key, request.max_tokens, job.prompt_tokens, state=state)
        return batch.run(seq)

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
        self._models.clear()
