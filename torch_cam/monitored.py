"""monitored_barrier on cam groups.

torch.distributed.monitored_barrier refuses every backend but gloo in Python before it reaches
the backend; cam implements the op (a barrier whose timeout names every rank that has not
arrived). ``torch_cam.monitored_barrier`` calls it directly, and importing torch_cam lets
``torch.distributed.monitored_barrier`` reach it for cam groups (other groups are untouched).
"""
from __future__ import annotations

import functools
from datetime import timedelta

import torch.distributed as dist

from .backend import BACKEND_NAME


def monitored_barrier(group=None, timeout: timedelta | None = None, wait_all_ranks: bool = False):
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if timeout is None:
        timeout = dist.distributed_c10d._get_default_timeout(BACKEND_NAME)
    elif isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


_torch_monitored_barrier = dist.monitored_barrier


@functools.wraps(_torch_monitored_barrier)
def _monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    if not dist.distributed_c10d._rank_not_in_group(group) and dist.get_backend(group) == BACKEND_NAME:
        return monitored_barrier(group, timeout, wait_all_ranks)
    return _torch_monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


if not getattr(dist.monitored_barrier, "_cam_wrapped", False):
    _monitored_barrier._cam_wrapped = True
    dist.monitored_barrier = _monitored_barrier
    dist.distributed_c10d.monitored_barrier = _monitored_barrier
