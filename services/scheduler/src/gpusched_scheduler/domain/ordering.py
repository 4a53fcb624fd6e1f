"""The order pending work is considered in: work whose preemption is under way first, then
aged work, then strict priority between classes; weighted fair share between tenants inside
each chunk, FIFO inside a tenant. Pure: time and consumption are passed in."""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from gpusched_common.contracts import PRIORITY_CLASSES
from gpusched_scheduler.domain.queue import Pending


@dataclass
class FairShare:
    """GPU-seconds each tenant consumed, decaying with `half_life_s` so that fairness follows
    recent use. `charge` takes both measured usage and estimates of work just placed."""

    half_life_s: float = 60.0
    _level: dict[str, float] = field(default_factory=dict)
    _at_s: dict[str, float] = field(default_factory=dict)

    def decay(self, elapsed_s: float) -> float:
        """What a charge made `elapsed_s` ago counts for now (1 when just made)."""
        return math.pow(0.5, max(0.0, elapsed_s) / self.half_life_s)

    def _decayed(self, tenant: str, now_s: float) -> float:
        level = self._level.get(tenant, 0.0)
        if level == 0.0:
            return 0.0
        return level * self.decay(now_s - self._at_s.get(tenant, now_s))

    def charge(self, tenant: str, gpu_seconds: float, now_s: float) -> None:
        self._level[tenant] = max(0.0, self._decayed(tenant, now_s) + gpu_seconds)
        self._at_s[tenant] = now_s

    def level(self, tenant: str, now_s: float) -> float:
        return self._decayed(tenant, now_s)


@dataclass(frozen=True)
class Chunk:
    """Units solved together; a unit of a chunk that has to wait keeps every later chunk
    waiting too (strict priority), while later units of its own chunk may still fit."""

    name: str
    items: list[Pending]


def is_aged(item: Pending, now_ms: int, class_target_ms: dict[str, float],
            aging_factor: float) -> bool:
    """Whether `item` has waited past `aging_factor` x its class's target."""
    return now_ms - item.aging_from_ms > aging_factor * class_target_ms[
        item.request.priority_class]


def order_pending(
    items: Iterable[Pending], now_ms: int, fair: FairShare, weights: dict[str, float],
    class_target_ms: dict[str, float], aging_factor: float,
    estimate_gpu_s: Callable[[Pending], float], preempting: Collection[str] = (),
) -> list[Chunk]:
    """Chunks in the order to solve them: 'preempting' (requests in `preempting`, whose
    victims are stopping: the room they free is theirs), 'aged' (waited over aging_factor x
    its class's target), then one chunk per class, interactive first. Inside each, tenants
    take turns by weighted consumption: the tenant with the least (decayed GPU-seconds +
    estimates of what it is given now) / weight goes next, its oldest aged work first in the
    aged chunk.
    (Aged work taken oldest first across tenants gave a tenant that floods its class all
    of it: its work aged first, and an equal tenant's waited behind it without bound.)"""
    first: list[Pending] = []
    aged: list[Pending] = []
    by_class: dict[str, list[Pending]] = {c: [] for c in PRIORITY_CLASSES}
    for item in items:
        cls = item.request.priority_class
        if item.request.request_id in preempting:
            first.append(item)
        elif is_aged(item, now_ms, class_target_ms, aging_factor):
            aged.append(item)
        else:
            by_class[cls].append(item)
    now_s = now_ms / 1000
    aged.sort(key=lambda p: p.aging_from_ms)
    chunks = [Chunk(name, _fair_interleave(part, now_s, fair, weights, estimate_gpu_s))
              for name, part in (("preempting", first), ("aged", aged)) if part]
    for cls in PRIORITY_CLASSES:
        if by_class[cls]:
            chunks.append(Chunk(cls, _fair_interleave(by_class[cls], now_s, fair, weights,
                                                      estimate_gpu_s)))
    return chunks


def _fair_interleave(items: list[Pending], now_s: float, fair: FairShare,
                     weights: dict[str, float], estimate_gpu_s: Callable[[Pending], float]
                     ) -> list[Pending]:
    per_tenant: dict[str, deque[Pending]] = {}
    for item in items:  # keeps the queue's own order (FIFO, requeued ones first)
        per_tenant.setdefault(item.request.tenant, deque()).append(item)
    if len(per_tenant) == 1:
        return items
    heap = [(fair.level(t, now_s) / weights.get(t, 1.0), i, t)
            for i, t in enumerate(sorted(per_tenant))]
    heapq.heapify(heap)
    out: list[Pending] = []
    while heap:
        virtual, tie, tenant = heapq.heappop(heap)
        item = per_tenant[tenant].popleft()
        out.append(item)
        if per_tenant[tenant]:
            virtual += estimate_gpu_s(item) / weights.get(tenant, 1.0)
            heapq.heappush(heap, (virtual, tie, tenant))
    return out
