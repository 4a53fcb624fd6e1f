"""The autoscaling signal: GPUs wanted per model to meet the latency targets (pure).

Little's law: the requests of a model in service at once are arrival rate x service time;
the GPUs to hold them are that over the concurrency one GPU sustains (its free memory over
a request's KV cache), plus what it takes to drain the current queue within the tightest
target of the classes queued. Published as an event and a gauge for KEDA/HPA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLoad:
    model: str
    arrivals_per_s: float
    service_s: float
    queued: int
    queued_by_class: dict[str, int]
    gpus_in_use: int
    concurrency_per_gpu: float
    tightest_target_s: float


def gpus_wanted(load: ModelLoad) -> int:
    if load.concurrency_per_gpu <= 0:
        return load.gpus_in_use
    steady = load.arrivals_per_s * load.service_s
    drain = load.queued * load.service_s / max(load.tightest_target_s, 1e-3)
    return max(0, math.ceil((steady + drain) / load.concurrency_per_gpu))
