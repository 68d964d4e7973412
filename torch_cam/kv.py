"""KV-cache transfer between ranks of a cam group (prefill -> decode), and the block copy under it.

``KVTransfer(group)`` (collective): each rank registers its paged KV pools (heap-resident, one
tensor per layer, described by a ``KVLayout``) and may then, one-sidedly, ``push`` a request's
blocks into a peer's pools or ``pull`` them from a peer's pools; the copy converts the layout
(TP head split/gather, block size, NHD/HND, MLA replication). After the last byte is written the
initiator posts a notification (request id, status, bytes) into the peer's ring, published with
a release store after a store fence, so a peer that sees it also sees the data. Registrations
carry a version (bumped on re-registration, seqlock-published); a transfer that finds the
peer's version changed under it fails and says so in its notification.

Control block of each rank (int64, in its tensor heap, read by peers through their mapping):
  [0] version (odd while being rewritten)  [1..12] layout  [16 .. 16+MAX_LAYERS) pool offsets
  [TAILS + p] how far this rank has read the ring rank p writes
  [RINGS + p*RING_STRIDE ...] ring written only by rank p: head, then NSLOTS slots

``copy_blocks`` moves one request's KV from ONE source tp rank's pools into ONE destination tp
rank's pools: the heads the plan (``kv_reference.plan_kv_copy``) takes from that source rank,
for every token, re-blocked and re-ordered (NHD/HND) inside the copy. It is the data path the
transport (docs/kv.md) will run between mapped pools of different ranks; it checks everything
before the first byte moves, exactly as ``kv_reference.reference_transfer`` does, and tests
compare the two bit for bit.
"""
from __future__ import annotations

import functools
import struct
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _C
from .backend import get_cam_backend
from .heap import empty as heap_empty
from .kv_reference import (KVLayout, _as_id_list, _check_compatible, _check_layers, _check_num_tokens,
                           _check_pools, plan_kv_copy)

__all__ = ["copy_blocks", "KVTransfer", "KVWork", "Notification", "KVLayout"]


def _logical_shape(layout: KVLayout) -> list[int]:
    """[planes, blocks, block_size, heads, head_dim], whatever the physical order."""
    if layout.kind == "mla":
        return [1, layout.num_blocks, layout.block_size, 1, layout.head_dim]
    return [2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]


