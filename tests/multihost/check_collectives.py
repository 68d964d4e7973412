"""One rank of a job across simulated hosts (started by torchrun on each host that
../shared/tools/multihost.sh makes): every collective and point-to-point op checked against the
reference (tests/hierarchical_checks.py), then nothing of the job left in this host's /dev/shm."""
import datetime
import os
import socket
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch_cam  # noqa: E402,F401
from hierarchical_checks import check_all  # noqa: E402

dist.init_process_group("cam", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
backend = dist.group.WORLD._get_backend(__import__("torch").device("cpu"))
assert isinstance(backend, torch_cam._C.HierarchicalBackend), type(backend)
assert socket.gethostname() in backend.host_names, (socket.gethostname(), backend.host_names)
want = {"ucx": "cam-ucx", "gloo": "gloo"}.get(os.environ.get("TORCH_CAM_INTER_HOST_ENGINE", ""))
assert want is None or backend.inter_host_engine == want, (backend.inter_host_engine, want)
bad = check_all(rank, world)
dist.destroy_process_group()
left = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_cam.{os.getuid()}.")]
if left:
    bad.append(f"left in {socket.gethostname()}'s /dev/shm: {left}")
for m in bad:
    print(f"rank {rank}: {m}", flush=True)
sys.exit(1 if bad else 0)
