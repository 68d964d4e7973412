"""RL weight transfer: trainer ranks publish a policy version, rollout ranks take it in place.

``WeightChannel(group, trainers=[...], replicas=[[...], ...])`` (collective) names the trainer
ranks and the rollout replicas (each a list of ranks; a replica holds the whole model, sharded
over its ranks). Every rank then registers tensors by name with a shard spec:

- ``Replicate()``: the rank holds the whole tensor;
- ``Shard(dim, index, count)``: the rank holds chunk ``index`` of ``count`` along ``dim``, sized as
  ``torch.chunk`` sizes them (tensor parallelism, DTensor's ``Shard``);
- ``FlatShard(offset, numel)``: the rank holds elements ``offset .. offset+numel-1`` of the
  flattened tensor (an FSDP flat shard).

``publish(version)`` on the trainers and ``update(version)`` on the rollouts (both collective over
the group) move every registered byte into the rollouts' tensors, resharding from the trainers'
layout to each replica's and casting to each rollout tensor's dtype (float to float, or float to
int8 / float8 with per-row scales when the rollout registers ``scale=``).

How bytes move on one host: a trainer's registered tensor is moved into the group's tensor heap
at ``register`` (its storage, not the tensor object: the values, shape and the object the
optimizer holds stay; see ``register``). Rollout ranks read those pages in place, so a transfer
is one copy per rollout byte, straight from the trainer's parameter into the engine's tensor with
the reshard and the cast done inside it. Every replica reads the same trainer pages: the trainers
write nothing per replica, and no rank forwards. Across hosts a rollout reads a trainer of
another host with UCX gets into a landing buffer, a group of tensors at a time, and copies from
there the same way.

Versions are atomic: nothing is written into a rollout tensor before every rank has entered the
call with the same version and names and checked the whole plan (the commit point), and what a
rollout reads after it lies in pages that outlive a trainer that dies. So a failure before the
commit point leaves the previous version bit for bit, and one after it the new version whole;
``reading()`` keeps an inference thread's step on one version. Design, costs and limits:
docs/weights.md.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import math
import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .backend import HostPeers

__all__ = ["WeightChannel", "ParameterServer", "Replicate", "Shard", "FlatShard", "ParamMeta", "quantize_rows"]


# ---- shard specs -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Replicate:
    """The rank holds the whole tensor."""


@dataclass(frozen=True)
class Shard:
    """Chunk ``index`` of ``count`` along ``dim``, chunk sizes as ``torch.chunk`` gives them."""
    dim: int
    index: int
    count: int


@dataclass(frozen=True)
class FlatShard:
    """Elements ``offset .. offset + numel - 1`` of the row-major flattened tensor."""
    offset: int
    numel: int


@dataclass(frozen=True)
class ParamMeta:
    """One registration as every rank sees it: ``shape`` is the whole tensor's, ``local_shape``
    the registering rank's part; ``quant`` is "int8", "fp8" or None (rollout tensors only)."""
    name: str
    rank: int
    role: str
    shape: tuple
    dtype: torch.dtype
    shard: object
    local_shape: tuple
    quant: str | None = None


