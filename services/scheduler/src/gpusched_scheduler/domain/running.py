"""Placements the scheduler has sent and not yet seen finish: what preemption, node-loss
recovery, quotas and fairness reason about. Plain data; persisted by an adapter."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, MutableMapping, ValuesView
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gpusched_common.contracts import InferenceRequest


class RunningPlacement(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    placement_id: str
    node_id: str
    gpu_indices: tuple[int, ...]
    memory_mib_per_gpu: int
    """KV cache per GPU plus the weights share when the placement loads its model."""
    kv_cache_mib: int
    """What preempting it frees on each GPU (its model stays loaded)."""
    estimate_gpu_s: float
    placed_at_ms: int
    request: InferenceRequest
    aged: bool | None = None
    """True: placed as aged work (it had waited past the aging threshold): no class-priority
    preemption takes it back, or the newest placement, cheapest to stop, was stopped at the
    next cycle and aged work never ran. A tenant reclaiming its guarantee still may. None
    otherwise. Not saved in Redis (a standby of an earlier version, which forbids fields it
    does not know, reads what is saved): a next leader does not know it."""
    retry: bool | None = None
    """True: placed as a retry the scheduler confirmed (`Pending.retry`): a preemption plan
    prices it by its earlier attempts. None otherwise: priced as a first attempt, whatever
    its request's `attempt` says (a producer's word where the retry was judged new work).
    Not saved in Redis, as `aged`: a next leader prices the work it inherits as first
    attempts."""
    trace_carrier: dict[str, str] = Field(default_factory=dict)
    """Its request's W3C trace context (`Pending.trace_carrier`): what is sent for it once
    placed (sent again, its retry, its end on its node's behalf) goes on in its request's
    trace. Saved in Redis apart from the placement (`redis_state.TRACES_KEY`), for a next
    leader."""

    @property
    def tenant(self) -> str:
        return self.request.tenant

    @property
    def memory_mib(self) -> int:
        """GPU memory it holds on all its GPUs."""
        return self.memory_mib_per_gpu * len(self.gpu_indices)


class RunningSet(MutableMapping[str, RunningPlacement]):
    """The placements in flight by placement id, with what each tenant holds kept as they
    come and go: quotas and guarantees read a tenant's share in O(1), and its borrowed work
    in O(what is borrowed), not by walking every placement in flight on each cycle or
    admission."""

    def __init__(self, placements: Iterable[RunningPlacement] = ()) -> None:
        self._by_id: dict[str, RunningPlacement] = {}
        self._memory_mib: Counter[str] = Counter()
        self._oldest_first: dict[str, list[tuple[int, str, int]]] = {}
        """Per tenant, (placed_at_ms, placement id, MiB held) of each of its placements,
        oldest first."""
        for r in placements:
            self[r.placement_id] = r

    def __getitem__(self, placement_id: str) -> RunningPlacement:
        return self._by_id[placement_id]

    def __setitem__(self, placement_id: str, placement: RunningPlacement) -> None:
        if placement_id in self._by_id:
            self._untally(self._by_id[placement_id])
        self._by_id[placement_id] = placement
        self._memory_mib[placement.tenant] += placement.memory_mib
        insort(self._oldest_first.setdefault(placement.tenant, []),
               (placement.placed_at_ms, placement.placement_id, placement.memory_mib))

    def __delitem__(self, placement_id: str) -> None:
        self._untally(self._by_id.pop(placement_id))

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, placement_id: object) -> bool:
        return placement_id in self._by_id

    def get(self, placement_id: str, default: RunningPlacement | None = None  # type: ignore[override]
            ) -> RunningPlacement | None:
        return self._by_id.get(placement_id, default)

    def values(self) -> ValuesView[RunningPlacement]:  # the dict's own view: no copy
        return self._by_id.values()

    def memory_mib(self, tenant: str) -> int:
        """GPU memory (MiB, all GPUs of each placement) `tenant` holds."""
        return self._memory_mib[tenant]

    def count(self, tenant: str) -> int:
        return len(self._oldest_first.get(tenant, ()))

    def holdings(self, leaving: Collection[str] = ()) -> Callable[[str], int]:
        """What each tenant holds (MiB), the placements `leaving` (told to stop) left out."""
        gone: Counter[str] = Counter()
        for placement_id in leaving:
            if (r := self._by_id.get(placement_id)) is not None:
                gone[r.tenant] += r.memory_mib
        return lambda tenant: self._memory_mib[tenant] - gone[tenant]

    def borrowed(self, guarantee: Callable[[str], int | None],
                 leaving: Collection[str] = ()) -> set[str]:
        """The placements beyond their tenant's GPU memory guarantee (`guarantee(tenant)`,
        MiB; None: unlimited, nothing borrowed), judged from what each tenant holds now:
        its oldest placements (by `placed_at_ms`, then placement id) are inside while
        together they hold no more than the guarantee, the rest are borrowed. Judged
        afresh at each call, not once at placement: a mark decided then outlived the work
        that had put its tenant past its guarantee, and the tenant's work, inside it now,
        was preempted as borrowed. The placements `leaving` (told to stop) are neither
        counted nor judged: counted, they made their tenant's other work borrowed until
        they stopped. O(tenants + leaving + borrowed placements)."""
        holds = self.holdings(leaving)
        out: set[str] = set()
        for tenant in self._memory_mib:
            limit = guarantee(tenant)
            if limit is None:
                continue
            held = holds(tenant)
            for _, placement_id, mib in reversed(self._oldest_first[tenant]):
                if held <= limit:  # this one and all older ones together: inside
                    break
                if placement_id not in leaving:
                    out.add(placement_id)
                    held -= mib
        return out

    def _untally(self, placement: RunningPlacement) -> None:
        tenant = placement.tenant
        self._memory_mib[tenant] -= placement.memory_mib
        placements = self._oldest_first[tenant]
        del placements[bisect_left(placements, (placement.placed_at_ms,
                                                placement.placement_id))]
        if not placements:
            del self._memory_mib[tenant], self._oldest_first[tenant]


ClaimState = Literal["untaken", "held", "ended", "fenced"]
"""Where a placement stands in the agents' claim ledger: no agent has claimed it yet; an
agent run holds it; that run ended it (its final usage is sent); the scheduler fenced it
(it never runs)."""
