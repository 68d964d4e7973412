"""Heap-resident tensors: CPU tensors allocated in this rank's window of a cam group's
symmetric heap. Peers map that memory, so collectives on such tensors skip the staging copy:
all_to_all_single reads a heap-resident input in place, and all_reduce (two-shot),
reduce_scatter, all_gather and gather read every rank's input in place when all ranks pass
heap-resident inputs. Allocation is local (not collective); the tensor stays valid after its
group is destroyed.

The heap allocator mode (on by default once a group forms; ``use_heap_allocator``) extends this
to ordinary tensors: every CPU tensor of at least ``min_bytes`` is born in this process's heap,
which every cam group of the host maps, so DDP buckets, FSDP2 parameters and any other large
tensor are read in place too.
"""
from __future__ import annotations

import torch

from . import _C
from .backend import get_host_backend


def _sizes(size) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return [int(s) for s in size]


def empty(*size, dtype: torch.dtype | None = None, group=None) -> torch.Tensor:
    """Like ``torch.empty(*size, dtype=dtype)``, in the tensor heap of ``group`` (default:
    the world group; for a group across hosts, the heap of its ranks on this host). Contents are
    uninitialised (freshly reserved pages read as zeros)."""
    return get_host_backend(group).empty(_sizes(size), dtype or torch.get_default_dtype())


def zeros(*size, dtype: torch.dtype | None = None, group=None) -> torch.Tensor:
    """Like ``torch.zeros``, in the tensor heap of ``group``."""
    return empty(*size, dtype=dtype, group=group).zero_()


def is_heap_tensor(tensor: torch.Tensor, group=None) -> bool:
    """Whether ``tensor``'s memory lies in this rank's tensor heap of ``group`` (views
    included), so that collectives of that group can let peers read it in place."""
    return get_host_backend(group).owns(tensor)


def use_heap_allocator(min_bytes: int | None = 1 << 20) -> None:
    """Make every CPU tensor of at least ``min_bytes`` bytes heap-resident for every cam group
    of this host (``None`` or 0: restore the previous CPU allocator; tensors already born in
    the heap stay valid). Process-wide and local: call it on every rank, before or after
    creating groups. Without a call the mode turns itself on at 1 MiB when the first group of
    two or more ranks on this host maps every peer's process heap; any call, even one that turns
    it off, takes that decision instead. The environment variable
    ``TORCH_CAM_HEAP_ALLOCATOR=<min_bytes>`` calls this at ``import torch_cam`` (0: never). Tensors of a forked child (a DataLoader worker), and any the
    heap cannot hold (``TORCH_CAM_PROCESS_HEAP_BYTES``, default the machine's memory up to 256
    GiB), come from the previous allocator."""
    if min_bytes is not None and (not isinstance(min_bytes, int) or min_bytes < 0):
        raise ValueError(f"torch_cam.use_heap_allocator: min_bytes must be a non-negative int or None, "
                         f"got {min_bytes!r}")
    _C.set_heap_allocator(min_bytes or 0)


def heap_allocator_stats() -> dict[str, int]:
    """The heap allocator mode's counters: ``installed`` (0/1), ``auto`` (1: turned on by a group,
    not by a call), ``min_bytes``, ``heap_tensors`` and ``heap_bytes`` (live tensors born in the
    heap), ``cached_bytes`` (freed blocks kept for later tensors of their size), ``fallbacks`` (tensors the heap could not hold)."""
    return dict(_C.heap_allocator_stats())
