"""Numba kernels of the placement solver: feasibility, per-policy node scores, the batch driver.

Kernels only write to the buffers they are handed: ``solve_kernel``/``apply_unit`` mutate
the working copy of the state (the public ``solve`` hands them a copy), the cache helpers
their caches. The plain-Python twin of each policy lives in ``reference.py`` and must make
identical decisions (same tie-breaks, same float operations in the same order).

Tuples used throughout (all int64 unless noted):
  S = (node_cpu_free, node_mem_free, node_cpu_total, node_mem_total, node_gpu_start,
       gpu_type, gpu_milli_free, gpu_mem_free, gpu_healthy[bool], gpu_models[G, K])
  U = (num_gpu, gpu_milli, gpu_mem, cpu, mem, type_mask, model, weight)
  W = (shape_cpu, shape_mem, shape_num_gpu, shape_milli, shape_gpu_mem, shape_mask,
       shape_weight, fill_value[1001], price[1001])  -- the workload's typical shapes
       (fgd; gpusched's gangs and CPU-only units) and what free GPU share is worth to it
       (gpusched's GPU choice, ``prices.price_tables``)
  params = [affinity_bonus_milli, stranded_weight, cpu_milli_per_gpu_milli,
            mem_mib_per_gpu_milli, shape_weight_sum, priced]  (float64; priced: 1.0 when
            gpusched places single-GPU units by the price tables, see ``solve.policy_params``)
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .result import Reason

INF = np.inf

# policy ids (keep in sync with policies.py)
FIRST_FIT = 0
BEST_FIT = 1
DOT_PRODUCT = 2
GPU_PACKING = 3
FGD = 4
GPUSCHED = 5

# reason codes as plain ints (a compiled kernel reads them as constants)
PLACED = int(Reason.PLACED)
INVALID_REQUEST = int(Reason.INVALID_REQUEST)
NO_ALLOWED_GPU_TYPE = int(Reason.NO_ALLOWED_GPU_TYPE)
GANG_TOO_LARGE = int(Reason.GANG_TOO_LARGE)
INSUFFICIENT_CPU_MEMORY = int(Reason.INSUFFICIENT_CPU_MEMORY)
INSUFFICIENT_GPU_SHARE = int(Reason.INSUFFICIENT_GPU_SHARE)
INSUFFICIENT_GPU_MEMORY = int(Reason.INSUFFICIENT_GPU_MEMORY)

HAIR = 1.0e-4
"""Weight of gpusched's tie-breaks (the tighter GPU per free milli-GPU; stranded growth
between CPU-only placements): at most 0.1 for a whole GPU, below a milli-GPU of the main
term."""

TIER_MILLI = 1.0e7
"""Score step between gpu-packing tiers (larger than any free milli-GPU of one node)."""


@njit(cache=True)
def model_loaded(gpu_models, g, model):
    if model < 0:
        return False
    for j in range(gpu_models.shape[1]):
        if gpu_models[g, j] == model:
            return True
    return False


@njit(cache=True)
def gpu_fits(S, g, milli, gmem, mask, model, weight):
    """Can GPU ``g`` host one GPU's worth of the unit (share, memory, type, health)?"""
    if not S[8][g]:
        return False
    if (mask >> S[5][g]) & 1 == 0:
        return False
    if S[6][g] < milli:
        return False
    need = gmem
    if model >= 0 and not model_loaded(S[9], g, model):
        need += weight
    return S[7][g] >= need


@njit(cache=True)
def frag_rows(S, n, W, C):
    """Cache node ``n``'s FGD bookkeeping in C = (frag_now[N], fit[N, M], frag[N, M],
    total[N]): per shape, how many GPUs could host one GPU's worth of it and how much free
    share sits on the GPUs that could not; ``frag_now`` is the node's fragmentation.

    Fragmentation (FGD, Weng et al. ATC'23): sum over shapes of weight x the free milli-GPU
    the shape cannot use -- all of it when the shape needs no GPU or cannot fit the node
    (CPU, memory, too few usable GPUs), else the share on GPUs it cannot use.
    """
    lo = S[4][n]
    hi = S[4][n + 1]
    gtype = S[5]
    gmilli = S[6]
    gmem = S[7]
    healthy = S[8]
    w_cpu, w_mem, w_k, w_milli, w_gmem, w_mask, w_count, _, _ = W
    total = 0
    for g in range(lo, hi):
        if healthy[g]:
            total += gmilli[g]
    f = 0  # int64: integer counts x milli-GPU, equal to the float sums of the reference
    for s in range(w_cpu.shape[0]):
        fit = 0
        frag = 0
        for g in range(lo, hi):  # branch-free: 0/1 integers (data-dependent branches)
            ok = np.int64(healthy[g])
            usable = (
                ((w_mask[s] >> gtype[g]) & 1)
                & np.int64(gmilli[g] >= w_milli[s])
                & np.int64(gmem[g] >= w_gmem[s])
            )
            fit += ok & usable
            frag += ok * (1 - usable) * gmilli[g]
        C[1][n, s] = fit
        C[2][n, s] = frag
        k = w_k[s]
        if k == 0 or S[0][n] < w_cpu[s] or S[1][n] < w_mem[s] or fit < k:
            f += w_count[s] * total
        else:
            f += w_count[s] * frag
    C[3][n] = total
    C[0][n] = float(f)
    return float(f)


