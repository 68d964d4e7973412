"""Options of a cam group: the only place that reads TORCH_CAM_* environment variables.

Precedence: defaults < environment < ``pg_options`` given to ``init_process_group`` or
``new_group`` (an :class:`Options` or a plain dict). The native side validates the result
against the group size and reports the offending field.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

_ENV_PREFIX = "TORCH_CAM_"

#: Options that shape every rank's window or decide which algorithm an op takes: all ranks of a
#: group must hold the same values, and init compares them (a peer whose window is laid out
#: otherwise would be misread, and ranks on two paths of one op would wait on each other until
#: the timeout). The rest (waiting, logging, caches) may differ per rank.
GROUP_WIDE = ("window_bytes", "p2p_fraction", "chunk_bytes", "single_copy_bytes", "tensor_heap_bytes",
              "one_shot_max_bytes", "eager_max_bytes", "allreduce_algo", "inter_host_engine",
              "all_to_all_hops")


@dataclasses.dataclass
class Options:
    #: Data bytes of each rank's window; larger messages are chunked through it.
    window_bytes: int = 32 << 20
    #: Share of the window used for point-to-point outboxes (split over peers).
    p2p_fraction: float = 0.25
    #: Pipeline chunk of collectives (one staging slot).
    chunk_bytes: int = 256 << 10
    #: All-to-all blocks this large are read straight from the sender's tensor (one copy,
    #: process_vm_readv) where the kernel allows it; 0 (default) keeps every byte staged
    #: through the windows, which measured faster on the development machine.
    single_copy_bytes: int = 0
    #: Address space of each rank's tensor arena (torch_cam.empty/zeros); pages are reserved
    #: as tensors are allocated, so the default costs nothing until used.
    tensor_heap_bytes: int = 1 << 30
    #: all_reduce: one-shot (every rank reduces everything) up to this size, reduce-scatter +
    #: all-gather above.
    one_shot_max_bytes: int = 256 << 10
    #: Collective inputs up to this size are eager: copied into the window with the descriptor,
    #: so the descriptor exchange is the op's only synchronisation (broadcast, all_to_all per
    #: sender, all_gather, gather, reduce, reduce_scatter, and one-shot all_reduce).
    eager_max_bytes: int = 64 << 10
    #: Freed MoE outputs (expand_x, combined tokens) kept per group for reuse, at most this
    #: many bytes of address space: reusing them spares every call the page faults of fresh
    #: large allocations. Only the pages calls actually wrote are resident (expand_x is sized
    #: for the worst case, e.g. 1 GiB at 8 ranks x 4096 tokens x H 2048, mostly untouched).
    moe_output_cache_bytes: int = 2 << 30
    #: "auto" (by size), or force "one_shot" / "two_shot".
    allreduce_algo: str = "auto"
    #: Wait policy: pause-spin for spin_us, then sched_yield until yield_us, then sleeps that
    #: grow to sleep_max_us, parked where the awaited peer rings them awake.
    spin_us: int = 5
    yield_us: int = 2000
    sleep_max_us: int = 500
    #: How often a waiting rank checks that its peers are alive.
    liveness_interval_ms: int = 50
    #: Poll interval of the background progress thread for ops nobody waits on; while every op
    #: is waited by its issuer the polls stretch to 8x this (an unwaited op is then picked up
    #: within 8x), since each poll is a timer wake that oversubscribed ranks pay for.
    progress_interval_us: int = 500

    #: What the group logs to stderr: "error", "warn", "info" (at init: what the group chose)
    #: or "debug" (also every op's issue and completion).
    log_level: str = "warn"
    #: Ops each group's flight recorder keeps for dumps (0: none).
    flight_recorder_entries: int = 2000
    #: When a group fails (timeout, dead or failed peer) each rank writes its flight recorder
    #: to ``<flight_recorder_path><global rank>.json``; "" writes nothing.
    flight_recorder_path: str = "/tmp/torch_cam_trace_rank_"
    #: Between the hosts of a group that spans hosts: "ucx" (one-sided put/get/atomics over
    #: UCX), "gloo" (torch's gloo), or "auto" (UCX where this build has it, else gloo).
    inter_host_engine: str = "auto"
    #: all_to_all between hosts of equal size, more than one rank each: "direct" (every block
    #: straight to its receiver) or "two_hops" (gathered per rail and host on the sender's host,
    #: one message per rail and host across the link; faster on a slow link, slower where the
    #: link is as fast as memory copies; docs/multihost.md).
    all_to_all_hops: str = "direct"

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "Options":
        environ = os.environ if environ is None else environ
        opts = cls()
        for field in dataclasses.fields(cls):
            raw = environ.get(_ENV_PREFIX + field.name.upper())
            if raw is not None:
                setattr(opts, field.name, _parse(field, raw, _ENV_PREFIX + field.name.upper()))
        return opts

    def merged(self, pg_options: Any) -> "Options":
        """This object updated with user pg_options (Options, dict, or None)."""
        if pg_options is None:
            return dataclasses.replace(self)
        if isinstance(pg_options, Options):
            return dataclasses.replace(pg_options)
        if isinstance(pg_options, dict):
            names = {f.name: f for f in dataclasses.fields(self)}
            unknown = sorted(set(pg_options) - set(names))
            if unknown:
                raise ValueError(f"cam pg_options: unknown option(s) {unknown}; known: {sorted(names)}")
            out = dataclasses.replace(self)
            for k, v in pg_options.items():
                setattr(out, k, _parse(names[k], v, k))
            return out
        raise TypeError(
            f"cam pg_options must be torch_cam.Options or a dict, got {type(pg_options).__name__}")

    def group_wide(self) -> dict[str, str]:
        """The :data:`GROUP_WIDE` options, as text: what every rank of a group must agree on."""
        return {name: str(getattr(self, name)) for name in GROUP_WIDE}

    def to_native(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _parse(field: dataclasses.Field, raw: Any, where: str):
    kind = {"float": float, "str": str}.get(getattr(field.type, "__name__", field.type), int)
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise ValueError(f"cam option {where}: expected {kind.__name__}, got {raw!r}") from None
