"""One rank of a job across simulated hosts (started by torchrun on each host that
../shared/tools/multihost.sh makes): every collective and point-to-point op checked against the
reference (tests/hierarchical_checks.py), then nothing of the job left in this host's /dev/shm."""
import os
import socket

import torch
import torch.distributed as dist

from job import finish, join  # first: it puts tests/ on the path
import torch_cam  # noqa: E402
from hierarchical_checks import check_all  # noqa: E402

rank, world = join(60)
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
assert isinstance(backend, torch_cam._C.HierarchicalBackend), type(backend)
assert socket.gethostname() in backend.host_names, (socket.gethostname(), backend.host_names)
want = {"ucx": "cam-ucx", "gloo": "gloo"}.get(os.environ.get("TORCH_CAM_INTER_HOST_ENGINE", ""))
assert want is None or backend.inter_host_engine == want, (backend.inter_host_engine, want)
finish(rank, check_all(rank, world))