@njit(cache=True)
def frag_after(S, n, u, U, sel, k, W, C):
    """Node fragmentation after placing unit ``u`` on GPUs ``sel[:k]`` of node ``n``,
    updated from the cached rows in O(shapes x k) (same sums, same order as frag_rows)."""
    cpu_after = S[0][n] - U[3][u]
    mem_after = S[1][n] - U[4][u]
    milli = U[1][u]
    total = C[3][n] - k * milli
    f = 0.0
    for s in range(W[0].shape[0]):
        ks = W[2][s]
        if ks == 0 or cpu_after < W[0][s] or mem_after < W[1][s]:
            f += W[6][s] * total
            continue
        fit = C[1][n, s]
        frag = C[2][n, s]
        for j in range(k):
            g = sel[j]
            a = S[6][g]
            b = S[7][g]
            need = U[2][u]
            if U[6][u] >= 0 and not model_loaded(S[9], g, U[6][u]):
                need += U[7][u]
            typed = (W[5][s] >> S[5][g]) & 1
            if typed and a >= W[3][s] and b >= W[4][s]:
                fit -= 1
            else:
                frag -= a
            if typed and a - milli >= W[3][s] and b - need >= W[4][s]:
                fit += 1
            else:
                frag += a - milli
        if fit < ks:
            f += W[6][s] * total
        else:
            f += W[6][s] * frag
    return f


@njit(cache=True, inline="always")
def share_loss_key(W, free_milli, milli, loaded, params):
    """gpusched's key for putting ``milli`` on a GPU with ``free_milli`` free (lower is
    better), in milli-GPU: the share the placement costs at the workload's LP prices
    (``fill_value[f] - price[milli] - fill_value[f - milli]``, micro-GPUs), then a hair
    toward the tighter GPU, minus the affinity bonus when the unit's model is loaded.
    ``free_milli`` beyond a whole GPU reads as a whole GPU (the tables end there)."""
    free_milli = min(free_milli, 1000)
    loss = W[7][free_milli] - W[8][milli] - W[7][free_milli - milli]
    key = (loss + 500) // 1000 + free_milli * HAIR  # micro-GPU rounding is noise
    if loaded:
        key -= params[0]
    return key


@njit(cache=True)
def node_gpu_free_total(S, n):
    tot = 0
    cap = 0
    for g in range(S[4][n], S[4][n + 1]):
        if S[8][g]:
            tot += S[6][g]
            cap += 1000
    return tot, cap


@njit(cache=True)
def stranded_milli(gpu_free_milli, cpu_free_milli, mem_free_mib, params):
    """Free GPU share a node cannot use because its free CPU or memory runs out first, at
    the workload's average CPU (params[2]) and memory (params[3]) per milli-GPU."""
    s = 0.0
    if params[2] > 0:
        s = max(s, gpu_free_milli - cpu_free_milli / params[2])
    if params[3] > 0:
        s = max(s, gpu_free_milli - mem_free_mib / params[3])
    return s


@njit(cache=True)
def node_active(S, n):
    for g in range(S[4][n], S[4][n + 1]):
        if S[8][g] and S[6][g] < 1000:
            return True
    return False


@njit(cache=True)
def fgd_score(growth, weight_sum):
    """FGD's node score as the published artifact computes it, as a cost (lower wins):
    ``-int(100 * sigmoid(-g / 1000))`` with ``g`` the fragmentation growth in milli-GPU
    for shape frequencies normalised to 1 (``growth / weight_sum``). The 0-100 integer is
    coarse (about 40 milli-GPU per step near zero growth), so many nodes tie and the
    tie-break (lowest node index) decides: this is what reproduces the paper's numbers."""
    x = -(growth / weight_sum) / 1000.0
    return -np.floor((1.0 / (1.0 + np.exp(-x))) * 100.0)


