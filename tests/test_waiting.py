"""Waiting past the spin and yield tiers: a rank that has waited long enough to sleep is parked
on its window's wait bell, and the peer whose signal it waits for wakes it at once, so its
latency after a long wait is a wake-up, not the remainder of a sleep. The sleep tier is set to
500 ms here: a ring that never came would cost about 250 ms on average, far above the bound.
And ops nobody waits on are finished by the progress thread within its poll interval, also
after a run of blocking ops has stretched that interval to its cap."""
import datetime
import os
import statistics
import sys
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402

LATE_S = 0.4     # how long the late rank keeps the others waiting
TRIALS = 5
BOUND_S = 0.05   # median latency from the late rank's issue to the waiter's return


def _straggler(rank, world_size, init_file, op):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30),
                            pg_options={"sleep_max_us": 500_000})
    late = world_size - 1
    x = torch.full((256,), float(rank + 1))
    times = []
    for _ in range(TRIALS):
        dist.barrier()
        if rank == late:
            time.sleep(LATE_S)
        t_issue = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the host
        if op == "all_reduce":
            x.fill_(rank + 1)
            dist.all_reduce(x)
            assert x[0].item() == world_size * (world_size + 1) / 2, x[0]
        elif op == "broadcast":
            x.fill_(rank + 1)
            dist.broadcast(x, src=late)
            assert x[0].item() == late + 1, x[0]
        elif op == "recv":
            if rank == late:
                dist.send(torch.full((256,), 7.0), 0)
            elif rank == 0:
                y = torch.zeros(256)
                dist.recv(y, late)
                assert y[0].item() == 7.0, y[0]
        times.append((t_issue, time.monotonic()))
    dist.barrier()
    dist.destroy_process_group()
    return times


def _unwaited(rank, world_size, init_file):
    """Blocking ops first (every op waited by its issuer, so the progress thread's poll interval
    grows to its cap), then async all_reduces nobody waits on: only the thread can finish them."""
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    x = torch.ones(256)
    times = []
    for _ in range(TRIALS):
        for _ in range(300):
            dist.all_reduce(x)
            x.fill_(1.0)
        dist.barrier()
        x.fill_(rank + 1)
        t0 = time.monotonic()
        fut = dist.all_reduce(x, async_op=True).get_future()
        while not fut.done() and time.monotonic() - t0 < 10:
            time.sleep(0.0005)  # polling done() drives nothing
        times.append(time.monotonic() - t0)
        assert fut.done(), "an all_reduce nobody waited on did not finish in 10 s"
        assert x[0].item() == world_size * (world_size + 1) / 2, x[0]
    dist.barrier()
    dist.destroy_process_group()
    return times


class TestUnwaitedOpsProgress(unittest.TestCase):
    def test_async_all_reduce_after_blocking_ops(self):
        res = run_ranks(_unwaited, 3, deadline_s=90)
        assert_all_ok(self, res)
        for r in range(3):
            med = statistics.median(res[r][1])
            self.assertLess(med, BOUND_S, f"rank {r}: an unwaited all_reduce took {med * 1e3:.1f} ms (median); "
                                          f"each trial: {[round(v * 1e3, 1) for v in res[r][1]]} ms")
        self.assertEqual(cam_segments(), [])


class TestParkedWaiterWakes(unittest.TestCase):
    def check(self, op, world):
        res = run_ranks(_straggler, world, op, deadline_s=90)
        assert_all_ok(self, res)
        late = world - 1
        waiters = [0] if op == "recv" else range(world - 1)
        for w in waiters:
            lat = [res[w][1][i][1] - res[late][1][i][0] for i in range(TRIALS)]
            med = statistics.median(lat)
            self.assertLess(med, BOUND_S, f"{op}: rank {w} returned {med * 1e3:.1f} ms (median) after "
                                          f"rank {late} issued; each trial: {[round(v * 1e3, 1) for v in lat]} ms")
        self.assertEqual(cam_segments(), [])

    def test_all_reduce(self):
        self.check("all_reduce", 3)

    def test_broadcast(self):
        self.check("broadcast", 2)

    def test_recv(self):
        self.check("recv", 2)


if __name__ == "__main__":
    unittest.main()
