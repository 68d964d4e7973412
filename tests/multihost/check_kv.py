"""One rank of a job across simulated hosts: KV transfer (push, pull, asynchronous, converting
layouts, bad input, stale versions) between ranks of this host and of others, checked against
the reference (tests/kv_across_hosts_checks.py); then nothing left in this host's /dev/shm.
With --dead-peer: the last rank vanishes and every other rank's wait for it and push to it must
raise well within the timeout."""
import datetime
import os
import socket
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch_cam  # noqa: E402,F401
from kv_across_hosts_checks import check_kv, check_kv_dead_peer  # noqa: E402

TIMEOUT_S = 60
dist.init_process_group("cam", timeout=datetime.timedelta(seconds=TIMEOUT_S))
rank, world = dist.get_rank(), dist.get_world_size()
bad = []
if "--dead-peer" in sys.argv:
    how, took, msg = check_kv_dead_peer(rank, world, timeout_s=TIMEOUT_S / 2)
    print(f"rank {rank} raised after {took:.2f} s: {msg[:300]}", flush=True)
    if how != "RuntimeError" or took > TIMEOUT_S / 4 or "| push:" not in msg:
        bad.append(f"the wait for the dead rank {how} after {took:.1f} s: {msg}")
else:
    bad = check_kv(rank, world)
    dist.destroy_process_group()
left = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_cam.{os.getuid()}.")]
if left:
    bad.append(f"left in {socket.gethostname()}'s /dev/shm: {left}")
for m in bad:
    print(f"rank {rank}: {m}", flush=True)
os._exit(1 if bad else 0)  # after a dead peer the group is failed: skip destroy's barrier
