"""Heap-resident tensors: CPU tensors allocated in this rank's window of a cam group's
symmetric heap. Peers map that memory, so collectives on such tensors skip the staging copy:
all_to_all_single reads a heap-resident input in place, and all_reduce (two-shot),
reduce_scatter, all_gather and gather read every rank's input in place when all ranks pass
heap-resident inputs. Allocation is local (not collective); the tensor stays valid after its
group is destroyed.
"""
from __future__ import annotations

import torch

from .backend import get_cam_backend


def _sizes(size) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return [int(s) for s in size]


def empty(*size, dtype: torch.dtype | None = None, group=None) -> torch.Tensor:
    """Like ``torch.empty(*size, dtype=dtype)``, in the tensor heap of ``group`` (default:
    the world group). Contents are uninitialised (freshly reserved pages read as zeros)."""
    return get_cam_backend(group).empty(_sizes(size), dtype or torch.get_default_dtype())


def zeros(*size, dtype: torch.dtype | None = None, group=None) -> torch.Tensor:
    """Like ``torch.zeros``, in the tensor heap of ``group``."""
    return empty(*size, dtype=dtype, group=group).zero_()


def is_heap_tensor(tensor: torch.Tensor, group=None) -> bool:
    """Whether ``tensor``'s memory lies in this rank's tensor heap of ``group`` (views
    included), so that collectives of that group can let peers read it in place."""
    return get_cam_backend(group).owns(tensor)
