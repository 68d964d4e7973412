"""Direct entry points: blocking collectives that skip torch.distributed's Python layer.

``dist.all_reduce`` costs a few microseconds of Python and dispatch per call before the
backend sees it (argument checks, logging wrappers, the dispatcher, a Work object). For
latency-bound callers, tensor-parallel inference above all, ``torch_cam.all_reduce_`` goes
straight to the group's cam backend: same algorithm, same results, same errors. On a group
whose ranks span hosts it calls that group's own all_reduce (cam inside each host, the
inter-host engine between them) the same way.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from .backend import get_cam_backend, spanning_backend


# The last group used, its backend and whether it spans hosts: the lookup costs about as much
# as the collective.
_last = (None, lambda: None, False)


def _backend(group):
    global _last
    pg = group if group is not None else dist.group.WORLD
    if _last[0] == id(pg):
        backend = _last[1]()
        if backend is not None:
            return backend, _last[2]
    spanning = spanning_backend(pg)
    backend = spanning if spanning is not None else get_cam_backend(pg)
    _last = (id(pg), weakref.ref(backend), spanning is not None)
    return backend, _last[2]


def all_reduce_(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """In place, blocking: ``tensor`` becomes the reduction over the ranks of ``group``
    (default: the world group). Returns ``tensor``."""
    backend, spans_hosts = _backend(group)
    if spans_hosts:
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.RedOpType(op) if isinstance(op, int) else op
        backend.allreduce([tensor], opts).wait()
        return tensor
    code = op.value if hasattr(op, "value") else int(op)
    return backend.all_reduce_(tensor, code)
