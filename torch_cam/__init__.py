"""torch_cam: the memory-semantic torch.distributed backend "cam".

Importing this package registers the backend, after which
``torch.distributed.init_process_group("cam")`` (or ``new_group(..., backend="cam")``) gives a
process group whose ranks exchange CPU tensors through a symmetric heap of shared memory.
"""
import torch
import torch.distributed as dist

from . import _C
from .config import Options
from .backend import BACKEND_NAME, create_backend, get_cam_backend
from .direct import all_reduce_
from .flight_recorder import dump_flight_recorder, flight_recorder
from .heap import empty, heap_allocator_stats, is_heap_tensor, use_heap_allocator, zeros
from .monitored import monitored_barrier
from .moe_buffer import Buffer, EventOverlap
from . import kv  # noqa: F401  (torch_cam.kv.KVTransfer)
from . import weights  # noqa: F401  (torch_cam.weights.WeightChannel)
from . import afd  # noqa: F401  (torch_cam.afd.AfdChannel)
from . import ops  # noqa: F401  (torch.ops.torch_cam.*)
from .moe import (moe_combine_shmem, moe_dispatch_shmem, moe_distribute_combine,
                  moe_distribute_combine_v2, moe_distribute_dispatch, moe_distribute_dispatch_v2)

__all__ = ["Options", "BACKEND_NAME", "get_cam_backend", "empty", "zeros", "is_heap_tensor",
           "use_heap_allocator", "heap_allocator_stats",
           "monitored_barrier", "all_reduce_",
           "dump_flight_recorder", "flight_recorder", "moe_distribute_dispatch", "moe_distribute_combine",
           "moe_distribute_dispatch_v2", "moe_distribute_combine_v2", "moe_dispatch_shmem",
           "moe_combine_shmem", "Buffer", "EventOverlap", "__version__"]
__version__ = "0.1.0"

dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True, devices=["cpu"])


def _heap_allocator_from_env() -> None:
    import os
    value = os.environ.get("TORCH_CAM_HEAP_ALLOCATOR", "").strip()
    if not value:
        return
    try:
        min_bytes = int(value)
    except ValueError:
        raise ValueError(f"TORCH_CAM_HEAP_ALLOCATOR: expected a byte count (the smallest tensor born in "
                         f"the heap), got {value!r}") from None
    use_heap_allocator(min_bytes)


_heap_allocator_from_env()
