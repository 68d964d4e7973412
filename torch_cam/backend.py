"""The creator torch.distributed calls for every cam group, and lookup helpers."""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import _C
from .config import Options

BACKEND_NAME = "cam"

# group_id -> backend, so extensions find the native object even when a debug wrapper
# (TORCH_DISTRIBUTED_DEBUG=DETAIL) sits between the ProcessGroup and it.
_backends: "weakref.WeakValueDictionary[str, _C.CamBackend]" = weakref.WeakValueDictionary()


def _describe_group(dist_backend_opts) -> str:
    """How messages name a group: its name and the global ranks it spans (torch passes no
    ranks for the default group)."""
    ranks = list(dist_backend_opts.global_ranks_in_group)
    return f"'{dist_backend_opts.group_id}' (global ranks {ranks if ranks else 'all'})"


def create_backend(dist_backend_opts, pg_options):
    opts = Options.from_env().merged(pg_options)
    # Flight-recorder dumps are named by global rank; torch creates the default group (whose
    # rank is the global one) before dist.get_rank() works.
    _C.set_trace_rank(dist.get_rank() if dist.is_initialized() else dist_backend_opts.group_rank)
    backend = _C.CamBackend(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout.total_seconds(),
        opts.to_native(),
        str(dist_backend_opts.group_id),
        _describe_group(dist_backend_opts),
    )
    _backends[str(dist_backend_opts.group_id)] = backend
    return backend


def get_cam_backend(group=None) -> "_C.CamBackend":
    """The native cam backend of ``group`` (default: the world group)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("torch_cam: no default process group; call init_process_group('cam') first")
    backend = pg._get_backend(torch.device("cpu"))
    if isinstance(backend, _C.CamBackend):
        return backend
    for b in _backends.values():
        if b.group_id == getattr(pg, "group_name", None):
            return b
    raise RuntimeError(f"torch_cam: group {pg.group_name!r} is not a cam group "
                       f"(its CPU backend is {type(backend).__name__})")
