"""Placement policies as named plugins: one registry, one scoring interface, chosen by name.

Each policy scores (node, GPU selection) candidates; lower wins, ties go to the lower node
index then lower GPU index. The kernel id selects the branch in ``kernels.eval_node`` and
the same-named function in ``reference.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import kernels as K


@dataclass(frozen=True)
class Policy:
    name: str
    kernel_id: int
    uses_shapes: bool
    description: str
    lookahead: str = "biggest-first"  # how a look-ahead batch is ordered (solve.lookahead_order)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("first-fit", K.FIRST_FIT, False, "lowest-index node and GPUs that fit"),
        Policy(
            "best-fit",
            K.BEST_FIT,
            False,
            "node with the least normalised free CPU+memory+GPU share left; tightest GPU",
        ),
        Policy(
            "dot-product",
            K.DOT_PRODUCT,
            False,
            "node whose free resources align best with the request (Tetris); tightest GPU",
        ),
        Policy(
            "gpu-packing",
            K.GPU_PACKING,
            False,
            "partially used GPUs first, then GPUs of active nodes, then idle nodes",
        ),
        Policy(
            "fgd",
            K.FGD,
            True,
            "fragmentation gradient descent (Weng et al., ATC'23): least growth of expected "
            "unusable GPU share over the workload's typical shapes, scored as the paper's "
            "artifact does (a 0-100 integer; ties to the lowest node index)",
        ),
        Policy(
            "gpusched",
            K.GPUSCHED,
            True,
            "the workload's bin-packing LP prices (least share lost per placement) plus "
            "stranded GPU share, model affinity and a tightness tie-break; CPU-only work "
            "where GPUs need the CPU least; gangs by FGD; gpusched's default",
            lookahead="gangs-first",
        ),
    )
}

DEFAULT_POLICY = "gpusched"


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"unknown placement policy {name!r}; choose one of: {known}") from None