@njit(cache=True)
def eval_node(policy, S, n, u, U, W, sel, cand, keys, C, params):
    """Score of placing unit ``u`` on node ``n`` (lower is better; inf = does not fit).

    Writes the chosen GPU indices to ``sel[:num_gpu]``. GPUs are ranked by a per-policy key
    (ties: lower GPU index) and the ``num_gpu`` best are taken. ``C[0][n]`` holds the
    node's current FGD fragmentation or NaN when unknown; rows are filled on demand.
    """
    k = U[0][u]
    if S[0][n] < U[3][u] or S[1][n] < U[4][u]:
        return INF
    lo = S[4][n]
    hi = S[4][n + 1]
    milli = U[1][u]
    # ---- candidate GPUs ------------------------------------------------------------
    nc = 0
    if k > 0:
        for g in range(lo, hi):
            if gpu_fits(S, g, milli, U[2][u], U[5][u], U[6][u], U[7][u]):
                cand[nc] = g
                nc += 1
        if nc < k:
            return INF
    priced = policy == GPUSCHED and params[5] > 0.0
    use_frag = policy == FGD or (policy == GPUSCHED and (k > 1 or (k == 1 and not priced)))
    fnow = 0.0
    if use_frag:
        fnow = C[0][n]
        if np.isnan(fnow):
            fnow = frag_rows(S, n, W, C)
    # ---- per-GPU keys --------------------------------------------------------------
    for c in range(nc):
        g = cand[c]
        if policy == FIRST_FIT:
            keys[c] = 0.0
        elif policy == BEST_FIT or policy == DOT_PRODUCT:
            keys[c] = S[6][g]
        elif policy == GPU_PACKING:
            keys[c] = S[6][g] if S[6][g] < 1000 else 2000.0
        elif priced:
            keys[c] = share_loss_key(W, S[6][g], milli, model_loaded(S[9], g, U[6][u]),
                                     params)
        else:
            # fragmentation delta of putting one GPU's share on g; identical GPUs share it
            dup = -1
            for d in range(c):
                h = cand[d]
                if (
                    S[6][h] == S[6][g]
                    and S[5][h] == S[5][g]
                    and S[7][h] == S[7][g]
                    and model_loaded(S[9], h, U[6][u]) == model_loaded(S[9], g, U[6][u])
                ):
                    dup = d
                    break
            if dup >= 0:
                keys[c] = keys[dup]
            else:
                sel[0] = g
                keys[c] = frag_after(S, n, u, U, sel, 1, W, C) - fnow
                if policy == GPUSCHED and model_loaded(S[9], g, U[6][u]):
                    keys[c] -= params[0] * params[4]
    # ---- pick the k lowest (key, GPU index); cand is ascending so strict < keeps ties low --
    first_key = 0.0
    for j in range(k):
        best = -1
        for c in range(nc):
            if keys[c] == INF:
                continue
            if best < 0 or keys[c] < keys[best]:
                best = c
        if j == 0:
            first_key = keys[best]
        sel[j] = cand[best]
        keys[best] = INF
    # keep the chosen GPUs in ascending index order (stable output)
    for j in range(1, k):
        x = sel[j]
        i = j - 1
        while i >= 0 and sel[i] > x:
            sel[i + 1] = sel[i]
            i -= 1
        sel[i + 1] = x
    # ---- node score ----------------------------------------------------------------
    if policy == FIRST_FIT:
        return 0.0
    cpu_after = S[0][n] - U[3][u]
    mem_after = S[1][n] - U[4][u]
    gfree, gcap = node_gpu_free_total(S, n)
    greq = k * milli
    if policy == BEST_FIT:
        sc = cpu_after / max(S[2][n], 1) + mem_after / max(S[3][n], 1)
        if gcap > 0:
            sc += (gfree - greq) / gcap
        return sc
    if policy == DOT_PRODUCT:
        sc = (U[3][u] / max(S[2][n], 1)) * (S[0][n] / max(S[2][n], 1))
        sc += (U[4][u] / max(S[3][n], 1)) * (S[1][n] / max(S[3][n], 1))
        if gcap > 0:
            sc += (greq / gcap) * (gfree / gcap)
        return -sc
    if policy == GPU_PACKING:
        tier = 2.0
        if k > 0 and first_key < 1000:
            tier = 0.0
        elif node_active(S, n):
            tier = 1.0
        return tier * TIER_MILLI + (gfree - greq)
    if policy == FGD:  # growth of the node's fragmentation, quantised as published
        delta = first_key if k == 1 else frag_after(S, n, u, U, sel, k, W, C) - fnow
        return fgd_score(delta, params[4])
    # gpusched: the chosen GPU's price loss (single-GPU units, when priced) or the node's
    # fragmentation growth per unit of workload, plus the growth of GPU share stranded by
    # missing CPU/memory at the workload's CPU and memory per milli-GPU
    before = stranded_milli(gfree, S[0][n], S[1][n], params)
    after = stranded_milli(gfree - greq, cpu_after, mem_after, params)
    if k == 0:
        # CPU-only: take CPU where GPUs need it least, i.e. the free GPU share whose CPU the
        # unit takes if the node's free CPU were spread over it evenly; stranded growth
        # breaks ties (all the nodes whose GPUs are busy)
        taken = U[3][u] * gfree / max(S[0][n], 1)
        return taken + HAIR * params[1] * (after - before)
    if priced and k == 1:
        return first_key + params[1] * (after - before)
    if k == 1:
        delta = first_key
    else:
        delta = frag_after(S, n, u, U, sel, k, W, C) - fnow
        for j in range(k):
            if model_loaded(S[9], sel[j], U[6][u]):
                delta -= params[0] * params[4]
    return delta / params[4] + params[1] * (after - before)


