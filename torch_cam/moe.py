"""MoE expert-parallel dispatch and combine over a cam group.

Argument-compatible with Ascend's ``torch_npu.npu_moe_distribute_dispatch`` / ``_combine`` (and
the ``_v2`` forms) and with CAM's ``moe_dispatch_shmem`` / ``moe_combine_shmem``: an Ascend caller
ports by renaming. ``group_ep`` (CAM: ``ext_info``) is a cam ProcessGroup or its group name. The
DeepEP-style ``Buffer`` lives in ``moe_buffer.py`` and uses the same two native ops.

How it moves data (csrc/moe/): every rank stages its token rows once plus its routing (the
counts phase, as CSR) in its window, publishes, and every receiver pulls the rows routed to its
experts straight into ``expand_x`` at their final position, quantizing to int8 inside that copy
when ``quant_mode == 2``. Combine is the mirror image: each rank stages the rows it computed and
every token owner pulls its rows, weights them and sums in fp32. One synchronisation per call,
double-buffered, nothing allocated in the window per call.

Output contract (what the NPU documents, plus what it leaves open):
- ``expand_x`` has ``T*A`` rows (see the NPU docs); only the first ``ep_recv_counts[-1]`` rows
  (plus the TP peer's with tp_world_size=2) are valid, the rest are unspecified (not zeroed:
  zeroing them would cost more than the dispatch at decode sizes);
- ``expand_idx`` / ``assist_info_for_combine`` / ``ep_recv_counts`` / ``tp_recv_counts`` /
  ``expand_scales`` are to be passed to combine unchanged; their values follow the layout
  documented in docs/moe.md (and match ``torch_cam.moe_reference``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .moe_hosts import moe_backend

__all__ = [
    "moe_distribute_dispatch", "moe_distribute_combine",
    "moe_distribute_dispatch_v2", "moe_distribute_combine_v2",
    "moe_dispatch_shmem", "moe_combine_shmem",
]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
ASSIST_INTS_PER_ROW = 128


def _ops():
    """torch_cam.ops (imported late: it builds on this module)."""
    from . import ops
    return ops


# ---- groups ------------------------------------------------------------------------------------

def resolve_group(group) -> dist.ProcessGroup:
    """A ProcessGroup from what callers pass as ``group_ep``/``group_tp``: the group itself, its
    name (``pg.group_name``, what torch_npu callers pass) or None (the world group)."""
    if group is None or (isinstance(group, str) and group == ""):
        pg = dist.group.WORLD
        if pg is None:
            raise RuntimeError("torch_cam.moe: no default process group; call init_process_group('cam')")
        return pg
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
        if resolve is not None:
            try:
                return resolve(group)
            except Exception:
                pass
        for pg, name in dist.distributed_c10d._world.pg_names.items():
            if name == group:
                return pg
        raise ValueError(f"torch_cam.moe: no process group named {group!r}")
    raise TypeError(f"torch_cam.moe: expected a ProcessGroup or a group name, got {type(group).__name__}")


# ---- small helpers -----------------------------------------------------------------------------

def occurrence_index(ids: torch.Tensor) -> torch.Tensor:
    """For flat routed ids (-1 = not routed): how many earlier entries (row-major) chose the same
    expert; -1 where not routed. This is ``expand_idx``: the entry's row within the block its
    expert's rank receives from this rank."""
    n = ids.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int32)
    ids = ids.to(torch.int64)
    order = torch.argsort(ids, stable=True)
    routed = ids >= 0
    counts = torch.bincount(ids[routed], minlength=1) if bool(routed.any()) else torch.zeros(1, dtype=torch.int64)
    # Sorted, the -1 entries come first, then each expert's entries in row-major order.
    first = torch.cumsum(counts, 0) - counts + (n - int(routed.sum()))
    sorted_ids = ids[order]
    occ = torch.full((n,), -1, dtype=torch.int64)
    keep = sorted_ids >= 0
    occ[order[keep]] = torch.arange(n)[keep] - first[sorted_ids[keep]]
    return occ.to(torch.int32)


def shared_chunk_lo(r: int, c: int, tokens: int, S: int) -> int:
    """First token of the chunk routed-expert rank r sends to shared rank c (of S)."""
    return (c + r) * tokens // S - r * tokens // S


