"""The autoscaling signal: GPUs wanted per model to meet the latency targets (pure).

Little's law: the requests of a model in service at once are arrival rate x service time;
the GPUs to hold them are that over the concurrency one gang of the model's GPUs sustains
(what each GPU has beyond its share of the weights, over its share of a request's KV
cache), in whole gangs, plus what it takes to drain the current queue within the tightest
target of the classes queued. Published as an event and a gauge for KEDA/HPA.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from gpusched_common.catalog import GPU_TYPES, ModelSpec
from gpusched_scheduler.domain.planner import gang_memory_per_gpu

LARGEST_GPU_MIB = max(t.memory_mib for t in GPU_TYPES.values())
"""The memory of the largest GPU type an agent may report (`GPU_TYPES`)."""


@dataclass(frozen=True)
class ModelLoad:
    model: str
    arrivals_per_s: float
    service_s: float
    queued: int
    queued_by_class: dict[str, int]
    gpus_in_use: int
    gang_gpus: int
    """The GPUs one copy of the model runs on (its `num_gpus`): GPUs are wanted in gangs."""
    concurrency_per_gang: float
    """Requests one gang holds at once (`gang_concurrency`); 0 where the model fits no
    gang of the GPUs known."""
    tightest_target_s: float


def gpu_memory_mib(reported_mib: Iterable[int]) -> int:
    """The GPU memory a model is sized on: the largest GPU a node reports; before any has
    reported (scaling from zero), the largest GPU type there is, the fewest GPUs to want
    (`gpus_wanted` asks for a gang at least). Sized on none, every model wanted 0 GPUs, and
    an autoscaler never started the first node."""
    return max(reported_mib, default=LARGEST_GPU_MIB)


def gang_concurrency(model: ModelSpec, gpu_memory_mib: int, tokens: int) -> float:
    """Requests of `tokens` tokens that one gang of the model (its `num_gpus` GPUs of
    `gpu_memory_mib` each) holds at once: each GPU holds its share of the weights and of
    every request's KV cache, as placements are sized. Weighed whole against one GPU, a
    model split over a gang (the 70B on two 80 GB GPUs) fit none and wanted 0 GPUs."""
    kv_mib, weights_mib = gang_memory_per_gpu(model, tokens, model.num_gpus)
    return max(0.0, (gpu_memory_mib - weights_mib) / max(kv_mib, 1))


def gpus_wanted(load: ModelLoad) -> int:
    """GPUs in whole gangs, and a gang at least while work of the model is queued (it needs
    one to run on, whatever the rates say); where no gang of the GPUs known holds a request,
    the GPUs in use."""
    least = load.gang_gpus if load.queued else 0
    if load.concurrency_per_gang <= 0:
        return max(load.gpus_in_use, least)
    steady = load.arrivals_per_s * load.service_s
    drain = load.queued * load.service_s / max(load.tightest_target_s, 1e-3)
    gangs = math.ceil((steady + drain) / load.concurrency_per_gang)
    return max(gangs * load.gang_gpus, least)