@njit(cache=True)
def apply_unit(S, n, u, U, sel):
    """Commit unit ``u`` to node ``n`` / GPUs ``sel[:num_gpu]`` (loads its model there)."""
    S[0][n] -= U[3][u]
    S[1][n] -= U[4][u]
    model = U[6][u]
    for j in range(U[0][u]):
        g = sel[j]
        S[6][g] -= U[1][u]
        need = U[2][u]
        if model >= 0 and not model_loaded(S[9], g, model):
            need += U[7][u]
            for s in range(S[9].shape[1]):
                if S[9][g, s] < 0:
                    S[9][g, s] = model
                    break
        S[7][g] -= need


@njit(cache=True)
def valid_request(u, U):
    """num_gpu 0-8; a GPU unit asks for 1-1000 milli-GPU each; no negative sizes."""
    k = U[0][u]
    milli = U[1][u]
    if k < 0 or k > 8 or milli < 0 or milli > 1000 or (k > 0 and milli == 0):
        return False
    return U[3][u] >= 0 and U[4][u] >= 0 and U[2][u] >= 0 and U[7][u] >= 0


@njit(cache=True)
def diagnose(S, u, U):
    """Reason code for a unit that fits no node (first failing requirement, most basic first)."""
    k = U[0][u]
    milli = U[1][u]
    if not valid_request(u, U):
        return INVALID_REQUEST
    any_type = k == 0
    gang_ok = k == 0
    cpu_ok = False
    share_ok = False
    n_nodes = S[0].shape[0]
    for n in range(n_nodes):
        typed = 0
        shared = 0
        for g in range(S[4][n], S[4][n + 1]):
            if S[8][g] and (U[5][u] >> S[5][g]) & 1:
                typed += 1
                if S[6][g] >= milli:
                    shared += 1
        if typed > 0:
            any_type = True
        if typed < k:
            continue
        gang_ok = True
        if S[0][n] < U[3][u] or S[1][n] < U[4][u]:
            continue
        cpu_ok = True
        if shared >= k:
            share_ok = True
    if not any_type:
        return NO_ALLOWED_GPU_TYPE
    if not gang_ok:
        return GANG_TOO_LARGE
    if not cpu_ok:
        return INSUFFICIENT_CPU_MEMORY
    if not share_ok:
        return INSUFFICIENT_GPU_SHARE
    return INSUFFICIENT_GPU_MEMORY


@njit(cache=True)
def single_gpu_scores(policy, S, u, U, W, C, params, nodes, count, out_score, out_gpu, cand):
    """``eval_node`` for FGD/gpusched and the single-GPU unit ``u`` on ``nodes[:count]``, in
    one call: ``out_score[i]`` is the node's score (inf = does not fit) and ``out_gpu[i]``
    the GPU ``eval_node`` would pick (-1 when it does not fit). Same floats, same GPU.
    gpusched's key is a lookup in the price tables when priced, else (and for FGD) the
    fragmentation growth.

    Why a batch: every call of a Numba function that takes the state tuples pays an atomic
    reference-count increment and decrement per array (about 30 arrays here); paid once per
    batch instead of once per node, a node costs tens of nanoseconds instead of ~700.
    Integer sums: every fragmentation term is an integer count x milli-GPU, so the int64
    sums here equal the float sums of ``frag_rows``/``frag_after``/the reference exactly
    (below 2**53), whatever the order. Fills node rows in C (``frag_rows``) on demand;
    ``cand`` is scratch with room for the largest node's GPUs. Shapes must be in ascending
    CPU order (``ShapeDistribution.arrays``).
    """
    cpu_free = S[0]
    mem_free = S[1]
    gpu_start = S[4]
    gtype = S[5]
    gmilli = S[6]
    gmem = S[7]
    healthy = S[8]
    models = S[9]
    frag_now = C[0]
    fit_rows = C[1]
    frag_rows_ = C[2]
    total_free = C[3]
    w_cpu, w_mem, w_k, w_milli, w_gmem, w_mask, w_count, _, _ = W
    n_shapes = w_cpu.shape[0]
    n_slots = models.shape[1]
    priced = policy == GPUSCHED and params[5] > 0.0
    bonus = params[0] * params[4]
    milli = U[1][u]
    unit_gmem = U[2][u]
    unit_cpu = U[3][u]
    unit_mem = U[4][u]
    mask = U[5][u]
    model = U[6][u]
    weight = U[7][u]
    weight_from = np.zeros(n_shapes + 1, np.int64)  # weight_from[s] = sum of w_count[s:]
    for s in range(n_shapes - 1, -1, -1):
        weight_from[s] = weight_from[s + 1] + w_count[s]
    for i in range(count):
        n = nodes[i]
        out_score[i] = INF
        out_gpu[i] = -1
        if cpu_free[n] < unit_cpu or mem_free[n] < unit_mem:
            continue
        cpu_after = cpu_free[n] - unit_cpu
        mem_after = mem_free[n] - unit_mem
        fnow = frag_now[n]
        best = -1
        best_key = INF
        nc = 0  # distinct candidate GPU states so far, each by its lowest GPU index
        gfree = 0  # the node's free share (healthy GPUs), for the stranded term
        for g in range(gpu_start[n], gpu_start[n + 1]):
            if not healthy[g]:
                continue
            a = gmilli[g]
            gfree += a
            if (mask >> gtype[g]) & 1 == 0 or a < milli:
                continue
            loaded = False
            if model >= 0:
                for j in range(n_slots):
                    if models[g, j] == model:
                        loaded = True
                        break
            need = unit_gmem
            if model >= 0 and not loaded:
                need += weight
            b = gmem[g]
            if b < need:
                continue
            dup = False
            for d in range(nc):
                h = cand[d]
                if gmilli[h] == a and gtype[h] == gtype[g] and gmem[h] == b:
                    h_loaded = False
                    if model >= 0:
                        for j in range(n_slots):
                            if models[h, j] == model:
                                h_loaded = True
                                break
                    if h_loaded == loaded:
                        dup = True  # same key as h, which has the lower index
                        break
            if dup:
                continue
            cand[nc] = g
            nc += 1
            if priced:
                key = share_loss_key(W, a, milli, loaded, params)
                if key < best_key:
                    best_key = key
                    best = g
                continue
            if np.isnan(fnow):
                fnow = frag_rows(S, n, W, C)
            # fragmentation after taking `milli`/`need` from g: frag_after for one GPU,
            # branch-free (the branches are data dependent and mispredict)
            t = gtype[g]
            a_after = a - milli
            b_after = b - need
            total_after = total_free[n] - milli
            # shapes come in ascending CPU order: past the first one the node's CPU cannot
            # host, every shape counts all of the node's free share
            s_end = 0
            while s_end < n_shapes and w_cpu[s_end] <= cpu_after:
                s_end += 1
            f = total_after * weight_from[s_end]
            for s in range(s_end):
                ks = w_k[s]
                alive = (ks > 0) & (mem_after >= w_mem[s])
                typed = (w_mask[s] >> t) & 1
                fit_before = typed & np.int64(a >= w_milli[s]) & np.int64(b >= w_gmem[s])
                fit_after = (
                    typed & np.int64(a_after >= w_milli[s]) & np.int64(b_after >= w_gmem[s])
                )
                fit = fit_rows[n, s] - fit_before + fit_after
                frag = frag_rows_[n, s] - a * (1 - fit_before) + a_after * (1 - fit_after)
                f += w_count[s] * (frag if alive & (fit >= ks) else total_after)
            key = float(f) - fnow
            if policy == GPUSCHED and loaded:
                key -= bonus
            if key < best_key:
                best_key = key
                best = g
        if best < 0:
            continue
        out_gpu[i] = best
        if policy == FGD:
            out_score[i] = fgd_score(best_key, params[4])
        else:
            before = stranded_milli(gfree, cpu_free[n], mem_free[n], params)
            after = stranded_milli(gfree - milli, cpu_after, mem_after, params)
            growth = best_key if priced else best_key / params[4]
            out_score[i] = growth + params[1] * (after - before)


