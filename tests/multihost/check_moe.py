"""One rank of a job across simulated hosts: MoE dispatch / combine (torch_npu's and CAM's
names) and the DeepEP-style Buffer (normal and low-latency mode) with experts on every host,
checked against the reference (tests/moe_across_hosts_checks.py); then nothing left in this
host's /dev/shm. With --dead-peer: the last rank vanishes and every other rank's next dispatch
must raise well within the timeout."""
import sys

from job import finish, join
from moe_across_hosts_checks import check_moe, check_moe_dead_peer

TIMEOUT_S = 60
rank, world = join(TIMEOUT_S)
if "--dead-peer" in sys.argv:
    how, took, msg = check_moe_dead_peer(rank, world, timeout_s=TIMEOUT_S / 2)
    print(f"rank {rank} raised after {took:.2f} s: {msg[:300]}", flush=True)
    bad = [] if how == "raised" else [f"the dispatch with a dead rank {how} after {took:.1f} s: {msg}"]
    finish(rank, bad, group_failed=True)
finish(rank, check_moe(rank, world))
