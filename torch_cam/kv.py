"""KV-cache transfer between ranks of a cam group (prefill -> decode), and the block copy under it.

``KVTransfer(group)`` (collective): each rank registers its paged KV pools (heap-resident, one
tensor per layer, described by a ``KVLayout``) and may then, one-sidedly, ``push`` a request's
blocks into a peer's pools or ``pull`` them from a peer's pools; the copy converts the layout
(TP head split/gather, block size, NHD/HND, MLA replication). After the last byte is written the
initiator posts a notification (request id, status, bytes) into the peer's ring, published with
a release store after a store fence, so a peer that sees it also sees the data. Registrations
carry a version (bumped on re-registration, seqlock-published); a transfer that finds the
peer's version changed under it fails and says so in its notification.

The request path (checks, plan, copy, notification) is native (csrc/kv/): a push costs one call
into C++ and no Python per block or layer. The control block each rank keeps in its tensor
heap (registration, notification rings) is described in csrc/kv/kv_control.hpp.

``copy_blocks`` moves one request's KV from ONE source tp rank's pools into ONE destination tp
rank's pools: the heads the plan (``kv_reference.plan_kv_copy``) takes from that source rank,
for every token, re-blocked and re-ordered (NHD/HND) inside the copy. It is the data path of
push/pull, run between local pools; it checks everything before the first byte moves, exactly
as ``kv_reference.reference_transfer`` does, and tests compare the two bit for bit.
"""
from __future__ import annotations

import datetime
import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _C
from .backend import HostPeers
from .heap import empty as heap_empty
from .kv_reference import KVLayout, _check_num_tokens

__all__ = ["copy_blocks", "KVTransfer", "KVWork", "Notification", "KVLayout"]


def copy_blocks(src_pools, src_layout: KVLayout, src_block_ids, dst_pools, dst_layout: KVLayout,
                dst_block_ids, num_tokens: int, layers=None) -> int:
    """Copies the heads ``dst_layout``'s rank takes from ``src_layout``'s rank (per
    ``plan_kv_copy``) for tokens ``0 .. num_tokens-1`` of the given layers (default all).
    Returns the bytes copied (0 when this source rank feeds nothing to that destination rank).
    Raises IndexError (block id or layer out of range) or ValueError before anything is written."""
    _check_layouts(src_layout, dst_layout)
    return _C.kv_copy_blocks(list(src_pools), src_layout, src_block_ids, list(dst_pools), dst_layout, dst_block_ids,
                             _check_num_tokens(num_tokens), layers)


def _check_layouts(src_layout, dst_layout):
    if not isinstance(src_layout, KVLayout) or not isinstance(dst_layout, KVLayout):
        raise ValueError("copy_blocks expects two KVLayout objects")


# ---- transfers between ranks -------------------------------------------------------------------

PUSH, PULL = 0, 1     # csrc/kv/kv_control.hpp KVKind
OK = 0                # KVStatus


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

    @staticmethod
    def _from(t) -> "Notification":
        peer, rid, kind, status, nbytes, msg = t
        return Notification(peer, rid, "push" if kind == PUSH else "pull", status == OK, nbytes, msg)


