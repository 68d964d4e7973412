"""Failures: a rank killed mid-operation makes every other rank raise promptly (not at the group
timeout) and leaves nothing in /dev/shm; a silent peer times out with a message naming what was
awaited; a window larger than /dev/shm fails at init naming the size; names left by a rank
killed during rendezvous are swept."""
import datetime
import os
import signal
import sys
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import cam_segments, run_ranks  # noqa: E402


def _init(rank, world_size, init_file, timeout_s=60, pg_options=None):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), pg_options=pg_options)


def _killed_mid_op(rank, world_size, init_file, op):
    if op == "all_to_all_single_copy":  # ordinary (not heap-born) tensors, read by process_vm_readv
        import torch_cam
        torch_cam.use_heap_allocator(None)
    _init(rank, world_size, init_file,
          pg_options={"single_copy_bytes": 1 << 20} if op == "all_to_all_single_copy" else None)
    dist.barrier()
    if rank == world_size - 1:
        if op == "moe_combine":
            import torch_cam
            ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) % (2 * world_size)
            torch_cam.moe_distribute_dispatch(torch.ones(2, 64, dtype=torch.bfloat16), ids, None, world_size,
                                              rank, 2 * world_size)
        time.sleep(0.3)  # let the others enter the op and wait on this rank
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if op == "broadcast":
            dist.broadcast(torch.zeros(4 << 20), src=world_size - 1)
        elif op == "all_to_all":
            dist.all_to_all_single(torch.empty(world_size * 1000), torch.ones(world_size * 1000))
        elif op == "all_to_all_single_copy":  # blocks read straight from the peer's memory
            n = world_size * (4 << 20)
            dist.all_to_all_single(torch.empty(n), torch.ones(n))
        elif op == "recv":
            dist.recv(torch.empty(10), world_size - 1)
        elif op in ("moe_dispatch", "moe_combine"):
            import torch_cam
            ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32) % (2 * world_size)
            x = torch.ones(2, 64, dtype=torch.bfloat16)
            if op == "moe_combine":
                # Every rank has dispatched; the dead rank dies before its combine.
                out = torch_cam.moe_distribute_dispatch(x, ids, None, world_size, rank, 2 * world_size)
                torch_cam.moe_distribute_combine(out[0], ids, out[2], out[4], None, None, world_size, rank,
                                                 2 * world_size)
            else:
                torch_cam.moe_distribute_dispatch(x, ids, None, world_size, rank, 2 * world_size)
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        # A later op fails at once with the same cause.
        try:
            dist.barrier()
            later = "no error"
        except RuntimeError as e2:
            later = str(e2)
        return str(e), elapsed, later
    return "no error", time.monotonic() - start, ""


def _kv_peer_dies(rank, world_size, init_file):
    """Rank 1 (prefill) dies before pushing; rank 0 (decode) waits for its notification."""
    _init(rank, world_size, init_file)
    import torch_cam
    from torch_cam.kv import KVTransfer
    from torch_cam.kv_reference import KVLayout
    kv = KVTransfer()
    lay = KVLayout("mha", 1, 4, 4, 2, 8, torch.float32)
    kv.register([torch_cam.zeros(*lay.pool_shape())], lay)
    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        kv.wait_notification(b"req", peer=1, timeout_s=60)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def _kv_push_to_dead_peer(rank, world_size, init_file):
    """Rank 1 (decode) dies after registering; rank 0 pushes to it, synchronously and not."""
    _init(rank, world_size, init_file)
    import torch_cam
    from torch_cam.kv import KVTransfer
    from torch_cam.kv_reference import KVLayout
    kv = KVTransfer()
    lay = KVLayout("mha", 2, 4, 4, 2, 8, torch.float32)
    kv.register(kv.allocate(lay), lay)
    kv.version(1 - rank)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    out = []
    for async_op in (False, True):
        start = time.monotonic()
        try:
            work = kv.push(1, [0], [1], 4, request_id=b"late", async_op=async_op)
            work.wait()
            out.append(("no error", time.monotonic() - start, None))
        except RuntimeError as e:
            out.append((str(e), time.monotonic() - start, sorted(work.failed_blocks()) if async_op else None))
    return out


