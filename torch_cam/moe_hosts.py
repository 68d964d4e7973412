"""MoE dispatch and combine on a cam group whose ranks span hosts.

``moe_backend(group)`` is what ``moe.py`` and ``moe_buffer.py`` call the two MoE ops on: the
group's own ``CamBackend`` when it lives on one host (csrc/moe/, rows pulled from peers'
windows), else a ``HostsMoe`` (csrc/moe/hosts_moe.hpp) taking the same arguments and giving the
same outputs, bit for bit, over the group's collectives: an all-gather of every rank's header,
refusal and counts, then one all_to_all_single of packed rows (or, for large ops on hosts of
equal size, two hops through the rail peer; a combine in two hops sums a token's rows of each
other host there first, the order ``moe_reference``'s ``hosts=`` states). The ops complete before the call
returns (``async_op`` of the Buffer is accepted and its event is already done);
``performance_info`` gets no per-peer wait times here.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from . import _C
from .backend import get_cam_backend, spanning_backend

__all__ = ["HostsMoe", "moe_backend"]

HostsMoe = _C.HostsMoe

_hosts: "weakref.WeakValueDictionary[str, HostsMoe]" = weakref.WeakValueDictionary()


def moe_backend(group):
    """What the MoE ops run on for ``group``: its CamBackend (one host), else a HostsMoe over
    the group's collectives (a group that spans hosts, or one whose backend is cam's one-sided
    engine alone, as the in-process test transport's groups are)."""
    group = group if group is not None else dist.group.WORLD
    backend = group._get_backend(torch.device("cpu")) if group is not None else None
    over_one_sided = isinstance(backend, _C.OneSidedBackend)
    if spanning_backend(group) is None and not over_one_sided:
        return get_cam_backend(group)
    moe = _hosts.get(group.group_name)
    if moe is None or not moe.runs_on(backend):  # a group of that name made again
        moe = HostsMoe(backend, group.rank(), group.size())
        _hosts[group.group_name] = moe
    return moe