class KVWork:
    """Completion of a transfer: ``wait()``, ``is_completed()``, ``layer_done(l)`` (per-layer
    progress), ``failed_blocks()`` (destination block ids not known to be written, on failure),
    ``get_future()`` (asynchronous transfers: the engine op's Future)."""

    def __init__(self, job, work):
        self._job, self._work = job, work

    @property
    def nbytes(self) -> int:
        return self._job.nbytes

    def wait(self, timeout: float | None = None) -> bool:
        if self._work is not None and not self._job.done:
            try:
                self._work.wait() if timeout is None else self._work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError:
                if not self._job.done:
                    raise  # the group failed under it (a dead peer): the engine's message
            if not self._job.done:
                raise TimeoutError(f"{self._job.what}: not complete after {timeout} s")
        err = self.exception()
        if err is not None:
            raise err
        return True

    def is_completed(self) -> bool:
        return self._job.done or (self._work is not None and self._work.is_completed())

    def layer_done(self, layer: int) -> bool:
        return self._job.layer_done(layer)

    def failed_blocks(self) -> set[int]:
        """On failure, the destination blocks of the request (none is known to be complete)."""
        return set() if self.exception() is None else set(self._job.failed_blocks())

    def exception(self) -> BaseException | None:
        if self._job.done:
            if not self._job.error:
                return None
            return (TimeoutError if self._job.timed_out else RuntimeError)(self._job.error)
        if self._work is not None and self._work.is_completed():  # the engine failed it (dead peer)
            try:
                self._work.wait()
            except RuntimeError as e:
                return e
        return None

    def get_future(self):
        if self._work is None:
            fut = torch.futures.Future()
            err = self.exception()
            fut.set_exception(err) if err is not None else fut.set_result(self._job.nbytes)
            return fut
        return self._work.get_future()


@torch.compiler.assume_constant_result
def _request_id_text(request_id) -> str:
    """A request id as the op's schema carries it (a str of the same bytes)."""
    return bytes(request_id).decode("latin-1")


