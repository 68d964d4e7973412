"""MoE dispatch and combine on a cam group whose ranks span hosts.

``moe_backend(group)`` is what ``moe.py`` and ``moe_buffer.py`` call the two MoE ops on: the
group's own ``CamBackend`` when it lives on one host (csrc/moe/, rows pulled from peers'
windows), else a ``HostsMoe`` taking the same arguments and giving the same outputs, bit for
bit (its row loops are csrc/moe/gathered_rows.cpp, over the same kernels). A ``HostsMoe`` op is
three collectives of the group, which run over shared memory inside a host and over UCX (or
the gloo fallback) between hosts:

1. every rank's fixed-size header (shapes, options, its first routing error, or the reason it
   refuses its arguments) is all-gathered, so bad input anywhere fails on every rank before any
   row moves, naming the rank;
2. the counts: for dispatch, every rank's rows per expert and per shared-expert rank (every rank
   checks every receiver's capacity alike); for combine, every rank's segment table;
3. one all_to_all_single of packed rows: a sender puts each row it sends a receiver once, in the
   order the receiver lays them out per source (for dispatch int8 rows when the quantization
   needs no per-expert smooth scales, so half the bytes cross the link), and the receiver places,
   quantizes or weights them from that one buffer.

The ops complete before the call returns (``async_op`` of the Buffer is accepted and its event
is already done); ``performance_info`` gets no per-peer wait times here.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import _C
from .backend import get_cam_backend, spanning_backend

__all__ = ["HostsMoe", "moe_backend"]

_ERROR_BYTES = 1024
_HEADER_INTS = 24
# Counts that ride with the headers in the first all-gather (dispatch: experts + shared-expert
# ranks; combine: 3 per segment); longer ones take a second all-gather.
_INLINE_INTS = 256
_BLOB_BYTES = _ERROR_BYTES + 8 * (2 + _HEADER_INTS + _INLINE_INTS)

# Dtype codes carried in headers (the index here).
_DTYPES = [getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _code(dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else -1


def _name(code: int) -> str:
    return str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"dtype #{code}"


_hosts: "weakref.WeakValueDictionary[str, HostsMoe]" = weakref.WeakValueDictionary()


def moe_backend(group):
    """What the MoE ops run on for ``group``: its CamBackend (one host), else a HostsMoe over
    the group's collectives (a group that spans hosts, or one whose backend is cam's one-sided
    engine alone, as the in-process test transport's groups are)."""
    group = group if group is not None else dist.group.WORLD
    over_one_sided = group is not None and isinstance(group._get_backend(torch.device("cpu")), _C.OneSidedBackend)
    if spanning_backend(group) is None and not over_one_sided:
        return get_cam_backend(group)
    name = group.group_name
    moe = _hosts.get(name)
    if moe is None:
        moe = HostsMoe(group)
        _hosts[name] = moe
    return moe


class _Done:
    """The Work of an op that completed inside its call."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """(n, k) uint8 view of a contiguous (n, ...) tensor's rows."""
    t = t.contiguous()
    per_row = t.element_size() * (1 if t.dim() == 1 else int(torch.Size(t.shape[1:]).numel()))
    return t.reshape(-1).view(torch.uint8).view(t.shape[0], per_row)


