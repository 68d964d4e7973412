"""Single-process reference of MoE expert-parallel dispatch / combine (the ground truth for tests).

Everything here takes the inputs of *all* ranks at once (lists indexed by rank) and returns the outputs
of all ranks (lists indexed by rank). It is written for clarity, not speed: index bookkeeping is done
with plain Python loops, only the per-row arithmetic is vectorised.

Two families, following docs ``moe-semantics.md`` sections 5.3-5.5:

* Ascend-style (``torch_npu.npu_moe_distribute_dispatch/combine``): :func:`dispatch`, :func:`combine`.
  One received row per (token, expert) pair, ordered (local expert, source rank, source token), with
  optional "shared-expert ranks", TP=2 all-gather, int8 dynamic quantisation and special experts.
* DeepEP-style ``Buffer``: :func:`get_dispatch_layout`, :func:`normal_dispatch`, :func:`normal_combine`
  (one row per (token, destination rank), unweighted combine) and :func:`low_latency_dispatch`,
  :func:`low_latency_combine` (per-expert slabs, weighted combine).

Numerical conventions (so that an implementation can be compared bit for bit where that makes sense):

* int8 dynamic quantisation of a row ``x`` (see :func:`quantize_int8_rows`): ``xf = float32(x)``
  (``* smooth`` as a float32 multiply when given), ``m = max|xf|``; if ``m == 0`` the row is all zeros with
  scale 0; else ``inv = float32(127) / m``, ``q = int8(clamp(round_half_even(xf * inv), -127, 127))`` and
  ``scale = m / 127`` (float32).
* Weighted sums accumulate in float32 as ``acc = acc + (w * row)`` (a rounded product, then a rounded
  add, never a fused multiply-add), in the order stated by each function, and are cast at the end.
* Combine across hosts in two hops (``hosts``: the host index of every rank of the group): a
  token's terms from ranks on another host than its own rank's are first summed there
  (``partial = 0 + t1 + t2 ...`` in the same order), and each such partial is added, unweighted, in
  the place of its host's first term (:func:`_sum_by_host`).

Rank layout for the Ascend-style functions: the lists hold ``W*T`` global ranks with
``T = max(tp_world_size, 1)``; global rank ``g`` has ``ep_rank = g // T`` and ``tp_rank = g % T``; the
EP group of tp rank ``p`` is ``[p, T+p, 2T+p, ...]``.
"""
from __future__ import annotations

import torch

__all__ = [
    "dispatch",
    "combine",
    "get_dispatch_layout",
    "normal_dispatch",
    "normal_combine",
    "low_latency_dispatch",
    "low_latency_combine",
    "quantize_int8_rows",
    "calc_diff",
]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ASSIST_INTS_PER_ROW = 128


# ---------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------

def quantize_int8_rows(x, smooth=None):
    """Dynamic per-row int8 quantisation.

    ``x``: (N, H) float tensor (any float dtype). ``smooth``: None, (H,) or (N, H) float32 smooth scales,
    multiplied in float32 before quantising. Returns ``(q int8 (N, H), scale float32 (N,))`` with
    ``x * smooth ~= q * scale``. A row whose max is 0 gives zeros and scale 0.
    """
    xf = x.to(torch.float32)
    if smooth is not None:
        xf = xf * smooth.to(torch.float32)
    if xf.dim() != 2:
        raise ValueError(f"quantize_int8_rows expects a 2-D tensor, got shape {tuple(xf.shape)}")
    if xf.shape[0] == 0:
        return (torch.zeros(xf.shape, dtype=torch.int8), torch.zeros(0, dtype=torch.float32))
    if xf.shape[1] == 0:
        return (torch.zeros(xf.shape, dtype=torch.int8), torch.zeros(xf.shape[0], dtype=torch.float32))
    m = xf.abs().amax(dim=1)                                   # (N,) float32
    zero = m == 0
    safe_m = torch.where(zero, torch.ones_like(m), m)
    inv = torch.tensor(127.0, dtype=torch.float32) / safe_m    # float32 division, per row
    q = torch.round(xf * inv.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    q[zero] = 0
    scale = m / torch.tensor(127.0, dtype=torch.float32)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return q, scale


def _dequantize(q, scale):
    return q.to(torch.float32) * scale.to(torch.float32).unsqueeze(1)


def calc_diff(a, b):
    """DeepEP's similarity metric: ``1 - 2*sum((a+1)(b+1)) / sum((a+1)^2 + (b+1)^2)`` in float64.

    0 means identical; returns a Python float."""
    a = a.to(torch.float64) + 1
    b = b.to(torch.float64) + 1
    denom = (a * a + b * b).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (a * b).sum() / denom)


