"""A DeepEP-style ``Buffer`` over a cam group: code written against DeepEP's V1 ``Buffer`` moves
to CPU ranks on one host by changing the import.

Normal mode (one row per (token, destination rank), received in source-rank then token order,
unweighted combine) and low-latency mode (one row per (token, expert) in fixed per-expert slabs,
weighted combine) both run on cam's two MoE ops (csrc/moe/): a rank stages its rows once and
every receiver pulls what is routed to it, so there are no per-peer channels to size and
``num_nvl_bytes`` / ``num_rdma_bytes`` are accepted and ignored (the stage grows to the largest
call and is reported by ``stats()["moe_stage_bytes"]`` of the group's backend).

CPU has no streams: every op runs at once unless ``async_finish`` or ``return_recv_hook`` is
set, in which case it is queued on the group and the returned ``EventOverlap`` /
``hook()`` completes it (the outputs are allocated up front and filled in place).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .heap import empty as heap_empty
from .moe import occurrence_index, segments_table
from .moe_hosts import HostsMoe, moe_backend

__all__ = ["Buffer", "EventOverlap", "Config"]

FP8_BLOCK = 128
FP8_MAX = 448.0


class EventOverlap:
    """Completion of an asynchronous Buffer op. ``current_stream_wait()`` (DeepEP's name) or
    ``wait()`` blocks until the op is done and its outputs are filled; ``is_completed()``
    polls. Usable as a context manager (waits on exit)."""

    def __init__(self, work=None, finish: Optional[Callable[[], None]] = None):
        self._work, self._finish, self._done = work, finish, work is None and finish is None

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            self._work.wait()
        if self._finish is not None:
            self._finish()
        self._done = True

    current_stream_wait = wait

    def is_completed(self) -> bool:
        return self._done or (self._work is not None and self._work.is_completed())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()


class Config:
    """Accepted for DeepEP compatibility (SM and chunk tuning has no meaning here)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs


def _wait_previous(previous_event) -> None:
    if previous_event is not None:
        previous_event.current_stream_wait()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """(T, ...) -> (T, nbytes) uint8 view of the same memory (contiguous)."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1) if t.numel() else torch.empty(t.shape[0], 0, dtype=torch.uint8)


def per_token_cast_to_fp8(x: torch.Tensor, round_scale: bool = False):
    """(x_fp8 (T, H) float8_e4m3fn, scales (T, H/128) float32): one scale per 128 channels,
    amax clamped to 1e-4, scale amax/448 (rounded up to a power of two with round_scale)."""
    T, H = x.shape
    if H % FP8_BLOCK:
        raise ValueError(f"cam Buffer fp8: hidden size {H} must be a multiple of {FP8_BLOCK}")
    blocks = x.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    scale = amax / FP8_MAX
    if round_scale:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, :, None]).to(torch.float8_e4m3fn).view(T, H)
    return q, scale.contiguous()


class Buffer:
    """DeepEP V1 ``Buffer`` semantics over a cam group (see the module docstring)."""

    num_sms = 0

    def __init__(self, group: dist.ProcessGroup, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None):
        if enable_shrink:
            raise ValueError("cam Buffer: enable_shrink (masking failed ranks) is not supported")
        self.group = group
        self.backend = moe_backend(group)
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._combine_buffers: dict = {}
        self._destroyed = False

    # ---- DeepEP helpers that have no meaning on CPU -----------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config()

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """Bytes a low-latency round stages per rank (bf16 rows both ways)."""
        return 2 * num_max_dispatch_tokens_per_rank * num_ranks * hidden * 2

    def clean_low_latency_buffer(self, *args, **kwargs) -> None:
        """Nothing to clean: cam's signals only increase and stages are rewritten per call."""

    def destroy(self) -> None:
        self._combine_buffers.clear()
        self._destroyed = True

    def _check(self):
        if self._destroyed:
            raise RuntimeError("cam Buffer: used after destroy()")

    # ---- layout ------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event). Local: no communication."""
        self._check()
        _wait_previous(previous_event)
        R = self.group_size
        if num_experts % R:
            raise ValueError(f"cam Buffer.get_dispatch_layout on rank {self.rank}: num_experts {num_experts} "
                             f"must be a multiple of the group size {R}")
        idx = topk_idx.to(torch.int64)
        if idx.numel() and (int(idx.max()) >= num_experts or int(idx.min()) < -1):
            raise ValueError(f"cam Buffer.get_dispatch_layout on rank {self.rank}: topk_idx values must be "
                             f"in [-1, {num_experts}), got [{int(idx.min())}, {int(idx.max())}]")
        valid = idx >= 0
        per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
        in_rank = torch.zeros(idx.shape[0], R, dtype=torch.bool)
        rows = torch.arange(idx.shape[0]).view(-1, 1).expand_as(idx)[valid]
        in_rank[rows, idx[valid] // (num_experts // R)] = True
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    # ---- normal mode -------------------------------------------------------------------------
    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Every token to every rank in ``is_token_in_rank`` once; received rows ordered by source
        rank, then token. Returns (recv_x, recv_topk_idx, recv_topk_weights,
        num_recv_tokens_per_expert_list, handle, event); ``x`` may be ``(x_fp8, x_scales)``."""
        self._check()
        _wait_previous(previous_event)
        R, me = self.group_size, self.rank
        fp8 = isinstance(x, tuple)
        rows, x_scales = (x[0], x[1]) if fp8 else (x, None)
        T = rows.shape[0]
        cached = handle is not None
        if cached:
            rank_prefix_matrix, _, _, _, is_token_in_rank, send_pos = handle
            topk_idx = topk_weights = None
        else:
            missing = "" if is_token_in_rank is not None and topk_idx is not None else \
                "pass is_token_in_rank and topk_idx (from get_dispatch_layout) or a handle"
            counts = None if missing else is_token_in_rank.sum(dim=0).to(torch.int32)
            # The counts phase: every rank learns how many rows each rank sends each rank.
            if isinstance(self.backend, HostsMoe):
                gathered = self.backend.all_gather_counts("Buffer.dispatch", counts, missing).view(-1)
            else:
                if missing:
                    self.backend.refuse("all_gather", "Buffer.dispatch", missing)
                gathered = torch.empty(R * R, dtype=torch.int32)
                dist.all_gather_into_tensor(gathered, counts, group=self.group)
            rank_prefix_matrix = gathered.view(R, R).cumsum(dim=0).to(torch.int32)
            before = torch.cat([torch.zeros(1, R, dtype=torch.int32), rank_prefix_matrix[:-1]])[me]
            send_pos = torch.where(is_token_in_rank,
                                   is_token_in_rank.to(torch.int32).cumsum(dim=0) - 1 + before, -1).to(torch.int32)
        n_recv = int(rank_prefix_matrix[-1, me])
        K = topk_idx.shape[1] if topk_idx is not None else 0
        side = []
        if topk_idx is not None:
            side.append(_as_bytes(topk_idx.to(torch.int64)))
            w = topk_weights if topk_weights is not None else torch.zeros(T, K)
            side.append(_as_bytes(w.to(torch.float32)))
        if fp8:
            side.append(_as_bytes(x_scales.to(torch.float32)))
        aux = torch.cat(side, dim=1).contiguous() if side else None
        cap = max(n_recv, num_worst_tokens)
        recv_rows = self.backend.moe_empty([cap, rows.shape[1]], rows.dtype)
        recv_aux = torch.empty(cap, aux.shape[1], dtype=torch.uint8) if aux is not None else None
        info = torch.empty(cap * 3, dtype=torch.int32)
        got_counts = torch.empty(R, dtype=torch.int32)
        ids = torch.where(is_token_in_rank, torch.arange(R, dtype=torch.int32), -1).to(torch.int32).contiguous()
        work = self.backend.moe_dispatch(
            rows=rows.contiguous(), ids=ids, weights=None, aux=aux,
            token_active=torch.zeros(T, dtype=torch.bool), smooth=None, smooth_shift=0, num_experts=R,
            shared_ranks=0, experts_per_rank=1, quant=False, slab_rows=0, max_tokens=-1,
            out_rows=recv_rows, out_scales=None, out_weights=None, out_info=info, info_stride=3,
            out_aux=recv_aux, out_counts=got_counts)
        recv_src_idx = info.view(cap, 3)[:, 1]
        recv_topk_idx = recv_topk_weights = recv_scales = None
        per_expert_list: list = []
        if topk_idx is not None:
            recv_topk_idx = torch.empty(cap, K, dtype=torch.int64)
            recv_topk_weights = torch.empty(cap, K, dtype=torch.float32)
        if fp8:
            recv_scales = torch.empty(cap, x_scales.shape[1], dtype=torch.float32)
        num_experts = num_tokens_per_expert.numel() if num_tokens_per_expert is not None else None
        new_handle = (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, send_pos)

        def finish():
            if not torch.equal(got_counts[-1:], rank_prefix_matrix[-1, me:me + 1]):
                raise RuntimeError(f"cam Buffer.dispatch on rank {me}: received {int(got_counts[-1])} rows, "
                                   f"the layout promised {n_recv} (handle from another routing?)")
            if cap > n_recv:
                recv_rows[n_recv:] = 0
                recv_src_idx[n_recv:] = -1
            if aux is not None:
                o = 0
                if topk_idx is not None:
                    gidx = recv_aux[:n_recv, : 8 * K].contiguous().view(torch.int64).view(n_recv, K)
                    gw = recv_aux[:n_recv, 8 * K: 12 * K].contiguous().view(torch.float32).view(n_recv, K)
                    o = 12 * K
                    if num_experts is None:
                        raise ValueError(f"cam Buffer.dispatch on rank {me}: pass num_tokens_per_expert "
                                         "(from get_dispatch_layout) with topk_idx")
                    Lx = num_experts // R
                    local = gidx - me * Lx
                    mine = (gidx >= 0) & (local >= 0) & (local < Lx)
                    recv_topk_idx[:n_recv] = torch.where(mine, local, -1)
                    recv_topk_weights[:n_recv] = torch.where(mine, gw, 0.0)
                    recv_topk_idx[n_recv:] = -1
                    recv_topk_weights[n_recv:] = 0
                    if num_worst_tokens == 0:
                        per = torch.bincount(recv_topk_idx[:n_recv][mine], minlength=Lx)
                        a = max(1, expert_alignment)
                        per_expert_list.extend(int((c + a - 1) // a * a) for c in per.tolist())
                if fp8:
                    recv_scales[:n_recv] = recv_aux[:n_recv, o:].contiguous().view(torch.float32).view(n_recv, -1)
                    recv_scales[n_recv:] = 0

        event = EventOverlap(work, finish)
        if not async_finish:
            event.wait()
        recv_x = (recv_rows, recv_scales) if fp8 else recv_rows
        return recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """For every token: the sum (fp32, cast to x's dtype) of the rows every rank it was sent
        to returns, plus ``bias`` (a tensor or a pair). Returns (combined_x,
        combined_topk_weights, event)."""
        self._check()
        _wait_previous(previous_event)
        R = self.group_size
        rank_prefix_matrix, _, _, _, is_token_in_rank, send_pos = handle
        T = is_token_in_rank.shape[0]
        peer = torch.where(is_token_in_rank, torch.arange(R, dtype=torch.int32), -1).to(torch.int32).contiguous()
        # At rank j this rank's tokens are segment `me` (rows from each source are contiguous);
        # a token's offset there is its index among this rank's tokens sent to j.
        seg = torch.full((T, R), self.rank, dtype=torch.int32)
        off = (is_token_in_rank.to(torch.int64).cumsum(dim=0) - 1).clamp(min=0).contiguous()
        segments = segments_table(rank_prefix_matrix[:, self.rank], torch.arange(R))
        add = None
        if bias is not None:
            parts = bias if isinstance(bias, (tuple, list)) else (bias,)
            parts = [b for b in parts if b is not None]
            if parts:
                add = parts[0].to(torch.float32)
                for b in parts[1:]:
                    add = add + b.to(torch.float32)
        combined = self.backend.moe_empty([T, x.shape[1]], x.dtype)
        w1 = self.backend.moe_combine(rows=x.contiguous(), segments=segments, quant=False, plan_peer=peer,
                                      plan_seg=seg, plan_off=off, plan_weight=None,
                                      add=None if add is None else add.contiguous(), add_first=True, out=combined)
        works = [w1]
        combined_w = None
        if topk_weights is not None:
            combined_w = torch.empty(T, topk_weights.shape[1], dtype=torch.float32)
            works.append(self.backend.moe_combine(
                rows=topk_weights.to(torch.float32).contiguous(), segments=segments, quant=False,
                plan_peer=peer, plan_seg=seg, plan_off=off, plan_weight=None, add=None, add_first=True,
                out=combined_w))

        def finish():
            for w in works:
                w.wait()

        event = EventOverlap(None, finish)
        if not async_finish:
            event.wait()
        return combined, combined_w, event

    # ---- low-latency mode --------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False):
        """Rows per (token, expert) into per-expert slabs ``[L, max_tokens * R, H]``, sources in
        rank order. Returns (recv_x, recv_count, handle, event, hook); with use_fp8 recv_x is
        (fp8 rows, scales [L, max*R, H/128] column-major in the last two dims)."""
        self._check()
        R, me = self.group_size, self.rank
        # Refused on every rank at once (the op's peers would otherwise wait for this one).
        if use_ue8m0:
            self.backend.refuse("moe_dispatch", "Buffer.low_latency_dispatch", "use_ue8m0 (packed UE8M0 "
                                "scales) is not supported; use round_scale=True for power-of-two scales")
        if num_experts % R:
            self.backend.refuse("moe_dispatch", "Buffer.low_latency_dispatch",
                                f"num_experts {num_experts} must be a multiple of the group size {R}")
        if use_fp8 and x.dim() == 2 and x.shape[1] % FP8_BLOCK:
            self.backend.refuse("moe_dispatch", "Buffer.low_latency_dispatch",
                                f"fp8: hidden size {x.shape[1]} must be a multiple of {FP8_BLOCK}")
        L = num_experts // R
        T, H = x.shape
        slab = num_max_dispatch_tokens_per_rank * R
        # More tokens than num_max_dispatch_tokens_per_rank is refused by the op on every rank.
        if use_fp8:
            rows, scales = per_token_cast_to_fp8(x, round_scale)
            aux = _as_bytes(scales)
        else:
            rows, aux = x, None
        recv = self.backend.moe_empty([L, slab, H], rows.dtype)
        recv_aux = torch.empty(L * slab, aux.shape[1], dtype=torch.uint8) if aux is not None else None
        info = torch.empty(L * slab * 3, dtype=torch.int32)
        counts = torch.empty(R * L, dtype=torch.int32)
        work = self.backend.moe_dispatch(
            rows=rows.contiguous(), ids=topk_idx.to(torch.int32).contiguous(), weights=None,
            aux=aux, token_active=torch.zeros(T, dtype=torch.bool), smooth=None, smooth_shift=0,
            num_experts=num_experts, shared_ranks=0, experts_per_rank=L, quant=False, slab_rows=slab,
            max_tokens=num_max_dispatch_tokens_per_rank, out_rows=recv.view(L * slab, H), out_scales=None,
            out_weights=None, out_info=info, info_stride=3, out_aux=recv_aux, out_counts=counts,
            wait_us=dispatch_wait_recv_cost_stats)
        recv_count = torch.empty(L, dtype=torch.int32)
        src_info = info.view(L, slab, 3)[:, :, 1]
        layout_range = torch.empty(L, R, dtype=torch.int64)
        recv_scales = torch.empty(L, H // FP8_BLOCK, slab, dtype=torch.float32).transpose(1, 2) if use_fp8 else None

        def finish():
            c = counts.to(torch.int64).view(L, R)
            first = torch.cat([torch.zeros(1, dtype=torch.int64), c.view(-1)[:-1]]).view(L, R)
            start = first[:, :1]
            begin = first - start
            cnt = c - first
            layout_range.copy_((begin << 32) | cnt)
            recv_count.copy_((c[:, -1:] - start).view(L).to(torch.int32))
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count.to(cumulative_local_expert_recv_stats.dtype))
            if use_fp8:
                recv_scales.copy_(recv_aux.view(torch.float32).view(L, slab, H // FP8_BLOCK))

        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, H, num_experts)
        event = EventOverlap(work, finish)
        hook = event.wait
        if not (async_finish or return_recv_hook):
            event.wait()
        recv_x = (recv, recv_scales) if use_fp8 else recv
        return recv_x, recv_count, handle, event, hook

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """A heap-resident [L, max*R, H] bf16 tensor: experts that write their output here let
        low_latency_combine(..., zero_copy=True) serve it to peers in place."""
        src_info, layout_range, max_tokens, H, num_experts = handle
        L = num_experts // self.group_size
        key = (L, max_tokens, H)
        buf = self._combine_buffers.get(key)
        if buf is None:
            buf = heap_empty(L, max_tokens * self.group_size, H, dtype=torch.bfloat16, group=self.group)
            self._combine_buffers[key] = buf
        return buf

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False, out=None,
                            combine_wait_recv_cost_stats=None):
        """out[t] = sum_k topk_weights[t, k] * (expert topk_idx[t, k]'s row for t), fp32, cast to
        x's dtype. Returns (combined_x, event, hook)."""
        self._check()
        R, me = self.group_size, self.rank
        src_info, layout_range, max_tokens, H, num_experts = handle
        L = num_experts // R
        slab = max_tokens * R
        T, K = topk_idx.shape
        begins = (layout_range >> 32).to(torch.int64)
        counts = (layout_range & 0xFFFFFFFF).to(torch.int64)
        segments = torch.stack([(torch.arange(L, dtype=torch.int64).view(L, 1) * slab + begins).view(-1),
                                counts.view(-1), torch.arange(R).repeat(L)], dim=1).contiguous()
        idx = topk_idx.to(torch.int64)
        valid = idx >= 0
        e = idx.clamp(min=0)
        peer = torch.where(valid, e // L, -1).to(torch.int32).contiguous()
        seg = ((e % L) * R + me).to(torch.int32).contiguous()
        occ = occurrence_index(torch.where(valid, idx, -1).to(torch.int32).view(-1)).view(T, K)
        off = occ.to(torch.int64).clamp(min=0).contiguous()
        combined = out if out is not None else self.backend.moe_empty([T, H], x.dtype)
        rows = x.reshape(L * slab, H)
        work = self.backend.moe_combine(
            rows=rows if rows.is_contiguous() else rows.contiguous(), segments=segments,
            quant=False, plan_peer=peer, plan_seg=seg, plan_off=off,
            plan_weight=topk_weights.to(torch.float32).contiguous(), add=None, add_first=True,
            out=combined, wait_us=combine_wait_recv_cost_stats)
        event = EventOverlap(work)
        hook = event.wait
        if not (async_finish or return_recv_hook):
            event.wait()
        return combined, event, hook
