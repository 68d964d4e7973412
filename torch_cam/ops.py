"""torch.ops for the extension ops: ``torch.ops.torch_cam.*``.

Each op is a custom op with a schema and a fake kernel that gives its output shapes, so that
``torch.compile`` (``fullgraph=True`` included) keeps it as one node of the graph instead of
breaking the graph around a pybind call. The public functions (``torch_cam.moe_distribute_*``,
``KVTransfer.push/pull``) route here while being compiled and call the implementation directly
in eager mode, so eager calls pay no dispatcher overhead; both run the same implementation.

Groups are passed by name (``pg.group_name``), as torch's functional collectives do.
Schemas have no optional outputs: an output the NPU API returns as ``None``
(``dynamic_scales`` without quantization, ``expand_scales`` without ``expert_scales``) is an
empty tensor here, and the public functions turn it back into ``None``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import moe

_DispatchOut = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def group_name(group) -> str:
    """The name torch.ops take for a group: a ProcessGroup's ``group_name``, a name as is, or
    "" for the world group."""
    if group is None or isinstance(group, str):
        return group or ""
    return group.group_name


def _group_size_rank(name: str) -> tuple[int, int]:
    pg = moe.resolve_group(name)
    return pg.size(), pg.rank()


def _or_empty(t: Optional[Tensor]) -> Tensor:
    return torch.empty(0) if t is None else t


def performance_info_or_scratch(info: Optional[Tensor], ep_world_size: int) -> Tensor:
    """The v2 ops' ``performance_info`` (accumulated wait times), or a scratch one when the
    caller passes none: compiled graphs cannot carry an optional argument the op mutates."""
    return torch.zeros(ep_world_size, dtype=torch.int64) if info is None else info


# ---- MoE dispatch --------------------------------------------------------------------------------

def _dispatch_fake(x, expert_ids, group_ep, moe_expert_num, expert_scales, tp_world_size,
                   shared_expert_rank_num, quant_mode, global_bs, v2) -> _DispatchOut:
    W, rank = _group_size_rank(group_ep)
    BS, K = expert_ids.shape
    H = x.shape[1]
    T = max(int(tp_world_size), 1)
    _, L_here, _, A = moe.dispatch_geometry(W, rank, BS, K, int(moe_expert_num),
                                                     int(shared_expert_rank_num), int(global_bs))
    quant = quant_mode == 2
    f32, i32 = torch.float32, torch.int32
    return (x.new_empty((T * A, H), dtype=torch.int8 if quant else x.dtype),
            x.new_empty((T * A,) if quant else (0,), dtype=f32),
            x.new_empty((A * moe.ASSIST_INTS_PER_ROW,) if v2 else (BS * K,), dtype=i32),
            x.new_empty((L_here,), dtype=torch.int64),
            x.new_empty((T * W * L_here,), dtype=i32),
            x.new_empty((T,), dtype=i32),
            x.new_empty((T * A,) if expert_scales is not None else (0,), dtype=f32))


def _dispatch_outputs(outs) -> _DispatchOut:
    return tuple(_or_empty(t) for t in outs)


@torch.library.custom_op("torch_cam::moe_distribute_dispatch", mutates_args=())
def moe_distribute_dispatch(
        x: Tensor, expert_ids: Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
        moe_expert_num: int, scales: Optional[Tensor], x_active_mask: Optional[Tensor],
        expert_scales: Optional[Tensor], group_tp: str, tp_world_size: int, tp_rank_id: int,
        expert_shard_type: int, shared_expert_num: int, shared_expert_rank_num: int,
        quant_mode: int, global_bs: int, expert_token_nums_type: int) -> _DispatchOut:
    return _dispatch_outputs(moe._dispatch(
        "moe_distribute_dispatch", x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        scales=scales, x_active_mask=x_active_mask, expert_scales=expert_scales, group_tp=group_tp,
        tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
        quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type))


@moe_distribute_dispatch.register_fake
def _(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, scales, x_active_mask,
      expert_scales, group_tp, tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
      shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type):
    return _dispatch_fake(x, expert_ids, group_ep, moe_expert_num, expert_scales, tp_world_size,
                          shared_expert_rank_num, quant_mode, global_bs, v2=False)


@torch.library.custom_op("torch_cam::moe_distribute_dispatch_v2", mutates_args=("performance_info",))
def moe_distribute_dispatch_v2(
        x: Tensor, expert_ids: Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
        moe_expert_num: int, scales: Optional[Tensor], x_active_mask: Optional[Tensor],
        expert_scales: Optional[Tensor], performance_info: Tensor, group_tp: str,
        tp_world_size: int, tp_rank_id: int, expert_shard_type: int, shared_expert_num: int,
        shared_expert_rank_num: int, quant_mode: int, global_bs: int, expert_token_nums_type: int,
        zero_expert_num: int, copy_expert_num: int, const_expert_num: int) -> _DispatchOut:
    return _dispatch_outputs(moe._dispatch(
        "moe_distribute_dispatch_v2", x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        scales=scales, x_active_mask=x_active_mask, expert_scales=expert_scales, group_tp=group_tp,
        tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
        quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type,
        special=int(zero_expert_num) + int(copy_expert_num) + int(const_expert_num), v2=True,
        performance_info=performance_info))


@moe_distribute_dispatch_v2.register_fake
def _(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, scales, x_active_mask,
      expert_scales, performance_info, group_tp, tp_world_size, tp_rank_id, expert_shard_type,
      shared_expert_num, shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type,
      zero_expert_num, copy_expert_num, const_expert_num):
    return _dispatch_fake(x, expert_ids, group_ep, moe_expert_num, expert_scales, tp_world_size,
                          shared_expert_rank_num, quant_mode, global_bs, v2=True)


def dispatch_result(outs, quant_mode: int, expert_scales) -> tuple:
    """The op's outputs as the NPU API returns them (None where it has no output)."""
    expand_x, dyn, idx, nums, ep_counts, tp_counts, exp_scales = outs
    return (expand_x, dyn if quant_mode == 2 else None, idx, nums, ep_counts, tp_counts,
            exp_scales if expert_scales is not None else None)