def _chunk_bounds(size: int, count: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` as torch.chunk splits ``size`` into ``count``."""
    step = -(-size // count) if size else 0
    start = min(step * index, size)
    return start, min(start + step, size)


# A box is (starts, extents) in the whole tensor's index space.
def _spec_boxes(shape: tuple, spec) -> list[tuple[tuple, tuple]]:
    """The boxes a spec holds, in the order its local tensor stores them (a FlatShard's are
    consecutive row-major runs, each contiguous and row-major inside itself)."""
    if isinstance(spec, Replicate):
        return [((0,) * len(shape), tuple(shape))]
    if isinstance(spec, Shard):
        a, b = _chunk_bounds(shape[spec.dim], spec.count, spec.index)
        starts = tuple(a if d == spec.dim else 0 for d in range(len(shape)))
        ext = tuple(b - a if d == spec.dim else s for d, s in enumerate(shape))
        return [(starts, ext)]
    return _flat_boxes(shape, spec.offset, spec.offset + spec.numel)


def _flat_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Splits the flat range [lo, hi) of a row-major ``shape`` into boxes of the form
    (fixed leading indices, a range on one dim, full trailing dims)."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    out = []
    first, last = lo // inner, (hi - 1) // inner
    if lo % inner or first == last:
        # A partial first row (or everything inside one row): recurse into that row.
        row_hi = min(hi, (first + 1) * inner)
        for s, e in _flat_boxes(shape[1:], lo - first * inner, row_hi - first * inner):
            out.append(((first,) + s, (1,) + e))
        lo, first = row_hi, first + 1
    if lo >= hi:
        return out
    full_last = hi // inner  # rows [first, full_last) are whole
    if full_last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (full_last - first,) + tuple(shape[1:])))
    if hi > full_last * inner:
        for s, e in _flat_boxes(shape[1:], 0, hi - full_last * inner):
            out.append(((full_last,) + s, (1,) + e))
    return out


def _intersect(a, b):
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    stops = tuple(min(x + m, y + n) for x, m, y, n in zip(a[0], a[1], b[0], b[1]))
    if any(e <= s for s, e in zip(starts, stops)):
        return None
    return starts, tuple(e - s for s, e in zip(starts, stops))


def _volume(box) -> int:
    return math.prod(box[1])


def _local_shape(shape: tuple, spec) -> tuple:
    if isinstance(spec, FlatShard):
        return (spec.numel,)
    return _spec_boxes(shape, spec)[0][1]


def _box_views(local: torch.Tensor, shape: tuple, spec):
    """[(box, view of local holding it)] for a spec's boxes."""
    boxes = _spec_boxes(shape, spec)
    if not isinstance(spec, FlatShard):
        return [(boxes[0], local)]
    flat, out, at = local.view(-1), [], 0
    for box in boxes:
        n = _volume(box)
        out.append((box, flat[at:at + n].view(box[1])))
        at += n
    return out


def _narrow(view: torch.Tensor, outer, inner) -> torch.Tensor:
    """The part of ``view`` (holding box ``outer``) that holds box ``inner``."""
    for d, (s, n) in enumerate(zip(inner[0], inner[1])):
        if n != outer[1][d]:
            view = view.narrow(d, s - outer[0][d], n)
    return view


# ---- dtypes ------------------------------------------------------------------------------------

_QUANT = {torch.int8: ("int8", 127.0), torch.float8_e4m3fn: ("fp8", 448.0)}


def _castable(src: torch.dtype, dst: torch.dtype, quant: str | None) -> bool:
    if quant is not None:
        return src.is_floating_point
    if src.is_floating_point and dst.is_floating_point:
        return True
    return src == dst  # integers, bool and complex move only as themselves


def quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (dim 0) symmetric quantization as ``update`` does it: ``scale = amax(|row|) /
    qmax`` (1/qmax for an all-zero row), ``q = round(row / scale)`` for int8 (clamped to
    [-127, 127]) or ``row / scale`` cast for float8_e4m3fn. Returns (q, scale float32)."""
    kind, qmax = _QUANT[dtype]
    w = w.float()
    rows = w.reshape(w.shape[0], -1) if w.dim() else w.reshape(1, 1)
    amax = rows.abs().amax(dim=1) if rows.shape[1] else torch.zeros(rows.shape[0])
    scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / qmax
    x = rows / scale[:, None]
    q = x.round().clamp_(-qmax, qmax).to(dtype) if kind == "int8" else x.to(dtype)
    return q.view(w.shape), scale


# ---- the channel -------------------------------------------------------------------------------

class _ReadWriteLock:
    """Many readers (inference steps) or one writer (the copy phase of update)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def read(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def write(self, timeout_s: float):
        end = time.monotonic() + timeout_s
        with self._cond:
            while self._writer or self._readers:
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"an inference step held reading() for longer than {timeout_s:.1f} s")
                self._cond.wait(left)
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


@dataclass
class _Entry:
    meta: ParamMeta
    tensor: torch.Tensor          # what the caller registered (trainer: heap-resident unless staged)
    source: torch.Tensor | None   # trainer: the contiguous heap tensor peers read
    offset: int                   # trainer: its arena offset (-1 when empty)
    scale: torch.Tensor | None = None


class _Step:
    """One planned write into a rollout tensor: ``dst.copy_(src)``, or for a quantized tensor
    (``buckets`` set) per bucket of rows: gather the rows' values into fp32 scratch from their
    sources, then write the quantized rows into ``dst`` and their scales into ``scale``."""
    __slots__ = ("dst", "src", "scale", "buckets")

    def __init__(self, dst, src=None, scale=None, buckets=None):
        self.dst, self.src, self.scale, self.buckets = dst, src, scale, buckets


class WeightChannel:
    """A trainer -> rollout weight channel over the cam group ``group`` (default: world).

    Collective: every rank of the group calls it with the same ``trainers`` (group ranks) and
    ``replicas`` (a list of lists of group ranks), which together must name every rank once.
    A rollout's copy runs in buckets of at most ``bucket_bytes`` (a large tensor is cut along its
    outer dims; a quantized one gathers, scales and writes that many bytes of fp32 rows at a
    time), spread over ``copy_threads`` threads (default: this host's cores shared among the
    rollout ranks, at least 1, at most the cores this process may run on: the trainers wait
    without spinning while the rollouts copy, so their cores are free)."""

    def __init__(self, group=None, *, trainers, replicas, bucket_bytes: int = 64 << 20,
                 copy_threads: int | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # This host's heap (the group's own on one host): trainers' tensors live there, and
        # rollouts read same-host trainers' pages through it. Ranks of other hosts are read
        # over UCX (self._link): their pages land in a buffer, a group of tensors at a time.
        peers = HostPeers(self.group, f"torch_cam WeightChannel on rank {self.rank}")
        self._backend, self._local_of = peers.backend, peers.near
        self._remote = {}  # while planning: id of a placeholder of another host's pages -> (trainer, meta)
        local_error = None
        try:
            trainers = [int(r) for r in trainers]
            replicas = [[int(r) for r in rep] for rep in replicas]
            bucket_bytes = int(bucket_bytes)
            named = trainers + [r for rep in replicas for r in rep]
            if sorted(named) != list(range(self.world)):
                raise ValueError(f"trainers {trainers} and replicas {replicas} must name every rank of the "
                                 f"group (0..{self.world - 1}) exactly once")
            if not trainers or not replicas or any(not rep for rep in replicas):
                raise ValueError("a weight channel needs at least one trainer and one non-empty replica")
            if bucket_bytes < 4096:
                raise ValueError(f"bucket_bytes must be at least 4096, got {bucket_bytes}")
            if copy_threads is not None and (isinstance(copy_threads, bool) or int(copy_threads) < 1):
                raise ValueError(f"copy_threads must be a positive int or None, got {copy_threads!r}")
        except (TypeError, ValueError) as e:
            local_error = f"{type(e).__name__}: {e}"
        args = (trainers, replicas, bucket_bytes, local_error)
        everyone = [None] * self.world
        dist.all_gather_object(everyone, args, group=self.group)
        for r, a in enumerate(everyone):
            if a[3] is not None:
                raise ValueError(f"WeightChannel on rank {self.rank}: rank {r}: {a[3]}")
        for r, a in enumerate(everyone):
            if a[:3] != everyone[0][:3]:
                raise ValueError(f"WeightChannel on rank {self.rank}: rank {r} passed trainers={a[0]}, "
                                 f"replicas={a[1]}, bucket_bytes={a[2]}; rank 0 passed trainers="
                                 f"{everyone[0][0]}, replicas={everyone[0][1]}, bucket_bytes={everyone[0][2]}")
        self.trainers, self.replicas, self.bucket_bytes = trainers, replicas, bucket_bytes
        self._link = peers.link("weight channel", self._backend.timeout_s)
        self.role = "trainer" if self.rank in trainers else "rollout"
        self.replica = next((i for i, rep in enumerate(replicas) if self.rank in rep), None)
        self._entries: dict[str, _Entry] = {}
        self._staged: set[str] = set()   # trainer names registered with stage=True
        self._epoch = 0                  # bumped by every (un)registration
        # rank -> (epoch, {name: ParamMeta}, {name: arena offset}) as that rank last sent them
        self._peer_meta: dict[int, tuple[int, dict, dict]] = {}
        self._plans: dict = {}
        self._version = None     # what this rank's tensors hold
        self._committed = None   # the last version every rank committed to (the same on all)
        self._lock = _ReadWriteLock()
        rollouts = sum(len(rep) for rep in replicas)
        self.copy_threads = int(copy_threads) if copy_threads is not None else max(
            1, min(len(os.sched_getaffinity(0)), (os.cpu_count() or 1) // rollouts))
        self._pool = None

    # -- registration (local) --

    def register(self, name: str, tensor: torch.Tensor, shard=None, *, shape=None, scale=None,
                 stage: bool = False) -> torch.Tensor:
        """Registers ``tensor`` (a CPU tensor) under ``name``; ``shard`` (default Replicate())
        says which part of the whole tensor it holds; ``shape`` is the whole tensor's shape
        (needed for a FlatShard; otherwise implied by the spec).

        Trainer: unless the tensor already lives in the group's tensor heap, its storage moves
        there (``tensor.data`` is replaced by a heap copy with the same values and shape, made
        contiguous), so the object an optimizer holds keeps working and peers read it in place.
        A tensor whose storage others share (a view, a tensor with views, a parameter's ``.data``)
        cannot move without cutting it off from them and is refused: register the owner, or pass
        ``stage=True`` to keep a heap copy refreshed at every publish instead. Rollout: the tensor stays where it is and is written in place;
        ``scale`` (float32, one per row of dim 0) makes an int8 or float8_e4m3fn tensor take
        per-row quantized values. Returns the registered tensor."""
        spec = Replicate() if shard is None else shard
        if not isinstance(name, str) or not name:
            raise TypeError(f"register: name must be a non-empty str, got {name!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.is_sparse:
            raise TypeError(f"register({name!r}): expected a dense CPU tensor, got "
                            f"{type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else tensor.device}")
        if not isinstance(spec, (Replicate, Shard, FlatShard)):
            raise TypeError(f"register({name!r}): shard must be Replicate(), Shard(dim, index, count) or "
                            f"FlatShard(offset, numel), got {spec!r}")
        full = self._whole_shape(name, tensor, spec, shape)
        quant = None
        if scale is not None:
            if self.role != "rollout":
                raise ValueError(f"register({name!r}): scale= is for rollout tensors (quantized targets)")
            if tensor.dtype not in _QUANT:
                raise TypeError(f"register({name!r}): a tensor with scales must be int8 or float8_e4m3fn, "
                                f"got {tensor.dtype}")
            if isinstance(spec, FlatShard) or tensor.dim() == 0:
                raise ValueError(f"register({name!r}): quantized tensors take per-row scales, so they need "
                                 f"a Replicate or Shard spec and at least one dim")
            got = (f"{scale.dtype} {scale.device} tensor of {scale.numel()} elements"
                   if isinstance(scale, torch.Tensor) else type(scale).__name__)
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or \
                    scale.numel() != tensor.shape[0] or scale.device.type != "cpu":
                raise ValueError(f"register({name!r}): scale must be a CPU float32 tensor of {tensor.shape[0]} "
                                 f"elements (one per row), got a {got}")
            try:
                scale = scale.view(-1)  # (rows,) or (rows, 1): written through a 1-d view
            except RuntimeError as e:
                raise ValueError(f"register({name!r}): scale must be viewable as one dim (its rows are "
                                 f"written in place): {e}") from e
            quant = _QUANT[tensor.dtype][0]
        if isinstance(spec, FlatShard) and not tensor.is_contiguous():
            raise ValueError(f"register({name!r}): a FlatShard tensor must be contiguous")
        meta = ParamMeta(name, self.rank, self.role, full, tensor.dtype, spec, tuple(tensor.shape), quant)
        source, offset = None, -1
        if self.role == "trainer":
            tensor, source = self._heap_source(name, tensor, stage)
            offset = self._backend.arena_offset(source) if source.numel() else -1
        self._entries[name] = _Entry(meta, tensor, source, offset, scale)
        self._staged.discard(name)
        if source is not None and source is not tensor:
            self._staged.add(name)
        self._epoch += 1
        return tensor

    def unregister(self, name: str) -> None:
        del self._entries[name]
        self._staged.discard(name)
        self._epoch += 1

    def _whole_shape(self, name, tensor, spec, shape):
        local = tuple(tensor.shape)
        if isinstance(spec, FlatShard):
            if shape is None:
                raise ValueError(f"register({name!r}): a FlatShard needs shape= (the whole tensor's shape)")
            full = tuple(int(s) for s in shape)
            n = math.prod(full)
            if spec.offset < 0 or spec.numel < 0 or spec.offset + spec.numel > n or tensor.numel() != spec.numel:
                raise ValueError(f"register({name!r}): FlatShard({spec.offset}, {spec.numel}) of a tensor of "
                                 f"{n} elements held in a tensor of {tensor.numel()} elements")
            return full
        if isinstance(spec, Replicate):
            full = local if shape is None else tuple(int(s) for s in shape)
        else:
            if not 0 <= spec.dim < tensor.dim() or not 0 <= spec.index < spec.count:
                raise ValueError(f"register({name!r}): {spec} does not fit a tensor of {tensor.dim()} dims")
            full = tuple(int(s) for s in shape) if shape is not None else None
            if full is None:
                # Chunks are equal except possibly the last; only an equal split is implied.
                full = tuple(s * spec.count if d == spec.dim else s for d, s in enumerate(local))
        if _local_shape(full, spec) != local:
            raise ValueError(f"register({name!r}): {spec} of a tensor of shape {list(full)} has shape "
                             f"{list(_local_shape(full, spec))}, got {list(local)}")
        return full

    def _heap_source(self, name, tensor, stage):
        if self._backend.owns(tensor) and tensor.is_contiguous() and not stage:
            return tensor, tensor
        if not stage and not _sole_owner(tensor) and tensor.numel():
            raise ValueError(f"register({name!r}): the tensor shares its storage (it is a view, has views, or is "
                             f"the .data of a parameter), so moving that storage into the heap would cut it off "
                             f"from what it aliases; register the tensor that owns the storage (the parameter "
                             f"itself), or pass stage=True (a heap copy refreshed at every publish)")
        try:
            heap = self._backend.empty(list(tensor.shape), tensor.dtype)
        except RuntimeError as e:
            raise RuntimeError(f"register({name!r}): {tensor.nbytes} bytes do not fit the group's tensor heap "
                               f"(raise the group's tensor_heap_bytes option): {e}") from e
        with torch.no_grad():
            heap.copy_(tensor)
            if stage:
                return tensor, heap
            tensor.data = heap  # the caller's object now reads and writes the heap pages
        return tensor, tensor

    # -- metadata --

    def _my_meta(self) -> tuple[dict, dict]:
        return ({n: e.meta for n, e in self._entries.items()},
                {n: e.offset for n, e in self._entries.items()})

    def gather_metas(self) -> list[ParamMeta]:
        """Collective: every rank's registrations, as every rank sees them."""
        self._exchange("gather_metas", None, None)
        return [m for r in range(self.world) for m in self._peer_meta[r][1].values()]

    def _exchange(self, op, version, names, local_error=None):
        """What every rank brings to a call: [(op, role, version, names, epoch, registrations or
        None, error or None)] per rank. A fixed-size header goes first (one small all_gather);
        only when some rank has news (new registrations, an error, other names) do the full
        messages follow, so a steady-state update costs one header exchange. Every rank decides
        alike: each holds the same record of what every rank last sent."""
        head = torch.tensor([_OPS.index(op), _ROLES.index(self.role), _int64(version), _digest(names),
                             self._epoch, local_error is not None], dtype=torch.int64)
        heads = [torch.empty_like(head) for _ in range(self.world)]
        dist.all_gather(heads, head, group=self.group)
        rows = [h.tolist() for h in heads]
        known = [self._peer_meta.get(r, (None,))[0] for r in range(self.world)]
        news = any(h[5] or h[4] != known[r] or h[3] != rows[0][3] for r, h in enumerate(rows))
        if not news:
            return [(_OPS[h[0]], _ROLES[h[1]], None if h[2] == _NONE else h[2], names, h[4], None, None)
                    for h in rows]
        sent = self._peer_meta.get(self.rank)
        mine = self._my_meta() if sent is None or sent[0] != self._epoch else None
        msg = (op, self.role, version, names, self._epoch, mine, local_error)
        everyone = [None] * self.world
        dist.all_gather_object(everyone, msg, group=self.group)
        for r, m in enumerate(everyone):
            if m[5] is not None or r not in self._peer_meta:
                self._peer_meta[r] = (m[4],) + (m[5] or ({}, {}))
        return everyone

    # -- publish / update --

    @property
    def version(self):
        """The version this rank's tensors hold (None before the first update)."""
        return self._version

    def reading(self):
        """Context manager for an inference step in another thread: inside it, no update
        writes into the registered tensors, so the step sees one version wholly."""
        return self._lock.read()

    def publish(self, version: int, names=None) -> None:
        """Trainers: makes ``version`` of the registered tensors (or of ``names``) available and
        returns once every rollout has taken it. Collective with the rollouts' ``update``."""
        self._call("publish", version, names)

    def update(self, version: int, names=None) -> None:
        """Rollouts: writes ``version`` (all registered names, or ``names``) into this rank's
        registered tensors in place. Collective with the trainers' ``publish``."""
        self._call("update", version, names)

    def _call(self, op, version, names, refusal=None):
        """publish/update; ``refusal`` is a local error found by a caller above (the adapter),
        sent to every rank like the ones found here."""
        local_error = refusal
        try:
            expected = "publish" if self.role == "trainer" else "update"
            if op != expected:
                raise RuntimeError(f"{op} called on a {self.role} rank (trainers publish, rollouts update)")
            if isinstance(version, bool) or not isinstance(version, int):
                raise TypeError(f"version must be an int, got {type(version).__name__}")
            if not _NONE < version < (1 << 63):
                raise ValueError(f"version must fit in int64, got {version}")
            if names is not None:
                names = tuple(sorted(set(names)))
                missing = [n for n in names if n not in self._entries]
                if missing:
                    raise KeyError(f"names not registered on this rank: {missing[:5]}")
            if self.role == "trainer" and local_error is None:
                self._refresh_staged(names)
        except Exception as e:  # every rank must hear of it, so none may leave before the exchange
            local_error = f"{type(e).__name__}: {e}"
        if local_error is not None:
            names = None
        try:
            everyone = self._exchange(op, version, names, local_error)
        except RuntimeError as e:  # a peer or the group failed before the commit point
            held = "no version yet" if self._version is None else f"version {self._version}"
            raise RuntimeError(f"weights {op} of version {version} on rank {self.rank}: {e} (before the commit "
                               f"point: this rank still holds {held})") from e
        plan = self._check_and_plan(op, version, everyone)
        # Commit point: every rank agreed and the plan checked out everywhere.
        self._committed = version
        failure = self._apply(plan, version) if self.role == "rollout" else None
        if self.role == "trainer":
            self._version = version
        self._close(op, version, failure)

    def _apply(self, plan, version):
        """Rollout: writes the plan under the write lock; returns the error to report, if any."""
        held = "no version yet" if self._version is None else f"version {self._version}"
        where = f"weights update of version {version} on rank {self.rank}"
        try:
            # Half the group's timeout: the peers, waiting in _close, must still hear of it.
            with self._lock.write(self._backend.timeout_s / 2):
                try:
                    self._run(plan)
                except Exception as e:
                    return RuntimeError(f"{where}: {type(e).__name__}: {e} (the copy stopped part way: this "
                                        f"rank's tensors may hold parts of {held} and of version {version})")
                self._version = version
        except TimeoutError as e:
            return TimeoutError(f"{where}: {e} (half the group's timeout); this rank still holds {held}")
        return None

    def _close(self, op, version, failure):
        """The call's last exchange: whether every rollout applied the version (trainers keep
        their tensors still until then). A rollout whose copy failed re-raises its error; every
        other rank raises naming it."""
        flag = torch.tensor([failure is not None], dtype=torch.int64)
        flags = [torch.empty_like(flag) for _ in range(self.world)]
        try:
            dist.all_gather(flags, flag, group=self.group)
            bad = [r for r, f in enumerate(flags) if f.item()]
            texts = [None] * self.world
            if bad:
                dist.all_gather_object(texts, None if failure is None else str(failure), group=self.group)
        except Exception as e:
            state = (f"this rank's tensors hold version {version} complete" if self.role == "rollout"
                     and failure is None else "a rollout that finished its copy holds the new version complete, "
                     "one that did not the previous one")
            raise RuntimeError(f"weights {op} of version {version} on rank {self.rank}: a peer failed after "
                               f"the commit point ({state}): {e}") from e
        if failure is not None:
            raise failure
        if bad:
            mine = "; this rank applied it" if self.role == "rollout" else ""
            raise RuntimeError(f"weights {op} of version {version} on rank {self.rank}: rollout rank(s) {bad} did "
                               f"not apply it: {texts[bad[0]]}{mine}")

    def _run(self, plan):
        """Runs the plan: the copies from this host's pages, then each group of copies from
        other hosts' pages once its bytes have landed (one landing buffer, reused)."""
        self._run_parts(plan.local)
        for reads, parts in plan.remote:
            self._link.read(reads, f"weights update on rank {self.rank}")
            self._run_parts(parts)

    def _run_parts(self, parts):
        """Runs parts (one per copy thread) side by side."""
        if len(parts) <= 1:
            return _run(parts[0]) if parts else None
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.copy_threads, "torch_cam-weights")
        for f in [self._pool.submit(_run, part) for part in parts]:
            f.result()  # tensor copies release the GIL, so the parts run side by side

    def _refresh_staged(self, names):
        wanted = None if names is None else set(names)
        for n in self._staged:
            if wanted is None or n in wanted:
                e = self._entries[n]
                with torch.no_grad():
                    e.source.copy_(e.tensor)

    def _fail(self, op, version, msg, exc=ValueError):
        raise exc(f"weights {op} of version {version} on rank {self.rank}: {msg}")

    def _check_and_plan(self, op, version, everyone):
        for r, m in enumerate(everyone):
            if m[6] is not None:
                self._fail(op, version, f"rank {r} ({m[1]}) refused: {m[6]}")
        for r, m in enumerate(everyone):
            want = "publish" if m[1] == "trainer" else "update"
            if m[0] != want:
                self._fail(op, version, f"rank {r} is a {m[1]} rank and called {m[0]}; the call every rank makes "
                           f"together is publish on trainers and update on rollouts")
        for r, m in enumerate(everyone):
            if m[2] != version:
                self._fail(op, version, f"rank {r} passed version {m[2]}, this rank {version}")
            if m[3] != everyone[self.rank][3]:
                self._fail(op, version, f"rank {r} asked for names {_short(m[3])}, this rank for "
                           f"{_short(everyone[self.rank][3])}")
        if self._committed is not None and version <= self._committed:
            self._fail(op, version, f"versions must increase; the channel committed to version {self._committed}")
        names = everyone[self.rank][3]
        key = (tuple(self._peer_meta[r][0] for r in range(self.world)), names)
        plan = self._plans.get(key)
        if plan is None:
            with torch.no_grad():  # views of parameters, written in place later
                plan = self._assemble(self._plan(op, version, names))
            self._plans = {key: plan}  # one cached plan: registrations or names changed otherwise
        return plan

    def _plan(self, op, version, names):
        """[steps of one rollout name] for every name this rank takes."""
        self._remote = {}
        metas = {r: self._peer_meta[r][1] for r in range(self.world)}
        rollouts = [r for rep in self.replicas for r in rep]
        every = set()
        for r in range(self.world):
            every |= set(metas[r])
        todo = sorted(every) if names is None else list(names)
        steps = []
        for name in todo:
            srcs = [metas[t][name] for t in self.trainers if name in metas[t]]
            if not srcs:
                self._fail(op, version, f"{name!r} is registered on no trainer rank", KeyError)
            for r in rollouts:
                if name not in metas[r]:
                    self._fail(op, version, f"{name!r} is registered on trainer rank {srcs[0].rank} but not on "
                               f"rollout rank {r} (replica {self._replica_of(r)})", KeyError)
            for m in [metas[r][name] for r in rollouts] + srcs:
                if m.shape != srcs[0].shape:
                    self._fail(op, version, f"{name!r} has whole shape {list(m.shape)} on rank {m.rank} and "
                               f"{list(srcs[0].shape)} on trainer rank {srcs[0].rank}: it cannot be resharded")
            for m in srcs:
                if m.dtype != srcs[0].dtype:
                    self._fail(op, version, f"{name!r} is {m.dtype} on trainer rank {m.rank} and {srcs[0].dtype} "
                               f"on trainer rank {srcs[0].rank}", TypeError)
            pieces = self._source_boxes(op, version, name, srcs)
            for r in rollouts:
                d = metas[r][name]
                if not _castable(srcs[0].dtype, d.dtype, d.quant):
                    self._fail(op, version, f"{name!r} is {srcs[0].dtype} on the trainers and {d.dtype}"
                               f"{' (quantized)' if d.quant else ''} on rollout rank {r}: no cast between them "
                               f"(floats cast to floats, or to int8/float8_e4m3fn with scale=; others move only "
                               f"as themselves)", TypeError)
                if r == self.rank:
                    steps.append(self._rollout_steps(name, d, pieces))
        return steps

    def _assemble(self, steps_by_name):
        """The plan from each rollout name's steps. Steps that read only this host's pages run
        first; the others are grouped (names in order, about bucket_bytes of remote bytes a
        group, a larger tensor alone), and each group's remote bytes are fetched into the
        landing buffer, which the group's steps then read: the span each trainer's part covers,
        so a rollout holds at most one group of another host's weights at a time."""
        local, groups = [], []
        for steps in steps_by_name:
            spans = {}  # trainer -> [lo, hi) elements of its registration these steps read
            for s in steps:
                for v in _sources(s):
                    if v.device.type != "meta" or v.numel() == 0:
                        continue
                    t, sm = self._remote[id(v if v._base is None else v._base)]
                    lo, hi = _extent(v)
                    a, b, _ = spans.get((t, sm.name), (lo, hi, sm))
                    spans[(t, sm.name)] = (min(a, lo), max(b, hi), sm)
            if not spans:
                local.extend(steps)
                continue
            nbytes = sum(_aligned((hi - lo) * sm.dtype.itemsize) for lo, hi, sm in spans.values())
            if groups and groups[-1][2] + nbytes <= self.bucket_bytes:
                groups[-1][0].extend(steps)
                groups[-1][1].update(spans)
                groups[-1][2] += nbytes
            else:
                groups.append([list(steps), dict(spans), nbytes])
        most = max((g[2] for g in groups), default=0)
        landing = torch.empty(most, dtype=torch.uint8) if most else None
        remote = []
        for steps, spans, _ in groups:
            reads, land, at = [], {}, 0
            for (t, name), (lo, hi, sm) in sorted(spans.items()):
                n = (hi - lo) * sm.dtype.itemsize
                slot = landing[at:at + n]
                reads.append((t, self._peer_meta[t][2][name] + lo * sm.dtype.itemsize, slot))
                land[(t, name)] = (slot.view(sm.dtype), lo)
                at += _aligned(n)

            def landed(v, land=land):
                if v.device.type != "meta":
                    return v
                t, sm = self._remote[id(v if v._base is None else v._base)]
                buf, lo = land[(t, sm.name)]
                return buf.as_strided(v.shape, v.stride(), buf.storage_offset() + v.storage_offset() - lo)
            for s in steps:
                _map_sources(s, landed)
            remote.append((reads, _balance(steps, self.copy_threads)))
        self._remote = {}  # every placeholder view is replaced
        return _Plan(_balance(local, self.copy_threads), remote, landing)

    def _replica_of(self, r):
        return next(i for i, rep in enumerate(self.replicas) if r in rep)

    def _source_boxes(self, op, version, name, srcs):
        """[(trainer rank, box, ParamMeta)] that tile the whole tensor once; a replicated name is
        read from one trainer per replica (spread over the trainers that hold it)."""
        shape = srcs[0].shape
        total = math.prod(shape)
        reps = [m for m in srcs if isinstance(m.shard, Replicate)]
        if reps:
            if len(reps) != len(srcs):
                self._fail(op, version, f"{name!r} is replicated on some trainer ranks and sharded on others")
            near = [m for m in reps if self._local_of[m.rank] >= 0]  # same host: no bytes cross a link
            m = (near or reps)[(self.replica or 0) % len(near or reps)]
            return [(m.rank, b, m) for b in _spec_boxes(shape, m.shard)]
        boxes = [(m.rank, b, m) for m in srcs for b in _spec_boxes(shape, m.shard)]
        covered = sum(_volume(b) for _, b, _ in boxes)
        overlap = any(_intersect(boxes[i][1], boxes[j][1]) for i in range(len(boxes))
                      for j in range(i + 1, len(boxes)))
        if covered != total or overlap:
            specs = ", ".join(f"rank {m.rank}: {m.shard}" for m in srcs)
            self._fail(op, version, f"the trainers' shards of {name!r} ({specs}) "
                       f"{'overlap' if overlap else f'cover {covered} of its {total} elements'}; they must "
                       f"tile the whole tensor once")
        return boxes

    def _rollout_steps(self, name, d, pieces):
        e = self._entries[name]
        dst_views = _box_views(e.tensor, d.shape, d.shard)
        parts = []  # (dst box, dst view, src trainer, src box, src meta)
        for dbox, dview in dst_views:
            for t, sbox, sm in pieces:
                ib = _intersect(dbox, sbox)
                if ib is not None:
                    parts.append((ib, _narrow(dview, dbox, ib), t, sbox, sm))
        views = {}
        for _, _, t, _, sm in parts:
            if (t, sm.name) not in views:
                views[(t, sm.name)] = self._peer_boxes(t, sm)
        def src_of(ib, t, sbox):
            sview = views[(t, name)][sbox]
            return _narrow(sview, sbox, ib)
        if d.quant is None:
            return [b for ib, dv, t, sbox, _ in parts for b in _buckets(dv, src_of(ib, t, sbox), self.bucket_bytes)]
        return [self._quant_step(e, d, parts, src_of)]

    def _peer_boxes(self, t, sm):
        """{box: view of trainer t's heap pages holding it} for trainer registration sm. For a
        trainer on another host the views are of a placeholder (a meta tensor of its shape) that
        _assemble points into the landing buffer."""
        if self._local_of[t] < 0:
            raw = torch.empty(sm.local_shape, dtype=sm.dtype, device="meta")
            self._remote[id(raw)] = (t, sm)  # its views keep it (their _base) alive, so the id stays its own
        else:
            raw = self._backend.peer_arena_view(self._local_of[t], self._peer_meta[t][2][sm.name],
                                                math.prod(sm.local_shape) * sm.dtype.itemsize)
            raw = raw.view(sm.dtype).view(sm.local_shape)
        return dict(_box_views(raw, sm.shape, sm.shard))

    def _quant_step(self, e, d, parts, src_of):
        """Row buckets of at most bucket_bytes of fp32 scratch: gather the rows' values from the
        trainers, scale per row, write q and scale."""
        local = e.tensor
        lrows = local.shape[0]
        row_elems = max(1, math.prod(local.shape[1:]))
        per = max(1, self.bucket_bytes // (4 * row_elems))
        dbox = _spec_boxes(d.shape, d.shard)[0]
        buckets = []
        for r0 in range(0, lrows, per):
            r1 = min(lrows, r0 + per)
            rows_box = ((dbox[0][0] + r0,) + dbox[0][1:], (r1 - r0,) + dbox[1][1:])
            srcs = []
            for ib, _, t, sbox, _ in parts:
                jb = _intersect(ib, rows_box)
                if jb is not None:
                    srcs.append((jb, src_of(jb, t, sbox)))
            buckets.append((r0, r1, rows_box, srcs))
        return _Step(local, scale=e.scale, buckets=buckets)


_OPS = ("publish", "update", "gather_metas")
_ROLES = ("trainer", "rollout")
_NONE = -(1 << 63)


def _int64(version) -> int:
    if version is None:
        return _NONE
    return version if isinstance(version, int) and _NONE < version < (1 << 63) else 0


def _digest(names) -> int:
    if names is None:
        return 0
    h = hashlib.blake2b("\0".join(names).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True) or 1


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` alone holds its storage, all of it: then replacing ``t.data`` moves every
    use of those bytes. (Views, ``.data`` aliases and tensors with views hold more references.)"""
    if t._base is not None or t.storage_offset() != 0 or not t.is_contiguous() \
            or t.untyped_storage().nbytes() != t.nbytes:
        return False
    # Two references: t's own and the temporary one untyped_storage() returns.
    return _use_count is None or _use_count(t.untyped_storage()._cdata) <= 2


def _short(names):
    if names is None:
        return "all"
    return f"{list(names[:4])}{' ...' if len(names) > 4 else ''} ({len(names)})"


def _buckets(dst, src, limit):
    """Plain copy steps of at most ``limit`` bytes (on the wider side) for dst.copy_(src), cut
    along the outermost dims."""
    nbytes = dst.numel() * max(dst.element_size(), src.element_size())
    if nbytes <= limit or dst.dim() == 0:
        return [_Step(dst, src)]
    d = next((i for i in range(dst.dim()) if dst.shape[i] > 1), None)
    if d is None:
        return [_Step(dst, src)]
    per_slice = nbytes // dst.shape[d]
    if per_slice > limit:  # one slice is still too large: cut inside each slice
        return [b for i in range(dst.shape[d]) for b in _buckets(dst.select(d, i), src.select(d, i), limit)]
    n = max(1, limit // per_slice)
    return [_Step(dst.narrow(d, i, min(n, dst.shape[d] - i)), src.narrow(d, i, min(n, dst.shape[d] - i)))
            for i in range(0, dst.shape[d], n)]


def _step_bytes(s):
    return s.dst.numel() * s.dst.element_size()


def _sources(step):
    """The source views a step reads."""
    if step.buckets is None:
        return [step.src]
    return [src for _, _, _, srcs in step.buckets for _, src in srcs]


def _map_sources(step, fn):
    """Replaces every source view of step by fn(view)."""
    if step.buckets is None:
        step.src = fn(step.src)
        return
    step.buckets = [(r0, r1, box, [(jb, fn(src)) for jb, src in srcs]) for r0, r1, box, srcs in step.buckets]


def _extent(v):
    """[lo, hi) storage elements a non-empty view spans."""
    lo = v.storage_offset()
    return lo, lo + 1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride()))


def _aligned(nbytes, to=64):
    return (nbytes + to - 1) // to * to


@dataclasses.dataclass
class _Plan:
    local: list          # parts reading this host's pages
    remote: list         # [(reads [(trainer, arena offset, landing slice)], parts)], run in order
    landing: torch.Tensor | None  # the buffer the remote parts read (kept alive with them)


class _Part:
    """The steps one copy thread runs: copies without a cast as one ``torch._foreach_copy_``
    (one call into ATen for all of them: about 1 us less per tensor than a Python loop), the
    rest (casts, which foreach copies do slowly, and quantized tensors) one by one."""
    __slots__ = ("dsts", "srcs", "rest")

    def __init__(self, steps):
        self.dsts, self.srcs, self.rest = [], [], []
        for s in steps:
            if s.buckets is None and s.dst.dtype == s.src.dtype:
                self.dsts.append(s.dst)
                self.srcs.append(s.src)
            else:
                self.rest.append(s)


def _balance(plan, k):
    """k parts of about equal bytes (largest step first onto the lightest part)."""
    lists, load = [[] for _ in range(k)], [0] * k
    for s in sorted(plan, key=_step_bytes, reverse=True):
        i = load.index(min(load))
        lists[i].append(s)
        load[i] += _step_bytes(s)
    return [_Part(lst) for lst in lists if lst]


_foreach_copy = getattr(torch, "_foreach_copy_", None)


@torch.no_grad()  # rollout tensors may be parameters that require grad (per thread: no_grad is)
def _run(part):
    if part.dsts:
        if _foreach_copy is not None:
            _foreach_copy(part.dsts, part.srcs)
        else:
            for d, src in zip(part.dsts, part.srcs):
                d.copy_(src)
    for s in part.rest:
        if s.buckets is None:
            s.dst.copy_(s.src)
            continue
        for r0, r1, rows_box, srcs in s.buckets:
            scratch = torch.empty(rows_box[1], dtype=torch.float32)
            for jb, src in srcs:
                _narrow(scratch, rows_box, jb).copy_(src)
            q, scale = quantize_rows(scratch, s.dst.dtype)
            s.dst[r0:r1].copy_(q)
            s.scale[r0:r1].copy_(scale)


# ---- the shape RL frameworks call --------------------------------------------------------------

class ParameterServer:
    """checkpoint-engine's ``ParameterServer`` calls over a WeightChannel: ``register_checkpoint``,
    ``gather_metas``, ``update``, ``unregister_checkpoint``. Unlike checkpoint-engine, both sides
    register: trainers their state, rollouts the tensors their engine serves from (so the update
    lands in place and no IPC buffer or ``load_weights`` pass is needed). Names are kept per
    checkpoint (``"<checkpoint>/<name>"`` on the channel)."""

    def __init__(self, group=None, *, trainers, replicas, **channel_options):
        self.channel = WeightChannel(group, trainers=trainers, replicas=replicas, **channel_options)
        self._names: dict[str, list[str]] = {}

    def register_checkpoint(self, checkpoint_name: str, *, named_tensors, shards=None, shapes=None,
                            scales=None) -> None:
        """Local. ``named_tensors``: {name: tensor} or (name, tensor) pairs; ``shards``,
        ``shapes``, ``scales``: {name: ...} for the names that are not whole tensors / are
        quantized (see WeightChannel.register)."""
        if checkpoint_name in self._names:
            raise ValueError(f"checkpoint {checkpoint_name!r} is already registered")
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        names = []
        try:
            for name, t in items:
                self.channel.register(f"{checkpoint_name}/{name}", t, (shards or {}).get(name),
                                      shape=(shapes or {}).get(name), scale=(scales or {}).get(name))
                names.append(name)
        except Exception:
            for name in names:
                self.channel.unregister(f"{checkpoint_name}/{name}")
            raise
        self._names[checkpoint_name] = names

    def unregister_checkpoint(self, checkpoint_name: str) -> None:
        for name in self._names.pop(checkpoint_name):
            self.channel.unregister(f"{checkpoint_name}/{name}")

    def gather_metas(self, checkpoint_name: str) -> list[ParamMeta]:
        """Collective: the checkpoint's registrations on every rank (names without the prefix)."""
        prefix = f"{checkpoint_name}/"
        return [dataclasses.replace(m, name=m.name[len(prefix):])
                for m in self.channel.gather_metas() if m.name.startswith(prefix)]

    def update(self, checkpoint_name: str, req_func=None, *, version: int | None = None) -> int:
        """Collective: moves the checkpoint's current values from the trainers into the rollouts'
        tensors (trainers publish, rollouts update). ``version`` defaults to the channel's last
        committed version plus one (the same on every rank, also after a failed update). On rollouts, ``req_func(names)`` runs afterwards (the engine's hook after a
        weight load, e.g. re-deriving fused weights). Returns the version."""
        version = (self.channel._committed or 0) + 1 if version is None else version
        known = checkpoint_name in self._names
        names = [f"{checkpoint_name}/{n}" for n in self._names.get(checkpoint_name, ())]
        refusal = None if known else f"KeyError: checkpoint {checkpoint_name!r} is not registered on this rank"
        self.channel._call("publish" if self.channel.role == "trainer" else "update", version, names, refusal)
        if self.channel.role == "rollout" and req_func is not None:
            req_func(list(self._names[checkpoint_name]))
        return version
