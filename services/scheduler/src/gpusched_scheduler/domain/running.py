"""Placements the scheduler has sent and not yet seen finish: what preemption, node-loss
recovery, quotas and fairness reason about. Plain data; persisted by an adapter."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

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
    borrowed: bool
    """Placed beyond the tenant's guaranteed GPU memory: reclaimable by preemption."""
    estimate_gpu_s: float
    placed_at_ms: int
    request: InferenceRequest

    @property
    def tenant(self) -> str:
        return self.request.tenant


ClaimState = Literal["untaken", "held", "ended", "fenced"]
"""Where a placement stands in the agents' claim ledger: no agent has claimed it yet; an
agent run holds it; that run ended it (its final usage is sent); the scheduler fenced it
(it never runs)."""