def _sum_by_host(acc, terms, own, hosts):
    """``acc`` plus one token's ``terms`` [(rank, float32 row)] in order; with ``hosts``, the terms
    of each other host than ``hosts[own]``'s summed first, that partial added where the host's
    first term stands."""
    if hosts is None:
        for _, v in terms:
            acc = acc + v
        return acc
    partial = {}
    for r, v in terms:
        h = hosts[r]
        if h != hosts[own]:
            partial[h] = (partial[h] if h in partial else torch.zeros_like(v)) + v
    for r, v in terms:
        h = hosts[r]
        if h == hosts[own]:
            acc = acc + v
        elif h in partial:
            acc = acc + partial.pop(h)
    return acc


def _inclusive_cumsum(counts):
    out, run = [], 0
    for c in counts:
        run += c
        out.append(run)
    return out


def _shared_chunk_lo(r, c, bs, S):
    """First token of chunk ``c`` of a MoE rank ``r`` with ``bs`` tokens (spec 5.4 step 5)."""
    return (c + r) * bs // S - r * bs // S


def _shared_chunk(r, c, bs, S):
    """Token range ``[lo, hi)`` of rank ``r`` that goes to shared-expert rank ``c``."""
    return _shared_chunk_lo(r, c, bs, S), _shared_chunk_lo(r, c + 1, bs, S)


def _check_list(name, value, n):
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ValueError(f"{name} must be None or a list with one entry per rank ({n})")
    return list(value)


def _entry_activity(ids, mask, moe_expert_num):
    """Per-entry activity (BS, K) bool for communication, and per-token activity (BS,) bool.

    An entry (t, k) is active iff the mask allows it (1-D: mask[t]; 2-D: mask[t, k]) and the id is a routed
    expert (< moe_expert_num). A token is active iff (1-D) mask[t], (2-D) any(mask[t, :]), or no mask.
    The third result is the mask-only entry activity (used for special experts in combine).
    """
    bs, k = ids.shape
    if mask is None:
        allowed = torch.ones(bs, k, dtype=torch.bool)
        token_active = torch.ones(bs, dtype=torch.bool)
    else:
        mask = mask.to(torch.bool)
        if mask.dim() == 1:
            if mask.shape[0] != bs:
                raise ValueError(f"x_active_mask shape {tuple(mask.shape)} does not match BS={bs}")
            allowed = mask.unsqueeze(1).expand(bs, k).clone()
            token_active = mask.clone()
        elif mask.dim() == 2:
            if tuple(mask.shape) != (bs, k):
                raise ValueError(f"x_active_mask shape {tuple(mask.shape)} does not match (BS, K)=({bs}, {k})")
            allowed = mask.clone()
            token_active = mask.any(dim=1) if k > 0 else torch.zeros(bs, dtype=torch.bool)
        else:
            raise ValueError("x_active_mask must be 1-D (BS,) or 2-D (BS, K)")
    routed = allowed & (ids < moe_expert_num)
    return routed, token_active, allowed


def _occurrence_index(ids, active):
    """expand_idx of one rank: for each active entry in row-major order, how many earlier active entries
    of this rank have the same expert id; -1 for inactive entries. Returns int32 (BS*K,)."""
    bs, k = ids.shape
    out = [-1] * (bs * k)
    seen = {}
    id_list = ids.tolist()
    act_list = active.tolist()
    for t in range(bs):
        for kk in range(k):
            if act_list[t][kk]:
                e = id_list[t][kk]
                out[t * k + kk] = seen.get(e, 0)
                seen[e] = seen.get(e, 0) + 1
    return torch.tensor(out, dtype=torch.int32)
    return out


# ---------------------------------------------------------------------------------------------------
# Ascend-style dispatch
# ---------------------------------------------------------------------------------------------------

def _layout_constants(n_global, tp_world_size, moe_expert_num, shared_expert_rank_num):
    if tp_world_size not in (0, 1, 2):
        raise ValueError(f"tp_world_size must be 0, 1 or 2, got {tp_world_size}")
    T = max(tp_world_size, 1)
    if n_global == 0 or n_global % T != 0:
        raise ValueError(f"number of ranks ({n_global}) must be a positive multiple of tp size {T}")
    W = n_global // T
    S = shared_expert_rank_num
    if not 0 <= S < W:
        raise ValueError(f"shared_expert_rank_num must be in [0, ep_world_size={W}), got {S}")
    if S > 0 and W % S != 0:
        raise ValueError(f"ep_world_size ({W}) must be a multiple of shared_expert_rank_num ({S})")
    if moe_expert_num <= 0 or moe_expert_num % (W - S) != 0:
        raise ValueError(f"moe_expert_num ({moe_expert_num}) must be a positive multiple of the number of "
                         f"MoE ranks ({W - S})")
    L = moe_expert_num // (W - S)
    if T == 2 and L != 1:
        raise ValueError("tp_world_size == 2 requires exactly one expert per MoE rank")
    return T, W, S, L