def _rows_at(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``t`` as (len(index), row bytes) uint8 (index_select: a copy per row)."""
    return _bytes(t).index_select(0, index)


def _place(dst: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> None:
    """dst[pos[i]] = rows[i] for uint8 ``rows`` of dst's row width (a memcpy per row, not the
    per-element scatter of advanced indexing). dst must be contiguous: _bytes would otherwise
    place into a copy."""
    if not dst.is_contiguous():
        raise RuntimeError(f"cam moe: rows are placed into a tensor of shape {tuple(dst.shape)} that is not contiguous")
    _C.moe_place_rows(rows, pos.contiguous(), _bytes(dst))


def _exclusive(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0) - counts


class _Args:
    """The first argument error of this rank's call (checked before anything is exchanged)."""

    def __init__(self):
        self.error = ""

    def need(self, ok: bool, what) -> bool:
        if not ok and not self.error:
            self.error = what() if callable(what) else what
        return ok

    def tensor(self, t, name, dtype=None, dim=None, required=True) -> bool:
        if t is None:
            return self.need(not required, f"{name} must be given")
        if not self.need(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided,
                         lambda: f"{name} must be a dense CPU tensor, got one on {getattr(t, 'device', type(t))}"):
            return False
        return self.need((dtype is None or t.dtype == dtype) and (dim is None or t.dim() == dim) and t.is_contiguous(),
                         lambda: f"{name} must be a contiguous CPU {dtype or 'tensor'}"
                                 f"{'' if dim is None else f' of {dim} dimension(s)'}, got {t.dtype} of shape "
                                 f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")


class HostsMoe:
    """The two MoE ops of ``moe_backend`` (see the module docstring) on a group across hosts."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank, self.world = group.rank(), group.size()

    # ---- what moe.py and moe_buffer.py call besides the ops ----------------------------------
    def moe_empty(self, sizes, dtype) -> torch.Tensor:
        return torch.empty(sizes, dtype=dtype)

    def refuse(self, kind: str, op: str, reason: str):
        """Takes part in the next MoE op of the group (``kind``: moe_dispatch or moe_combine) as a
        refusal: every rank raises naming this rank and ``reason``."""
        if kind not in ("moe_dispatch", "moe_combine"):
            raise ValueError(f"HostsMoe.refuse: {kind!r} is not an MoE op (use all_gather_counts)")
        self._agree(op, torch.zeros(_HEADER_INTS, dtype=torch.int64), reason)
        raise AssertionError("unreachable: a refusal raises")  # pragma: no cover

    def all_gather_counts(self, op: str, counts, reason: str) -> torch.Tensor:
        """(W, n) every rank's ``counts`` (n int32 each), or the refusal of any rank on every rank."""
        mine = torch.zeros(self.world, dtype=torch.int64) if counts is None else counts
        return self._agree(op, torch.zeros(_HEADER_INTS, dtype=torch.int64), reason, mine)[1].to(torch.int32)

    def stats(self) -> dict:
        return {}

    # ---- the exchange of headers -------------------------------------------------------------
    def _agree(self, op: str, header: torch.Tensor, error: str, extra=None):
        """All-gathers every rank's (error, header, extra); raises on every rank if any rank
        refused, its own reason first. ``extra`` (int64, any length per rank) rides inline up to
        _INLINE_INTS, else in a second all-gather padded to the longest. Returns the (W, 24)
        headers and the (W, longest) extras, zero-padded."""
        extra = torch.zeros(0, dtype=torch.int64) if extra is None else extra.reshape(-1).to(torch.int64)
        text = error.encode()[:_ERROR_BYTES]
        blob = torch.zeros(_BLOB_BYTES, dtype=torch.uint8)
        ints = blob[_ERROR_BYTES:].view(torch.int64)  # [text bytes, extra length, header, inline extra]
        ints[0], ints[1] = len(text), extra.numel()
        ints[2:2 + _HEADER_INTS].copy_(header)
        if extra.numel() <= _INLINE_INTS:
            ints[2 + _HEADER_INTS:2 + _HEADER_INTS + extra.numel()].copy_(extra)
        if text:
            blob[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        every = self._all_gather(op, blob).view(self.world, -1)
        every_ints = every[:, _ERROR_BYTES:].contiguous().view(torch.int64).view(self.world, -1)
        for r in [self.rank] + [r for r in range(self.world) if r != self.rank]:
            n = int(every_ints[r, 0])
            if n:
                why = bytes(every[r, :n].tolist()).decode(errors="replace")
                where = f"cam {op} on rank {self.rank}"
                raise RuntimeError(f"{where}: {why}" if r == self.rank else
                                   f"{where}: rank {r} refused its arguments: {why}")
        lens = every_ints[:, 1]
        longest = int(lens.max())
        if longest <= _INLINE_INTS:
            extras = every_ints[:, 2 + _HEADER_INTS:2 + _HEADER_INTS + longest]
        else:
            padded = torch.zeros(longest, dtype=torch.int64)
            padded[:extra.numel()] = extra
            extras = self._all_gather(op, padded.view(torch.uint8)).view(torch.int64).view(self.world, longest)
        return every_ints[:, 2:2 + _HEADER_INTS], extras

    def _all_gather(self, op: str, mine: torch.Tensor) -> torch.Tensor:
        every = torch.empty(self.world * mine.numel(), dtype=mine.dtype)
        try:
            dist.all_gather_into_tensor(every, mine, group=self.group)
        except RuntimeError as e:  # a peer or the group failed: say which op of this rank saw it
            raise RuntimeError(f"cam {op} on rank {self.rank}: {e}") from e
        return every

    def _a2a_rows(self, op: str, send: torch.Tensor, send_counts, recv_counts, width: int) -> torch.Tensor:
        """all_to_all_single of (rows, width) uint8 by row counts per peer."""
        recv = torch.empty(int(sum(recv_counts)) * width, dtype=torch.uint8)
        try:
            dist.all_to_all_single(recv, send.reshape(-1), [int(c) * width for c in recv_counts],
                                   [int(c) * width for c in send_counts], group=self.group)
        except RuntimeError as e:
            raise RuntimeError(f"cam {op} on rank {self.rank}: {e}") from e
        return recv.view(-1, width)

    # ---- dispatch ------------------------------------------------------------------------------
    def moe_dispatch(self, *, rows, ids, weights, aux, token_active, smooth, smooth_shift, num_experts,
                     shared_ranks, experts_per_rank, quant, slab_rows, max_tokens, out_rows, out_scales,
                     out_weights, out_info, info_stride, out_aux, out_counts, out_occurrence=None, wait_us=None,
                     timeout_s=0.0):
        W, me = self.world, self.rank
        M, S, L = int(num_experts), int(shared_ranks), int(experts_per_rank)
        c = _Args()
        c.tensor(rows, "token rows", dim=2)
        c.tensor(ids, "routing ids", torch.int32, 2)
        c.tensor(weights, "routing weights", torch.float32, 2, required=False)
        c.tensor(aux, "per-token side data", torch.uint8, 2, required=False)
        c.tensor(token_active, "token activity", torch.bool, 1)
        c.tensor(out_rows, "expand_x", dim=2)
        c.tensor(out_counts, "ep_recv_counts", torch.int32, 1)
        c.tensor(out_weights, "expand_scales", torch.float32, 1, required=False)
        c.tensor(out_info, "row info", torch.int32, 1, required=False)
        c.tensor(out_aux, "received side data", torch.uint8, 2, required=False)
        c.tensor(out_occurrence, "expand_idx", torch.int32, 1, required=False)
        c.need(M >= 1 and L >= 1 and 0 <= S < W and M == (W - S) * L, "invalid expert layout")
        prequant = bool(quant) and smooth is None
        if not c.error:
            T, H = rows.shape
            K = ids.shape[1]
            cap = out_rows.shape[0]
            c.need(ids.shape[0] == T, "routing ids must have one row per token")
            c.need(weights is None or weights.shape == ids.shape, "routing weights must have the ids' shape")
            c.need(aux is None or aux.shape[0] == T, "per-token side data must have one row per token")
            c.need(token_active.shape[0] == T, "token activity must have one entry per token")
            if quant:
                c.need(rows.dtype in _FLOATS, lambda: f"int8 quantization takes float32, bfloat16 or float16 tokens, "
                                                      f"got {rows.dtype}")
                c.need(out_rows.dtype == torch.int8 and out_rows.shape[1] == H, "expand_x must be int8 of x's hidden size")
                c.tensor(out_scales, "dynamic_scales", torch.float32, 1)
                c.need(out_scales is not None and out_scales.shape[0] >= cap, "dynamic_scales must cover expand_x")
                if smooth is not None and c.tensor(smooth, "scales", torch.float32, 2):
                    c.need(smooth.shape[1] == H, "scales must have x's hidden size")
                    c.need(smooth.shape[0] > M - 1 + int(smooth_shift),
                           lambda: f"scales must have a row per expert ({M + int(smooth_shift)} rows), got {smooth.shape[0]}")
            else:
                c.need(out_rows.dtype == rows.dtype and out_rows.shape[1] == H,
                       "expand_x must be a contiguous tensor of x's dtype and hidden size")
            c.need(out_weights is None or out_weights.shape[0] >= cap, "expand_scales must cover expand_x")
            c.need(out_info is None or (info_stride >= 3 and out_info.shape[0] >= cap * info_stride),
                   "row info must hold info_stride (>= 3) ints per row")
            c.need(out_aux is None or (aux is not None and out_aux.shape[0] >= cap and out_aux.shape[1] == aux.shape[1]),
                   "received side data must have one row of the side data's width per output row")
            c.need(out_occurrence is None or out_occurrence.numel() == ids.numel(),
                   "expand_idx must have one entry per routing slot")
            local = W if me < S else W * L
            c.need(out_counts.shape[0] >= local, lambda: f"ep_recv_counts must hold {local} entries")
        header = torch.zeros(_HEADER_INTS, dtype=torch.int64)
        if not c.error:
            flat = ids.reshape(-1).to(torch.int64)
            bad = torch.zeros(T, K, dtype=torch.int32)
            out_of_range = (flat.view(T, K) != -1) & ((flat.view(T, K) < 0) | (flat.view(T, K) >= M))
            bad[out_of_range] = 1
            if K > 1:
                same = ids.unsqueeze(2) == ids.unsqueeze(1)  # [t, k, k2]
                earlier = torch.ones(K, K, dtype=torch.bool).tril(-1)
                repeated = (same & earlier).any(dim=2) & (ids != -1) & ~out_of_range
                bad[repeated & (bad == 0)] = 2
            first_bad = int(torch.nonzero(bad.reshape(-1)).min()) if bool(bad.any()) else -1
            width = H * rows.element_size()
            header[:19] = torch.tensor([
                T, K, M, width, 0 if aux is None else aux.shape[1], int(max_tokens), cap, int(slab_rows), S, L,
                int(bool(quant)), int(weights is not None), _code(rows.dtype), H, int(prequant),
                0 if first_bad < 0 else int(bad.reshape(-1)[first_bad]), first_bad // K if first_bad >= 0 else 0,
                first_bad % K if first_bad >= 0 else 0, int(flat[first_bad]) if first_bad >= 0 else 0])
        counts = None
        if not c.error:  # rows per expert (CSR sizes) and per shared-expert rank
            valid = (flat >= 0) & (flat < M)
            per_expert = torch.bincount(flat[valid], minlength=M)
            active = token_active.to(torch.int64)
            to_shared = torch.zeros(S, dtype=torch.int64)
            for d in range(S):
                if me == d:
                    to_shared[d] = int(active.sum())
                elif me >= S:
                    to_shared[d] = int(active[_shared_lo(me, d, T, S):_shared_lo(me, d + 1, T, S)].sum())
            counts = torch.cat([per_expert, to_shared])
        # Round 1 (and 2 for counts past the inline room): headers and counts of every rank.
        heads, G = self._agree("moe_dispatch", header, c.error, counts)
        self._check_dispatch_headers(heads)
        hd = {name: heads[:, i] for i, name in enumerate((
            "tokens", "topk", "experts", "width", "aux", "max_tokens", "capacity", "slab", "shared", "per_rank",
            "quant", "has_weights", "dtype", "hidden", "prequant"))}
        self._check_capacity(G, hd, M, S, L)

        # Then the rows, one per (receiver, expert, token) in the receiver's order per source.
        order = torch.argsort(flat.masked_fill(~valid, M), stable=True)[: int(valid.sum())]
        tok = [order // K]
        slot = [order % K]
        for d in range(S):
            if me == d:
                sel = torch.nonzero(token_active).view(-1)
            elif me >= S:
                lo, hi = _shared_lo(me, d, T, S), _shared_lo(me, d + 1, T, S)
                sel = lo + torch.nonzero(token_active[lo:hi]).view(-1)
            else:
                continue
            tok.insert(len(tok) - 1, sel)
            slot.insert(len(slot) - 1, torch.full_like(sel, -1))
        tok, slot = torch.cat(tok), torch.cat(slot)
        send_counts = to_shared.tolist() + per_expert.view(W - S, L).sum(1).tolist()
        if prequant:
            q, q_scales = _C.moe_quantize_rows(rows.contiguous())
            parts = [_rows_at(q, tok), _rows_at(q_scales, tok)]
        else:
            parts = [_rows_at(rows, tok)]
        if aux is not None and aux.shape[1]:
            parts.append(_rows_at(aux, tok))
        if weights is not None:
            w = torch.where(slot >= 0, weights.reshape(-1)[(tok * K + slot.clamp(min=0))], 0.0)
            parts.append(_bytes(w.to(torch.float32)))
        parts.append(_bytes(torch.stack([tok, slot], 1).to(torch.int32)))
        send = torch.cat(parts, 1) if parts else torch.empty(0, 0, dtype=torch.uint8)
        row_bytes = H if prequant else width
        rec_width = row_bytes + (4 if prequant else 0) + (aux.shape[1] if aux is not None else 0) \
            + (4 if weights is not None else 0) + 8
        if me < S:
            recv_counts = G[:, M + me]
        else:
            recv_counts = G[:, (me - S) * L:(me - S + 1) * L].sum(1)
        recv = self._a2a_rows("moe_dispatch", send.contiguous(), send_counts, recv_counts.tolist(), rec_width)

        # Where each received row goes, and ep_recv_counts.
        src = torch.repeat_interleave(torch.arange(W), recv_counts)
        n = recv.shape[0]
        if me < S:
            pos = torch.arange(n)
            own_act = token_active.to(torch.int64)
            for ch in range(S):
                out_counts[ch] = int(own_act[:_shared_lo(me, ch + 1, T, S)].sum())
            running = torch.cumsum(recv_counts, 0)
            out_counts[S:W] = running[S:W].to(torch.int32)
            smooth_row = torch.zeros(n, dtype=torch.int64)
        else:
            C = G[:, (me - S) * L:(me - S + 1) * L]           # [src, j]
            jmajor = C.t().reshape(-1)                          # (j, src) order
            base = _exclusive(jmajor).view(L, W)                # [j, src]
            out_counts[:W * L] = torch.cumsum(jmajor, 0).to(torch.int32)
            if int(slab_rows) > 0:  # expert j's rows from source src after those of earlier sources
                block_pos = torch.arange(L).view(1, L) * int(slab_rows) + (torch.cumsum(C, 0) - C)
            else:
                block_pos = base.t()                            # [src, j]
            j_of = torch.repeat_interleave(torch.arange(L).repeat(W), C.reshape(-1))
            src_block_start = _exclusive(C.reshape(-1))[torch.repeat_interleave(torch.arange(W * L), C.reshape(-1))]
            rank_in_block = torch.arange(n) - src_block_start
            pos = block_pos.reshape(-1)[src * L + j_of] + rank_in_block
            smooth_row = (me - S) * L + j_of + int(smooth_shift)
        col = 0
        if prequant:
            _place(out_rows, pos, recv[:, :H])
            _place(out_scales, pos, recv[:, H:H + 4])
            col = H + 4
        elif quant:
            raw = recv[:, :width].contiguous().view(rows.dtype).view(n, H)
            q, s = _C.moe_quantize_rows(raw, smooth, smooth_row.contiguous())
            _place(out_rows, pos, _bytes(q))
            _place(out_scales, pos, _bytes(s))
            col = width
        else:
            _place(out_rows, pos, recv[:, :width])
            col = width
        if aux is not None and aux.shape[1]:
            if out_aux is not None:
                _place(out_aux, pos, recv[:, col:col + aux.shape[1]])
            col += aux.shape[1]
        w_recv = None
        if weights is not None:
            w_recv = recv[:, col:col + 4].contiguous().view(torch.float32).view(-1)
            col += 4
        if out_weights is not None:
            out_weights[pos] = w_recv if w_recv is not None else torch.zeros(n)
        if out_info is not None:
            tk = recv[:, col:col + 8].contiguous().view(torch.int32).view(n, 2)
            info = out_info[: out_rows.shape[0] * info_stride].view(-1, info_stride)
            info[pos, 0] = src.to(torch.int32)
            info[pos, 1:3] = tk
        if out_occurrence is not None:
            from .moe import occurrence_index
            out_occurrence.copy_(occurrence_index(flat))
        return _Done()

    def _check_dispatch_headers(self, heads: torch.Tensor) -> None:
        """The refusals of the single-host op's validation, from every rank's header alike."""
        me = heads[self.rank].tolist()
        where = f"cam moe_dispatch on rank {self.rank}"

        def who(r):
            return "this rank" if r == self.rank else f"rank {r}"

        for r in range(self.world):
            p = heads[r].tolist()
            for i, what in ((2, "moe_expert_num (routed expert ids)"), (1, "top-k (expert_ids.size(1))"),
                            (8, "shared_expert_rank_num"), (9, "experts per rank"), (13, "hidden size (x.size(1))"),
                            (3, "bytes per token row"), (4, "bytes of per-token side data"),
                            (11, "routing weights given (expert_scales)"),
                            (5, "max tokens per rank (global_bs / ep_world_size)"),
                            (14, "int8 rows quantized by the sender (quantization without smooth scales)")):
                if p[i] != me[i]:
                    raise RuntimeError(f"{where}: rank {r} dispatches with {what} = {p[i]} while this rank uses "
                                       f"{me[i]}; every rank of the EP group must pass the same value")
            if p[10] != me[10]:
                raise RuntimeError(f"{where}: rank {r} dispatches with quant_mode = {2 * p[10]} while this rank "
                                   f"uses {2 * me[10]}; every rank of the EP group must pass the same value")
            if p[12] != me[12]:
                raise RuntimeError(f"{where}: rank {r} dispatches {_name(p[12])} tokens while this rank dispatches "
                                   f"{_name(me[12])}")
            if me[5] == 0 and p[0] != me[0]:
                raise RuntimeError(f"{where}: {who(r)} has {p[0]} tokens while this rank has {me[0]}; ranks with "
                                   "different batch sizes must pass global_bs = max tokens per rank * ep_world_size")
            if p[5] > 0 and p[0] > p[5]:
                raise RuntimeError(f"{where}: {who(r)} has {p[0]} tokens, more than the {p[5]} per rank the outputs "
                                   "are sized for (global_bs / ep_world_size, or num_max_dispatch_tokens_per_rank)")
            if p[15]:
                what = (f" is out of range; expected an expert id in [0, {p[2]})" if p[15] == 1 else
                        " repeats an expert already chosen earlier in that token's row; each token's expert ids "
                        "must be distinct")
                raise RuntimeError(f"{where}: {who(r)}: expert_ids[{p[16]}, {p[17]}] = {p[18]}{what}")

    def _check_capacity(self, G: torch.Tensor, hd, M: int, S: int, L: int) -> None:
        """Every receiver's rows against its output, computed by every rank alike."""
        where = f"cam moe_dispatch on rank {self.rank}"
        slab = int(hd["slab"][self.rank])
        for d in range(self.world):
            if d < S:
                total = int(G[:, M + d].sum())
            else:
                per = G[:, (d - S) * L:(d - S + 1) * L].sum(0)
                if slab > 0 and bool((per > slab).any()):
                    j = int(torch.nonzero(per > slab)[0])
                    raise RuntimeError(f"{where}: expert {(d - S) * L + j} on rank {d} receives {int(per[j])} rows "
                                       f"but its slab holds {slab} (num_max_dispatch_tokens_per_rank * num_ranks)")
                total = int(per.sum())
            cap = int(hd["capacity"][d])
            if total > cap:
                who = "this rank" if d == self.rank else f"rank {d}"
                raise RuntimeError(f"{where}: {who} would receive {total} rows but its output holds {cap} (sized "
                                   "from global_bs and the expert layout); pass a global_bs that bounds every "
                                   "rank's tokens")

    # ---- combine -------------------------------------------------------------------------------
    def moe_combine(self, *, rows, segments, quant, plan_peer, plan_seg, plan_off, plan_weight, add, add_first,
                    out, wait_us=None, timeout_s=0.0):
        W, me = self.world, self.rank
        c = _Args()
        if c.tensor(rows, "expert output rows", dim=2):
            c.need(rows.dtype in _FLOATS, lambda: f"expert output rows must be a contiguous 2-D float32, bfloat16 or "
                                                  f"float16 tensor, got {rows.dtype} of shape {tuple(rows.shape)}")
        c.tensor(segments, "segments", torch.int64, 2)
        c.tensor(out, "the output", dim=2)
        c.tensor(plan_peer, "plan ranks", torch.int32, 2)
        c.tensor(plan_seg, "plan segments", torch.int32, 2)
        c.tensor(plan_off, "plan offsets", torch.int64, 2)
        c.tensor(plan_weight, "plan weights", torch.float32, 2, required=False)
        c.tensor(add, "the added rows", required=False)
        if not c.error:
            n, H = rows.shape
            c.need(segments.shape[1] == 3, "segments must be (n, 3): first row, rows, owner rank")
            for i, (first, count, _owner) in enumerate(segments.tolist() if segments.shape[1] == 3 else []):
                if not c.need(first >= 0 and count >= 0 and first <= n - count,
                              f"segment {i} [{first}, {first + count}) lies outside the {n} expert output rows "
                              "(fewer rows than dispatch served?)"):
                    break
            c.need(out.dtype in _FLOATS and out.shape[1] == H,
                   "the output must be a contiguous float tensor of the rows' hidden size")
            c.need(plan_peer.shape[0] == out.shape[0] and plan_seg.shape == plan_peer.shape
                   and plan_off.shape == plan_peer.shape, "the plan must have one row per output token")
            c.need(plan_weight is None or plan_weight.shape == plan_peer.shape, "plan weights must have the plan's shape")
            c.need(add is None or (add.shape == out.shape and add.dtype in (out.dtype, torch.float32)),
                   "the added rows must have the output's shape, and its dtype or float32")
        header = torch.zeros(_HEADER_INTS, dtype=torch.int64)
        if not c.error:
            header[:5] = torch.tensor([n, H, segments.shape[0], _code(rows.dtype), int(bool(quant))])
        heads, tables = self._agree("moe_combine", header, c.error, None if c.error else segments)
        where = f"cam moe_combine on rank {me}"
        serving = [r for r in range(W) if heads[r, 0] > 0]
        for r in range(W):
            if heads[r, 4] != heads[me, 4]:
                raise RuntimeError(f"{where}: rank {r} combines with comm_quant_mode {2 * int(heads[r, 4])} while "
                                   f"this rank uses {2 * int(heads[me, 4])}; every rank must pass the same value")
        for r in serving:
            if heads[r, 1] != H:
                raise RuntimeError(f"{where}: rank {r} returns rows of hidden size {int(heads[r, 1])} while this rank "
                                   f"combines into rows of {H}")
            if heads[r, 3] != heads[serving[0], 3]:
                raise RuntimeError(f"{where}: rank {r} returns {_name(int(heads[r, 3]))} rows while rank "
                                   f"{serving[0]} returns {_name(int(heads[serving[0], 3]))}; every rank must "
                                   "return one dtype")
        dtype = _DTYPES[int(heads[serving[0], 3])] if serving else rows.dtype
        nseg = heads[:, 2]
        most = max(1, int(nseg.max()))
        SG = torch.zeros(W, most * 3, dtype=torch.int64)  # every rank's segments, zero-padded
        SG[:, :tables.shape[1]] = tables
        SG = SG.view(W, most, 3)

        # The rows this rank sends each owner: its segments of that owner, in segment order.
        mine = SG[me, : segments.shape[0]]
        send_idx, send_counts = [], []
        for s in range(W):
            segs = mine[mine[:, 2] == s]
            send_idx += [torch.arange(f, f + k) for f, k in segs[:, :2].tolist()]
            send_counts.append(int(segs[:, 1].sum()))
        send_idx = torch.cat(send_idx) if send_idx else torch.zeros(0, dtype=torch.int64)
        if quant:
            q, scales = _C.moe_quantize_rows(rows.contiguous()) if n else (torch.empty(0, H, dtype=torch.int8),
                                                                            torch.empty(0))
            send = torch.cat([_rows_at(q, send_idx), _rows_at(scales, send_idx)], 1) if n else torch.empty(0, H + 4,
                                                                                                         dtype=torch.uint8)
            width = H + 4
        else:
            width = H * torch.empty(0, dtype=dtype).element_size()
            send = _rows_at(rows, send_idx) if n else torch.empty(0, width, dtype=torch.uint8)
        # Each peer's segments of this rank: where their rows land in the received buffer.
        valid_seg = torch.arange(most).view(1, most) < nseg.view(W, 1)
        for_me = (SG[:, :, 2] == me) & valid_seg
        sizes = torch.where(for_me, SG[:, :, 1], 0)                        # [peer, seg]
        recv_counts = sizes.sum(1)
        seg_base = _exclusive(recv_counts).view(W, 1) + (torch.cumsum(sizes, 1) - sizes)
        recv = self._a2a_rows("moe_combine", send.contiguous(), send_counts, recv_counts.tolist(), width)

        # The plan against what every peer serves (a bad plan fails this rank, after its peers
        # have their rows: the same as on one host).
        P = plan_peer.shape[1]
        peer = plan_peer.to(torch.int64).reshape(-1)
        seg = plan_seg.to(torch.int64).reshape(-1)
        off = plan_off.reshape(-1)
        used = peer >= 0
        p_c, s_c = peer.clamp(0, W - 1), seg.clamp(0, most - 1)
        entry = SG[p_c, s_c]                                               # [first, rows, owner]
        problem = torch.zeros_like(peer)
        problem[used & (peer >= W)] = 1
        problem[used & (problem == 0) & ((seg < 0) | (seg >= nseg[p_c]))] = 2
        problem[used & (problem == 0) & ((off < 0) | (off >= entry[:, 1]) | (entry[:, 0] + off >= heads[p_c, 0]))] = 3
        problem[used & (problem == 0) & (entry[:, 2] != me)] = 4
        if bool(problem.any()):
            i = int(torch.nonzero(problem)[0])
            p, sg, o, kind = int(peer[i]), int(seg[i]), int(off[i]), int(problem[i])
            first, count, owner = entry[i].tolist()
            what = {1: lambda: f"names rank {p} outside the group of {W}",
                    2: lambda: f"names segment {sg} of rank {p}, which serves {int(nseg[p])} segments "
                               "(ep_send_counts / handle from another dispatch?)",
                    3: lambda: f"names row {o} of segment {sg} of rank {p}, which holds {count} rows there and "
                               f"returns {int(heads[p, 0])} in all (expand_idx / handle from another dispatch, or "
                               "expand_x shorter than dispatch produced?)",
                    4: lambda: f"names segment {sg} of rank {p}, which holds rank {owner}'s tokens, not this "
                               "rank's"}[kind]()
            raise RuntimeError(f"{where}: token {i // P} slot {i % P}: {what}")
        index = torch.where(used, seg_base[p_c, s_c] + off, -1)
        if quant:
            rows_in = recv[:, :H].view(torch.int8)
            scales_in = recv[:, H:].contiguous().view(torch.float32).view(-1)
        else:
            rows_in = recv.view(dtype).view(-1, H)
            scales_in = None
        _C.moe_weighted_sum_rows(rows_in.contiguous(), scales_in, index.view(-1, P), plan_weight,
                                 None if add is None else add.contiguous(), bool(add_first), out)
        return _Done()


def _shared_lo(r: int, c: int, T: int, S: int) -> int:
    """First of rank r's T tokens in the chunk it sends shared-expert rank c of S (the rotation of
    csrc/moe/dispatch.cpp)."""
    return (c + r) * T // S - r * T // S
