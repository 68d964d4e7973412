"""KV-cache block copies with layout conversion, on the native kernel (kernels/kv_copy.cpp).

``copy_blocks`` moves one request's KV from ONE source tp rank's pools into ONE destination tp
rank's pools: the heads the plan (``kv_reference.plan_kv_copy``) takes from that source rank,
for every token, re-blocked and re-ordered (NHD/HND) inside the copy. It is the data path the
transport (docs/kv.md) will run between mapped pools of different ranks; it checks everything
before the first byte moves, exactly as ``kv_reference.reference_transfer`` does, and tests
compare the two bit for bit.
"""
from __future__ import annotations

import torch

from . import _C
from .kv_reference import (KVLayout, _as_id_list, _check_block_ids, _check_compatible, _check_layers,
                           _check_num_tokens, _check_pools, plan_kv_copy, token_runs)

__all__ = ["copy_blocks"]


def _logical_shape(layout: KVLayout) -> list[int]:
    """[planes, blocks, block_size, heads, head_dim], whatever the physical order."""
    if layout.kind == "mla":
        return [1, layout.num_blocks, layout.block_size, 1, layout.head_dim]
    return [2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]


def copy_blocks(src_pools, src_layout: KVLayout, src_block_ids, dst_pools, dst_layout: KVLayout,
                dst_block_ids, num_tokens: int, layers=None) -> int:
    """Copies the heads ``dst_layout``'s rank takes from ``src_layout``'s rank (per
    ``plan_kv_copy``) for tokens ``0 .. num_tokens-1`` of the given layers (default all).
    Returns the bytes copied (0 when this source rank feeds nothing to that destination rank).
    Raises IndexError (block id or layer out of range) or ValueError before anything is written."""
    _check_compatible(src_layout, dst_layout, False)
    num_tokens = _check_num_tokens(num_tokens)
    s_ids = _as_id_list(src_block_ids, "src_block_ids")
    d_ids = _as_id_list(dst_block_ids, "dst_block_ids")
    _check_block_ids(s_ids, src_layout, num_tokens, "src_block_ids", unique=False)
    _check_block_ids(d_ids, dst_layout, num_tokens, "dst_block_ids", unique=True)
    layer_list = _check_layers(layers, dst_layout)
    _check_pools(src_pools, src_layout, "src_pools")
    _check_pools(dst_pools, dst_layout, "dst_pools")
    plan = plan_kv_copy(src_layout.with_rank(src_layout.tp_rank), dst_layout)
    pieces = [p for p in plan.pieces if p.src_tp_rank == src_layout.tp_rank]
    if not pieces or num_tokens == 0:
        return 0
    piece_t = torch.tensor([[p.src_head_lo, p.dst_head_lo, p.num_heads] for p in pieces], dtype=torch.int64)
    runs = torch.tensor(token_runs(s_ids, src_layout.block_size, d_ids, dst_layout.block_size, num_tokens),
                        dtype=torch.int64).view(-1, 5)
    s_shape, d_shape = _logical_shape(src_layout), _logical_shape(dst_layout)
    s_hnd = src_layout.kind == "mha" and src_layout.order == "HND"
    d_hnd = dst_layout.kind == "mha" and dst_layout.order == "HND"
    for l in layer_list:
        _C.kv_copy(src_pools[l], dst_pools[l], s_shape, d_shape, s_hnd, d_hnd, runs, piece_t)
    planes = s_shape[0]
    elem = torch.empty((), dtype=dst_layout.dtype).element_size()
    return len(layer_list) * planes * num_tokens * sum(p.num_heads for p in pieces) * dst_layout.head_dim * elem