def segments_table(counts: torch.Tensor, owners: torch.Tensor) -> torch.Tensor:
    """(n, 3) int64 [first row, rows, owner rank] of consecutive segments, from inclusive running
    sums of their sizes and the rank whose tokens each holds."""
    ends = counts.to(torch.int64)
    first = torch.zeros_like(ends)
    if ends.numel() > 1:
        first[1:] = ends[:-1]
    return torch.stack([first, ends - first, owners.to(torch.int64)], dim=1).contiguous()


def _fail_collectively(backend, op: str, error: str, combine: bool = False):
    """Takes part in the op as a refusal carrying this rank's reason, so that every rank of the
    group raises it at once (a rank that merely raised here would leave its peers waiting)."""
    backend.refuse("moe_combine" if combine else "moe_dispatch", op, error)
    raise AssertionError("unreachable: a refusal raises")  # pragma: no cover


class _Checks:
    """Collects the first argument error of a call; the op then raises it on every rank."""

    def __init__(self, op: str, rank: int):
        self.op, self.rank, self.error = op, rank, ""

    def require(self, ok: bool, what) -> bool:
        if not ok and not self.error:
            self.error = what() if callable(what) else what
        return ok

    @contextlib.contextmanager
    def guard(self):
        """Planning in this block that raises (an argument torch itself rejects) becomes this
        call's error, refused on every rank, instead of failing this rank alone."""
        try:
            yield
        except Exception as e:  # noqa: BLE001
            self.require(False, f"{type(e).__name__}: {e}")


def _check_layout(c: _Checks, W: int, rank: int, ep_world_size, ep_rank_id, moe_expert_num, S,
                  tp_world_size, shared_expert_num, expert_shard_type):
    c.require(ep_world_size == W, lambda: f"ep_world_size is {ep_world_size} but group_ep has {W} ranks")
    c.require(ep_rank_id == rank, lambda: f"ep_rank_id is {ep_rank_id} but this rank is rank {rank} of group_ep")
    c.require(expert_shard_type == 0, lambda: f"expert_shard_type must be 0 (shared-expert ranks first), got {expert_shard_type}")
    c.require(0 <= S < W, lambda: f"shared_expert_rank_num must be in [0, {W}), got {S}")
    c.require(S == 0 or W % S == 0, lambda: f"ep_world_size {W} must be a multiple of shared_expert_rank_num {S}")
    c.require(S == 0 or shared_expert_num == 1,
              lambda: f"shared_expert_num must be 1 when shared_expert_rank_num > 0, got {shared_expert_num}")
    c.require(moe_expert_num >= 1 and W > S and moe_expert_num % (W - S) == 0,
              lambda: f"moe_expert_num {moe_expert_num} must be a positive multiple of the "
                      f"{W - S} routed-expert ranks (ep_world_size - shared_expert_rank_num)")
    c.require(tp_world_size in (0, 1, 2), lambda: f"tp_world_size must be 0, 1 or 2, got {tp_world_size}")