@njit(cache=True)
def score_nodes(policy, S, u, U, W, C, params, nodes, count, out_score, out_gpu, sel, cand,
                keys):
    """``out_score[i] = eval_node(policy, S, nodes[i], u, ...)`` for i < count (the batched
    single-GPU FGD/gpusched path when it applies; ``out_gpu`` is its scratch)."""
    if U[0][u] == 1 and (policy == FGD or policy == GPUSCHED):
        single_gpu_scores(policy, S, u, U, W, C, params, nodes, count, out_score, out_gpu,
                          cand)
        return
    for i in range(count):
        out_score[i] = eval_node(policy, S, nodes[i], u, U, W, sel, cand, keys, C, params)


@njit(cache=True)
def tree_update(tree, score, n, size):
    """Tournament tree over nodes: ``tree[1]`` is the node with the lowest (score, index)."""
    i = (n + size) >> 1
    while i >= 1:
        a = tree[2 * i]
        b = tree[2 * i + 1]
        if b < 0:
            w = a
        elif a < 0:
            w = b
        elif score[b] < score[a]:  # left subtree holds the lower indices: ties go left
            w = b
        else:
            w = a
        if tree[i] == w and w != n:
            break  # same winner, not the rescored node: every ancestor is unchanged
        tree[i] = w
        i >>= 1


@njit(cache=True)
def tree_build(tree, score, n_nodes, size):
    for i in range(size):
        tree[size + i] = i if i < n_nodes else -1
    for i in range(size - 1, 0, -1):
        a = tree[2 * i]
        b = tree[2 * i + 1]
        if b < 0:
            tree[i] = a
        elif a < 0:
            tree[i] = b
        elif score[b] < score[a]:
            tree[i] = b
        else:
            tree[i] = a


