"""What every script here does around its checks: join the job's group (torchrun's environment,
one deadline), and on the way out add whatever of the job is left in this host's /dev/shm to the
failures, print each, and exit with the verdict."""
import datetime
import os
import socket
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch_cam  # noqa: E402,F401


def join(timeout_s):
    dist.init_process_group("cam", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def finish(rank, bad, group_failed=False):
    """group_failed: a peer is gone, so destroy_process_group's barrier could only fail."""
    if not group_failed:
        dist.destroy_process_group()
    left = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_cam.{os.getuid()}.")]
    if left:
        bad.append(f"left in {socket.gethostname()}'s /dev/shm: {left}")
    for m in bad:
        print(f"rank {rank}: {m}", flush=True)
    sys.stdout.flush()
    os._exit(1 if bad else 0)