def _ids_tensor(ids, layout: KVLayout, num_tokens: int, what: str, unique: bool) -> torch.Tensor:
    """Block ids as int64, checked like kv_reference does (IndexError naming the first bad one,
    ValueError for too few or repeated), vectorized."""
    t = ids.to(torch.int64) if isinstance(ids, torch.Tensor) else torch.tensor(_as_id_list(ids, what), dtype=torch.int64)
    bad = (t < 0) | (t >= layout.num_blocks)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"{what}[{i}] = {int(t[i])} is out of range for a pool of {layout.num_blocks} blocks")
    used = -(-num_tokens // layout.block_size)
    if t.numel() < used:
        raise ValueError(f"{what} has {t.numel()} blocks but {num_tokens} tokens at block_size "
                         f"{layout.block_size} need {used}")
    if unique and torch.unique(t[:used]).numel() != used:
        raise ValueError(f"{what} repeats a block id among the {used} blocks written")
    return t[:used]


def _runs(s_ids: torch.Tensor, s_bs: int, d_ids: torch.Tensor, d_bs: int, num_tokens: int) -> torch.Tensor:
    """(n, 5) int64 token runs [src_block, src_slot, dst_block, dst_slot, tokens] (as
    kv_reference.token_runs), vectorized: runs start wherever either side starts a block."""
    if s_bs == d_bs:
        starts = torch.arange(0, num_tokens, s_bs, dtype=torch.int64)
    else:
        starts = torch.unique(torch.cat([torch.arange(0, num_tokens, s_bs), torch.arange(0, num_tokens, d_bs)]))
    lens = torch.diff(starts, append=torch.tensor([num_tokens]))
    return torch.stack([s_ids[starts // s_bs], starts % s_bs, d_ids[starts // d_bs], starts % d_bs, lens], 1).contiguous()


@functools.lru_cache(maxsize=256)
def _planned(src_layout: KVLayout, dst_layout: KVLayout):
    """(head pieces this source rank feeds the destination rank, as an int64 (n, 3) tensor of
    [src head, dst head, heads]; bytes copied per token per layer). Layouts are frozen, so a
    (prefill config, decode config) pair is planned once."""
    _check_compatible(src_layout, dst_layout, False)
    plan = plan_kv_copy(src_layout, dst_layout)
    pieces = [p for p in plan.pieces if p.src_tp_rank == src_layout.tp_rank]
    elem = torch.empty((), dtype=dst_layout.dtype).element_size()
    planes = 1 if dst_layout.kind == "mla" else 2
    token_bytes = planes * sum(p.num_heads for p in pieces) * dst_layout.head_dim * elem
    table = torch.tensor([[p.src_head_lo, p.dst_head_lo, p.num_heads] for p in pieces], dtype=torch.int64)
    return table.view(-1, 3), token_bytes


class _Copy:
    """One checked, planned copy from one rank's pools into another's; ``layer(l)`` runs it
    for one layer. Everything is checked at construction, before any byte moves."""

    def __init__(self, src_pools, src_layout, src_block_ids, dst_pools, dst_layout, dst_block_ids, num_tokens,
                 layers):
        self.num_tokens = _check_num_tokens(num_tokens)
        s_ids = _ids_tensor(src_block_ids, src_layout, num_tokens, "src_block_ids", unique=False)
        d_ids = _ids_tensor(dst_block_ids, dst_layout, num_tokens, "dst_block_ids", unique=True)
        self.layers = _check_layers(layers, dst_layout)
        _check_pools(src_pools, src_layout, "src_pools")
        _check_pools(dst_pools, dst_layout, "dst_pools")
        self.src, self.dst = src_pools, dst_pools
        self.pieces, token_bytes = _planned(src_layout, dst_layout)
        self.runs = _runs(s_ids, src_layout.block_size, d_ids, dst_layout.block_size, num_tokens)
        self.s_shape, self.d_shape = _logical_shape(src_layout), _logical_shape(dst_layout)
        self.s_hnd = src_layout.kind == "mha" and src_layout.order == "HND"
        self.d_hnd = dst_layout.kind == "mha" and dst_layout.order == "HND"
        self.layer_bytes = num_tokens * token_bytes
        self.empty = self.pieces.numel() == 0 or num_tokens == 0

    def layer(self, l: int) -> int:
        if self.empty:
            return 0
        _C.kv_copy(self.src[l], self.dst[l], self.s_shape, self.d_shape, self.s_hnd, self.d_hnd, self.runs,
                   self.pieces)
        return self.layer_bytes


def copy_blocks(src_pools, src_layout: KVLayout, src_block_ids, dst_pools, dst_layout: KVLayout,
                dst_block_ids, num_tokens: int, layers=None) -> int:
    """Copies the heads ``dst_layout``'s rank takes from ``src_layout``'s rank (per
    ``plan_kv_copy``) for tokens ``0 .. num_tokens-1`` of the given layers (default all).
    Returns the bytes copied (0 when this source rank feeds nothing to that destination rank).
    Raises IndexError (block id or layer out of range) or ValueError before anything is written."""
    c = _Copy(src_pools, src_layout, src_block_ids, dst_pools, dst_layout, dst_block_ids, num_tokens, layers)
    return sum(c.layer(l) for l in c.layers)


# ---- transfers between ranks -------------------------------------------------------------------

MAX_LAYERS = 256
NSLOTS = 64
SLOT_INTS = 32          # seq, status, kind, nbytes, id_len, msg_len, id (8 ints), msg (16 ints), pad
ID_BYTES, MSG_BYTES = 64, 128
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.int8, torch.uint8, torch.float64]
OK, FAILED = 0, 1
PUSH, PULL = 0, 1


@dataclass(frozen=True)
class Notification:
    """What a peer posted after a transfer touching this rank's pools: ``kind`` "push" (it wrote
    into them) or "pull" (it read from them); ``ok`` False carries the error in ``message``."""
    peer: int
    request_id: bytes
    kind: str
    ok: bool
    nbytes: int
    message: str


class KVWork:
    """Completion of a transfer: ``wait()``, ``is_completed()``, ``layer_done(l)`` (per-layer
    progress), ``failed_blocks()`` (destination block ids not known to be written, on failure)."""

    def __init__(self, what: str, dst_blocks):
        self._what, self._dst_blocks = what, dst_blocks
        self._done_layers: set[int] = set()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self.nbytes = 0

    def wait(self, timeout: float | None = None) -> bool:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self._what}: not complete after {timeout} s")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def layer_done(self, layer: int) -> bool:
        return layer in self._done_layers

    def failed_blocks(self) -> set[int]:
        if self._error is None:
            return set()
        ids = self._dst_blocks
        return set(ids.tolist() if isinstance(ids, torch.Tensor) else _as_id_list(ids, "dst_block_ids"))

    def exception(self) -> BaseException | None:
        return self._error


class KVTransfer:
    """Paged-KV transfer over a cam group (see the module docstring). Constructing it is
    collective over ``group``; everything after is one-sided."""

    def __init__(self, group=None, timeout_s: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.backend = get_cam_backend(self.group)
        self.rank, self.world = self.group.rank(), self.group.size()
        self.timeout_s = timeout_s if timeout_s is not None else 300.0
        W = self.world
        self._tails, self._rings = 16 + MAX_LAYERS, 16 + MAX_LAYERS + W
        self._ring_stride = 1 + NSLOTS * SLOT_INTS
        n = self._rings + W * self._ring_stride
        self._ctrl = heap_empty(n, dtype=torch.int64, group=self.group).zero_()
        offsets = [None] * W
        dist.all_gather_object(offsets, self.backend.arena_offset(self._ctrl), group=self.group)
        self._peer_ctrl = [self._ctrl if r == self.rank else
                           self.backend.peer_arena_view(r, offsets[r], n * 8).view(torch.int64)
                           for r in range(W)]
        self._sent = [0] * W          # notifications posted to each peer
        self._pools, self._layout = None, None
        self._peer_cache: dict = {}   # rank -> (version, layout, pools)
        self._queue: list[Notification] = []
        self._lock = threading.Lock()  # one transfer at a time per object

    # -- registration --
    def register(self, pools: list[torch.Tensor], layout: KVLayout) -> int:
        """Publishes this rank's per-layer pools (heap-resident tensors of this group, shaped
        ``layout.pool_shape()``). Returns the new version; transfers planned against an older
        one fail."""
        layout.validate()
        if len(pools) != layout.num_layers or layout.num_layers > MAX_LAYERS:
            raise ValueError(f"cam KVTransfer.register on rank {self.rank}: expected {layout.num_layers} "
                             f"layer pools (at most {MAX_LAYERS}), got {len(pools)}")
        offs = []
        for l, t in enumerate(pools):
            if tuple(t.shape) != tuple(layout.pool_shape()) or t.dtype != layout.dtype or not t.is_contiguous():
                raise ValueError(f"cam KVTransfer.register on rank {self.rank}: layer {l} pool is "
                                 f"{t.dtype} {tuple(t.shape)}, expected contiguous {layout.dtype} {layout.pool_shape()}")
            off = self.backend.arena_offset(t)
            if off < 0:
                raise ValueError(f"cam KVTransfer.register on rank {self.rank}: layer {l} pool is not in this "
                                 "group's tensor heap; allocate it with torch_cam.empty(..., group=group)")
            offs.append(off)
        c = self._ctrl
        v = int(c[0])
        _C.signal_store(c, 0, v + 1)  # odd: being rewritten
        c[1:13] = torch.tensor([0 if layout.kind == "mha" else 1, layout.num_layers, layout.num_blocks,
                                layout.block_size, layout.num_kv_heads, layout.head_dim,
                                _DTYPES.index(layout.dtype), 0 if layout.order == "NHD" else 1,
                                layout.tp_rank, layout.tp_size, layout.total_kv_heads or 0,
                                pools[0].nbytes], dtype=torch.int64)
        c[16:16 + len(offs)] = torch.tensor(offs, dtype=torch.int64)
        _C.signal_store(c, 0, v + 2)
        self._pools, self._layout = list(pools), layout
        return v + 2

    def _peer(self, r: int):
        """(version, layout, pools) of rank r's current registration, mapped here."""
        c = self._peer_ctrl[r]
        deadline = time.monotonic() + self.timeout_s
        while True:
            v = _C.signal_load(c, 0)
            if v == 0:
                raise RuntimeError(f"cam KVTransfer on rank {self.rank}: rank {r} has registered no KV pools")
            if v % 2 == 0:
                cached = self._peer_cache.get(r)
                if cached is not None and cached[0] == v:
                    return cached
                f = c[1:13].tolist()
                offs = c[16:16 + f[1]].tolist()
                if _C.signal_load(c, 0) == v:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"cam KVTransfer on rank {self.rank}: rank {r}'s registration stayed "
                                   "half-written")
            time.sleep(1e-4)
        layout = KVLayout("mha" if f[0] == 0 else "mla", f[1], f[2], f[3], f[4], f[5], _DTYPES[f[6]],
                          "NHD" if f[7] == 0 else "HND", f[8], f[9], f[10] or None)
        nbytes = f[11]
        pools = [self.backend.peer_arena_view(r, off, nbytes).view(layout.dtype).view(layout.pool_shape())
                 for off in offs]
        self._peer_cache[r] = (v, layout, pools)
        return self._peer_cache[r]

    def version(self, peer: int) -> int:
        return self._peer(peer)[0]

    # -- transfers --
    def push(self, peer: int, src_block_ids, dst_block_ids, num_tokens: int, *, layers=None,
             request_id: bytes = b"", version: int | None = None, async_op: bool = False) -> KVWork:
        """Writes this rank's share (per the layouts' TP plan) of a request's KV into ``peer``'s
        pools, then notifies ``peer``. ``version``: the peer registration the block ids were
        planned against (``version(peer)``); a different current one refuses the transfer."""
        return self._transfer(PUSH, peer, src_block_ids, dst_block_ids, num_tokens, layers, request_id,
                              version, async_op)

    def pull(self, peer: int, remote_block_ids, local_block_ids, num_tokens: int, *, layers=None,
             request_id: bytes = b"", version: int | None = None, async_op: bool = False) -> KVWork:
        """Reads ``peer``'s share of a request's KV into this rank's pools, then notifies ``peer``
        that its blocks have been read."""
        return self._transfer(PULL, peer, remote_block_ids, local_block_ids, num_tokens, layers, request_id,
                              version, async_op)

    def _transfer(self, kind, peer, src_ids, dst_ids, num_tokens, layers, request_id, expect_version,
                  async_op) -> KVWork:
        if self._layout is None:
            raise RuntimeError(f"cam KVTransfer on rank {self.rank}: register this rank's pools first")
        if not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"cam KVTransfer on rank {self.rank}: peer {peer} is not another rank of the group")
        request_id = bytes(request_id)
        if len(request_id) > ID_BYTES:
            raise ValueError(f"cam KVTransfer: request_id has {len(request_id)} bytes, at most {ID_BYTES}")
        version, peer_layout, peer_pools = self._peer(peer)
        if kind == PUSH:
            src = (self._pools, self._layout)
            dst = (peer_pools, peer_layout)
        else:
            src = (peer_pools, peer_layout)
            dst = (self._pools, self._layout)
        # Everything is checked before any byte moves (raises here, on the caller's thread); the
        # peer still hears that the request failed.
        try:
            if expect_version is not None and expect_version != version:
                raise RuntimeError(f"cam KVTransfer on rank {self.rank}: rank {peer}'s KV pools were "
                                   f"re-registered (version {expect_version} -> {version}); block ids planned "
                                   "against the old registration are refused")
            copy = _Copy(src[0], src[1], src_ids, dst[0], dst[1], dst_ids, num_tokens, layers)
        except Exception as e:
            try:
                self._notify(peer, request_id, kind, FAILED, 0, str(e))
            except Exception as unreachable:  # the refusal itself is what the caller must see
                e.add_note(f"(rank {peer} could not be told: {unreachable})")
            raise
        layer_list = copy.layers
        work = KVWork(f"cam KV {'push to' if kind == PUSH else 'pull from'} rank {peer} (request "
                      f"{request_id!r}) on rank {self.rank}", dst_ids)

        def run():
            with self._lock:
                try:
                    for l in layer_list:
                        work.nbytes += copy.layer(l)
                        work._done_layers.add(l)
                    if _C.signal_load(self._peer_ctrl[peer], 0) != version:
                        raise RuntimeError(f"cam KVTransfer on rank {self.rank}: rank {peer} re-registered its "
                                           f"KV pools during the transfer (version {version} -> "
                                           f"{_C.signal_load(self._peer_ctrl[peer], 0)}); the blocks may hold "
                                           "partial data")
                    self._notify(peer, request_id, kind, OK, work.nbytes, "")
                except BaseException as e:  # the peer still hears about it
                    work._error = e
                    try:
                        self._notify(peer, request_id, kind, FAILED, work.nbytes, str(e))
                    except Exception as unreachable:
                        e.add_note(f"(rank {peer} could not be told: {unreachable})")
                finally:
                    work._event.set()

        if async_op:
            threading.Thread(target=run, daemon=True).start()
        else:
            run()
            work.wait()
        return work

    # -- notifications --
    def _notify(self, peer: int, request_id: bytes, kind: int, status: int, nbytes: int, message: str):
        ring = self._peer_ctrl[peer]
        base = self._rings + self.rank * self._ring_stride
        seq = self._sent[peer]
        deadline = time.monotonic() + self.timeout_s
        while seq - _C.signal_load(ring, self._tails + self.rank) >= NSLOTS:
            why = self.backend.peer_failure(peer)
            if why:
                raise RuntimeError(f"cam KVTransfer on rank {self.rank}: cannot notify rank {peer}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cam KVTransfer on rank {self.rank}: rank {peer} has not read its "
                                   f"notifications for {self.timeout_s} s (ring of {NSLOTS} full)")
            time.sleep(1e-4)
        slot = base + 1 + (seq % NSLOTS) * SLOT_INTS
        msg = message.encode()[:MSG_BYTES]
        idb = request_id.ljust(ID_BYTES, b"\0")
        packed = struct.pack("<6q", seq + 1, status, kind, nbytes, len(request_id), len(msg)) + idb + \
            msg.ljust(MSG_BYTES, b"\0")
        ring[slot:slot + 30] = torch.frombuffer(bytearray(packed), dtype=torch.int64)
        self._sent[peer] = seq + 1
        _C.signal_store(ring, base, seq + 1)  # after a store fence: data and slot are visible first

    def _drain(self) -> None:
        """Moves every notification posted to this rank into the local queue."""
        c = self._ctrl
        for p in range(self.world):
            if p == self.rank:
                continue
            base = self._rings + p * self._ring_stride
            head, tail = _C.signal_load(c, base), int(c[self._tails + p])
            for seq in range(tail, head):
                slot = base + 1 + (seq % NSLOTS) * SLOT_INTS
                f = c[slot:slot + 6].tolist()
                rid = c[slot + 6:slot + 14].numpy().tobytes()[:f[4]]
                msg = c[slot + 14:slot + 30].numpy().tobytes()[:f[5]].decode(errors="replace")
                self._queue.append(Notification(p, rid, "push" if f[2] == PUSH else "pull", f[1] == OK, f[3], msg))
            if head > tail:
                _C.signal_store(c, self._tails + p, head)  # the slots may be reused

    def poll_notifications(self) -> list[Notification]:
        """Notifications posted to this rank and not yet returned, oldest first per peer."""
        self._drain()
        out, self._queue = self._queue, []
        return out

    def wait_notification(self, request_id: bytes, peer: int | None = None,
                          timeout_s: float | None = None) -> Notification:
        """Blocks until a notification for ``request_id`` (from ``peer``, if given) arrives;
        others that arrive meanwhile stay queued for poll_notifications. Raises if the peer
        dies or the timeout passes."""
        request_id = bytes(request_id)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        peers = [peer] if peer is not None else [q for q in range(self.world) if q != self.rank]
        delay = 1e-5
        while True:
            self._drain()
            for i, n in enumerate(self._queue):
                if n.request_id == request_id and (peer is None or n.peer == peer):
                    return self._queue.pop(i)
            for p in peers:
                why = self.backend.peer_failure(p)
                if why:
                    raise RuntimeError(f"cam KVTransfer on rank {self.rank}: waiting for request "
                                       f"{request_id!r} from rank {p}: {why}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"cam KVTransfer on rank {self.rank}: no notification for request "
                                   f"{request_id!r}{'' if peer is None else f' from rank {peer}'} in time")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
