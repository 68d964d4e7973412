"""Pure-PyTorch reference of one AFD exchange computed in one process (torch_cam.afd): what
every attention rank's ``recv`` must return, bit for bit, given the same expert functions.

``expert_fn(e, rows, scales)`` computes expert ``e`` (``-1``: the shared expert) on rows in the
form the FFN rank receives them: the tokens themselves, or with ``quant`` their per-token int8
and float32 scales (``scales`` is None otherwise). It must treat rows independently (as a
matmul over a batch of rows does up to rounding; tests use row-wise functions so that grouping
cannot change a bit). Its output is rounded to the tokens' dtype (what the FFN rank returns).

The sums are the channel's (csrc/afd/afd_rows.hpp states them), fp32 throughout, weight times
row as a multiply then an add, one rounding at the end:
- weights given with the tokens: per FFN rank f holding any of the token's experts (or its
  shared-expert chunk), partial_f = sum over its experts, k in order, of w_k * y_k, then + the
  shared row; out = sum over those f, ascending, of partial_f;
- weights given at the receive (``weights_at_recv``): out = sum over k in order of w_k * y_k,
  then + the shared row.
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


def exchange(xs, ids, weights, expert_fn, *, experts_per_rank: int, num_ffn: int, shared_expert: bool = False,
             quant: bool = False, weights_at_recv=None):
    """One layer's exchange for every attention rank: xs[a] (bs_a, H), ids[a] (bs_a, K) (-1: not
    routed), weights[a] (bs_a, K) given with the tokens, or None and ``weights_at_recv[a]``.
    Returns the list of (bs_a, H) outputs."""
    outs = []
    for a, (x, i) in enumerate(zip(xs, ids)):
        bs, K = i.shape
        H = x.shape[1]
        rows, scales = quantize_int8_rows(x) if quant else (x, None)
        y = torch.zeros(bs, K, H, dtype=x.dtype)
        for e in sorted(set(i[i >= 0].tolist())):
            t, k = (i == e).nonzero(as_tuple=True)
            y[t, k] = expert_fn(e, rows[t], None if scales is None else scales[t]).to(x.dtype)
        sh = expert_fn(-1, rows, scales).to(x.dtype) if shared_expert else None
        if weights[a] is None:
            outs.append(combine(y, i, weights_at_recv[a], sh, x.dtype))
            continue
        w = weights[a].to(torch.float32)
        chunk = -(-bs // num_ffn) if bs else 1
        owner = torch.arange(bs) // chunk
        acc = torch.zeros(bs, H, dtype=torch.float32)
        for f in range(num_ffn):
            part = torch.zeros(bs, H, dtype=torch.float32)
            has = torch.zeros(bs, 1, dtype=torch.bool)
            for k in range(K):
                mine = ((i[:, k] >= 0) & (torch.div(i[:, k], experts_per_rank, rounding_mode="floor") == f)).unsqueeze(1)
                part = torch.where(mine, part + w[:, k:k + 1] * y[:, k].to(torch.float32), part)
                has |= mine
            if sh is not None:
                mine = (owner == f).unsqueeze(1)
                part = torch.where(mine, part + sh.to(torch.float32), part)
                has |= mine
            acc = torch.where(has, acc + part, acc)
        outs.append(acc.to(x.dtype))
    return outs