class PeerDeathTest(unittest.TestCase):
    def _check(self, op):
        before = set(cam_segments())
        results = run_ranks(_killed_mid_op, 3, op, deadline_s=60, allow_died=(2,))
        for rank in (0, 1):
            status, value = results[rank]
            self.assertEqual(status, "ok", value)
            msg, elapsed, later = value
            self.assertRegex(msg, r"peer rank 2 died \(process \d+ (no longer exists|has exited)\)|peer rank \d failed")
            self.assertLess(elapsed, 10.0, "death must be noticed well before the 60 s timeout")
            self.assertRegex(later, r"unusable after an earlier error")
        self.assertEqual(set(cam_segments()) - before, set(), "segments left in /dev/shm")

    def test_killed_during_broadcast(self):
        self._check("broadcast")

    def test_killed_during_all_to_all(self):
        self._check("all_to_all")

    def test_killed_during_single_copy_all_to_all(self):
        self._check("all_to_all_single_copy")

    def test_killed_during_recv(self):
        self._check("recv")

    def test_kv_peer_killed_while_awaited(self):
        results = run_ranks(_kv_peer_dies, 2, deadline_s=60, allow_died=(1,))
        status, (msg, elapsed) = results[0]
        self.assertEqual(status, "ok")
        self.assertRegex(msg, r"waiting for request 'req' from rank 1: .*(no longer exists|has exited)")
        self.assertLess(elapsed, 10.0)

    def test_kv_push_to_dead_peer(self):
        results = run_ranks(_kv_push_to_dead_peer, 2, deadline_s=60, allow_died=(1,))
        status, out = results[0]
        self.assertEqual(status, "ok", out)
        for (msg, elapsed, failed), async_op in zip(out, (False, True)):
            self.assertRegex(msg, r"rank 1 (died|.*process \d+ (no longer exists|has exited))", msg)
            self.assertLess(elapsed, 10.0)
            if async_op:
                self.assertEqual(failed, [1])

    def test_killed_during_moe_dispatch(self):
        self._check("moe_dispatch")

    def test_killed_during_moe_combine(self):
        self._check("moe_combine")


def _silent_peer(rank, world_size, init_file):
    _init(rank, world_size, init_file, timeout_s=2)
    if rank == 0:
        start = time.monotonic()
        try:
            dist.broadcast(torch.zeros(10), src=0)
        except RuntimeError as e:
            return str(e), time.monotonic() - start
        return "no error", 0.0
    time.sleep(4)  # never joins the broadcast
    return "", 0.0


class TimeoutTest(unittest.TestCase):
    def test_timeout_names_op_and_peer(self):
        results = run_ranks(_silent_peer, 2, deadline_s=60)
        msg, elapsed = results[0][1]
        self.assertRegex(msg, r"cam broadcast \(seq 1\) on rank 0: timeout after 2000 ms waiting for the "
                              r"collective descriptor from rank 1")
        self.assertGreaterEqual(elapsed, 1.9)
        self.assertLess(elapsed, 10)


def _init_only(rank, world_size, init_file, pg_options):
    try:
        _init(rank, world_size, init_file, timeout_s=20, pg_options=pg_options)
    except RuntimeError as e:
        return str(e)
    dist.destroy_process_group()
    return "no error"


class InitFailureTest(unittest.TestCase):
    def test_window_larger_than_dev_shm(self):
        st = os.statvfs("/dev/shm")
        too_big = (st.f_blocks * st.f_frsize) * 2
        results = run_ranks(_init_only, 2, {"window_bytes": too_big}, deadline_s=60)
        for rank in (0, 1):
            msg = results[rank][1]
            self.assertRegex(msg, r"cam init of group .* on rank \d: the window needs [\d.]+ MiB of shared memory but "
                                  r"/dev/shm has only [\d.]+ MiB free")
        self.assertEqual(cam_segments(), [])

    def test_stale_segment_of_dead_process_is_swept(self):
        # A name like a rank killed during rendezvous would leave (pid 2**22+ is never alive).
        import torch_cam
        name = f"/dev/shm/torch_cam.{os.getuid()}.{4194301}.deadbeef"
        with open(name, "wb") as f:
            f.write(b"\0" * 4096)
        self.assertGreaterEqual(torch_cam._C.sweep_stale_segments(), 1)
        self.assertFalse(os.path.exists(name))


if __name__ == "__main__":
    unittest.main()
