"""Single-process reference of paged KV-cache transfer between TP groups (the ground truth for tests).

A request's KV cache moves from the ranks of a prefill instance ("source", TP size ``Ts``) to the
ranks of a decode instance ("destination", TP size ``Td``), converting the layout inside the copy:
TP head split / gather (any ratio both ways), block size (any pair of sizes, token-level remap),
``NHD`` <-> ``HND`` order, MLA replication, and optionally a dtype cast. Everything here is plain
PyTorch indexing written for clarity, not speed; the transport (docs ``kv.md``) is checked against it.

Conventions
-----------

Pools. One rank holds one tensor per layer (:meth:`KVLayout.allocate`), the *logical* shape with the
physical order of vLLM's FlashAttention-style backends (K/V split outermost):

* ``kind="mha"``, ``order="NHD"``: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
  (index 0 of the first dim is K, 1 is V).
* ``kind="mha"``, ``order="HND"``: ``[2, num_blocks, num_kv_heads, block_size, head_dim]``.
* ``kind="mla"``: ``[num_blocks, block_size, head_dim]`` (one latent vector per token, no K/V split,
  no head dim; ``order`` is accepted but has no effect).

FlashInfer's ``[num_blocks, 2, ...]`` split and cross-layer blocks are not modelled.

Token order. A request's tokens ``0 .. num_tokens-1`` live, on each side, in that side's block id list
(the same list on every TP rank of the side): token ``i`` is in block ``block_ids[i // block_size]``
at slot ``i % block_size``. Only the first ``ceil(num_tokens / block_size)`` ids are used (a list may
be longer; every id in it is still bounds-checked). Slots past ``num_tokens`` in the last block are
never read as data and never written.

Token tensors (what :func:`gather_tokens` returns and :func:`scatter_tokens` takes, per layer):
``[2, num_tokens, heads, head_dim]`` for mha (K/V, token, head), ``[num_tokens, head_dim]`` for mla.
A "model" tensor holds all ``total_kv_heads`` heads; :func:`shard_heads` cuts one rank's slice.

Head slicing across TP (mha). With ``H = total_kv_heads`` and ``T = tp_size``:

* ``T <= H``: ``H % T == 0``, each rank holds ``H // T`` heads and rank ``r`` holds the contiguous
  global heads ``[r * H // T, (r + 1) * H // T)``.
* ``T > H`` (replicated KV heads, as in vLLM when TP exceeds the KV head count): ``T % H == 0``,
  each rank holds ``num_kv_heads == 1`` head, rank ``r`` holds global head ``r * H // T``; head ``g``
  is replicated on the ``T // H`` ranks ``[g * T // H, (g + 1) * T // H)``.

MLA: ``num_kv_heads == total_kv_heads == 1`` and the latent is replicated on every TP rank.

Which source rank feeds a destination head. A head held by exactly one source rank is read from
that rank. A head replicated on ``k > 1`` source ranks (mha with ``Ts > H``, or MLA with
``k = Ts``) is read from the replica ``g * k + (dst.tp_rank % k)``, so destination ranks spread
their reads over the replicas; for MLA that is source rank ``dst.tp_rank % Ts``. Other replicas are
never read.

Plan pieces (:class:`KVCopyPiece`) use LOCAL head indices on both sides: source heads
``[src_head_lo, src_head_hi)`` of source rank ``src_tp_rank`` go to destination heads starting at
``dst_head_lo``. Pieces are in increasing destination-head order, cover each destination head
exactly once, and adjacent heads from the same source rank are merged into one piece.

Compatibility (:func:`plan_kv_copy`): same ``kind``, ``num_layers``, ``head_dim`` and
``total_kv_heads``. ``num_blocks``, ``block_size``, ``order``, ``tp_size`` may differ. ``dtype``
must match unless ``allow_dtype_cast=True``, in which case values are converted with
``Tensor.to(dst.dtype)`` (PyTorch's rounding; no scaling, so FP8 scales are not modelled).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Union

import torch

__all__ = [
    "KVLayout",
    "KVCopyPiece",
    "KVCopyPlan",
    "plan_kv_copy",
    "reference_transfer",
    "scatter_tokens",
    "gather_tokens",
    "shard_heads",
    "token_slots",
    "token_runs",
]

_KINDS = ("mha", "mla")
_ORDERS = ("NHD", "HND")


def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


# ---------------------------------------------------------------------------------------------------
# Layout descriptor
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVLayout:
    """One rank's per-layer paged KV pool (see the module docstring for the conventions).

    ``total_kv_heads=None`` means "not replicated": ``num_kv_heads * tp_size`` for mha, ``1`` for
    mla; give it explicitly when ``tp_size > total_kv_heads``. The layout is validated on
    construction (:meth:`validate`), so an invalid one raises ``ValueError`` right away.
    """

    kind: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    order: str = "NHD"
    tp_rank: int = 0
    tp_size: int = 1
    total_kv_heads: Optional[int] = None

    def __post_init__(self):
        if self.total_kv_heads is None:
            if self.kind == "mla":
                total = 1
            elif _is_int(self.num_kv_heads) and _is_int(self.tp_size):
                total = self.num_kv_heads * self.tp_size
            else:
                total = None
            object.__setattr__(self, "total_kv_heads", total)
        self.validate()

    # -- checks ------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        if self.kind not in _KINDS:
            raise ValueError(f"KVLayout.kind must be one of {_KINDS}, got {self.kind!r}")
        if self.order not in _ORDERS:
            raise ValueError(f"KVLayout.order must be one of {_ORDERS}, got {self.order!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "tp_size",
                     "total_kv_heads"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {v!r}")
        if not _is_int(self.tp_rank) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVLayout.tp_rank must be an int in [0, tp_size={self.tp_size}), "
                             f"got {self.tp_rank!r}")
        H, T = self.total_kv_heads, self.tp_size
        if self.kind == "mla":
            if self.num_kv_heads != 1 or H != 1:
                raise ValueError(f"mla layouts hold one latent vector per token: num_kv_heads and "
                                 f"total_kv_heads must be 1, got {self.num_kv_heads} and {H}")
            return
        if T <= H:
            if H % T != 0:
                raise ValueError(f"total_kv_heads={H} is not divisible by tp_size={T}")
            if self.num_kv_heads != H // T:
                raise ValueError(f"num_kv_heads={self.num_kv_heads} but total_kv_heads={H} over "
                                 f"tp_size={T} gives {H // T} heads per rank")
        else:
            if T % H != 0:
                raise ValueError(f"tp_size={T} > total_kv_heads={H} replicates KV heads, which needs "
                                 f"tp_size % total_kv_heads == 0")
            if self.num_kv_heads != 1:
                raise ValueError(f"tp_size={T} > total_kv_heads={H}: each rank holds one replicated "
                                 f"head, so num_kv_heads must be 1, got {self.num_kv_heads}")

    # -- derived -----------------------------------------------------------------------------------
    @property
    def replication(self) -> int:
        """How many ranks of the TP group hold each head (1 = sharded, no replication)."""
        if self.kind == "mla":
            return self.tp_size
        return max(1, self.tp_size // self.total_kv_heads)

    def heads(self) -> range:
        """Global head indices this rank holds (``range(0, 1)`` for mla)."""
        if self.kind == "mla":
            return range(0, 1)
        H, T, r = self.total_kv_heads, self.tp_size, self.tp_rank
        if T <= H:
            return range(r * H // T, (r + 1) * H // T)
        g = r * H // T
        return range(g, g + 1)

    def with_rank(self, tp_rank: int) -> "KVLayout":
        """The same layout for another rank of the same TP group."""
        return dataclasses.replace(self, tp_rank=tp_rank)

    def tp_group(self) -> list:
        """Layouts of every rank of this TP group, indexed by tp rank."""
        return [self.with_rank(r) for r in range(self.tp_size)]

    def pool_shape(self) -> tuple:
        """Shape of one layer's pool tensor on this rank."""
        if self.kind == "mla":
            return (self.num_blocks, self.block_size, self.head_dim)
        if self.order == "NHD":
            return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return (2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def block_bytes(self) -> int:
        """Bytes of one block of one layer on this rank (K and V together for mha)."""
        elt = torch.empty((), dtype=self.dtype).element_size()
        kv = 1 if self.kind == "mla" else 2
        return kv * self.block_size * self.num_kv_heads * self.head_dim * elt

    def allocate(self, device="cpu") -> list:
        """One zero-filled pool tensor per layer."""
        return [torch.zeros(self.pool_shape(), dtype=self.dtype, device=device)
                for _ in range(self.num_layers)]


# ---------------------------------------------------------------------------------------------------
# Plan
# ---------------------------------------------------------------------------------------------------

class KVCopyPiece(NamedTuple):
    """Source heads ``[src_head_lo, src_head_hi)`` of ``src_tp_rank`` -> destination heads from
    ``dst_head_lo`` (local indices on both sides)."""
    src_tp_rank: int
    src_head_lo: int
    src_head_hi: int
    dst_head_lo: int

    @property
    def num_heads(self) -> int:
        return self.src_head_hi - self.src_head_lo


@dataclass(frozen=True)
class KVCopyPlan:
    """What one destination rank receives: ``pieces`` plus the two layouts (``src.tp_rank`` is
    irrelevant and normalised to 0; ``dst`` is the destination rank's own layout)."""
    src: KVLayout
    dst: KVLayout
    pieces: tuple

    @property
    def src_ranks(self) -> tuple:
        """Distinct source tp ranks read, in increasing order."""
        return tuple(sorted({p.src_tp_rank for p in self.pieces}))

    @property
    def needs_permute(self) -> bool:
        return self.src.kind == "mha" and self.src.order != self.dst.order

    @property
    def needs_cast(self) -> bool:
        return self.src.dtype != self.dst.dtype

    @property
    def same_block_size(self) -> bool:
        return self.src.block_size == self.dst.block_size


def _source_rank_of_head(src: KVLayout, g: int, dst_tp_rank: int) -> int:
    """Source tp rank read for global head ``g`` by destination rank ``dst_tp_rank``."""
    k = src.replication
    if k == 1:
        return g // src.num_kv_heads
    return g * k + dst_tp_rank % k          # replicas of g: [g*k, (g+1)*k); mla: g == 0


def _check_compatible(src: KVLayout, dst: KVLayout, allow_dtype_cast: bool) -> None:
    for name in ("kind", "num_layers", "head_dim", "total_kv_heads"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ValueError(f"incompatible KV layouts: source {name}={a!r}, destination {name}={b!r}")
    if src.dtype != dst.dtype and not allow_dtype_cast:
        raise ValueError(f"incompatible KV layouts: source dtype={src.dtype}, destination "
                         f"dtype={dst.dtype} (pass allow_dtype_cast=True to convert)")


def plan_kv_copy(src: KVLayout, dst: KVLayout, *, allow_dtype_cast: bool = False) -> KVCopyPlan:
    """Plan the copy into destination rank ``dst.tp_rank`` from the source TP group described by
    ``src`` (any rank's layout of that group). Raises ``ValueError`` on incompatible layouts."""
    if not isinstance(src, KVLayout) or not isinstance(dst, KVLayout):
        raise ValueError("plan_kv_copy expects two KVLayout objects")
    src.validate()
    dst.validate()
    _check_compatible(src, dst, allow_dtype_cast)
    pieces = []
    for j, g in enumerate(dst.heads()):
        s = _source_rank_of_head(src, g, dst.tp_rank)
        lo = g - src.with_rank(s).heads().start
        last = pieces[-1] if pieces else None
        if last is not None and last.src_tp_rank == s and last.src_head_hi == lo:
            pieces[-1] = last._replace(src_head_hi=lo + 1)
        else:
            pieces.append(KVCopyPiece(s, lo, lo + 1, j))
    return KVCopyPlan(src=src.with_rank(0), dst=dst, pieces=tuple(pieces))


# ---------------------------------------------------------------------------------------------------
# Token addressing
# ---------------------------------------------------------------------------------------------------

def _as_id_list(block_ids, what: str) -> list:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer tensor or a sequence of ints")
        return [int(x) for x in block_ids.tolist()]
    out = []
    for x in block_ids:
        if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point:
            x = int(x)
        if not _is_int(x):
            raise ValueError(f"{what} must hold ints, got {x!r}")
        out.append(x)
    return out


def _check_block_ids(ids: list, layout: KVLayout, num_tokens: int, what: str, unique: bool) -> int:
    """Bounds-check every id (IndexError), then the coverage (ValueError). Returns blocks used."""
    for i, b in enumerate(ids):
        if not 0 <= b < layout.num_blocks:
            raise IndexError(f"{what}[{i}] = {b} is out of range for a pool of "
                             f"{layout.num_blocks} blocks")
    used = -(-num_tokens // layout.block_size)
    if len(ids) < used:
        raise ValueError(f"{what} has {len(ids)} blocks but {num_tokens} tokens at block_size "
                         f"{layout.block_size} need {used}")
    if unique and len(set(ids[:used])) != used:
        raise ValueError(f"{what} repeats a block id among the {used} blocks written")
    return used


def _check_layers(layers, layout: KVLayout) -> list:
    if layers is None:
        return list(range(layout.num_layers))
    if _is_int(layers):
        layers = [layers]
    out = []
    for l in layers:
        if not _is_int(l):
            raise ValueError(f"layers must hold ints, got {l!r}")
        if not 0 <= l < layout.num_layers:
            raise IndexError(f"layer {l} is out of range for {layout.num_layers} layers")
        out.append(l)
    return out


def _check_num_tokens(num_tokens) -> int:
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    return num_tokens


def token_slots(block_ids, block_size: int, num_tokens: int):
    """``(blocks, offsets)``: two int64 tensors of length ``num_tokens`` giving token ``i``'s block
    id and slot. (vLLM's flat ``slot_mapping`` is ``blocks * block_size + offsets``.)"""
    ids = torch.tensor(_as_id_list(block_ids, "block_ids"), dtype=torch.int64)
    t = torch.arange(num_tokens, dtype=torch.int64)
    return ids[t // block_size], t % block_size


def token_runs(src_block_ids, src_block_size: int, dst_block_ids, dst_block_size: int,
               num_tokens: int) -> list:
    """Maximal runs of consecutive tokens that stay inside one source block and one destination
    block: a list of ``(src_block, src_offset, dst_block, dst_offset, length)`` in token order.
    (Runs are not merged across blocks even when the ids are consecutive.)"""
    src_ids = _as_id_list(src_block_ids, "src_block_ids")
    dst_ids = _as_id_list(dst_block_ids, "dst_block_ids")
    runs, i = [], 0
    while i < num_tokens:
        so, do = i % src_block_size, i % dst_block_size
        n = min(src_block_size - so, dst_block_size - do, num_tokens - i)
        runs.append((src_ids[i // src_block_size], so, dst_ids[i // dst_block_size], do, n))
        i += n
    return runs


def _logical_view(pool: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A view of the pool as ``[C, num_blocks, block_size, heads, head_dim]`` (C = 2 for mha, 1 for
    mla) sharing its storage, whatever the physical order."""
    if layout.kind == "mla":
        return pool.unsqueeze(0).unsqueeze(3)
    if layout.order == "HND":
        return pool.transpose(2, 3)
    return pool


def _check_pools(pools, layout: KVLayout, what: str) -> None:
    if pools is None or len(pools) != layout.num_layers:
        n = None if pools is None else len(pools)
        raise ValueError(f"{what} must hold {layout.num_layers} per-layer tensors, got {n}")
    shape = layout.pool_shape()
    for l, p in enumerate(pools):
        if not isinstance(p, torch.Tensor) or tuple(p.shape) != shape or p.dtype != layout.dtype:
            got = (tuple(p.shape), p.dtype) if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"{what}[{l}] must be a {layout.dtype} tensor of shape {shape}, got {got}")


def _token_shape(layout: KVLayout, num_tokens: int, heads: int) -> tuple:
    if layout.kind == "mla":
        return (num_tokens, layout.head_dim)
    return (2, num_tokens, heads, layout.head_dim)


def _read(view, blk, off, lo, hi):
    return view[:, blk, off, lo:hi]                   # [C, T, hi-lo, D] (a copy)


def _write(view, blk, off, lo, data):
    view[:, blk, off, lo:lo + data.shape[2]] = data   # index_put_ through the view


# ---------------------------------------------------------------------------------------------------
# Token gather / scatter (one rank)
# ---------------------------------------------------------------------------------------------------

def shard_heads(kv_tokens: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The slice of a model token tensor (all ``total_kv_heads`` heads) that ``layout``'s rank holds.
    mla tensors are returned unchanged (replicated)."""
    if layout.kind == "mla":
        return kv_tokens
    h = layout.heads()
    return kv_tokens[:, :, h.start:h.stop]


def gather_tokens(pools, layout: KVLayout, block_ids, num_tokens: int, layers=None) -> list:
    """Read a request's tokens out of one rank's pools: one new tensor per requested layer (default
    all), ``[2, num_tokens, num_kv_heads, head_dim]`` for mha or ``[num_tokens, head_dim]`` for mla."""
    layout.validate()
    num_tokens = _check_num_tokens(num_tokens)
    ids = _as_id_list(block_ids, "block_ids")
    _check_block_ids(ids, layout, num_tokens, "block_ids", unique=False)
    layer_list = _check_layers(layers, layout)
    _check_pools(pools, layout, "pools")
    blk, off = token_slots(ids, layout.block_size, num_tokens)
    out = []
    for l in layer_list:
        data = _read(_logical_view(pools[l], layout), blk.to(pools[l].device),
                     off.to(pools[l].device), 0, layout.num_kv_heads)
        out.append(data.reshape(_token_shape(layout, num_tokens, layout.num_kv_heads)))
    return out


def scatter_tokens(pools, layout: KVLayout, block_ids, kv_tokens, layers=None) -> None:
    """Write a request's tokens into one rank's pools in place. ``kv_tokens``: one tensor per layer
    written (``layers``, default all), each ``[2, num_tokens, num_kv_heads, head_dim]`` for mha
    (this rank's heads; see :func:`shard_heads`) or ``[num_tokens, head_dim]`` for mla. Everything is
    checked before the first write; slots past ``num_tokens`` are left as they are."""
    layout.validate()
    layer_list = _check_layers(layers, layout)
    kv_tokens = list(kv_tokens)
    if len(kv_tokens) != len(layer_list):
        raise ValueError(f"kv_tokens has {len(kv_tokens)} tensors for {len(layer_list)} layers")
    if not kv_tokens:
        return
    num_tokens = kv_tokens[0].shape[0 if layout.kind == "mla" else 1]
    shape = _token_shape(layout, num_tokens, layout.num_kv_heads)
    for l, t in zip(layer_list, kv_tokens):
        if tuple(t.shape) != shape:
            raise ValueError(f"kv_tokens for layer {l} must have shape {shape}, got {tuple(t.shape)}")
    ids = _as_id_list(block_ids, "block_ids")
    _check_block_ids(ids, layout, num_tokens, "block_ids", unique=True)
    _check_pools(pools, layout, "pools")
    blk, off = token_slots(ids, layout.block_size, num_tokens)
    for l, t in zip(layer_list, kv_tokens):
        p = pools[l]
        data = t.to(device=p.device, dtype=p.dtype)
        if layout.kind == "mla":
            data = data.reshape(1, num_tokens, 1, layout.head_dim)
        _write(_logical_view(p, layout), blk.to(p.device), off.to(p.device), 0, data)


# ---------------------------------------------------------------------------------------------------
# Transfer
# ---------------------------------------------------------------------------------------------------

LayoutArg = Union[KVLayout, Sequence[Optional[KVLayout]]]


def _side_layouts(arg, pools, what: str) -> list:
    """Per-rank layouts of one side (a single KVLayout expands to its whole TP group)."""
    if isinstance(arg, KVLayout):
        layouts = arg.tp_group()
    else:
        layouts = list(arg)
        if not layouts or not isinstance(layouts[0], KVLayout):
            raise ValueError(f"{what}_layout_per_rank must be a KVLayout or a list of them by tp rank")
        base = layouts[0]
        if len(layouts) != base.tp_size:
            raise ValueError(f"{what}_layout_per_rank has {len(layouts)} entries for tp_size "
                             f"{base.tp_size}")
        for r, lay in enumerate(layouts):
            if not isinstance(lay, KVLayout) or lay != base.with_rank(r):
                raise ValueError(f"{what}_layout_per_rank[{r}] must equal the rank-0 layout with "
                                 f"tp_rank={r}, got {lay!r}")
    if len(pools) != len(layouts):
        raise ValueError(f"{what}_pools has {len(pools)} entries for a TP group of {len(layouts)} "
                         f"ranks (use None for a rank that takes no part)")
    return layouts


def reference_transfer(src_pools, src_layout_per_rank: LayoutArg, src_block_ids,
                       dst_pools, dst_layout_per_rank: LayoutArg, dst_block_ids,
                       num_tokens: int, layers=None, *, allow_dtype_cast: bool = False) -> list:
    """Copy a request's KV from a source TP group's pools into a destination TP group's pools.

    ``src_pools[r]`` / ``dst_pools[r]``: the per-layer pool tensors of tp rank ``r`` of each side;
    an entry may be ``None`` (a destination rank left out, or a source rank no plan reads).
    ``*_layout_per_rank``: the list of each rank's :class:`KVLayout` (or one layout, expanded to
    its TP group). ``*_block_ids``: the request's block ids on each side (sequence or 1-D tensor).
    ``layers``: layer indices to copy (default all).

    Writes exactly the ``num_tokens`` token slots of each listed destination rank's heads in the
    given layers, nothing else. All checks run before the first write: ``IndexError`` for a block id
    or layer out of range (naming it), ``ValueError`` for anything else (incompatible layouts, pool
    shapes, a block list too short for ``num_tokens``, a repeated destination block id).
    Returns the plans used, one per destination rank (``None`` where ``dst_pools[r]`` is None).
    """
    src_layouts = _side_layouts(src_layout_per_rank, src_pools, "src")
    dst_layouts = _side_layouts(dst_layout_per_rank, dst_pools, "dst")
    src0, dst0 = src_layouts[0], dst_layouts[0]
    _check_compatible(src0, dst0, allow_dtype_cast)
    num_tokens = _check_num_tokens(num_tokens)
    s_ids = _as_id_list(src_block_ids, "src_block_ids")
    d_ids = _as_id_list(dst_block_ids, "dst_block_ids")
    _check_block_ids(s_ids, src0, num_tokens, "src_block_ids", unique=False)
    _check_block_ids(d_ids, dst0, num_tokens, "dst_block_ids", unique=True)
    layer_list = _check_layers(layers, dst0)

    plans = []
    for r, lay in enumerate(dst_layouts):
        if dst_pools[r] is None:
            plans.append(None)
            continue
        _check_pools(dst_pools[r], lay, f"dst_pools[{r}]")
        plans.append(plan_kv_copy(src0, lay, allow_dtype_cast=allow_dtype_cast))
    for s in sorted({p.src_tp_rank for plan in plans if plan is not None for p in plan.pieces}):
        if src_pools[s] is None:
            raise ValueError(f"src_pools[{s}] is None but the plan reads source tp rank {s}")
        _check_pools(src_pools[s], src_layouts[s], f"src_pools[{s}]")

    if num_tokens == 0:
        return plans
    s_blk, s_off = token_slots(s_ids, src0.block_size, num_tokens)
    d_blk, d_off = token_slots(d_ids, dst0.block_size, num_tokens)
    for l in layer_list:
        # read everything for this layer first, so that aliased source/destination pools are safe
        writes = []
        for r, plan in enumerate(plans):
            if plan is None:
                continue
            for piece in plan.pieces:
                sp = src_pools[piece.src_tp_rank][l]
                data = _read(_logical_view(sp, src0), s_blk.to(sp.device), s_off.to(sp.device),
                             piece.src_head_lo, piece.src_head_hi)
                writes.append((r, piece.dst_head_lo, data))
        for r, lo, data in writes:
            dp = dst_pools[r][l]
            _write(_logical_view(dp, dst_layouts[r]), d_blk.to(dp.device), d_off.to(dp.device), lo,
                   data.to(device=dp.device, dtype=dp.dtype))
    return plans
