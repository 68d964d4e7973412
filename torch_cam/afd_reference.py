"""Pure-PyTorch reference of one AFD exchange computed in one process (torch_cam.afd): what
every attention rank's ``recv`` must return, bit for bit, given the same expert functions.

``expert_fn(e, rows, scales)`` computes expert ``e`` (``-1``: the shared expert) on rows in the
form the FFN rank receives them: the tokens themselves, or with ``quant`` their per-token int8
and float32 scales (``scales`` is None otherwise). It must treat rows independently (as a
matmul over a batch of rows does up to rounding; tests use row-wise functions so that grouping
cannot change a bit). The sum is the channel's: fp32, k in order, weight times row (a multiply,
then an add), the shared expert added last, one rounding to the attention rank's dtype.
"""
from __future__ import annotations

import torch

from .moe_reference import quantize_int8_rows

__all__ = ["combine", "exchange"]


def combine(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """rows (bs, K, H): output of each token's k-th routed expert (ignored where ids < 0);
    weights (bs, K); shared (bs, H) or None. Returns (bs, H) of dtype."""
    bs, K, H = rows.shape
    acc = torch.zeros(bs, H, dtype=torch.float32)
    w = weights.to(torch.float32)
    for k in range(K):
        routed = (ids[:, k] >= 0).unsqueeze(1)
        acc = torch.where(routed, acc + w[:, k:k + 1] * rows[:, k].to(torch.float32), acc)
    if shared is not None:
        acc = acc + shared.to(torch.float32)
    return acc.to(dtype)


def exchange(xs, ids, weights, expert_fn, *, shared_expert: bool = False, quant: bool = False):
    """One layer's exchange for every attention rank: xs[a] (bs_a, H), ids[a] (bs_a, K) (-1: not
    routed), weights[a] (bs_a, K) or None (weight 1). Returns the list of (bs_a, H) outputs."""
    outs = []
    for x, i, w in zip(xs, ids, weights):
        bs, K = i.shape
        rows, scales = quantize_int8_rows(x) if quant else (x, None)
        y = torch.zeros(bs, K, x.shape[1], dtype=x.dtype)
        for e in sorted(set(i[i >= 0].tolist())):
            t, k = (i == e).nonzero(as_tuple=True)
            y[t, k] = expert_fn(e, rows[t], None if scales is None else scales[t]).to(x.dtype)
        sh = expert_fn(-1, rows, scales).to(x.dtype) if shared_expert else None
        outs.append(combine(y, i, torch.ones(bs, K) if w is None else w, sh, x.dtype))
    return outs