@njit(cache=True)
def node_signature(S, n):
    """Hash of everything a node's score can depend on (free/total CPU and memory, and per
    GPU: type, free share, free memory, health, loaded models)."""
    h = np.uint64(1469598103934665603)
    p = np.uint64(1099511628211)
    h = (h ^ np.uint64(S[0][n])) * p
    h = (h ^ np.uint64(S[1][n])) * p
    h = (h ^ np.uint64(S[2][n])) * p
    h = (h ^ np.uint64(S[3][n])) * p
    for g in range(S[4][n], S[4][n + 1]):
        h = (h ^ np.uint64(S[5][g])) * p
        h = (h ^ np.uint64(S[6][g])) * p
        h = (h ^ np.uint64(S[7][g])) * p
        h = (h ^ np.uint64(1 if S[8][g] else 0)) * p
        for j in range(S[9].shape[1]):
            h = (h ^ np.uint64(S[9][g, j] + 1)) * p
    h = (h ^ np.uint64(S[4][n + 1] - S[4][n])) * p
    return np.int64(h >> np.uint64(1))


@njit(cache=True)
def nodes_alike(S, a, b):
    """Exactly equal node states (so every policy scores them the same)."""
    if S[0][a] != S[0][b] or S[1][a] != S[1][b] or S[2][a] != S[2][b] or S[3][a] != S[3][b]:
        return False
    m = S[4][a + 1] - S[4][a]
    if S[4][b + 1] - S[4][b] != m:
        return False
    for i in range(m):
        ga = S[4][a] + i
        gb = S[4][b] + i
        if S[5][ga] != S[5][gb] or S[6][ga] != S[6][gb] or S[7][ga] != S[7][gb]:
            return False
        if S[8][ga] != S[8][gb]:
            return False
        for j in range(S[9].shape[1]):
            if S[9][ga, j] != S[9][gb, j]:
                return False
    return True


@njit(cache=True)
def build_groups(S, group):
    """``group[n]``: the lowest-index node whose state equals node ``n``'s exactly (a hash
    finds candidates, ``nodes_alike`` confirms). Every policy scores a group's members the
    same, so one evaluation serves them all. A node that changes later leaves its group
    (``group[n] = -1``); the others stay equal to each other."""
    n_nodes = S[0].shape[0]
    size = 1
    while size < 2 * n_nodes:
        size *= 2
    mask = size - 1
    table = np.full(size, -1, np.int64)
    sig = np.empty(n_nodes, np.int64)
    for n in range(n_nodes):
        sig[n] = node_signature(S, n)
        i = sig[n] & mask
        rep = -1
        while table[i] >= 0:
            r = table[i]
            if sig[r] == sig[n] and nodes_alike(S, r, n):
                rep = r
                break
            i = (i + 1) & mask
        if rep < 0:
            table[i] = n
            rep = n
        group[n] = rep


@njit(cache=True)
def score_all(policy, S, u, U, W, C, params, sc, group, group_score, group_epoch, epoch,
              pend, pscore, pgpu, sel, cand, keys):
    """sc[n] for every node, evaluating one member of each group of equal nodes (a fresh or
    lightly used cluster has few distinct states); returns how many evaluations it took.
    ``group_epoch[r] == epoch`` marks group ``r`` as evaluated in this call."""
    n_nodes = S[0].shape[0]
    m = 0
    for n in range(n_nodes):
        r = group[n]
        if r < 0:
            pend[m] = n
            m += 1
        elif group_epoch[r] != epoch:
            group_epoch[r] = epoch
            pend[m] = n
            m += 1
    score_nodes(policy, S, u, U, W, C, params, pend, m, pscore, pgpu, sel, cand, keys)
    for i in range(m):
        r = group[pend[i]]
        if r >= 0:
            group_score[r] = pscore[i]
    for n in range(n_nodes):
        r = group[n]
        sc[n] = group_score[r] if r >= 0 else INF
    for i in range(m):
        sc[pend[i]] = pscore[i]
    return m


HELD_NODES = 1
"""gpusched holds back the last node(s) where the workload's largest gang still fits: a unit
that is not such a gang goes there only when no other node fits it, unless the gang still
fits there beside it."""


@njit(cache=True)
def shape_fits(S, n, W, s, u, U, sel, k):
    """Does one unit of shape ``s`` fit node ``n`` (CPU, memory, and GPUs of its type with
    its share and GPU memory free), were unit ``u`` placed on GPUs ``sel[:k]`` of it first
    (``k`` = -1: nothing placed first)?"""
    cpu = S[0][n]
    mem = S[1][n]
    if k >= 0:
        cpu -= U[3][u]
        mem -= U[4][u]
    if cpu < W[0][s] or mem < W[1][s]:
        return False
    fit = 0
    for g in range(S[4][n], S[4][n + 1]):
        if not S[8][g] or (W[5][s] >> S[5][g]) & 1 == 0:
            continue
        a = S[6][g]
        b = S[7][g]
        for j in range(k):
            if sel[j] == g:
                a -= U[1][u]
                b -= U[2][u]
                if U[6][u] >= 0 and not model_loaded(S[9], g, U[6][u]):
                    b -= U[7][u]
        if a >= W[3][s] and b >= W[4][s]:
            fit += 1
    return fit >= W[2][s]