def _check_cpu(c: _Checks, **tensors) -> None:
    """Every tensor argument lives in host memory: a meta or device tensor has no bytes here."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            c.require(t.device.type == "cpu" and t.layout == torch.strided,
                      lambda: f"{name} must be a dense CPU tensor, got one on {t.device} with layout {t.layout}")


def _check_performance_info(c: _Checks, info, W: int) -> None:
    if info is not None:
        c.require(isinstance(info, torch.Tensor) and info.dtype == torch.int64 and info.shape == (W,)
                  and info.is_contiguous(),
                  lambda: f"performance_info must be a contiguous int64 tensor of {W} entries (one per EP "
                          f"rank), got {getattr(info, 'dtype', type(info))} of shape {tuple(getattr(info, 'shape', ()))}")


def _active_entries(c: _Checks, ids: torch.Tensor, mask, special: int, M: int):
    """(routed ids with -1 where inactive or special, token activity, entry activity per the mask)."""
    BS, K = ids.shape
    entry = torch.ones(BS, K, dtype=torch.bool)
    if mask is not None:
        if mask.dim() == 1 and c.require(mask.shape == (BS,), lambda: f"x_active_mask must be ({BS},) or ({BS}, {K}), got {tuple(mask.shape)}"):
            entry = mask.bool().view(BS, 1).expand(BS, K).clone()
        elif mask.dim() == 2 and c.require(mask.shape == (BS, K), lambda: f"x_active_mask must be ({BS},) or ({BS}, {K}), got {tuple(mask.shape)}"):
            entry = mask.bool().clone()
        else:
            c.require(False, lambda: f"x_active_mask must be 1-D or 2-D, got {mask.dim()}-D")
    token = entry.any(dim=1) if K > 0 else torch.ones(BS, dtype=torch.bool)
    routed = ids.to(torch.int32).clone()
    is_special = (routed >= M) & (routed < M + special)
    routed[~entry | is_special] = -1
    return routed.contiguous(), token.contiguous(), entry


# ---- dispatch ----------------------------------------------------------------------------------

def dispatch_geometry(W: int, rank: int, BS: int, K: int, M: int, S: int, global_bs: int):
    """(is_shared, L_here, max_bs, A) of a dispatch on ``rank``: whether it holds the shared
    expert, its local experts, the per-rank token bound and A, the rows ``expand_x`` has per TP
    rank (the NPU's worst case: every token of every rank routed here). The one statement of
    the output sizes: the dispatch and its fake kernel (torch_cam/ops.py) both use it."""
    L = M // (W - S)
    is_shared = rank < S
    max_bs = global_bs // W if global_bs else BS
    A = max_bs * W // S if is_shared else max_bs * W * min(L, K)
    return is_shared, (1 if is_shared else L), max_bs, A


def _dispatch(op, x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales,
              x_active_mask, expert_scales, group_tp, tp_world_size, tp_rank_id, expert_shard_type,
              shared_expert_num, shared_expert_rank_num, quant_mode, global_bs,
              expert_token_nums_type, special=0, v2=False, performance_info=None):
    pg = resolve_group(group_ep)
    backend = moe_backend(pg)
    W, rank = pg.size(), pg.rank()
    S = int(shared_expert_rank_num)
    M = int(moe_expert_num)
    c = _Checks(op, rank)
    _check_layout(c, W, rank, ep_world_size, ep_rank_id, M, S, tp_world_size, shared_expert_num,
                  expert_shard_type)
    c.require(isinstance(x, torch.Tensor) and x.dim() == 2 and x.dtype in _FLOATS,
              lambda: f"x must be a 2-D bfloat16, float16 or float32 tensor, got {getattr(x, 'dtype', type(x))} "
                      f"of shape {tuple(getattr(x, 'shape', ()))}")
    c.require(isinstance(expert_ids, torch.Tensor) and expert_ids.dim() == 2
              and expert_ids.dtype in (torch.int32, torch.int64)
              and expert_ids.shape[0] == (x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1),
              lambda: f"expert_ids must be an int32 (BS, K) tensor with BS = x.size(0), got "
                      f"{getattr(expert_ids, 'dtype', type(expert_ids))} of shape {tuple(getattr(expert_ids, 'shape', ()))}")
    _check_cpu(c, x=x, expert_ids=expert_ids, scales=scales, x_active_mask=x_active_mask,
               expert_scales=expert_scales, performance_info=performance_info)
    c.require(quant_mode in (0, 2), lambda: f"quant_mode must be 0 (none) or 2 (dynamic int8), got {quant_mode}")
    c.require(expert_token_nums_type in (0, 1), lambda: f"expert_token_nums_type must be 0 or 1, got {expert_token_nums_type}")
    c.require(global_bs >= 0 and global_bs % W == 0, lambda: f"global_bs must be 0 or a multiple of ep_world_size {W}, got {global_bs}")
    if c.error:
        _fail_collectively(backend, op, c.error)
    with c.guard():
        L = M // (W - S)
        T = max(int(tp_world_size), 1)
        c.require(T == 1 or L == 1, lambda: f"tp_world_size 2 needs one expert per rank, got {L}")
        BS, K = expert_ids.shape
        H = x.shape[1]
        routed, token_active, _ = _active_entries(c, expert_ids, x_active_mask, special, M)
        if expert_scales is not None:
            c.require(isinstance(expert_scales, torch.Tensor) and expert_scales.shape == (BS, K),
                      lambda: f"expert_scales must be float32 ({BS}, {K}), got {tuple(expert_scales.shape)}")
        smooth = None
        _check_performance_info(c, performance_info, W)
        if scales is not None and quant_mode == 2:
            rows_needed = M + (1 if S > 0 else 0)
            c.require(isinstance(scales, torch.Tensor) and scales.dim() == 2 and scales.shape[0] >= rows_needed
                      and scales.shape[1] == H,
                      lambda: f"scales must be float32 ({rows_needed}, {H}) (one smooth-scale row per expert"
                              f"{', shared expert first' if S else ''}), got {tuple(scales.shape)}")
            smooth = scales.to(torch.float32).contiguous()
    if c.error:
        _fail_collectively(backend, op, c.error)

    is_shared, L_here, max_bs, A = dispatch_geometry(W, rank, BS, K, M, S, global_bs)
    quant = quant_mode == 2
    expand_x = backend.moe_empty([T * A, H], torch.int8 if quant else x.dtype)
    dynamic_scales = backend.moe_empty([T * A], torch.float32) if quant else None
    expand_scales = torch.zeros(T * A, dtype=torch.float32) if expert_scales is not None else None
    counts = torch.empty(W * L_here, dtype=torch.int32)
    if v2:
        info = torch.zeros(A * ASSIST_INTS_PER_ROW, dtype=torch.int32)
        stride = ASSIST_INTS_PER_ROW
    else:
        info, stride = None, 3
    expand_idx = None if v2 else torch.empty(BS * K, dtype=torch.int32)
    backend.moe_dispatch(
        rows=x.contiguous(), ids=routed, weights=None if expert_scales is None else expert_scales.to(torch.float32).contiguous(),
        aux=None, token_active=token_active, smooth=smooth, smooth_shift=1 if S > 0 else 0,
        num_experts=M, shared_ranks=S, experts_per_rank=L, quant=quant, slab_rows=0,
        max_tokens=max_bs if global_bs else 0, out_rows=expand_x[:A], out_scales=dynamic_scales,
        out_weights=expand_scales, out_info=info, info_stride=stride, out_aux=None, out_counts=counts,
        out_occurrence=expand_idx, wait_us=performance_info).wait()
    n_own = int(counts[-1]) if counts.numel() else 0
    ep_recv_counts, tp_recv_counts = counts, torch.tensor([n_own], dtype=torch.int32)
    if T == 2:
        ep_recv_counts, tp_recv_counts = _tp_gather(
            group_tp, tp_rank_id, A, n_own, counts, [expand_x, dynamic_scales, expand_scales])
    n_valid = int(tp_recv_counts.sum())
    # Rows per local expert (all valid rows of expand_x: with TP=2 the peer's rows too).
    if is_shared:
        per_expert = torch.tensor([n_valid], dtype=torch.int64)
    else:
        per_expert = torch.zeros(L, dtype=torch.int64)
        for half in ep_recv_counts.view(T, L * W).to(torch.int64):
            ends = half.view(L, W)[:, -1]
            per_expert += torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64))
    expert_token_nums = per_expert.cumsum(0) if expert_token_nums_type == 0 else per_expert
    idx = info if v2 else expand_idx
    return (expand_x, dynamic_scales, idx, expert_token_nums, ep_recv_counts, tp_recv_counts,
            expand_scales)


def _tp_gather(group_tp, tp_rank_id, A, n_own, counts, row_tensors):
    """tp_world_size 2: after the EP exchange, each TP rank appends its peer's received rows
    (and counts) to its own."""
    tp = resolve_group(group_tp)
    if tp.size() != 2 or tp.rank() != tp_rank_id:
        raise ValueError(f"cam moe_distribute_dispatch: group_tp must have 2 ranks and tp_rank_id must be "
                         f"this rank's index in it (got size {tp.size()}, rank {tp.rank()}, tp_rank_id {tp_rank_id})")
    both = [torch.empty(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(both, torch.tensor([n_own]), group=tp)
    n = [int(v) for v in both]
    peer = 1 - tp.rank()
    for t in row_tensors:
        if t is None:
            continue
        outs = [torch.empty((n[r],) + tuple(t.shape[1:]), dtype=t.dtype) for r in range(2)]
        outs[peer] = t[n_own:n_own + n[peer]]
        dist.all_gather(outs, t[:n_own].contiguous(), group=tp)
    peer_counts = [torch.empty_like(counts) for _ in range(2)]
    dist.all_gather(peer_counts, counts, group=tp)
    ep_recv_counts = torch.cat([counts, peer_counts[peer]])
    return ep_recv_counts, torch.tensor([n[0], n[1]], dtype=torch.int32)


def moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                            scales=None, x_active_mask=None, expert_scales=None, group_tp="",
                            tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                            shared_expert_rank_num=0, quant_mode=0, global_bs=0,
                            expert_token_nums_type=1):
    """``torch_npu.npu_moe_distribute_dispatch`` on a cam group. Returns ``(expand_x,
    dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales)``."""
    if torch.compiler.is_compiling():
        return _ops().dispatch_result(torch.ops.torch_cam.moe_distribute_dispatch(
            x, expert_ids, _ops().group_name(group_ep), ep_world_size, ep_rank_id, moe_expert_num, scales,
            x_active_mask, expert_scales, _ops().group_name(group_tp), tp_world_size, tp_rank_id,
            expert_shard_type, shared_expert_num, shared_expert_rank_num, quant_mode, global_bs,
            expert_token_nums_type), quant_mode, expert_scales)
    return _dispatch("moe_distribute_dispatch", x, expert_ids, group_ep, ep_world_size, ep_rank_id,
                     moe_expert_num, scales=scales, x_active_mask=x_active_mask,
                     expert_scales=expert_scales, group_tp=group_tp, tp_world_size=tp_world_size,
                     tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                     shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                     quant_mode=quant_mode, global_bs=global_bs,
                     expert_token_nums_type=expert_token_nums_type)


def moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                               scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                               performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                               expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                               quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
                               zero_expert_num=0, copy_expert_num=0, const_expert_num=0, y_dtype=None):
    """``torch_npu.npu_moe_distribute_dispatch_v2`` on a cam group: as v1, with
    ``assist_info_for_combine`` (row i: [source rank, source token, top-k slot]) in place of
    ``expand_idx``, and special experts (ids from moe_expert_num on: zero, copy, const) that are
    not communicated. ``comm_alg`` is accepted and ignored (one algorithm); ``performance_info``
    (int64, one entry per EP rank) accumulates the microseconds this rank waited for each
    peer to arrive."""
    if elastic_info is not None:
        _fail_collectively(moe_backend(resolve_group(group_ep)), "moe_distribute_dispatch_v2",
                           "elastic_info (elastic EP shrink) is not supported")
    if torch.compiler.is_compiling():
        return _ops().dispatch_result(torch.ops.torch_cam.moe_distribute_dispatch_v2(
            x, expert_ids, _ops().group_name(group_ep), ep_world_size, ep_rank_id, moe_expert_num, scales,
            x_active_mask, expert_scales, _ops().performance_info_or_scratch(performance_info, ep_world_size),
            _ops().group_name(group_tp), tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
            shared_expert_rank_num, quant_mode, global_bs,
            expert_token_nums_type, zero_expert_num, copy_expert_num, const_expert_num),
            quant_mode, expert_scales)
    special = int(zero_expert_num) + int(copy_expert_num) + int(const_expert_num)
    return _dispatch("moe_distribute_dispatch_v2", x, expert_ids, group_ep, ep_world_size, ep_rank_id,
                     moe_expert_num, scales=scales, x_active_mask=x_active_mask,
                     expert_scales=expert_scales, group_tp=group_tp, tp_world_size=tp_world_size,
                     tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                     shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                     quant_mode=quant_mode, global_bs=global_bs,
                     expert_token_nums_type=expert_token_nums_type, special=special, v2=True,
                     performance_info=performance_info)


# ---- combine -----------------------------------------------------------------------------------

def _combine(op, expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
             ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts, x_active_mask,
             shared_expert_x, group_tp, tp_world_size, tp_rank_id, expert_shard_type,
             shared_expert_num, shared_expert_rank_num, global_bs, comm_quant_mode, v2,
             zero_expert_num=0, copy_expert_num=0, const_expert_num=0, ori_x=None,
             const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None,
             performance_info=None):
    pg = resolve_group(group_ep)
    backend = moe_backend(pg)
    W, rank = pg.size(), pg.rank()
    S, M = int(shared_expert_rank_num), int(moe_expert_num)
    c = _Checks(op, rank)
    _check_layout(c, W, rank, ep_world_size, ep_rank_id, M, S, tp_world_size, shared_expert_num,
                  expert_shard_type)
    c.require(isinstance(expand_x, torch.Tensor) and expand_x.dim() == 2 and expand_x.dtype in _FLOATS,
              lambda: f"expand_x must be a 2-D bfloat16, float16 or float32 tensor (the experts' output), got "
                      f"{getattr(expand_x, 'dtype', type(expand_x))}")
    c.require(isinstance(expert_ids, torch.Tensor) and expert_ids.dim() == 2,
              "expert_ids must be the (BS, K) tensor passed to dispatch")
    _check_cpu(c, expand_x=expand_x, expert_ids=expert_ids, expand_idx=expand_idx, ep_send_counts=ep_send_counts,
               expert_scales=expert_scales, x_active_mask=x_active_mask, shared_expert_x=shared_expert_x,
               performance_info=performance_info)
    c.require(comm_quant_mode in (0, 2), lambda: f"comm_quant_mode must be 0 or 2, got {comm_quant_mode}")
    if c.error:
        _fail_collectively(backend, op, c.error, combine=True)
    with c.guard():
        L = M // (W - S)
        T = max(int(tp_world_size), 1)
        BS, K = expert_ids.shape
        H = expand_x.shape[1]
        special = int(zero_expert_num) + int(copy_expert_num) + int(const_expert_num)
        routed, token_active, entry_active = _active_entries(c, expert_ids, x_active_mask, special, M)
        is_shared = rank < S
        L_here = 1 if is_shared else L
        counts = ep_send_counts.to(torch.int32).contiguous()
        c.require(counts.numel() == W * T * L_here,
                  lambda: f"ep_send_counts must be dispatch's ep_recv_counts ({W * T * L_here} entries), got {counts.numel()}")
        if expert_scales is not None:
            c.require(expert_scales.shape == (BS, K), lambda: f"expert_scales must be ({BS}, {K}), got {tuple(expert_scales.shape)}")
        _check_performance_info(c, performance_info, W)
        if not v2:
            c.require(isinstance(expand_idx, torch.Tensor) and expand_idx.numel() == BS * K,
                      lambda: f"expand_idx must be dispatch's ({BS * K},) expand_idx, got {tuple(getattr(expand_idx, 'shape', ()))}")
    if c.error:
        _fail_collectively(backend, op, c.error, combine=True)
    own = counts[: W * L_here]
    n_own = int(own[-1]) if own.numel() else 0
    rows = expand_x[:n_own]
    if T == 2:
        rows = _tp_reduce(group_tp, expand_x, n_own, tp_send_counts)
    with c.guard():
        # The plan: for every token, where each of its rows lives (rank, segment, offset) and its weight.
        idx = occurrence_index(routed.view(-1)) if v2 else expand_idx.to(torch.int64).view(-1)
        e = routed.to(torch.int64)
        valid = e >= 0
        P = K + (1 if S > 0 else 0)
        peer = torch.full((BS, P), -1, dtype=torch.int32)
        seg = torch.zeros(BS, P, dtype=torch.int32)
        off = torch.zeros(BS, P, dtype=torch.int64)
        weight = torch.ones(BS, P, dtype=torch.float32)
        e_safe = e.clamp(min=0)
        peer[:, :K] = torch.where(valid, S + e_safe // L, -1).to(torch.int32)
        seg[:, :K] = ((e_safe % L) * W + rank).to(torch.int32)
        off[:, :K] = idx.view(BS, K)
        if expert_scales is not None:
            weight[:, :K] = expert_scales.to(torch.float32)
        if S > 0:
            # The shared-expert row: on a shared rank its own token (chunked by its own split), on
            # a routed-expert rank the token's chunk at shared rank `chunk`.
            tok = torch.arange(BS)
            bounds = torch.tensor([shared_chunk_lo(rank, cc, BS, S) for cc in range(S + 1)])
            chunk = torch.searchsorted(bounds, tok, right=True) - 1
            act = token_active.to(torch.int64)
            before = torch.cumsum(act, 0) - act  # active tokens before t
            at_chunk_start = before.new_tensor([int(act[:bounds[cc]].sum()) for cc in range(S)])
            peer[:, K] = torch.where(token_active, rank if is_shared else chunk, -1).to(torch.int32)
            seg[:, K] = (chunk if is_shared else torch.full_like(chunk, rank)).to(torch.int32)
            off[:, K] = before - at_chunk_start[chunk]
        add = None
        if shared_expert_x is not None:
            add = shared_expert_x.reshape(BS, H).to(torch.float32)
        if special:
            add = _special_experts(expert_ids, entry_active, expert_scales, M, zero_expert_num, copy_expert_num,
                                   const_expert_num, ori_x, const_expert_alpha_1, const_expert_alpha_2,
                                   const_expert_v, add, BS, H)
        # Segment i of this rank's rows holds source rank owners[i]'s tokens.
        seg_ids = torch.arange(W * L_here)
        owners = torch.where(seg_ids < S, rank, seg_ids) if is_shared else seg_ids % W
    if c.error:
        _fail_collectively(backend, op, c.error, combine=True)
    out = backend.moe_empty([BS, H], expand_x.dtype)
    backend.moe_combine(
        rows=rows.contiguous(), segments=segments_table(own, owners), quant=comm_quant_mode == 2,
        plan_peer=peer, plan_seg=seg, plan_off=off, plan_weight=weight,
        add=None if add is None else add.contiguous(), add_first=False, out=out,
        wait_us=performance_info).wait()
    if not bool(token_active.all()):
        out[~token_active] = 0
    return out


def _tp_reduce(group_tp, expand_x, n_own, tp_send_counts):
    """tp_world_size 2: this rank's rows summed (fp32) with the peer's copy of the same rows
    (each TP rank computed a partial expert output for both blocks)."""
    tp = resolve_group(group_tp)
    n = [int(v) for v in tp_send_counts]
    me, peer = tp.rank(), 1 - tp.rank()
    outs = [torch.empty(n[me] if r == peer else n[peer], expand_x.shape[1], dtype=expand_x.dtype) for r in range(2)]
    dist.all_gather(outs, expand_x[n_own:n_own + n[peer]].contiguous(), group=tp)
    return expand_x[:n_own].to(torch.float32) + outs[peer].to(torch.float32)


def _special_experts(expert_ids, entry_active, expert_scales, M, zero_n, copy_n, const_n, ori_x,
                     alpha1, alpha2, v, add, BS, H):
    """The weighted contribution of copy and const experts (zero experts give nothing)."""
    acc = torch.zeros(BS, H, dtype=torch.float32) if add is None else add.clone()
    ids = expert_ids.to(torch.int64)
    w = expert_scales.to(torch.float32) if expert_scales is not None else torch.ones(ids.shape)
    x = ori_x.to(torch.float32) if ori_x is not None else None
    for k in range(ids.shape[1]):
        e = ids[:, k]
        act = entry_active[:, k]
        is_copy = act & (e >= M + zero_n) & (e < M + zero_n + copy_n)
        if bool(is_copy.any()):
            if x is None:
                raise ValueError("cam moe_distribute_combine_v2: copy experts need ori_x")
            acc[is_copy] += w[is_copy, k, None] * x[is_copy]
        cidx = e - (M + zero_n + copy_n)
        is_const = act & (cidx >= 0) & (cidx < const_n)
        if bool(is_const.any()):
            if x is None or alpha1 is None or alpha2 is None or v is None:
                raise ValueError("cam moe_distribute_combine_v2: const experts need ori_x, "
                                 "const_expert_alpha_1, const_expert_alpha_2 and const_expert_v")
            ci = cidx[is_const]
            a1, a2, vv = alpha1.to(torch.float32)[ci], alpha2.to(torch.float32)[ci], v.to(torch.float32)[ci]
            acc[is_const] += w[is_const, k, None] * (a1 * x[is_const] + a2 * vv)
    return acc


def moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                           ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                           x_active_mask=None, activation_scale=None, weight_scale=None,
                           group_list=None, expand_scales=None, shared_expert_x=None, group_tp="",
                           tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
                           shared_expert_rank_num=0, global_bs=0, out_dtype=0, comm_quant_mode=0,
                           group_list_type=0):
    """``torch_npu.npu_moe_distribute_combine`` on a cam group: for every token, the sum over
    its experts of ``expert_scales * expert output`` (fp32), plus the shared-expert rank's row
    and ``shared_expert_x`` unweighted. ``activation_scale``, ``weight_scale``, ``group_list``,
    ``out_dtype`` and ``group_list_type`` are reserved on NPU and ignored here too."""
    if torch.compiler.is_compiling():
        return torch.ops.torch_cam.moe_distribute_combine(
            expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, _ops().group_name(group_ep),
            ep_world_size, ep_rank_id, moe_expert_num, tp_send_counts, x_active_mask, shared_expert_x,
            _ops().group_name(group_tp), tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
            shared_expert_rank_num, global_bs, comm_quant_mode)
    return _combine("moe_distribute_combine", expand_x, expert_ids, expand_idx, ep_send_counts,
                    expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                    tp_send_counts=tp_send_counts, x_active_mask=x_active_mask,
                    shared_expert_x=shared_expert_x, group_tp=group_tp, tp_world_size=tp_world_size,
                    tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                    shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                    global_bs=global_bs, comm_quant_mode=comm_quant_mode, v2=False)


def moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts,
                              expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                              tp_send_counts=None, x_active_mask=None, expand_scales=None,
                              shared_expert_x=None, elastic_info=None, ori_x=None,
                              const_expert_alpha_1=None, const_expert_alpha_2=None,
                              const_expert_v=None, performance_info=None, group_tp="",
                              tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                              shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                              comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                              const_expert_num=0):
    """``torch_npu.npu_moe_distribute_combine_v2`` on a cam group (see the v1 form), with the
    special experts: zero adds nothing, copy adds ``w * ori_x``, const ``c`` adds
    ``w * (alpha_1[c] * ori_x + alpha_2[c] * v[c])``."""
    if elastic_info is not None:
        _fail_collectively(moe_backend(resolve_group(group_ep)), "moe_distribute_combine_v2",
                           "elastic_info (elastic EP shrink) is not supported", combine=True)
    if torch.compiler.is_compiling():
        return torch.ops.torch_cam.moe_distribute_combine_v2(
            expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
            _ops().group_name(group_ep), ep_world_size, ep_rank_id, moe_expert_num, tp_send_counts,
            x_active_mask, shared_expert_x, ori_x, const_expert_alpha_1, const_expert_alpha_2, const_expert_v,
            _ops().performance_info_or_scratch(performance_info, ep_world_size), _ops().group_name(group_tp),
            tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs,
            comm_quant_mode, zero_expert_num, copy_expert_num, const_expert_num)
    return _combine("moe_distribute_combine_v2", expand_x, expert_ids, assist_info_for_combine,
                    ep_send_counts, expert_scales, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                    tp_send_counts=tp_send_counts, x_active_mask=x_active_mask,
                    shared_expert_x=shared_expert_x, group_tp=group_tp, tp_world_size=tp_world_size,
                    tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                    shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                    global_bs=global_bs, comm_quant_mode=comm_quant_mode, v2=True,
                    zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num,
                    const_expert_num=const_expert_num, ori_x=ori_x,
                    const_expert_alpha_1=const_expert_alpha_1, const_expert_alpha_2=const_expert_alpha_2,
                    const_expert_v=const_expert_v, performance_info=performance_info)


# ---- CAM names (umdk_cam_op_lib) ---------------------------------------------------------------

def moe_dispatch_shmem(x, expert_ids, scales, x_active_mask, ep_world_size, ep_rank_id, moe_expert_num,
                       tp_world_size, tp_rank_id, expert_shard_type, shared_expert_num,
                       shared_expert_rank_num, quant_mode, global_bs, expert_token_nums_type, ext_info,
                       window_size=0):
    """CAM's ``moe_dispatch_shmem``, positional order kept. ``ext_info`` names the EP group
    (a cam ProcessGroup or its name; CAM's shmem base address has no meaning here) and
    ``window_size`` is accepted and ignored (cam sizes its MoE stage itself). Returns a list."""
    return list(moe_distribute_dispatch(
        x, expert_ids, ext_info, ep_world_size, ep_rank_id, moe_expert_num, scales=scales,
        x_active_mask=x_active_mask, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num, quant_mode=quant_mode, global_bs=global_bs,
        expert_token_nums_type=expert_token_nums_type))


def moe_combine_shmem(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, tp_send_counts,
                      x_active_mask, activation_scale, weight_scale, group_list, expand_scales,
                      ep_world_size, ep_rank_id, moe_expert_num, tp_world_size, tp_rank_id,
                      expert_shard_type, shared_expert_num, shared_expert_rank_num, global_bs,
                      comm_quant_mode, ext_info, out_dtype=0, group_list_type=0, window_size=0):
    """CAM's ``moe_combine_shmem``, positional order kept (``ext_info`` as in
    :func:`moe_dispatch_shmem`)."""
    return moe_distribute_combine(
        expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, ext_info, ep_world_size,
        ep_rank_id, moe_expert_num, tp_send_counts=tp_send_counts, x_active_mask=x_active_mask,
        expand_scales=expand_scales, tp_world_size=tp_world_size, tp_rank_id=tp_rank_id,
        expert_shard_type=expert_shard_type, shared_expert_num=shared_expert_num,
        shared_expert_rank_num=shared_expert_rank_num, global_bs=global_bs,
        comm_quant_mode=comm_quant_mode)
