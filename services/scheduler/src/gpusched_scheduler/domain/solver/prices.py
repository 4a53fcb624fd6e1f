"""What a GPU's free share is worth to the workload: LP prices of the sharing requests.

The configuration LP of bin packing asks how few GPUs the workload's sharing requests
(milli-GPU per GPU below 1000) could fill; its dual gives every share size a price in GPUs
(an 810 costs a whole GPU, a 470 half of one, ...). ``fill_value[f]`` is then the most a
free share of ``f`` milli-GPU can still earn at those prices. Placing a request of share
``s`` on a GPU with ``f`` free loses ``fill_value[f] - price[s] - fill_value[f - s]`` (never
negative): zero when the placement is part of some optimal packing, more when it strands
share the workload cannot use. Prices are integers (micro-GPUs) so every kernel, and the
plain-Python reference, compute the same losses exactly.

Pure NumPy: a small revised simplex with column generation (the patterns are priced by an
unbounded knapsack), deterministic for a given input.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .state import WHOLE_GPU_MILLI

MICRO = 1_000_000
"""Prices are in micro-GPUs: a whole GPU is worth ``MICRO``."""

_EPS = 1e-9
_MAX_PIVOTS = 2_000


@njit(cache=True)
def _knapsack(sizes, values, capacity):
    """Unbounded knapsack over ``sizes`` (milli-GPU) with ``values``: best[c] for every
    capacity c <= ``capacity`` and the size taken last to reach it (-1: none, best[c] is
    best[c - 1]'s)."""
    best = np.zeros(capacity + 1, values.dtype)
    last = np.full(capacity + 1, -1, np.int64)
    for c in range(1, capacity + 1):
        best[c] = best[c - 1]
        for i in range(sizes.shape[0]):
            s = sizes[i]
            if s <= c and best[c - s] + values[i] > best[c]:
                best[c] = best[c - s] + values[i]
                last[c] = i
    return best, last


def _pattern(sizes: np.ndarray, last: np.ndarray, capacity: int) -> np.ndarray:
    counts = np.zeros(len(sizes), np.float64)
    c = capacity
    while c > 0:
        i = last[c]
        if i < 0:
            c -= 1
        else:
            counts[i] += 1
            c -= sizes[i]
    return counts


def share_prices(sizes: np.ndarray, demand: np.ndarray) -> np.ndarray:
    """Optimal dual prices (GPUs per request, floats >= 0) of the configuration LP
    ``min sum(x) s.t. sum_p x_p * pattern_p >= demand``, patterns being the ways to put
    requests of ``sizes`` (distinct, 0 < s < 1000 milli-GPU) on one GPU. ``demand`` is
    how many requests of each size the workload has (any positive weights)."""
    sizes = np.asarray(sizes, np.int64)
    demand = np.asarray(demand, np.float64)
    m = len(sizes)
    if m == 0:
        return np.zeros(0)
    # start from one pattern per size (as many copies as fit): a feasible diagonal basis
    basis = np.diag((WHOLE_GPU_MILLI // sizes).astype(np.float64))
    cost = np.ones(m)  # 1 per pattern column, 0 per surplus column
    x = demand / np.diag(basis)
    y = np.zeros(m)
    for _ in range(_MAX_PIVOTS):
        y = np.linalg.solve(basis.T, cost)
        neg = np.flatnonzero(y < -_EPS)
        if len(neg):  # a surplus column prices out: drop the over-covered size's price
            column, column_cost = -np.eye(m)[neg[0]], 0.0
        else:
            best, last = _knapsack(sizes, y, WHOLE_GPU_MILLI)
            if best[WHOLE_GPU_MILLI] <= 1.0 + _EPS:
                break  # no pattern is worth more than the GPU it takes: optimal
            column, column_cost = _pattern(sizes, last, WHOLE_GPU_MILLI), 1.0
        d = np.linalg.solve(basis, column)
        rows = np.flatnonzero(d > _EPS)
        if len(rows) == 0:
            break  # cannot happen for a bounded LP; keep the current prices
        ratios = x[rows] / d[rows]
        leave = rows[np.argmin(ratios)]  # first minimum: deterministic
        theta = ratios.min()
        x = x - theta * d
        x[leave] = theta
        basis[:, leave] = column
        cost[leave] = column_cost
    return np.maximum(y, 0.0)


def price_tables(sizes: np.ndarray, demand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(fill_value, price)``, both int64 micro-GPUs indexed by milli-GPU 0..1000:
    ``price[s]`` is the LP price of a request of share ``s`` (sizes outside the workload are
    priced at what their share could hold), ``fill_value[f]`` the most requests fitting in
    ``f`` milli-GPU are worth. ``fill_value[f] >= price[s] + fill_value[f - s]`` for every
    s <= f, so a placement's loss is never negative. Without sharing requests both are 0."""
    sizes = np.asarray(sizes, np.int64)
    keep = (sizes > 0) & (sizes < WHOLE_GPU_MILLI)
    sizes, demand = sizes[keep], np.asarray(demand, np.float64)[keep]
    y = np.rint(share_prices(sizes, demand) * MICRO).astype(np.int64)
    fill_value, _ = _knapsack(sizes, y, WHOLE_GPU_MILLI)
    price = fill_value.copy()
    price[sizes] = y
    return fill_value, price