@njit(cache=True)
def held_shape(policy, S, W, U, sel):
    """gpusched's gang shape to hold a node for (see ``HELD_NODES``): the workload's gang
    shape (two GPUs or more) with the most GPUs that fits some node now, the most frequent
    of those (then the first); -1 when there is none. Returns (shape, nodes it fits)."""
    best = -1
    best_fit = 0
    if policy != GPUSCHED:
        return best, best_fit
    for s in range(W[2].shape[0]):
        if W[2][s] < 2:
            continue
        if best >= 0 and (W[2][s] < W[2][best] or
                          (W[2][s] == W[2][best] and W[6][s] <= W[6][best])):
            continue
        fit = 0
        for n in range(S[0].shape[0]):
            if shape_fits(S, n, W, s, 0, U, sel, -1):
                fit += 1
        if fit > 0:
            best = s
            best_fit = fit
    return best, best_fit


@njit(cache=True)
def past_held_tree(S, W, U, hs, best, sc, tr, size, held, held_score, sel):
    """The lowest (score, index) node of tournament tree ``tr`` where shape ``hs`` does not
    fit, or ``best`` when there is none: takes the nodes it fits out of the tree one by
    one (at most ``HELD_NODES`` of them exist when this is asked), then puts them back."""
    nh = 0
    alt = best
    while (alt >= 0 and sc[alt] < INF and nh < HELD_NODES
           and shape_fits(S, alt, W, hs, 0, U, sel, -1)):
        held[nh] = alt
        held_score[nh] = sc[alt]
        nh += 1
        sc[alt] = INF
        tree_update(tr, sc, alt, size)
        alt = tr[1]
    if alt >= 0 and sc[alt] < INF and not shape_fits(S, alt, W, hs, 0, U, sel, -1):
        best = alt
    for i in range(nh):
        sc[held[i]] = held_score[i]
        tree_update(tr, sc, held[i], size)
    return best


@njit(cache=True)
def past_held_scan(S, W, U, hs, best, scan, sel):
    """``past_held_tree`` over a plain array of node scores."""
    alt_score = INF
    alt = best
    for n in range(scan.shape[0]):
        if scan[n] < alt_score and not shape_fits(S, n, W, hs, 0, U, sel, -1):
            alt_score = scan[n]
            alt = n
    return alt


