"""GPU placement solver: pure functions over struct-of-arrays cluster state and work batches.

``solve(state, batch, policy=...)`` places a batch (online, each unit seeing the previous
ones) with a named policy from ``POLICIES``; ``plan_preemption`` finds the cheapest
lower-priority victims on one node for a unit that fits nowhere. See docs/SOLVER.md.
"""

from .policies import DEFAULT_POLICY, POLICIES, Policy, get_policy
from .preemption import PreemptionPlan, RunningWork, plan_preemption
from .result import REASON_TEXT, Placed, Reason, SolveResult, Unschedulable
from .session import SolverSession
from .solve import ShapeDistribution, apply, lookahead_order, release, solve, unload_model
from .state import MAX_GPU_TYPES, ClusterState, GpuSpec, NodeSpec, WorkBatch

__all__ = [
    "DEFAULT_POLICY",
    "MAX_GPU_TYPES",
    "POLICIES",
    "REASON_TEXT",
    "ClusterState",
    "GpuSpec",
    "NodeSpec",
    "Placed",
    "Policy",
    "PreemptionPlan",
    "Reason",
    "RunningWork",
    "ShapeDistribution",
    "SolveResult",
    "SolverSession",
    "Unschedulable",
    "WorkBatch",
    "apply",
    "get_policy",
    "lookahead_order",
    "plan_preemption",
    "release",
    "solve",
    "unload_model",
]