class KVTransfer:
    """Paged-KV transfer over a cam group (see the module docstring). Constructing it is
    collective over ``group``; everything after is one-sided. ``timeout_s`` bounds every wait
    (default: the group's timeout)."""

    def __init__(self, group=None, timeout_s: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = self.group.rank(), self.group.size()
        # Same-host peers through the host's heap; a group across hosts reaches the others over UCX.
        peers = HostPeers(self.group, "torch_cam KVTransfer")
        self.backend = peers.backend
        self._local_of = None
        self.timeout_s = float(self.backend.timeout_s if timeout_s is None else timeout_s)
        self._native = _C.KVTransfer(self.backend, self.timeout_s, self.rank, self.world)
        offsets = [None] * self.world
        dist.all_gather_object(offsets, self._native.control_offset, group=self.group)
        if peers.spanning is None:
            self._native.connect(offsets)
        else:
            self._local_of = peers.near
            self._native.connect_across_hosts(offsets, self._local_of, self.backend,
                                              peers.link("kv transfer", self.timeout_s))
        self.handle = next(KVTransfer._handles)
        KVTransfer._live[self.handle] = self

    # torch.ops.torch_cam.kv_transfer names its transfer object by handle (an op takes no objects).
    _handles = itertools.count(1)
    _live: "weakref.WeakValueDictionary[int, KVTransfer]" = weakref.WeakValueDictionary()

    @staticmethod
    def _by_handle(handle: int) -> "KVTransfer":
        t = KVTransfer._live.get(handle)
        if t is None:
            raise ValueError(f"cam kv_transfer: no live KVTransfer with handle {handle}")
        return t

    # -- registration --
    def allocate(self, layout: KVLayout) -> list[torch.Tensor]:
        """Zeroed per-layer pools for ``layout`` in this group's tensor heap, ready to register."""
        if not isinstance(layout, KVLayout):
            raise ValueError("cam KVTransfer.allocate expects a KVLayout")
        return [heap_empty(*layout.pool_shape(), dtype=layout.dtype, group=self.group).zero_()
                for _ in range(layout.num_layers)]

    def register(self, pools: list[torch.Tensor], layout: KVLayout) -> int:
        """Publishes this rank's per-layer pools (heap-resident tensors of this group, shaped
        ``layout.pool_shape()``). Returns the new version; transfers planned against an older
        one are refused, and one in flight when the version changes fails."""
        if not isinstance(layout, KVLayout):
            raise ValueError("cam KVTransfer.register expects a KVLayout")
        return self._native.register(list(pools), layout)

    def version(self, peer: int) -> int:
        """The peer's current registration version (0: none yet). The first look at a new
        registration also maps the peer's pools into this process's page tables (about 0.2 ms
        per MiB of pool, once), so calling it at setup keeps that off the first transfer."""
        return self._native.peer_registration(peer)[0]

    def peer_layout(self, peer: int) -> KVLayout | None:
        f = self._native.peer_registration(peer)[1]
        return None if f is None else KVLayout(**f)

    def peer_pools(self, peer: int) -> list[torch.Tensor]:
        """Views of the peer's registered pools, mapped here (for inspection and tests)."""
        v, f, offsets = self._native.peer_registration(peer)
        if v == 0:
            raise RuntimeError(f"cam KVTransfer on rank {self.rank}: rank {peer} has registered no KV pools")
        layout = KVLayout(**f)
        nbytes = layout.block_bytes() * layout.num_blocks
        local = peer if self._local_of is None else self._local_of[peer]
        if local < 0:
            raise RuntimeError(f"cam KVTransfer on rank {self.rank}: rank {peer} is on another host; its pools "
                               "are not mapped here (pull its blocks instead)")
        return [self.backend.peer_arena_view(local, off, nbytes).view(layout.dtype).view(layout.pool_shape())
                for off in offsets]

    # -- transfers --
    def push(self, peer: int, src_block_ids, dst_block_ids, num_tokens: int, *, layers=None,
             request_id: bytes = b"", version: int | None = None, async_op: bool = False) -> KVWork:
        """Writes this rank's share (per the layouts' TP plan) of a request's KV into ``peer``'s
        pools, then notifies ``peer``. ``version``: the peer registration the block ids were
        planned against (``version(peer)``); a different current one refuses the transfer.
        Bad input raises here (IndexError/ValueError/RuntimeError) and the peer is told."""
        return self._transfer(PUSH, peer, src_block_ids, dst_block_ids, num_tokens, layers, request_id, version,
                              async_op)

    def pull(self, peer: int, remote_block_ids, local_block_ids, num_tokens: int, *, layers=None,
             request_id: bytes = b"", version: int | None = None, async_op: bool = False) -> KVWork:
        """Reads ``peer``'s share of a request's KV into this rank's pools, then notifies ``peer``
        that its blocks have been read."""
        return self._transfer(PULL, peer, remote_block_ids, local_block_ids, num_tokens, layers, request_id,
                              version, async_op)

    def _transfer(self, kind, peer, src_ids, dst_ids, num_tokens, layers, request_id, version, async_op) -> KVWork:
        if torch.compiler.is_compiling():
            # One graph node; it completes before the graph goes on (no Work crosses a graph).
            if async_op:
                raise ValueError("cam KVTransfer: async_op=True cannot be compiled; call it outside the graph")
            torch.ops.torch_cam.kv_transfer(self.handle, kind, peer, torch.as_tensor(src_ids, dtype=torch.int64),
                                            torch.as_tensor(dst_ids, dtype=torch.int64), num_tokens,
                                            None if layers is None else list(layers),
                                            _request_id_text(request_id), -1 if version is None else version)
            return None
        job, work = self._native.transfer(kind, peer, src_ids, dst_ids, num_tokens, layers, bytes(request_id),
                                          -1 if version is None else version, async_op)
        w = KVWork(job, work)
        if not async_op:
            w.wait()
        return w

    # -- notifications --
    def poll_notifications(self) -> list[Notification]:
        """Notifications posted to this rank and not yet returned, oldest first per peer."""
        return [Notification._from(t) for t in self._native.poll()]

    def wait_notification(self, request_id: bytes, peer: int | None = None,
                          timeout_s: float | None = None) -> Notification:
        """Blocks until a notification for ``request_id`` (from ``peer``, if given) arrives;
        others that arrive meanwhile stay queued for poll_notifications. Raises if the peer
        dies or the timeout passes."""
        t = self._native.wait_notification(bytes(request_id), -1 if peer is None else peer,
                                           self.timeout_s if timeout_s is None else timeout_s)
        return Notification._from(t)
