"""Attention-FFN disaggregation (AFD): attention ranks and FFN (expert) ranks exchange every
layer's tokens, several micro-batches in flight.

``AfdChannel(group, attention_ranks=[...], ffn_ranks=[...], experts_per_rank=, hidden=, topk=,
max_tokens=)`` (collective over ``group``) names the two sides (any M:N, ranks of the group) and
the expert placement: FFN rank ``f`` (its index in ``ffn_ranks``) holds routed experts
``f * experts_per_rank .. (f + 1) * experts_per_rank - 1``; with ``shared_expert=True`` every FFN
rank also runs the shared expert for a contiguous chunk of every attention rank's tokens.

Attention side, per layer and micro-batch::

    h = channel.send(x, expert_ids, expert_weights, layer=l, micro_batch=m)   # returns at once
    ...                                                                      # other work
    y = channel.recv(h)    # (bs, H): sum_k w_k * expert_k(x) (+ shared(x)), fp32 sum, one rounding

FFN side::

    tok = channel.recv_tokens(layer=l, micro_batch=m)   # rows grouped per local expert
    out = grouped_experts(tok.rows, tok.counts)           # (tok.rows.shape[0], H)
    channel.send_outputs(out, tok)

How bytes move on one host (docs/afd.md): ``send`` writes the tokens (or their per-token int8
with ``quant=True``), ids and weights into this rank's slot of the channel in its tensor heap and
raises the slot's counter; every FFN rank pulls the rows of its experts straight from there into
its grouped buffer; ``send_outputs`` sums each token's weighted expert outputs in fp32 and writes
that partial row straight into the owning attention rank's receive area, then raises a done
counter; ``recv`` adds a token's partials in one pass. (Weights given only at ``recv``: the rows
themselves travel back and ``recv`` weights them.) Nothing is allocated per call once buffers
have grown to the largest batch seen; the only synchronisation is those counters, so an
attention rank computes micro-batch k+1 while the FFN ranks work on k. Across hosts the same
moves are UCX puts and gets, and each side waits on counters in its own memory (docs/afd.md,
"Across hosts").

Errors: bad input raises on the rank that passed it and on every rank waiting for that message
(its peers learn through the message header or the FFN's status line), naming the op, the ranks,
and what was expected against what came; the channel stays usable. A peer that dies or stops
answering makes every wait on it raise within the channel's timeout; the channel is then broken
and every later call raises at once with that cause.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import _C
from .backend import HostPeers

__all__ = ["AfdChannel", "AfdHandle", "AfdTokens", "AfdError", "AfdTimeout",
           "a2e", "e2a", "dispatch_send_async", "dispatch_recv_async", "combine_send_async",
           "combine_recv_async", "moe_dispatch_send_async", "moe_dispatch_recv_async",
           "moe_combine_send_async", "moe_combine_recv_async"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LINE = 64          # one counter per cache line
_TEXT = 448         # bytes of an error text in a header or status line
# Attention slot header: int64 words (word 0 is the posted counter, written last).
_H_POSTED, _H_LAYER, _H_MB, _H_BS, _H_QUANT, _H_REFUSED, _H_WEIGHTED, _H_WORDS = 0, 1, 2, 3, 4, 5, 6, 8
_HEADER_BYTES = 1024  # words, then the refusal text at byte 512
_TEXT_AT = 512
# FFN status line per slot: word 0 = the message it failed (0: none), text from byte 64.
_STATUS_BYTES = 512

# Channel blocks stay mapped until the process exits: a peer may still be reading one when its
# owner drops the channel (the heap punches freed pages out; peers would read zeros).
_retired: list[torch.Tensor] = []


class AfdError(RuntimeError):
    """Bad input or a failure of a peer, on any rank of the exchange."""


class AfdTimeout(AfdError, TimeoutError):
    """A peer did not answer within the channel's timeout."""


def _align(n: int, a: int = _LINE) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class _Config:
    attention_ranks: tuple
    ffn_ranks: tuple
    experts_per_rank: int
    hidden: int
    topk: int
    max_tokens: int
    dtype: str
    shared_expert: bool
    micro_batches: int

    @property
    def num_experts(self) -> int:
        return self.experts_per_rank * len(self.ffn_ranks)


class _SlotLayout:
    """Byte offsets inside one attention slot (one statement of the layout; both sides use it)."""

    def __init__(self, c: _Config, esize: int):
        B, K, H = c.max_tokens, c.topk, c.hidden
        self.rows_per_token = K + (1 if c.shared_expert else 0)
        self.ids = _HEADER_BYTES
        self.weights = self.ids + _align(B * K * 4)
        self.scales = self.weights + _align(B * K * 4)
        self.rows = self.scales + _align(B * 4)
        # The receive area holds either the FFN ranks' fp32 partial sums (B, N, H) or, when the
        # weights come only at recv, the expert rows themselves (B, K + shared, H).
        self.recv = self.rows + _align(B * H * esize)
        self.recv_bytes = B * H * max(len(c.ffn_ranks) * 4, self.rows_per_token * esize)
        self.bytes = self.recv + _align(self.recv_bytes)


@dataclass
class AfdHandle:
    """An attention rank's message in flight; ``channel.recv(handle)`` completes it."""
    layer: int
    micro_batch: int
    message: int
    bs: int
    weighted: bool = True   # weights came with send: the FFN ranks pre-summed
    _weights: torch.Tensor | None = dataclasses.field(default=None, repr=False)


@dataclass
class AfdTokens:
    """What an FFN rank received for one layer and micro-batch (views of the channel's buffers,
    valid until ``micro_batches`` later ``recv_tokens`` calls reuse them).

    ``rows`` (n, H): grouped by local expert (0 .. experts_per_rank - 1, then the shared expert
    if the channel has one), inside a group by (attention rank, token); int8 when the attention
    ranks quantized, with ``scales`` (n,) float32 (row i ~= rows[i] * scales[i]). ``counts``
    (groups,) int64: rows per group. ``weights`` (n,): the routing weight of each row (1 for a
    shared-expert row), which ``send_outputs`` applies when it pre-sums (``weighted``: the
    attention ranks sent weights; otherwise they apply them at ``recv``). ``source`` (n, 3) int32:
    (attention index, token, k) of each row, k = topk for a shared-expert row.
    ``batch_sizes``: each attention rank's batch."""
    layer: int
    micro_batch: int
    rows: torch.Tensor
    scales: torch.Tensor | None
    counts: torch.Tensor
    weights: torch.Tensor
    source: torch.Tensor
    batch_sizes: list
    message: int
    sent: bool = False
    weighted: bool = True
    _token_rows: torch.Tensor | None = dataclasses.field(default=None, repr=False)