@njit(cache=True)
def solve_kernel(
    policy, S, U, W, order, shape_of, scores, trees, C, P, out_node, out_gpus, out_reason,
    params, stats,
):
    """Place units in ``order``, one at a time, each seeing the previous placements.

    ``shape_of[u]`` is the unit's cache slot (units with equal requests share one) or -1.
    For a slot, node scores are kept in a tournament tree and only nodes changed since the
    slot's last use are rescored, so a placement costs O(changed nodes x log N), not O(N).
    Writes out_node[u] (-1 = unschedulable), out_gpus[u, :num_gpu], out_reason[u].
    Work buffers come from the caller (``work_buffers``) so their memory is accounted:
    scores[slots, N], trees[slots, 2P] and the FGD row cache C (see ``frag_rows``).
    ``stats`` counts node evaluations: [tree builds, rescored, winner re-evaluations, scans].
    P = (built[slots], cursor[slots], changed[log], stamp[N], group[N], counters[2]) is the
    cache bookkeeping, kept by a ``SolverSession`` across calls: which slots hold scores,
    each slot's position in the node change log, the log, the last log position per node,
    scratch for the groups of equal nodes (``build_groups``, rebuilt in each call that
    needs them), and [log length, unused]. The log must have room for ``len(order)`` more
    entries.
    """
    n_nodes = S[0].shape[0]
    max_g = 1
    for n in range(n_nodes):
        max_g = max(max_g, S[4][n + 1] - S[4][n])
    sel = np.empty(max(max_g, 8), np.int64)
    best_sel = np.empty(max(max_g, 8), np.int64)
    cand = np.empty(max_g, np.int64)
    keys = np.empty(max_g, np.float64)
    size = trees.shape[1] // 2
    built = P[0]
    cursor = P[1]
    changed = P[2]
    stamp = P[3]  # last log position that touched the node
    group = P[4]
    n_changed = P[5][0]
    groups_built = False
    group_score = np.empty(n_nodes, np.float64)
    group_epoch = np.full(n_nodes, -1, np.int64)
    epoch = 0
    pend = np.empty(n_nodes, np.int64)  # nodes to (re)score for the current unit
    pscore = np.empty(n_nodes, np.float64)
    pgpu = np.empty(n_nodes, np.int64)
    scan = np.empty(n_nodes, np.float64)
    hs, n_fit = held_shape(policy, S, W, U, sel)  # the gang shape held for, the nodes it fits
    held = np.empty(HELD_NODES, np.int64)
    held_score = np.empty(HELD_NODES, np.float64)
    for idx in range(len(order)):
        u = order[idx]
        k = U[0][u]
        slot = shape_of[u]
        best = -1
        fast = k == 1 and (policy == FGD or policy == GPUSCHED)  # batched single-GPU scorer
        if not valid_request(u, U):
            out_node[u] = -1
            out_reason[u] = INVALID_REQUEST
            continue
        if slot >= 0 and built[slot]:
            sc = scores[slot]
            tr = trees[slot]
            m = 0
            for c in range(cursor[slot], n_changed):
                n = changed[c]
                if stamp[n] == c:  # else a later log entry rescores this node
                    pend[m] = n
                    m += 1
            if fast:
                single_gpu_scores(policy, S, u, U, W, C, params, pend, m, pscore, pgpu, cand)
            else:
                score_nodes(policy, S, u, U, W, C, params, pend, m, pscore, pgpu, sel, cand,
                            keys)
            for i in range(m):
                sc[pend[i]] = pscore[i]
                tree_update(tr, sc, pend[i], size)
            stats[1] += m
            cursor[slot] = n_changed
            if tr[1] >= 0 and sc[tr[1]] < INF:
                best = tr[1]
        else:
            if not groups_built:
                build_groups(S, group)
                groups_built = True
            sc = scores[slot] if slot >= 0 else scan
            epoch += 1
            evals = score_all(policy, S, u, U, W, C, params, sc, group, group_score,
                              group_epoch, epoch, pend, pscore, pgpu, sel, cand, keys)
            if slot >= 0:
                stats[0] += evals
                tree_build(trees[slot], sc, n_nodes, size)
                built[slot] = True
                cursor[slot] = n_changed
                tr = trees[slot]
                if tr[1] >= 0 and sc[tr[1]] < INF:
                    best = tr[1]
            else:
                stats[3] += evals
                best_score = INF
                for n in range(n_nodes):
                    if scan[n] < best_score:
                        best_score = scan[n]
                        best = n
        if best < 0:
            out_node[u] = -1
            out_reason[u] = diagnose(S, u, U)
            continue
        stats[2] += 1
        for attempt in range(2):
            if fast:
                pend[0] = best
                single_gpu_scores(policy, S, u, U, W, C, params, pend, 1, pscore, pgpu, cand)
                best_sel[0] = pgpu[0]
            else:
                eval_node(policy, S, best, u, U, W, best_sel, cand, keys, C, params)
            if (attempt > 0 or hs < 0 or k >= W[2][hs] or n_fit > HELD_NODES
                    or not shape_fits(S, best, W, hs, 0, U, sel, -1)
                    or shape_fits(S, best, W, hs, u, U, best_sel, k)):
                break
            # it would take the last node the gang fits: the best other node, if any fits
            alt = past_held_tree(S, W, U, hs, best, scores[slot], trees[slot], size, held,
                                 held_score, sel) if slot >= 0 else \
                past_held_scan(S, W, U, hs, best, scan, sel)
            if alt == best:
                break
            best = alt
        held_before = hs >= 0 and shape_fits(S, best, W, hs, 0, U, sel, -1)
        apply_unit(S, best, u, U, best_sel)
        if held_before and not shape_fits(S, best, W, hs, 0, U, sel, -1):
            n_fit -= 1
        C[0][best] = np.nan
        if groups_built:
            group[best] = -1  # no longer equal to its old group
        out_node[u] = best
        out_reason[u] = PLACED
        for j in range(k):
            out_gpus[u, j] = best_sel[j]
        changed[n_changed] = best
        stamp[best] = n_changed
        n_changed += 1
    P[5][0] = n_changed


@njit(cache=True)
def note_changed(nodes, P, C):
    """Record nodes changed outside ``solve_kernel`` (a session's next state): append them to
    the change log and drop their cached fragmentation."""
    n_changed = P[5][0]
    for i in range(len(nodes)):
        n = nodes[i]
        P[2][n_changed] = n
        P[3][n] = n_changed
        n_changed += 1
        C[0][n] = np.nan
    P[5][0] = n_changed


@njit(cache=True)
def group_rows_kernel(rows):
    """Group equal rows of the (n, c) int64 array: (group id per row, group sizes), groups
    numbered by their first row. One pass over an open-addressing hash table; each row is
    compared only with the first rows of its hash chain."""
    n, c = rows.shape
    size = 1
    while size < 2 * n:
        size <<= 1
    mask = np.uint64(size - 1)
    table = np.full(size, -1, np.int64)
    first = np.empty(n, np.int64)
    counts = np.zeros(n, np.int64)
    gid = np.empty(n, np.int64)
    groups = 0
    for i in range(n):
        h = np.uint64(0xCBF29CE484222325)
        for j in range(c):
            h = (h ^ np.uint64(rows[i, j])) * np.uint64(0x100000001B3)
        h ^= h >> np.uint64(33)  # mix the high bits down: the table is indexed by the low
        h *= np.uint64(0xFF51AFD7ED558CCD)
        h ^= h >> np.uint64(33)
        slot = h & mask
        while True:
            g = table[slot]
            if g < 0:
                table[slot] = groups
                first[groups] = i
                counts[groups] = 1
                gid[i] = groups
                groups += 1
                break
            r = first[g]
            same = True
            for j in range(c):
                if rows[r, j] != rows[i, j]:
                    same = False
                    break
            if same:
                counts[g] += 1
                gid[i] = g
                break
            slot = (slot + np.uint64(1)) & mask
    return gid, counts[:groups].copy()