def dispatch(xs, expert_ids, moe_expert_num, *, scales=None, x_active_mask=None, expert_scales=None,
             tp_world_size=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0, global_bs=0,
             expert_token_nums_type=1):
    """Reference of ``npu_moe_distribute_dispatch`` (v1) / ``_v2`` for all ranks at once.

    Returns, per global rank, a dict with ``expand_x``, ``dynamic_scales``, ``expand_idx``,
    ``assist_info_for_combine``, ``expert_token_nums``, ``ep_recv_counts``, ``tp_recv_counts``,
    ``expand_scales`` (shapes per spec 5.3), plus informational ``n_valid`` (rows of ``expand_x``
    that are valid) and ``A``.

    Choices where the spec is silent:
    * ``assist_info_for_combine`` is ``(A*128,)`` and describes only this rank's own EP-received rows
      (the first ``ep_recv_counts[W*L_here-1]`` rows), ``src_rank`` being the EP rank of the source;
      shared-expert rows have ``k_slot = -1``.
    * With TP=2, ``expert_token_nums`` counts the rows of both TP halves (own + peer), i.e. every valid
      row of ``expand_x``, because the local expert processes all of them.
    * With ``global_bs == 0`` all ranks must have the same BS (as on NPU); otherwise ValueError.
    """
    n_global = len(xs)
    if len(expert_ids) != n_global:
        raise ValueError("xs and expert_ids must have one entry per rank")
    T, W, S, L = _layout_constants(n_global, tp_world_size, moe_expert_num, shared_expert_rank_num)
    M = moe_expert_num
    if quant_mode not in (0, 2):
        raise ValueError(f"quant_mode {quant_mode} is not supported (only 0 and 2)")
    if expert_token_nums_type not in (0, 1):
        raise ValueError("expert_token_nums_type must be 0 or 1")
    if S > 0 and shared_expert_num != 1:
        raise ValueError("only shared_expert_num == 1 is supported with shared-expert ranks")
    masks = _check_list("x_active_mask", x_active_mask, n_global)
    weights = _check_list("expert_scales", expert_scales, n_global)

    # ---- validate per-rank inputs
    H = xs[0].shape[1] if xs[0].dim() == 2 else None
    K = expert_ids[0].shape[1] if expert_ids[0].dim() == 2 else None
    for g in range(n_global):
        x, ids = xs[g], expert_ids[g]
        if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"xs[{g}] must be 2-D bf16/fp16/fp32, got {x.dtype} {tuple(x.shape)}")
        if x.shape[1] != H or x.dtype != xs[0].dtype:
            raise ValueError("all ranks must have the same H and dtype")
        if ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] != K:
            raise ValueError(f"expert_ids[{g}] must be (BS, K) with the same K on every rank")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError("expert_ids must be an integer tensor")
        if ids.numel() and int(ids.min()) < 0:
            raise ValueError(f"expert_ids[{g}] has negative ids")
        routed = torch.where(ids < M, ids.to(torch.int64), torch.full_like(ids, -1, dtype=torch.int64))
        srt = routed.sort(dim=1).values
        if K > 1 and ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any():
            raise ValueError(f"expert_ids[{g}] has duplicate routed experts within a row")
        if weights[g] is not None and tuple(weights[g].shape) != tuple(ids.shape):
            raise ValueError(f"expert_scales[{g}] must be (BS, K)")
    bss = [x.shape[0] for x in xs]
    if global_bs:
        if global_bs % W != 0:
            raise ValueError(f"global_bs ({global_bs}) must be a multiple of ep_world_size ({W})")
        max_bs = global_bs // W
        if max(bss) > max_bs:
            raise ValueError(f"BS {max(bss)} exceeds global_bs/ep_world_size = {max_bs}")
    else:
        if len(set(bss)) != 1:
            raise ValueError("ranks have different BS; pass global_bs = max_bs * ep_world_size")
        max_bs = bss[0]
    if scales is not None:
        n_rows = M + (1 if S > 0 else 0)
        if tuple(scales.shape) != (n_rows, H):
            raise ValueError(f"scales must be ({n_rows}, {H}), got {tuple(scales.shape)}")
    out_dtype = torch.int8 if quant_mode == 2 else xs[0].dtype

    # ---- EP exchange, once per tp rank p (the EP group of ranks g with g % T == p)
    ep_out = [[None] * W for _ in range(T)]          # ep_out[p][d]: rows received by EP rank d
    expand_idx = [None] * n_global
    for p in range(T):
        group = [d * T + p for d in range(W)]
        activity = [_entry_activity(expert_ids[g], masks[g], M) for g in group]
        for r, g in enumerate(group):
            expand_idx[g] = _occurrence_index(expert_ids[g], activity[r][0])
        for d in range(W):
            ep_out[p][d] = _ep_receive(d, group, xs, expert_ids, activity, W, S, L)

    # ---- materialise each rank's outputs (TP all-gather: own rows, then the peer's rows)
    results = []
    for g in range(n_global):
        d, p = g // T, g % T
        is_shared = d < S
        L_here = 1 if is_shared else L
        A = max_bs * W // S if is_shared else max_bs * W * min(L, K)
        halves = [ep_out[p][d]] + ([ep_out[1 - p][d]] if T == 2 else [])
        for h in halves:
            if len(h["rows"]) > A:
                raise RuntimeError(f"rank {g} receives {len(h['rows'])} rows, more than A={A}")

        all_rows = [row for h in halves for row in h["rows"]]      # (src_global, t, k, smooth_row)
        n_valid = len(all_rows)
        expand_x = torch.zeros(T * A, H, dtype=out_dtype)
        dyn = torch.zeros(T * A, dtype=torch.float32) if quant_mode == 2 else None
        if n_valid:
            data = torch.stack([xs[src][t] for (src, t, _, _) in all_rows])
            if quant_mode == 2:
                smooth = None
                if scales is not None:
                    smooth = scales.to(torch.float32)[torch.tensor([row[3] for row in all_rows])]
                q, sc = quantize_int8_rows(data, smooth)
                expand_x[:n_valid] = q
                dyn[:n_valid] = sc
            else:
                expand_x[:n_valid] = data
        expand_scales = None
        if expert_scales is not None:
            expand_scales = torch.zeros(T * A, dtype=torch.float32)
            vals = [float(weights[src][t, k]) if k >= 0 else 0.0 for (src, t, k, _) in all_rows]
            expand_scales[:n_valid] = torch.tensor(vals, dtype=torch.float32)

        assist = torch.zeros(A, ASSIST_INTS_PER_ROW, dtype=torch.int32)
        own_rows = ep_out[p][d]["rows"]
        if own_rows:
            assist[:len(own_rows), :3] = torch.tensor([[src // T, t, k] for (src, t, k, _) in own_rows],
                                                      dtype=torch.int32)
        assist = assist.reshape(-1)

        per_expert = [sum(h["per_expert"][j] for h in halves) for j in range(L_here)]
        if expert_token_nums_type == 0:
            per_expert = _inclusive_cumsum(per_expert)
        ep_recv_counts = [c for h in halves for c in _inclusive_cumsum(h["counts"])]
        tp_counts = [len(ep_out[q][d]["rows"]) for q in range(T)]

        results.append({
            "expand_x": expand_x,
            "dynamic_scales": dyn,
            "expand_idx": expand_idx[g],
            "assist_info_for_combine": assist,
            "expert_token_nums": torch.tensor(per_expert, dtype=torch.int64),
            "ep_recv_counts": torch.tensor(ep_recv_counts, dtype=torch.int32),
            "tp_recv_counts": torch.tensor(tp_counts, dtype=torch.int32),
            "expand_scales": expand_scales,
            "n_valid": n_valid,
            "A": A,
        })
    return results


def _ep_receive(d, group, xs, expert_ids, activity, W, S, L):
    """Rows EP rank ``d`` receives inside one EP group (spec 5.4 steps 4-5).

    Returns dict(rows=[(src_global, t, k, smooth_row)], counts=[...], per_expert=[...]) where
    ``k`` is -1 for shared-expert rows and ``counts`` is per (local expert, source EP rank)."""
    rows, counts = [], []
    if d >= S:                                   # MoE rank: (local expert, source rank, token) order
        per_expert = []
        for j in range(L):
            e = (d - S) * L + j
            smooth_row = e + (1 if S > 0 else 0)
            n_e = 0
            for src in range(W):
                g_src = group[src]
                hit = (expert_ids[g_src].to(torch.int64) == e) & activity[src][0]
                n = 0
                for t, k in torch.nonzero(hit).tolist():       # row-major (t, k) order
                    rows.append((g_src, t, k, smooth_row))
                    n += 1
                counts.append(n)
                n_e += n
            per_expert.append(n_e)
        return {"rows": rows, "counts": counts, "per_expert": per_expert}

    # shared-expert rank d: own active tokens, then the chunk of every MoE rank in rank order
    def take(src, lo, hi):
        g_src = group[src]
        token_active = activity[src][1].tolist()
        n = 0
        for t in range(lo, hi):
            if token_active[t]:
                rows.append((g_src, t, -1, 0))
                n += 1
        return n

    own_bs = xs[group[d]].shape[0]
    for c in range(S):                           # own tokens, accounted as S chunks (sum = own count)
        lo, hi = _shared_chunk(d, c, own_bs, S)
        counts.append(take(d, lo, hi))
    for src in range(S, W):
        lo, hi = _shared_chunk(src, d, xs[group[src]].shape[0], S)
        counts.append(take(src, lo, hi))
    return {"rows": rows, "counts": counts, "per_expert": [len(rows)]}


# ---------------------------------------------------------------------------------------------------
# Ascend-style combine
# ---------------------------------------------------------------------------------------------------

def _per_rank(value, g):
    """A per-rank argument given either as one tensor (same on every rank) or as a list per rank."""
    if isinstance(value, (list, tuple)):
        return value[g]
    return value


def combine(expert_outputs, expert_ids, expand_idx, ep_send_counts, expert_scales, moe_expert_num, *,
            tp_send_counts=None, x_active_mask=None, shared_expert_x=None, tp_world_size=0,
            shared_expert_num=1, shared_expert_rank_num=0, comm_quant_mode=0, out_dtype=None, ori_x=None,
            const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None, zero_expert_num=0,
            copy_expert_num=0, const_expert_num=0, hosts=None):
    """Reference of ``npu_moe_distribute_combine`` (v1) / ``_v2`` for all ranks at once.

    ``expert_outputs[g]``: rank g's expert output, same row layout as its ``expand_x`` (T*A rows).
    ``ep_send_counts[g]`` / ``tp_send_counts[g]``: rank g's ``ep_recv_counts`` / ``tp_recv_counts``.
    ``expert_scales[g]``: (BS, K) routing weights (None: all weights 1).
    ``ori_x`` (list per rank), ``const_expert_alpha_1/_2`` and ``const_expert_v`` ((const_expert_num, H),
    one tensor for all ranks or a list per rank) feed the copy / const special experts.

    Per token ``t`` of rank ``r``, in float32: for ``k = 0..K-1`` (active entries only) add
    ``w[t,k] * row`` for a routed expert, or the weighted special-expert value; then the shared-expert
    rank's row (unweighted) when S > 0; then ``shared_expert_x[t]`` (unweighted). With TP=2 the returned
    row is the float32 sum of both TP ranks' copies (own block + the peer's copy of it).
    ``comm_quant_mode == 2`` quantises every returned row (routed and shared) to int8 and back before use.
    ``hosts`` (EP rank -> host index): the rows of other hosts are summed by host first (module doc).
    A token counts as inactive (result all zeros) when its 1-D mask is False or all of its 2-D mask
    entries are False. Output dtype: ``out_dtype`` if it is a torch.dtype, else expert_outputs' dtype.
    """
    n_global = len(expert_outputs)
    T, W, S, L = _layout_constants(n_global, tp_world_size, moe_expert_num, shared_expert_rank_num)
    M = moe_expert_num
    if comm_quant_mode not in (0, 2):
        raise ValueError(f"comm_quant_mode {comm_quant_mode} is not supported (only 0 and 2)")
    if S > 0 and shared_expert_num != 1:
        raise ValueError("only shared_expert_num == 1 is supported with shared-expert ranks")
    for name, v in (("expert_ids", expert_ids), ("expand_idx", expand_idx), ("ep_send_counts", ep_send_counts)):
        if len(v) != n_global:
            raise ValueError(f"{name} must have one entry per rank")
    masks = _check_list("x_active_mask", x_active_mask, n_global)
    weights = _check_list("expert_scales", expert_scales, n_global)
    shared_x = _check_list("shared_expert_x", shared_expert_x, n_global)
    ori = _check_list("ori_x", ori_x, n_global)
    dtype = expert_outputs[0].dtype
    if isinstance(out_dtype, torch.dtype):
        dtype = out_dtype
    H = expert_outputs[0].shape[1]
    zero_end = M + zero_expert_num
    copy_end = zero_end + copy_expert_num
    const_end = copy_end + const_expert_num

    def counts_of(g):
        """Own half of rank g's ep_send_counts (inclusive running sums), as Python ints."""
        L_here = 1 if g // T < S else L
        return [int(c) for c in ep_send_counts[g].tolist()[: W * L_here]]

    cnts = [counts_of(g) for g in range(n_global)]

    # ---- TP reduce-scatter: effective returned rows Z[g] (float32) of every global rank
    Z = [None] * n_global
    for g in range(n_global):
        d, p = g // T, g % T
        own_n = cnts[g][-1]
        y = expert_outputs[g].to(torch.float32)
        if T == 1:
            Z[g] = y[:own_n]
        else:
            peer = d * T + (1 - p)
            if tp_send_counts is not None:
                n_own = int(tp_send_counts[g][p])
                n_peer = int(tp_send_counts[g][1 - p])
            else:
                n_own, n_peer = own_n, cnts[peer][-1]
            y_peer = expert_outputs[peer].to(torch.float32)
            Z[g] = y[:n_own] + y_peer[n_peer: n_peer + n_own]
        if comm_quant_mode == 2:
            Z[g] = _dequantize(*quantize_int8_rows(Z[g]))

    outs = []
    for g in range(n_global):
        r, p = g // T, g % T
        ids = expert_ids[g]
        bs, K = ids.shape
        _, token_active, allowed = _entry_activity(ids, masks[g], M)
        id_list = ids.tolist()
        eidx = expand_idx[g].tolist()
        w = weights[g].to(torch.float32) if weights[g] is not None else torch.ones(bs, K)
        acc = torch.zeros(bs, H, dtype=torch.float32)
        chunk_of = {}
        if S > 0 and r >= S:
            for c in range(S):
                lo, hi = _shared_chunk(r, c, bs, S)
                for t in range(lo, hi):
                    chunk_of[t] = c
        active_list = token_active.tolist()
        allowed_list = allowed.tolist()
        for t in range(bs):
            if not active_list[t]:
                continue
            terms = []  # (EP rank holding the row, weighted float32 row)
            for k in range(K):
                if not allowed_list[t][k]:
                    continue
                e = id_list[t][k]
                wk = w[t, k]
                if e < M:
                    d = S + e // L
                    j = e % L
                    cnt = cnts[d * T + p]
                    base = cnt[j * W + r - 1] if j * W + r > 0 else 0     # exclusive prefix
                    row = Z[d * T + p][base + eidx[t * K + k]]
                    terms.append((d, wk * row))
                elif e < zero_end:
                    pass
                elif e < copy_end:
                    terms.append((r, wk * ori[g][t].to(torch.float32)))
                elif e < const_end:
                    c = e - copy_end
                    a1 = _per_rank(const_expert_alpha_1, g)[c].to(torch.float32)
                    a2 = _per_rank(const_expert_alpha_2, g)[c].to(torch.float32)
                    v = _per_rank(const_expert_v, g)[c].to(torch.float32)
                    terms.append((r, wk * (a1 * ori[g][t].to(torch.float32) + a2 * v)))
                else:
                    raise ValueError(f"expert id {e} on rank {g} is out of range")
            if S > 0:
                if r < S:                # own token on a shared rank: rows are the own active tokens
                    c = r
                    row_idx = sum(active_list[:t])
                else:                    # token t lies in chunk c, which went to shared rank c
                    c = chunk_of[t]
                    lo = _shared_chunk_lo(r, c, bs, S)
                    row_idx = cnts[c * T + p][r - 1] + sum(active_list[lo:t])
                terms.append((c, Z[c * T + p][row_idx]))
            acc[t] = _sum_by_host(acc[t], terms, r, hosts)
            if shared_x[g] is not None:
                acc[t] = acc[t] + shared_x[g].reshape(bs, H)[t].to(torch.float32)
        outs.append(acc.to(dtype))
    return outs


# ---------------------------------------------------------------------------------------------------
# DeepEP-style Buffer reference
# ---------------------------------------------------------------------------------------------------

def get_dispatch_layout(topk_idx, num_experts, num_ranks):
    """Layout of ONE rank's routing: ``topk_idx`` (T, K) int64, -1 = no expert.

    Returns ``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
    is_token_in_rank [T, R] bool)``; a token counts once per destination rank."""
    if num_experts % num_ranks != 0:
        raise ValueError("num_experts must be a multiple of num_ranks")
    L = num_experts // num_ranks
    idx = topk_idx.to(torch.int64)
    n_tok = idx.shape[0]
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int32)
    is_token_in_rank = torch.zeros(n_tok, num_ranks, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e < 0:
                continue
            if e >= num_experts:
                raise ValueError(f"expert id {e} >= num_experts {num_experts}")
            num_tokens_per_expert[e] += 1
            is_token_in_rank[t, e // L] = True
    num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
    return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank


def normal_dispatch(xs, topk_idx, topk_weights, num_experts, *, expert_alignment=1, num_worst_tokens=0):
    """DeepEP normal-mode dispatch for all ranks. Per receiving rank ``j`` returns a dict:

    ``recv_x`` (N, H); ``recv_topk_idx`` (N, K) int64 local ids or -1; ``recv_topk_weights`` (N, K)
    float32 (0 where the expert is not on j; None when topk_weights is None);
    ``num_recv_tokens_per_expert_list`` (Python ints rounded up to expert_alignment; [] when
    num_worst_tokens > 0); ``rank_prefix_matrix`` [R, R] int32 (``[i][j]`` = rows j receives from ranks
    0..i); ``recv_src_idx`` (N,) int32; ``is_token_in_rank`` [T_j, R] bool and ``send_pos`` [T_j, R] int32
    of rank j *as a sender* (row index at the destination, or -1); ``num_recv_tokens`` (valid rows).
    Rows arrive ordered by source rank, then source token index. With ``num_worst_tokens > 0`` the outputs
    are padded to that many rows: zero rows, topk_idx -1, weights 0, recv_src_idx -1.
    """
    R = len(xs)
    if num_experts % R != 0:
        raise ValueError("num_experts must be a multiple of the number of ranks")
    L = num_experts // R
    weights = _check_list("topk_weights", topk_weights, R)
    layouts = [get_dispatch_layout(topk_idx[s], num_experts, R) for s in range(R)]
    in_rank = [lay[3] for lay in layouts]

    # rank_prefix_matrix and send positions (computed from the global layout)
    per_pair = torch.zeros(R, R, dtype=torch.int32)                 # [src][dst] rows
    for s in range(R):
        per_pair[s] = layouts[s][0]
    rank_prefix = per_pair.cumsum(dim=0).to(torch.int32)
    send_pos = []
    for s in range(R):
        pos = torch.full((xs[s].shape[0], R), -1, dtype=torch.int32)
        for dst in range(R):
            start = int(rank_prefix[s - 1, dst]) if s > 0 else 0
            toks = torch.nonzero(in_rank[s][:, dst]).flatten()
            pos[toks, dst] = torch.arange(start, start + toks.numel(), dtype=torch.int32)
        send_pos.append(pos)

    results = []
    for j in range(R):
        H = xs[j].shape[1]
        K = topk_idx[j].shape[1]
        src_rows, src_idx, r_idx, r_w = [], [], [], []
        for s in range(R):
            idx_s = topk_idx[s].to(torch.int64)
            for t in torch.nonzero(in_rank[s][:, j]).flatten().tolist():
                src_rows.append(xs[s][t])
                src_idx.append(t)
                ids = idx_s[t]
                here = (ids >= j * L) & (ids < (j + 1) * L)
                r_idx.append(torch.where(here, ids - j * L, torch.full_like(ids, -1)))
                if weights[s] is not None:
                    r_w.append(torch.where(here, weights[s][t].to(torch.float32), torch.zeros(K)))
        n = len(src_rows)
        n_rows = n
        if num_worst_tokens > 0:
            if n > num_worst_tokens:
                raise RuntimeError(f"rank {j} receives {n} rows, more than num_worst_tokens={num_worst_tokens}")
            n_rows = num_worst_tokens
        recv_x = torch.zeros(n_rows, H, dtype=xs[j].dtype)
        recv_topk_idx = torch.full((n_rows, K), -1, dtype=torch.int64)
        recv_src_idx = torch.full((n_rows,), -1, dtype=torch.int32)
        recv_w = torch.zeros(n_rows, K, dtype=torch.float32) if topk_weights is not None else None
        if n:
            recv_x[:n] = torch.stack(src_rows)
            recv_topk_idx[:n] = torch.stack(r_idx)
            recv_src_idx[:n] = torch.tensor(src_idx, dtype=torch.int32)
            if recv_w is not None:
                recv_w[:n] = torch.stack(r_w)
        if num_worst_tokens > 0:
            per_expert = []
        else:
            per_expert = []
            for i in range(L):
                c = int((recv_topk_idx[:n] == i).sum())
                per_expert.append((c + expert_alignment - 1) // expert_alignment * expert_alignment)
        results.append({
            "recv_x": recv_x,
            "recv_topk_idx": recv_topk_idx,
            "recv_topk_weights": recv_w,
            "num_recv_tokens_per_expert_list": per_expert,
            "rank_prefix_matrix": rank_prefix.clone(),
            "recv_src_idx": recv_src_idx,
            "is_token_in_rank": in_rank[j],
            "send_pos": send_pos[j],
            "num_recv_tokens": n,
        })
    return results


def normal_combine(recv_xs, dispatch_results, topk_weights_recv=None, bias=None, hosts=None):
    """DeepEP normal-mode combine for all ranks: unweighted sum of the rows every destination returns.

    ``recv_xs[j]``: rank j's rows (same layout as its ``recv_x``). ``bias``: None, a list of per-rank
    (T, H) tensors, or a tuple of two such lists. Per token, float32: ``acc = bias0 + bias1`` (those
    given, in that order; DeepEP starts from the bias) then ``+ recv_xs[j][row]`` for destinations j in
    ascending order; cast to recv_xs' dtype. Weights likewise (no bias). Returns a list per rank of
    ``(combined_x, combined_topk_weights or None)``. ``hosts`` (rank -> host index): the rows of
    other hosts are summed by host first (module doc).
    """
    R = len(recv_xs)
    if isinstance(bias, tuple):
        biases = [b for b in bias if b is not None]
    elif bias is None:
        biases = []
    else:
        biases = [bias]
    out = []
    for s in range(R):
        pos = dispatch_results[s]["send_pos"]
        n_tok = pos.shape[0]
        H = recv_xs[0].shape[1]
        acc = torch.zeros(n_tok, H, dtype=torch.float32)
        for b in biases:
            acc = acc + b[s].to(torch.float32)
        w_acc = None
        if topk_weights_recv is not None:
            w_acc = torch.zeros(n_tok, topk_weights_recv[0].shape[1], dtype=torch.float32)
        terms = []  # per destination j: (j, tokens it returns rows of, their rows, their weights)
        for j in range(R):
            sel = torch.nonzero(pos[:, j] >= 0).flatten()
            rows = pos[sel, j].to(torch.int64)
            terms.append((j, sel, recv_xs[j][rows].to(torch.float32),
                          topk_weights_recv[j][rows].to(torch.float32) if w_acc is not None else None))
        acc = _sum_rows_by_host(acc, [(j, sel, x) for j, sel, x, _ in terms], s, hosts)
        if w_acc is not None:
            w_acc = _sum_rows_by_host(w_acc, [(j, sel, x) for j, sel, _, x in terms], s, hosts)
        out.append((acc.to(recv_xs[0].dtype), w_acc))
    return out


def _sum_rows_by_host(acc, terms, own, hosts):
    """:func:`_sum_by_host` for every token at once: ``terms`` [(rank, tokens, their float32 rows)]."""
    if hosts is None:
        for _, sel, x in terms:
            acc[sel] = acc[sel] + x
        return acc
    partial, added = {}, {}
    for r, sel, x in terms:
        h = hosts[r]
        if h != hosts[own]:
            if h not in partial:
                partial[h] = torch.zeros_like(acc)
                added[h] = torch.zeros(acc.shape[0], dtype=torch.bool)
            partial[h][sel] = partial[h][sel] + x
    for r, sel, x in terms:
        h = hosts[r]
        if h == hosts[own]:
            acc[sel] = acc[sel] + x
        else:
            first = sel[~added[h][sel]]
            acc[first] = acc[first] + partial[h][first]
            added[h][first] = True
    return acc


def low_latency_dispatch(xs, topk_idx, num_max_dispatch_tokens_per_rank, num_experts):
    """DeepEP low-latency dispatch (bf16 path, no FP8) for all ranks. Per receiving rank ``j``:

    ``recv_x`` [L, max*R, H] (zeros beyond the valid rows), ``recv_count`` [L] int32, ``src_info``
    [L, max*R] int32 (source token index, -1 beyond valid), ``layout_range`` [L, R] int64 =
    ``(begin << 32) | count`` per source rank, plus ``num_max_dispatch_tokens_per_rank``, ``num_experts``.
    Rows of local expert i: for each source rank in order, its entries (t, k) equal to that expert in
    row-major order.
    """
    R = len(xs)
    if num_experts % R != 0:
        raise ValueError("num_experts must be a multiple of the number of ranks")
    L = num_experts // R
    cap = num_max_dispatch_tokens_per_rank
    for s in range(R):
        if xs[s].shape[0] > cap:
            raise ValueError(f"rank {s} has {xs[s].shape[0]} tokens > num_max_dispatch_tokens_per_rank {cap}")
    results = []
    for j in range(R):
        H = xs[j].shape[1]
        recv_x = torch.zeros(L, cap * R, H, dtype=xs[j].dtype)
        recv_count = torch.zeros(L, dtype=torch.int32)
        src_info = torch.full((L, cap * R), -1, dtype=torch.int32)
        layout_range = torch.zeros(L, R, dtype=torch.int64)
        for i in range(L):
            e = j * L + i
            n = 0
            for s in range(R):
                begin = n
                for t, _k in torch.nonzero(topk_idx[s].to(torch.int64) == e).tolist():
                    recv_x[i, n] = xs[s][t]
                    src_info[i, n] = t
                    n += 1
                layout_range[i, s] = (begin << 32) | (n - begin)
            recv_count[i] = n
        results.append({
            "recv_x": recv_x,
            "recv_count": recv_count,
            "src_info": src_info,
            "layout_range": layout_range,
            "num_max_dispatch_tokens_per_rank": cap,
            "num_experts": num_experts,
        })
    return results


def low_latency_combine(ys, topk_idx, topk_weights, dispatch_results, hosts=None):
    """DeepEP low-latency combine for all ranks: ``out[t] = sum_k w[t,k] * ys[owner][i, slot]`` over the
    k with ``topk_idx != -1``, float32 in k order, cast to ys' dtype. ``ys[j]``: [L, max*R, H].
    ``hosts`` (rank -> host index): the rows of other hosts are summed by host first (module doc)."""
    R = len(ys)
    num_experts = dispatch_results[0]["num_experts"]
    L = num_experts // R
    out = []
    for s in range(R):
        idx = topk_idx[s].to(torch.int64)
        n_tok, K = idx.shape
        H = ys[0].shape[2]
        acc = torch.zeros(n_tok, H, dtype=torch.float32)
        w = topk_weights[s].to(torch.float32)
        seen = {}                       # entries of rank s per expert so far (row-major order)
        slot = {}
        for t in range(n_tok):
            for k in range(K):
                e = int(idx[t, k])
                if e < 0:
                    continue
                slot[(t, k)] = seen.get(e, 0)
                seen[e] = seen.get(e, 0) + 1
        for t in range(n_tok):
            terms = []
            for k in range(K):
                e = int(idx[t, k])
                if e < 0:
                    continue
                j, i = e // L, e % L
                begin = int(dispatch_results[j]["layout_range"][i, s]) >> 32
                terms.append((j, w[t, k] * ys[j][i, begin + slot[(t, k)]].to(torch.float32)))
            acc[t] = _sum_by_host(acc[t], terms, s, hosts)
        out.append(acc.to(ys[0].dtype))
    return out