class AfdChannel:
    """See the module docstring. Collective: every rank of ``group`` constructs it with the same
    arguments. ``max_tokens``: the largest batch an attention rank sends in one message.
    ``micro_batches``: messages an attention rank may have in flight (one slot each).
    ``timeout``: seconds any wait may take (default: the group's timeout)."""

    def __init__(self, group=None, *, attention_ranks, ffn_ranks, experts_per_rank: int, hidden: int,
                 topk: int, max_tokens: int, dtype: torch.dtype = torch.bfloat16, shared_expert: bool = False,
                 micro_batches: int = 2, timeout: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        # This host's heap (the group's own on one host): peers of this host are mapped; on a
        # group across hosts the others are reached over UCX (self._link, see _map_peers).
        peers = HostPeers(self.group, f"cam afd channel on rank {self.rank}", AfdError)
        self._backend, self._near = peers.backend, peers.near
        attention_ranks = tuple(int(r) for r in attention_ranks)
        ffn_ranks = tuple(int(r) for r in ffn_ranks)
        cfg = _Config(attention_ranks, ffn_ranks, int(experts_per_rank), int(hidden), int(topk),
                      int(max_tokens), str(dtype), bool(shared_expert), int(micro_batches))
        problem = self._check_config(cfg, dtype, world)
        self.timeout = float(timeout) if timeout is not None else self._backend.timeout_s
        self.cfg = cfg
        self.dtype = dtype
        self.M, self.N = len(attention_ranks), len(ffn_ranks)
        self.S = cfg.micro_batches
        self.role = ("attention" if self.rank in attention_ranks else
                     "ffn" if self.rank in ffn_ranks else None)
        esize = torch.empty(0, dtype=dtype).element_size() if problem is None else 1
        self._layout = _SlotLayout(cfg, esize) if problem is None else None
        block = None
        if problem is None:
            nbytes = self._block_bytes()
            try:
                block = self._backend.empty([max(nbytes, 1)], torch.uint8) if nbytes else None
            except Exception as e:  # heap full: every rank must hear it
                problem = f"cannot place the channel's {nbytes} bytes in the tensor heap: {e}"
            if block is not None:
                block.zero_()
        me = (problem, cfg, self._backend.arena_offset(block) if block is not None else -1)
        every = [None] * world
        dist.all_gather_object(every, me, group=self.group)
        errors = [f"rank {r}: {p}" for r, (p, _, _) in enumerate(every) if p]
        errors += [f"rank {r} passed {c} but rank {self.rank} passed {cfg}"
                   for r, (p, c, _) in enumerate(every) if not p and c != cfg][:1]
        if errors:
            if block is not None:
                _retired.append(block)
            raise AfdError(f"cam afd channel on rank {self.rank}: " + "; ".join(errors))
        self._block = block
        self._offsets = [off for _, _, off in every]
        self._link = peers.link("AFD channel", self.timeout)
        self._broken: str | None = None
        self._next = 1          # number of this rank's next message (1-based, both sides)
        self._map_peers()
        if self.role == "attention":
            self._a = attention_ranks.index(self.rank)
            self._inflight: list[AfdHandle | None] = [None] * self.S
            self._out = [torch.empty(cfg.max_tokens, cfg.hidden, dtype=dtype) for _ in range(self.S)]
        elif self.role == "ffn":
            self._f = ffn_ranks.index(self.rank)
            self._pending: list[AfdTokens | None] = [None] * self.S
            self._bufs = [None] * self.S
            self._sources_cache: dict = {}

    # ---- setup ---------------------------------------------------------------------------------

    @staticmethod
    def _check_config(c: _Config, dtype, world: int) -> str | None:
        if dtype not in _DTYPES:
            return f"dtype must be one of float32, bfloat16, float16, got {dtype}"
        everyone = c.attention_ranks + c.ffn_ranks
        if not c.attention_ranks or not c.ffn_ranks:
            return "attention_ranks and ffn_ranks must both be non-empty"
        if len(set(everyone)) != len(everyone) or any(r < 0 or r >= world for r in everyone):
            return (f"attention_ranks {list(c.attention_ranks)} and ffn_ranks {list(c.ffn_ranks)} must be "
                    f"distinct ranks of the group of {world}")
        for name in ("experts_per_rank", "hidden", "topk", "max_tokens", "micro_batches"):
            if getattr(c, name) < 1:
                return f"{name} must be at least 1, got {getattr(c, name)}"
        if c.topk > c.num_experts:
            return f"topk {c.topk} exceeds the {c.num_experts} routed experts"
        return None

    # Block layouts. An FFN rank's block: per slot and attention rank a done line, per slot a
    # status line (together its "answer" area), then per slot and attention rank an inbox line
    # where an attention rank of another host puts its header words. An attention rank's
    # block: its slots, then per FFN rank a copy of that rank's answer area, which an FFN rank
    # of another host puts into. Peers of this host read and write the originals in place.
    def _answer_bytes(self) -> int:
        return self.S * self.M * _LINE + self.S * _STATUS_BYTES

    def _block_bytes(self) -> int:
        if self.role == "attention":
            return self.S * self._layout.bytes + self.N * self._answer_bytes()
        if self.role == "ffn":
            return self._answer_bytes() + self.S * self.M * _LINE
        return 0

    def _remote(self, r: int) -> bool:
        return self._near[r] < 0

    def _answer_views(self, area: torch.Tensor):
        """(done counters [s * M + a] every _LINE bytes, S status lines) of an answer area."""
        return area[: self.S * self.M * _LINE].view(torch.int64), area[self.S * self.M * _LINE:self._answer_bytes()]

    def _map_peers(self):
        c, L, be = self.cfg, self._layout, self._backend
        if self.role == "ffn":
            mine = self._block
            self._done, self._status = self._answer_views(mine)
            self._inbox = mine[self._answer_bytes():].view(torch.int64)   # [s * M + a] every _LINE bytes
            # Every attention rank's slots: mapped (this host), or a shadow that recv_tokens fills
            # with UCX gets (another host). Header words, ids, weights, scales, rows, recv.
            self._peer_slots = []
            for r in c.attention_ranks:
                if self._remote(r):
                    view = torch.zeros(self.S * L.bytes, dtype=torch.uint8)
                else:
                    view = be.peer_arena_view(self._near[r], self._offsets[r], self.S * L.bytes)
                self._peer_slots.append([self._slot_views(view[s * L.bytes:(s + 1) * L.bytes])
                                         for s in range(self.S)])
        if self.role == "attention":
            mine = self._block
            self._slots = [self._slot_views(mine[s * L.bytes:(s + 1) * L.bytes]) for s in range(self.S)]
            self._peer_done, self._peer_status = [], []
            for f, r in enumerate(c.ffn_ranks):
                if self._remote(r):   # the copy in this rank's block that rank r puts into
                    at = self.S * L.bytes + f * self._answer_bytes()
                    area = mine[at:at + self._answer_bytes()]
                else:
                    area = be.peer_arena_view(self._near[r], self._offsets[r], self._answer_bytes())
                done, status = self._answer_views(area)
                self._peer_done.append(done)
                self._peer_status.append(status)

    def _slot_views(self, b: torch.Tensor) -> dict:
        c, L = self.cfg, self._layout
        B, K, H = c.max_tokens, c.topk, c.hidden
        return {
            "header": b[:_H_WORDS * 8].view(torch.int64),
            "text": b[_TEXT_AT:_TEXT_AT + _TEXT],
            "ids": b[L.ids:L.ids + B * K * 4].view(torch.int32).view(B, K),
            "weights": b[L.weights:L.weights + B * K * 4].view(torch.float32).view(B, K),
            "scales": b[L.scales:L.scales + B * 4].view(torch.float32),
            "rows": b[L.rows:L.rows + B * H * self._esize()].view(self.dtype).view(B, H),
            "qrows": b[L.rows:L.rows + B * H].view(torch.int8).view(B, H),
            "recv": b[L.recv:L.recv + B * L.rows_per_token * H * self._esize()].view(self.dtype)
                     .view(B, L.rows_per_token, H),
            "partials": b[L.recv:L.recv + B * self.N * H * 4].view(torch.float32).view(B, self.N, H),
        }

    def _esize(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    # ---- shared helpers ------------------------------------------------------------------------

    def _where(self, op: str) -> str:
        return f"cam afd {op} on {self.role or 'no'} rank {self.rank}"

    def _check_usable(self, op: str, role: str):
        if self._broken:
            raise AfdError(f"{self._where(op)}: the channel is broken: {self._broken}")
        if self.role != role:
            raise AfdError(f"{self._where(op)}: {op} is an {role} rank's call; this rank is "
                           f"{'an ' + self.role + ' rank' if self.role else 'in neither role'} "
                           f"(attention ranks {list(self.cfg.attention_ranks)}, ffn ranks "
                           f"{list(self.cfg.ffn_ranks)})")

    def _wait(self, op: str, peer: int, counters: torch.Tensor, index: int, target: int, what: str):
        if self._remote(peer):   # a counter that peer puts into this rank's memory over UCX
            why = self._link.wait_signal(peer, counters, index, target, self.timeout)
            if why and why != "timeout":
                why = f"is unreachable ({why})"
        else:
            why = self._backend.wait_signal(self._near[peer], counters, index, target, self.timeout)
        if not why:
            return
        if why == "timeout":
            got = _C.signal_load(counters, index)
            self._broken = (f"rank {peer} did not {what} within {self.timeout:g} s "
                            f"(expected message {target}, it is at {got})")
            raise AfdTimeout(f"{self._where(op)}: {self._broken}")
        self._broken = f"rank {peer} {why} before it could {what}"
        raise AfdError(f"{self._where(op)}: {self._broken}")

    def _put(self, after, op: str, data=()):
        """Puts data [(rank, arena offset, tensor)] to ranks of other hosts, then (after them)
        the counters in after; a peer lost on the way breaks the channel."""
        try:
            self._link.write(list(data), list(after), f"{self._where(op)}")
        except RuntimeError as e:
            self._broken = str(e)
            raise AfdError(f"{self._where(op)}: {e}") from e

    @staticmethod
    def _write_text(t: torch.Tensor, text: str):
        data = text.encode()[: _TEXT - 1]
        t.zero_()
        if data:
            t[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    @staticmethod
    def _read_text(t: torch.Tensor) -> str:
        raw = bytes(t.tolist())
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    # ---- attention side ------------------------------------------------------------------------

    def send(self, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor | None = None, *,
             layer: int, micro_batch: int = 0, quant: bool = False, _refusal: str | None = None) -> AfdHandle:
        """Post ``x`` (bs, H) with its routing (``expert_ids`` (bs, K) int, -1 = not routed;
        ``expert_weights`` (bs, K) float, or None to give them at ``recv``). Returns at once; the
        tensors may be reused as soon as it returns. ``quant``: per-token dynamic int8 on the way.
        Bad input is posted as a refusal (the FFN ranks and, through them, the other attention
        ranks raise too) and raises here; ``_refusal``: a front end's own reason to refuse."""
        op = "send"
        self._check_usable(op, "attention")
        layer, micro_batch = int(layer), int(micro_batch)
        n = self._next
        s = (n - 1) % self.S
        busy = self._inflight[s]
        if busy is not None:
            raise AfdError(f"{self._where(op)}: layer {layer} micro-batch {micro_batch} would be message {n}, "
                           f"but slot {s} still holds layer {busy.layer} micro-batch {busy.micro_batch} "
                           f"(message {busy.message}): recv it first (the channel has "
                           f"{self.S} micro-batch slots)")
        problem = _refusal
        for h in self._inflight:
            if problem is None and h is not None and (h.layer, h.micro_batch) == (layer, micro_batch):
                problem = f"layer {layer} micro-batch {micro_batch} is already in flight (message {h.message})"
        slot = self._slots[s]
        if n > self.S:
            # Every FFN rank is done with the slot's previous message (recv waited for that,
            # unless this rank refused it).
            for f, r in enumerate(self.cfg.ffn_ranks):
                self._wait(op, r, self._peer_done[f], (s * self.M + self._a) * (_LINE // 8), n - self.S,
                           f"finish message {n - self.S} of attention rank {self.rank}")
        problem = problem or self._check_tokens(x, expert_ids, expert_weights)
        if problem is not None:
            self._post(slot, n, layer, micro_batch, 0, quant, expert_weights is not None, problem)
            self._next += 1
            raise AfdError(f"{self._where(op)}: layer {layer} micro-batch {micro_batch}: {problem}")
        bs = x.shape[0]
        slot["ids"][:bs].copy_(expert_ids)
        if expert_weights is not None:
            slot["weights"][:bs].copy_(expert_weights)
        else:
            slot["weights"][:bs].fill_(1.0)
        in_slot = x.data_ptr() == slot["rows"].data_ptr() and x.is_contiguous()   # from send_buffer()
        if quant:   # int8 rows overwrite the slot's row area: quantize from a copy when x lies there
            _C.afd_quantize(x.clone() if in_slot else x.contiguous(), slot["qrows"], slot["scales"])
        elif not in_slot:
            slot["rows"][:bs].copy_(x)
        self._post(slot, n, layer, micro_batch, bs, quant, expert_weights is not None, None)
        self._next += 1
        h = AfdHandle(layer, micro_batch, n, bs, weighted=expert_weights is not None,
                      _weights=None if expert_weights is None else slot["weights"][:bs])
        self._inflight[s] = h
        return h

    def send_buffer(self) -> torch.Tensor:
        """The (max_tokens, H) rows of the slot the next ``send`` uses, in this rank's heap.
        Compute the tokens straight into ``[:bs]`` of it (an ``out=``) and pass that view to
        ``send``: it then skips copying them. Valid until that ``send``."""
        op = "send_buffer"
        self._check_usable(op, "attention")
        s = (self._next - 1) % self.S
        busy = self._inflight[s]
        if busy is not None:
            raise AfdError(f"{self._where(op)}: the next slot ({s}) still holds layer {busy.layer} micro-batch "
                           f"{busy.micro_batch} (message {busy.message}): recv it first")
        return self._slots[s]["rows"]

    def _check_tokens(self, x, ids, w) -> str | None:
        c = self.cfg
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != c.hidden:
            return f"x must be (bs, {c.hidden}), got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}"
        if x.dtype != self.dtype:
            return f"x must be {self.dtype} (the channel's dtype), got {x.dtype}"
        if x.device.type != "cpu":
            return f"x must be a CPU tensor, got one on {x.device}"
        bs = x.shape[0]
        if bs > c.max_tokens:
            return f"batch of {bs} tokens exceeds the channel's max_tokens {c.max_tokens}"
        if (not isinstance(ids, torch.Tensor) or tuple(ids.shape) != (bs, c.topk)
                or ids.dtype not in (torch.int32, torch.int64)):
            return (f"expert_ids must be int32/int64 ({bs}, {c.topk}), got "
                    f"{(tuple(ids.shape), ids.dtype) if isinstance(ids, torch.Tensor) else type(ids)}")
        if w is not None and (not isinstance(w, torch.Tensor) or tuple(w.shape) != (bs, c.topk)
                              or not w.dtype.is_floating_point):
            return f"expert_weights must be float ({bs}, {c.topk}), got " \
                   f"{(tuple(w.shape), w.dtype) if isinstance(w, torch.Tensor) else type(w)}"
        ids32 = ids.to(torch.int32).contiguous() if ids.dtype != torch.int32 or not ids.is_contiguous() else ids
        if ids.dtype == torch.int64 and bs and (ids.max() > 2**31 - 1 or ids.min() < -2**31):
            return f"expert id {int(ids.abs().max())} is outside [-1, {c.num_experts})"
        why = _C.afd_check_routing(ids32, c.num_experts)
        return why or None

    def _post(self, slot, n, layer, mb, bs, quant, weighted, refused: str | None):
        hdr = slot["header"]
        if refused:
            self._write_text(slot["text"], refused)
        fields = ((_H_LAYER, layer), (_H_MB, mb), (_H_BS, bs), (_H_QUANT, int(bool(quant))),
                  (_H_REFUSED, 1 if refused else 0), (_H_WEIGHTED, int(bool(weighted))))
        for word, value in fields:   # plain fields; the posted counter below publishes them
            _C.signal_store(hdr, word, value)
        _C.signal_store(hdr, _H_POSTED, n)
        self._backend.ring_parked_peers()
        # FFN ranks of another host find the header words in their inbox (they then get the rest).
        s = (n - 1) % self.S
        line = (self._answer_bytes() + (s * self.M + self._a) * _LINE)
        far = [(r, self._offsets[r] + line, hdr) for r in self.cfg.ffn_ranks if self._remote(r)]
        if far:
            self._put(far, "send")

    def recv(self, handle: AfdHandle, expert_weights: torch.Tensor | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The combined output (bs, H) of ``handle``'s tokens. ``expert_weights``: the routing
        weights, when ``send`` had none. Without ``out`` the result is a view of the channel's
        buffer for that slot, valid until the slot's next recv (``micro_batches`` messages on)."""
        op = "recv"
        self._check_usable(op, "attention")
        s = (handle.message - 1) % self.S
        if self._inflight[s] is not handle:
            raise AfdError(f"{self._where(op)}: layer {handle.layer} micro-batch {handle.micro_batch} "
                           f"(message {handle.message}) is not in flight (already received?)")
        c = self.cfg
        bs = handle.bs
        weights = handle._weights
        if expert_weights is not None and handle.weighted:
            raise AfdError(f"{self._where(op)}: layer {handle.layer} micro-batch {handle.micro_batch} had its "
                           f"weights at send (the FFN ranks applied them); pass them at one place only")
        if expert_weights is not None:
            if tuple(expert_weights.shape) != (bs, c.topk) or not expert_weights.dtype.is_floating_point:
                raise AfdError(f"{self._where(op)}: expert_weights must be float ({bs}, {c.topk}), got "
                               f"{tuple(expert_weights.shape)} {expert_weights.dtype}")
            weights = self._slots[s]["weights"][:bs]
            weights.copy_(expert_weights)
        elif weights is None:
            weights = self._slots[s]["weights"][:bs]   # 1.0 each (send had no weights)
        if out is not None and (tuple(out.shape) != (bs, c.hidden) or not out.is_contiguous()
                                or out.dtype not in _DTYPES):
            raise AfdError(f"{self._where(op)}: out must be contiguous float ({bs}, {c.hidden}), got "
                           f"{tuple(out.shape)} {out.dtype}")
        failures = []
        for f, r in enumerate(c.ffn_ranks):
            what = f"return layer {handle.layer} micro-batch {handle.micro_batch} to attention rank {self.rank}"
            try:
                self._wait(op, r, self._peer_done[f], (s * self.M + self._a) * (_LINE // 8), handle.message, what)
            except AfdError:
                self._inflight[s] = None
                raise
            st = self._peer_status[f]
            if _C.signal_load(st.view(torch.int64), s * _STATUS_BYTES // 8) == handle.message:
                at = s * _STATUS_BYTES + _LINE
                failures.append(f"ffn rank {r}: {self._read_text(st[at:at + _TEXT])}")
        self._inflight[s] = None
        if failures:
            raise AfdError(f"{self._where(op)}: layer {handle.layer} micro-batch {handle.micro_batch} failed: "
                           + "; ".join(failures))
        dst = out if out is not None else self._out[s][:bs]
        if handle.weighted:
            _C.afd_combine_partials(self._slots[s]["partials"], self._slots[s]["ids"][:bs], c.experts_per_rank,
                                    c.shared_expert, dst)
        else:
            _C.afd_combine(self._slots[s]["recv"], self._slots[s]["ids"][:bs], weights.contiguous(),
                           c.shared_expert, dst)
        return dst

    # ---- FFN side ------------------------------------------------------------------------------

    def recv_tokens(self, layer: int | None = None, micro_batch: int | None = None,
                    quant: bool | None = None) -> AfdTokens:
        """This FFN rank's rows of the next message from every attention rank (see AfdTokens).
        ``layer`` / ``micro_batch`` / ``quant``, when given, must match what the attention ranks
        sent; a mismatch raises here and on every attention rank."""
        op = "recv_tokens"
        self._check_usable(op, "ffn")
        c = self.cfg
        n = self._next
        s = (n - 1) % self.S
        prev = self._pending[s]
        if prev is not None and not prev.sent:
            raise AfdError(f"{self._where(op)}: message {n} would reuse slot {s}, which still holds layer "
                           f"{prev.layer} micro-batch {prev.micro_batch} (message {prev.message}): "
                           f"send_outputs for it first (the channel has {self.S} slots)")
        heads = []
        for a, r in enumerate(c.attention_ranks):
            slot = self._peer_slots[a][s]
            want = f"send message {n} (layer {layer}, micro-batch {micro_batch}) to ffn rank {self.rank}" \
                if layer is not None else f"send message {n} to ffn rank {self.rank}"
            line = (s * self.M + a) * (_LINE // 8)
            try:
                if self._remote(r):   # its header words arrive in this rank's inbox
                    self._wait(op, r, self._inbox, line + _H_POSTED, n, want)
                    slot["header"].copy_(self._inbox[line:line + _H_WORDS])
                else:
                    self._wait(op, r, slot["header"], _H_POSTED, n, want)
            except AfdError as e:   # the other attention ranks hear it now, not at their timeout
                self._fail_message(s, n, f"{e}")
                raise
            heads.append(slot["header"].tolist())
        self._next += 1
        self._fetch(op, s, n, heads, texts=True)
        problem = self._check_headers(heads, n, layer, micro_batch, quant)
        if problem is not None:
            self._fail_message(s, n, problem)
            self._pending[s] = None
            raise AfdError(f"{self._where(op)}: message {n}: {problem}")
        self._fetch(op, s, n, heads, texts=False)
        lay, mb, q, weighted = heads[0][_H_LAYER], heads[0][_H_MB], bool(heads[0][_H_QUANT]), bool(heads[0][_H_WEIGHTED])
        sizes = [h[_H_BS] for h in heads]
        for a, slot_set in enumerate(self._peer_slots):   # every FFN rank judges every message alike
            why = _C.afd_check_routing(slot_set[s]["ids"][:sizes[a]], c.num_experts)
            if why:
                problem = f"attention rank {c.attention_ranks[a]}: {why}"
                self._fail_message(s, n, problem)
                self._pending[s] = None
                raise AfdError(f"{self._where(op)}: layer {lay} micro-batch {mb}: {problem}")
        try:
            tokens = self._gather(s, n, lay, mb, q, sizes)
        except Exception as e:   # the attention ranks must hear of it too
            self._fail_message(s, n, f"ffn rank {self.rank} could not gather: {e}")
            self._pending[s] = None
            raise AfdError(f"{self._where(op)}: layer {lay} micro-batch {mb}: could not gather: {e}") from e
        tokens.weighted = weighted
        self._pending[s] = tokens
        return tokens

    def _fetch(self, op: str, s: int, n: int, heads, texts: bool):
        """Fills the shadow slots of attention ranks of other hosts for message n: the refusal
        texts of those that refused (texts), or the ids, weights, scales and rows of the batch
        each announced (once the headers checked out)."""
        L, reads = self._layout, []
        for a, r in enumerate(self.cfg.attention_ranks):
            if not self._remote(r) or heads[a][_H_POSTED] != n:
                continue
            slot, base = self._peer_slots[a][s], self._offsets[r] + s * L.bytes
            if texts:
                if heads[a][_H_REFUSED]:
                    reads.append((r, base + _TEXT_AT, slot["text"]))
                continue
            bs, quant = heads[a][_H_BS], bool(heads[a][_H_QUANT])
            reads += [(r, base + L.ids, slot["ids"][:bs]), (r, base + L.weights, slot["weights"][:bs]),
                      (r, base + L.rows, slot["qrows" if quant else "rows"][:bs])]
            if quant:
                reads.append((r, base + L.scales, slot["scales"][:bs]))
        if not reads:
            return
        try:
            self._link.read(reads, self._where(op))
        except RuntimeError as e:   # the other attention ranks hear it now, not at their timeout
            self._broken = str(e)
            self._fail_message(s, n, self._broken)
            raise AfdError(f"{self._where(op)}: {e}") from e

    def _check_headers(self, heads, n, layer, mb, quant) -> str | None:
        c = self.cfg
        for a, h in enumerate(heads):
            if h[_H_POSTED] != n:
                return f"attention rank {c.attention_ranks[a]} posted message {h[_H_POSTED]}, expected {n}"
            if h[_H_REFUSED]:
                text = self._read_text(self._peer_slots[a][(n - 1) % self.S]["text"])
                return f"attention rank {c.attention_ranks[a]} refused layer {h[_H_LAYER]} micro-batch {h[_H_MB]}: {text}"
        for a, h in enumerate(heads):
            r = c.attention_ranks[a]
            if (layer is not None and h[_H_LAYER] != layer) or (mb is not None and h[_H_MB] != mb):
                return (f"ffn rank {self.rank} expected layer {layer} micro-batch {mb}, attention rank {r} sent "
                        f"layer {h[_H_LAYER]} micro-batch {h[_H_MB]}")
            if (h[_H_LAYER], h[_H_MB]) != (heads[0][_H_LAYER], heads[0][_H_MB]):
                return (f"attention rank {c.attention_ranks[0]} sent layer {heads[0][_H_LAYER]} micro-batch "
                        f"{heads[0][_H_MB]} but attention rank {r} sent layer {h[_H_LAYER]} micro-batch {h[_H_MB]}")
            if h[_H_WEIGHTED] != heads[0][_H_WEIGHTED]:
                return (f"attention rank {c.attention_ranks[0]} sent {'' if heads[0][_H_WEIGHTED] else 'no '}weights "
                        f"but attention rank {r} sent {'' if h[_H_WEIGHTED] else 'none'}")
            if h[_H_QUANT] != heads[0][_H_QUANT]:
                return (f"attention rank {c.attention_ranks[0]} sent quant={bool(heads[0][_H_QUANT])} but "
                        f"attention rank {r} sent quant={bool(h[_H_QUANT])}")
            if quant is not None and bool(h[_H_QUANT]) != bool(quant):
                return f"ffn rank {self.rank} expected quant={bool(quant)}, attention rank {r} sent quant={bool(h[_H_QUANT])}"
            if not 0 <= h[_H_BS] <= c.max_tokens:
                return f"attention rank {r} sent a batch of {h[_H_BS]} tokens, outside 0..{c.max_tokens}"
        return None

    def _fail_message(self, s: int, n: int, text: str):
        """Tell every attention rank that message n failed here (status line, then done)."""
        at = s * _STATUS_BYTES
        self._write_text(self._status[at + _LINE:at + _LINE + _TEXT], text)
        _C.signal_store(self._status.view(torch.int64), at // 8, n)
        for a in range(self.M):
            _C.signal_store(self._done, (s * self.M + a) * (_LINE // 8), n)
        self._backend.ring_parked_peers()
        self._answer_far("failure report", s, None, failed=True)

    def _groups(self) -> int:
        return self.cfg.experts_per_rank + (1 if self.cfg.shared_expert else 0)

    def _buffers(self, s: int, rows: int, quant: bool):
        c = self.cfg
        buf = self._bufs[s]
        if buf is None or buf["cap"] < rows or buf["quant"] != quant:
            cap = max(rows, c.max_tokens, 2 * buf["cap"] if buf is not None and buf["quant"] == quant else 0)
            buf = {
                "cap": cap, "quant": quant,
                "rows": torch.empty(cap, c.hidden, dtype=torch.int8 if quant else self.dtype),
                "scales": torch.empty(cap, dtype=torch.float32) if quant else None,
                "weights": torch.empty(cap, dtype=torch.float32),
                "info": torch.empty(cap, 3, dtype=torch.int32),
                "counts": torch.zeros(self._groups(), dtype=torch.int64),
                "token_rows": torch.empty(self.M * c.max_tokens * (c.topk + 1), dtype=torch.int32),
            }
            self._bufs[s] = buf
        return buf

    def _gather(self, s, n, layer, mb, quant, sizes) -> AfdTokens:
        c = self.cfg
        key = (s, quant, tuple(sizes))
        sources = self._sources_cache.get(key)
        if sources is None:
            sources = []
            for a, bs in enumerate(sizes):
                v = self._peer_slots[a][s]
                sources.append((v["ids"][:bs], v["weights"][:bs], v["qrows" if quant else "rows"][:bs],
                                v["scales"][:bs] if quant else None, bs))
            if len(self._sources_cache) > 64:
                self._sources_cache.clear()
            self._sources_cache[key] = sources
        buf = self._buffers(s, 0, quant)
        while True:
            got = _C.afd_gather(sources, c.topk, c.num_experts, self._f * c.experts_per_rank,
                                c.experts_per_rank, c.shared_expert, self._f, self.N, buf["rows"],
                                buf["scales"], buf["weights"], buf["info"], buf["counts"], buf["token_rows"],
                                c.max_tokens)
            if got >= 0:
                break
            buf = self._buffers(s, -got - 1, quant)
        tokens = AfdTokens(layer, mb, buf["rows"][:got], buf["scales"][:got] if quant else None,
                           buf["counts"], buf["weights"][:got], buf["info"][:got], sizes, n,
                           _token_rows=buf["token_rows"])
        return tokens

    def expert_ids(self, tokens: AfdTokens) -> torch.Tensor:
        """Global expert id of each of ``tokens``' rows (-1: a shared-expert row)."""
        c = self.cfg
        groups = torch.arange(self._groups(), dtype=torch.int64).repeat_interleave(tokens.counts)
        ids = groups + self._f * c.experts_per_rank
        if c.shared_expert:
            ids[groups == c.experts_per_rank] = -1
        return ids

    def send_outputs(self, expert_out: torch.Tensor, tokens: AfdTokens) -> None:
        """Return the expert outputs of ``tokens`` (one row per received row, same order, the
        channel's dtype) to the attention ranks."""
        op = "send_outputs"
        self._check_usable(op, "ffn")
        c = self.cfg
        s = (tokens.message - 1) % self.S
        if self._pending[s] is not tokens or tokens.sent:
            raise AfdError(f"{self._where(op)}: layer {tokens.layer} micro-batch {tokens.micro_batch} "
                           f"(message {tokens.message}) is not awaiting outputs (already sent?)")
        n_rows = tokens.rows.shape[0]
        problem = None
        if not isinstance(expert_out, torch.Tensor) or tuple(expert_out.shape) != (n_rows, c.hidden):
            problem = (f"expert outputs must be ({n_rows}, {c.hidden}) (one row per received row), got "
                       f"{tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor) else type(expert_out)}")
        elif expert_out.dtype != self.dtype:
            problem = f"expert outputs must be {self.dtype} (the channel's dtype), got {expert_out.dtype}"
        elif expert_out.device.type != "cpu":
            problem = f"expert outputs must be CPU tensors, got one on {expert_out.device}"
        tokens.sent = True
        if problem is not None:
            self._fail_message(s, tokens.message, f"layer {tokens.layer} micro-batch {tokens.micro_batch}: {problem}")
            raise AfdError(f"{self._where(op)}: layer {tokens.layer} micro-batch {tokens.micro_batch}: {problem}")
        try:
            if tokens.weighted:
                dest = [self._peer_slots[a][s]["partials"] for a in range(self.M)]
                _C.afd_reduce(expert_out.contiguous(), tokens.weights, tokens._token_rows, dest, tokens.batch_sizes,
                              c.max_tokens, c.topk, self._f, self.N)
            else:
                dest = [self._peer_slots[a][s]["recv"] for a in range(self.M)]
                _C.afd_scatter(expert_out.contiguous(), tokens.source, dest, tokens.batch_sizes,
                               self._layout.rows_per_token)
        except Exception as e:   # the attention ranks must hear of it too
            self._fail_message(s, tokens.message, f"ffn rank {self.rank} could not send its outputs: {e}")
            raise AfdError(f"{self._where(op)}: layer {tokens.layer} micro-batch {tokens.micro_batch}: {e}") from e
        for a in range(self.M):   # signal_store fences the copies before each counter
            _C.signal_store(self._done, (s * self.M + a) * (_LINE // 8), tokens.message)
        self._backend.ring_parked_peers()
        self._answer_far(op, s, tokens)

    def _far_answer_at(self, r: int) -> int:
        """Arena offset, in attention rank r's heap, of its copy of this FFN rank's answer area."""
        return self._offsets[r] + self.S * self._layout.bytes + self._f * self._answer_bytes()

    def _answer_far(self, op: str, s: int, tokens: AfdTokens | None, failed: bool = False):
        """Attention ranks of other hosts: the rows this rank wrote into their shadow slots (unless
        the message failed), and its status line if it did, then the done counter, put into
        their copies of this rank's answer area. A peer that is gone is left out when failing."""
        c, L = self.cfg, self._layout
        esize = self._esize()
        for a, r in enumerate(c.attention_ranks):
            if not self._remote(r):
                continue
            at, line = self._far_answer_at(r), (s * self.M + a) * (_LINE // 8)
            data = []
            if failed:
                data.append((r, at + self.S * self.M * _LINE + s * _STATUS_BYTES,
                             self._status[s * _STATUS_BYTES:(s + 1) * _STATUS_BYTES]))
            elif tokens.weighted:   # this rank's partial of every token of that rank's batch
                partials, base = self._peer_slots[a][s]["partials"], self._offsets[r] + s * L.bytes + L.recv
                data += [(r, base + (t * self.N + self._f) * c.hidden * 4, partials[t, self._f])
                         for t in range(tokens.batch_sizes[a])]
            else:   # the expert rows it returned, each to its (token, k) row
                rows, base = self._peer_slots[a][s]["recv"], self._offsets[r] + s * L.bytes + L.recv
                mine = tokens.source[tokens.source[:, 0] == a]
                data += [(r, base + (t * L.rows_per_token + k) * c.hidden * esize, rows[t, k])
                         for t, k in mine[:, 1:].tolist()]
            after = [(r, at + line * 8, self._done[line:line + 1])]
            if failed:
                try:
                    self._link.write(data, after, self._where(op))
                except RuntimeError:
                    pass  # that rank is gone: it cannot wait for this message any more
            else:
                self._put(after, op, data)

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self):
        """Drop the channel (local). Its memory stays mapped until the process exits, so a peer
        still finishing a message never reads freed pages."""
        if self._block is not None:
            _retired.append(self._block)
            self._block = None
        self._broken = self._broken or "closed"

    def __del__(self):
        blk = getattr(self, "_block", None)
        if blk is not None:
            _retired.append(blk)


# ---- CAM's names ---------------------------------------------------------------------------------
# umdk_cam_op_lib's AFD ops with their arguments. They keep no handle in the caller's hands, so
# each channel keeps its messages in order: a receive completes the oldest message in flight.
# Channels are created on first use (collectively: every rank of the group reaches its first
# call) and cached per group and shape. Only tp_size 1; comm_args, comm_id and aiv_num are
# accepted and ignored (they size NPU resources).

@dataclass
class _CamState:
    channel: AfdChannel
    inflight: list = dataclasses.field(default_factory=list)   # handles or tokens, oldest first
    messages: int = 0


_cam_states: dict = {}
_split_by_shape: dict = {}   # the split ops' channel of the last dispatch of each shape


def _resolve_group(group):
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group if group is not None else dist.group.WORLD


def _cam_state(group, attention_ranks, ffn_ranks, experts_per_rank, hidden, topk, max_tokens, dtype,
               tp_size=1) -> _CamState:
    if int(tp_size) != 1:
        raise AfdError(f"cam afd: tp_size {tp_size} is not supported (only 1)")
    pg = _resolve_group(group)
    key = (pg.group_name, tuple(attention_ranks), tuple(ffn_ranks), int(experts_per_rank), int(hidden), int(topk),
           int(max_tokens), dtype)
    st = _cam_states.get(key)
    if st is None:
        st = _CamState(AfdChannel(pg, attention_ranks=attention_ranks, ffn_ranks=ffn_ranks,
                                  experts_per_rank=experts_per_rank, hidden=hidden, topk=topk,
                                  max_tokens=max_tokens, dtype=dtype))
        _cam_states[key] = st
    return st


def _check_world(pg, world_size):
    if int(world_size) != dist.get_world_size(pg):
        raise AfdError(f"cam afd: world_size {world_size} is not the group's size {dist.get_world_size(pg)}")


def _cam_send(st: _CamState, x, expert_ids, weights, layer, quant, refusal=None) -> None:
    # Two micro-batches of one layer in flight need distinct keys: number them per layer.
    mb = sum(1 for h in st.inflight if h.layer == layer)
    st.inflight.append(st.channel.send(x, expert_ids, weights, layer=layer, micro_batch=mb, quant=bool(quant),
                                       _refusal=refusal))


def _cam_oldest(st: _CamState, what: str):
    if not st.inflight:
        raise AfdError(f"cam afd {what} on rank {st.channel.rank}: no message in flight")
    return st.inflight.pop(0)


def a2e(x, expert_ids, scales, batch_size, hidden_size, topk, expert_rank_size, atten_rank_size, rank,
        group_ep, aiv_num=0, compute_gate=1):
    """CAM's attention-to-expert op. Ranks below ``expert_rank_size`` are expert ranks (one
    expert each: expert e on rank e) and pass empty placeholders; the others are attention
    ranks. Attention side returns placeholders and ``atten_batch_size`` = [bs]; expert side
    returns ``(expand_x, expert id per row, weight per row, batch size per attention rank,
    x_active_mask)``."""
    pg = _resolve_group(group_ep)
    W = int(expert_rank_size) + int(atten_rank_size)
    _check_world(pg, W)
    experts = list(range(int(expert_rank_size)))
    st = _cam_state(pg, list(range(int(expert_rank_size), W)), experts, 1, hidden_size, topk, batch_size, x.dtype)
    ch = st.channel
    if ch.role == "attention":
        _cam_send(st, x, expert_ids, scales, st.messages, False)
        st.messages += 1
        empty = x.new_empty(0, int(hidden_size))
        return (empty, torch.empty(0, dtype=torch.int32), torch.empty(0), torch.tensor([x.shape[0]]),
                torch.ones(x.shape[0], dtype=torch.bool))
    tok = ch.recv_tokens()
    st.inflight.append(tok)
    return (tok.rows, ch.expert_ids(tok).to(torch.int32), tok.weights, torch.tensor(tok.batch_sizes),
            torch.ones(tok.rows.shape[0], dtype=torch.bool))


def e2a(expand_x, atten_batch_size, batch_size, hidden_size, topk, expert_rank_size, attention_rank_size, rank,
        group_ep, aiv_num=0):
    """CAM's expert-to-attention op: the expert side returns its rows of the oldest a2e, the
    attention side receives the weighted sum (bs, H) of its oldest a2e."""
    pg = _resolve_group(group_ep)
    W = int(expert_rank_size) + int(attention_rank_size)
    st = _cam_state(pg, list(range(int(expert_rank_size), W)), list(range(int(expert_rank_size))), 1,
                    hidden_size, topk, batch_size, expand_x.dtype)
    if st.channel.role == "attention":
        return st.channel.recv(_cam_oldest(st, "e2a")).clone()
    tok = _cam_oldest(st, "e2a")
    st.channel.send_outputs(expand_x[: tok.rows.shape[0]], tok)
    return expand_x.new_empty(0, int(hidden_size))


def _split_state(group_name, x_dtype, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                 route_expert_num_per_moe, world_size, tp_size):
    pg = _resolve_group(group_name)
    _check_world(pg, world_size)
    A, F = int(attn_rank_num), int(moe_rank_num)
    st = _cam_state(pg, list(range(A)), list(range(A, A + F)), route_expert_num_per_moe, hidden_size, top_k,
                    max_seq_len, x_dtype, tp_size)
    # combine_recv_async has no max_seq_len: it finds the channel by the rest.
    _split_by_shape[(pg.group_name, A, F, int(route_expert_num_per_moe), int(hidden_size), int(top_k), x_dtype)] = st
    return st


def dispatch_send_async(x, expert_ids, comm_args, comm_id, max_seq_len, batch_size, hidden_size, top_k,
                        moe_rank_num, attn_rank_num, route_expert_num_per_moe, attn_rank_id, world_size,
                        layer_index, tp_size=1, dynamic_quant=0, group_name=None):
    """CAM's split dispatch send (attention ranks 0 .. attn_rank_num - 1): posts x and returns
    at once. Weights come with combine_recv_async."""
    st = _split_state(group_name, x.dtype, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                      route_expert_num_per_moe, world_size, tp_size)
    refusal = None if int(batch_size) == x.shape[0] else f"batch_size {batch_size} but x has {x.shape[0]} rows"
    _cam_send(st, x, expert_ids, None, int(layer_index), dynamic_quant, refusal)
    return torch.zeros(1, dtype=torch.int8)


def dispatch_recv_async(x, comm_args, comm_id, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                        route_expert_num_per_moe, moe_rank_id, world_size, tp_size=1, dynamic_quant=0,
                        group_name=None):
    """CAM's split dispatch receive (FFN ranks attn_rank_num ..): ``[expanded (n, H), scales,
    batch_info, counts]``; batch_info (int64[5 + tp_size + experts]) is
    [message, layer, micro-batch, rows, attention ranks, total tokens, counts...]."""
    st = _split_state(group_name, x.dtype, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                      route_expert_num_per_moe, world_size, tp_size)
    tok = st.channel.recv_tokens(quant=bool(dynamic_quant))
    st.inflight.append(tok)
    info = torch.tensor([tok.message, tok.layer, tok.micro_batch, tok.rows.shape[0], len(tok.batch_sizes),
                         sum(tok.batch_sizes)] + tok.counts.tolist(), dtype=torch.int64)
    scales = tok.scales if tok.scales is not None else torch.zeros(1)
    return [tok.rows, scales, info, tok.counts.clone()]


def combine_send_async(expand_x, comm_args, batch_info, comm_id, max_seq_len, hidden_size, top_k, moe_rank_num,
                       attn_rank_num, route_expert_num_per_moe, moe_rank_id, world_size, tp_size=1,
                       group_name=None):
    """CAM's split combine send: the expert outputs of the message batch_info names (its first
    rows; they must be the oldest received message)."""
    st = _split_state(group_name, expand_x.dtype, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                      route_expert_num_per_moe, world_size, tp_size)
    tok = _cam_oldest(st, "combine_send_async")
    if int(batch_info[0]) != tok.message:
        st.inflight.insert(0, tok)
        raise AfdError(f"cam afd combine_send_async on rank {st.channel.rank}: batch_info names message "
                       f"{int(batch_info[0])}, the oldest received is {tok.message}")
    st.channel.send_outputs(expand_x[: tok.rows.shape[0]], tok)
    return torch.zeros(1, dtype=torch.int8)


def combine_recv_async(expand_x, expert_ids, expert_scales, comm_args, comm_id, batch_size, hidden_size, top_k,
                       moe_rank_num, attn_rank_num, route_expert_num_per_moe, attn_rank_id, world_size,
                       group_name=None, max_seq_len=None):
    """CAM's split combine receive: (batch_size, H), the oldest dispatch's tokens combined with
    ``expert_scales``. ``max_seq_len`` (an extension): when the channel was created with one
    other than batch_size."""
    if max_seq_len is not None:
        st = _split_state(group_name, expand_x.dtype, max_seq_len, hidden_size, top_k, moe_rank_num, attn_rank_num,
                          route_expert_num_per_moe, world_size, 1)
    else:
        st = _split_by_shape.get((_resolve_group(group_name).group_name, int(attn_rank_num), int(moe_rank_num),
                                  int(route_expert_num_per_moe), int(hidden_size), int(top_k), expand_x.dtype))
    if st is None:
        raise AfdError("cam afd combine_recv_async: no dispatch_send_async of this shape was sent")
    h = _cam_oldest(st, "combine_recv_async")
    if int(batch_size) != h.bs:
        st.inflight.insert(0, h)
        raise AfdError(f"cam afd combine_recv_async on rank {st.channel.rank}: batch_size {batch_size}, the "
                       f"oldest dispatch sent {h.bs} tokens")
    return st.channel.recv(h, expert_scales).clone()


moe_dispatch_send_async = dispatch_send_async
moe_dispatch_recv_async = dispatch_recv_async
moe_combine_send_async = combine_send_async
moe_combine_recv_async = combine_recv_async