# ---- MoE combine ---------------------------------------------------------------------------------

@torch.library.custom_op("torch_cam::moe_distribute_combine", mutates_args=())
def moe_distribute_combine(
        expand_x: Tensor, expert_ids: Tensor, expand_idx: Tensor, ep_send_counts: Tensor,
        expert_scales: Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
        moe_expert_num: int, tp_send_counts: Optional[Tensor], x_active_mask: Optional[Tensor],
        shared_expert_x: Optional[Tensor], group_tp: str, tp_world_size: int, tp_rank_id: int,
        expert_shard_type: int, shared_expert_num: int, shared_expert_rank_num: int,
        global_bs: int, comm_quant_mode: int) -> Tensor:
    return moe._combine(
        "moe_distribute_combine", expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales,
        group_ep, ep_world_size, ep_rank_id, moe_expert_num, tp_send_counts=tp_send_counts,
        x_active_mask=x_active_mask, shared_expert_x=shared_expert_x, group_tp=group_tp,
        tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
        shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
        global_bs=global_bs, comm_quant_mode=comm_quant_mode, v2=False)


@moe_distribute_combine.register_fake
def _(expand_x, expert_ids, *args):
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


@torch.library.custom_op("torch_cam::moe_distribute_combine_v2", mutates_args=("performance_info",))
def moe_distribute_combine_v2(
        expand_x: Tensor, expert_ids: Tensor, assist_info_for_combine: Tensor, ep_send_counts: Tensor,
        expert_scales: Tensor, group_ep: str, ep_world_size: int, ep_rank_id: int,
        moe_expert_num: int, tp_send_counts: Optional[Tensor], x_active_mask: Optional[Tensor],
        shared_expert_x: Optional[Tensor], ori_x: Optional[Tensor],
        const_expert_alpha_1: Optional[Tensor], const_expert_alpha_2: Optional[Tensor],
        const_expert_v: Optional[Tensor], performance_info: Tensor, group_tp: str,
        tp_world_size: int, tp_rank_id: int, expert_shard_type: int, shared_expert_num: int,
        shared_expert_rank_num: int, global_bs: int, comm_quant_mode: int, zero_expert_num: int,
        copy_expert_num: int, const_expert_num: int) -> Tensor:
    return moe._combine(
        "moe_distribute_combine_v2", expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
        expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
        tp_send_counts=tp_send_counts, x_active_mask=x_active_mask, shared_expert_x=shared_expert_x,
        group_tp=group_tp, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs,
        comm_quant_mode=comm_quant_mode, v2=True, zero_expert_num=zero_expert_num,
        copy_expert_num=copy_expert_num, const_expert_num=const_expert_num, ori_x=ori_x,
        const_expert_alpha_1=const_expert_alpha_1, const_expert_alpha_2=const_expert_alpha_2,
        const_expert_v=const_expert_v, performance_info=performance_info)


@moe_distribute_combine_v2.register_fake
def _(expand_x, expert_ids, *args):
    return expand_x.new_empty((expert_ids.shape[0], expand_x.shape[1]))


# ---- KV transfer ---------------------------------------------------------------------------------
# A transfer writes (push: the peer's, pull: this rank's) registered KV pools, which are not
# arguments of the op: "unknown" mutation keeps the compiler from reordering or dropping it.

@torch.library.custom_op("torch_cam::kv_transfer", mutates_args="unknown")
def kv_transfer(handle: int, kind: int, peer: int, src_block_ids: Tensor, dst_block_ids: Tensor,
                num_tokens: int, layers: Optional[list[int]], request_id: str, version: int) -> None:
    from .kv import KVTransfer
    KVTransfer._by_handle(handle)._transfer(kind, peer, src_block_ids.tolist(), dst_block_ids.tolist(),
                                            num_tokens, layers, request_id.encode("latin-1"),
                                            None if version < 0 else version, False)


@kv_transfer.register_fake
def _(*args):
    return None


__all__ = ["moe_distribute_dispatch", "moe_distribute_dispatch_v2", "moe_distribute_combine",
           "moe_distribute_combine_v2", "kv_transfer", "group_name", "dispatch_result",
           "performance_info_or_scratch"]

