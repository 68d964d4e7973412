"""Ways to start a cam group: env:// under torchrun, tcp://, file://, an explicit store, and
TORCH_DISTRIBUTED_DEBUG=DETAIL (which wraps the backend and needs sequence numbers)."""
import datetime
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exercise(rank, world_size):
    t = torch.arange(5.0) if rank == 0 else torch.zeros(5)
    dist.broadcast(t, src=0)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], t
    out = torch.empty(world_size)
    dist.all_to_all_single(out, torch.full((world_size,), float(rank)))
    assert out.tolist() == [float(j) for j in range(world_size)], out
    dist.barrier()
    backend = dist.get_backend()
    dist.destroy_process_group()
    return backend


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_init_method(rank, world_size, init_file, method, port):
    import torch_cam  # noqa: F401
    url = f"file://{init_file}" if method == "file" else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("cam", init_method=url, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    return _exercise(rank, world_size)


def _with_store(rank, world_size, init_file, port):
    import torch_cam  # noqa: F401
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("cam", store=store, rank=rank, world_size=world_size)
    return _exercise(rank, world_size)


def _detail_debug(rank, world_size, init_file):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))  # the debug wrapper
    before = backend._get_sequence_number_for_group()
    dist.barrier()
    after = backend._get_sequence_number_for_group()
    assert after == before + 1, (before, after)
    return _exercise(rank, world_size), type(backend).__name__


def _cannot_create_a_window():
    """Makes this process unable to size a window (ftruncate past RLIMIT_FSIZE fails with
    EFBIG) while its options stay those of its peers."""
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _one_rank_cannot_create_its_window(rank, world_size, init_file, subgroup):
    import time
    import torch_cam  # noqa: F401
    if not subgroup and rank == 1:
        _cannot_create_a_window()
    start = time.monotonic()
    try:
        dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        if subgroup:
            if rank == 1:
                _cannot_create_a_window()
            g = dist.new_group([2, 1, 0], backend="cam")
            dist.barrier(group=g)
        return "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start


def _options_per_rank(rank, world_size, init_file, env, subgroup_options):
    """Init with this rank's TORCH_CAM_* environment (env[rank]) and, when subgroup_options is
    given, a subgroup of all ranks with this rank's pg_options (subgroup_options[rank]); then a
    checked all_reduce on whichever group came up last, and on the world group."""
    import time
    import torch_cam  # noqa: F401
    os.environ.update(env.get(rank, {}))
    start = time.monotonic()
    errors = []
    try:
        dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start, None
    groups = [None]
    if subgroup_options is not None:
        try:
            groups.append(dist.new_group(list(range(world_size)), backend="cam",
                                         pg_options=subgroup_options.get(rank)))
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {e}")
    elapsed = time.monotonic() - start
    sums = []
    for g in groups:  # the world group works whether or not the subgroup came up
        t = torch.full((1000,), float(rank + 1))
        dist.all_reduce(t, group=g)
        sums.append(t.unique().tolist())
    dist.destroy_process_group()
    return (errors[0] if errors else "no error"), elapsed, sums


def _window_hides_its_size(rank, world_size, init_file):
    """Rank 1 makes an 8 MiB window but tells the group it has the default options, as a rank
    built from another torch_cam might: the transport, not only the option check, must refuse
    a peer window of another size before mapping it (a read past its end is SIGBUS)."""
    import time
    import torch_cam
    if rank == 1:
        os.environ["TORCH_CAM_WINDOW_BYTES"] = str(8 << 20)
        record = torch_cam.backend.rank_record
        torch_cam.backend.rank_record = lambda opts: record(torch_cam.Options())
    start = time.monotonic()
    try:
        dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        return "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - start


def _failed_rank_gone_before_peers_look(rank, world_size, init_file, port):
    import time
    import torch_cam  # noqa: F401
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        _cannot_create_a_window()
        try:
            dist.init_process_group("cam", store=store, rank=rank, world_size=world_size)
        finally:
            store.set("rank1_done", "1")
            os._exit(1)
    # Every rank reads all ranks' hosts before setting up its window (torch_cam/backend.py): post
    # this rank's now, as a peer already in init would have, so that rank 1 gets to fail first.
    # (torch prefixes the default group's keys with "0//cpu//" when init gets a store.)
    store.set(f"0//cpu//cam_host/0/{rank}", torch_cam.backend.rank_record(torch_cam.Options.from_env()))
    store.wait(["rank1_done"])
    time.sleep(1.0)  # rank 1 is gone by now
    start = time.monotonic()
    try:
        dist.init_process_group("cam", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=30))
        result = "no error", time.monotonic() - start
    except Exception as e:  # noqa: BLE001
        result = f"{type(e).__name__}: {e}", time.monotonic() - start
    store.set(f"rank{rank}_done", "1")
    if rank == 0:
        store.wait(["rank2_done"])  # rank 0 hosts the store: keep it up until rank 2 has read it
    return result


class InitFailureTest(unittest.TestCase):
    """A rank that cannot create its window publishes why: every peer raises at once with that
    reason (not at the group timeout), naming the group, and nothing is left in /dev/shm."""

    def check(self, subgroup, group):
        before = set(cam_segments())
        results = run_ranks(_one_rank_cannot_create_its_window, 3, subgroup, deadline_s=90)
        for r, (status, (msg, elapsed)) in sorted(results.items()):
            self.assertEqual(status, "ok")
            self.assertLess(elapsed, 10, f"rank {r} raised only after {elapsed:.1f} s: {msg}")
            self.assertIn(f"cam init of group {group} on rank {r}: ", msg)
            if r != 1:
                self.assertIn("rank 1 could not set up its window: ", msg)
            self.assertRegex(msg, r"cannot reserve [\d.]+ MiB of shared memory in /dev/shm for this rank's window: "
                                  r"File too large")
        self.assertEqual(set(cam_segments()) - before, set())

    def test_world_group(self):
        self.check(False, "'0' (global ranks all)")

    def test_failure_record_outlives_its_rank(self):
        # Rank 1 fails and exits before the others even look: its record still says why (a
        # record is waited past as stale only when it is not a failure).
        port = _free_port()
        results = run_ranks(_failed_rank_gone_before_peers_look, 3, port, deadline_s=90, allow_died=(1,))
        for r in (0, 2):
            status, (msg, elapsed) = results[r]
            self.assertEqual(status, "ok")
            self.assertLess(elapsed, 10, f"rank {r} raised only after {elapsed:.1f} s: {msg}")
            self.assertIn("rank 1 could not set up its window: ", msg)

    def test_subgroup(self):
        self.check(True, r"'1' (global ranks [0, 1, 2])")


class GroupWideOptionsTest(unittest.TestCase):
    """Options that lay out the windows or choose an op's algorithm (torch_cam.config.GROUP_WIDE)
    must be equal on every rank: a group whose ranks disagree is refused at init by every rank,
    naming the option, the peer and both values, before any window is mapped (a smaller peer
    window would otherwise fault on access, and ranks on two paths of one op would hang)."""

    def check_refused(self, results, option, odd_rank, odd, usual):
        for r, (status, (msg, elapsed, _)) in sorted(results.items()):
            self.assertEqual(status, "ok")
            self.assertLess(elapsed, 10, f"rank {r} raised only after {elapsed:.1f} s: {msg}")
            peer, theirs, mine = (0, usual, odd) if r == odd_rank else (odd_rank, odd, usual)
            self.assertIn(f"on rank {r}: rank {peer} has {option}={theirs} but this rank has {option}={mine}", msg)
            self.assertIn("must be equal on every rank of a group", msg)

    def test_window_bytes_differs(self):
        before = set(cam_segments())
        env = {1: {"TORCH_CAM_WINDOW_BYTES": str(8 << 20)}}
        results = run_ranks(_options_per_rank, 3, env, None, deadline_s=90)
        self.check_refused(results, "window_bytes", 1, 8 << 20, 32 << 20)
        self.assertEqual(set(cam_segments()) - before, set())

    def test_eager_max_bytes_differs_in_a_subgroup(self):
        results = run_ranks(_options_per_rank, 3, {}, {2: {"eager_max_bytes": 4096}}, deadline_s=90)
        self.check_refused(results, "eager_max_bytes", 2, 4096, 64 << 10)
        for r, (_, (_, _, sums)) in results.items():
            self.assertEqual(sums, [[6.0]], f"rank {r}: the world group after the refused subgroup")

    def test_per_rank_options_may_differ(self):
        env = {0: {"TORCH_CAM_SPIN_US": "0", "TORCH_CAM_LOG_LEVEL": "error"},
               1: {"TORCH_CAM_FLIGHT_RECORDER_ENTRIES": "0", "TORCH_CAM_SLEEP_MAX_US": "50"}}
        results = run_ranks(_options_per_rank, 2, env, {1: {"liveness_interval_ms": 10}}, deadline_s=90)
        assert_all_ok(self, results)
        for r, (_, (msg, _, sums)) in results.items():
            self.assertEqual((msg, sums), ("no error", [[3.0], [3.0]]), f"rank {r}")

    def test_transport_refuses_a_window_of_another_size(self):
        before = set(cam_segments())
        results = run_ranks(_window_hides_its_size, 2, deadline_s=90)
        for r, (status, (msg, elapsed)) in sorted(results.items()):
            self.assertEqual(status, "ok")
            self.assertLess(elapsed, 10, f"rank {r}: {msg}")
            # Either this rank found it, or the peer did first and this rank reports the peer's finding.
            self.assertRegex(msg, rf"on rank {r}: (rank {1 - r} could not map the heap: .*)?rank \d's window is "
                                  r"[\d.]+ MiB but this rank lays it out in [\d.]+ MiB; window options must be equal")
        self.assertEqual(set(cam_segments()) - before, set())

    def test_every_window_larger_than_dev_shm(self):
        vfs = os.statvfs("/dev/shm")
        env = {r: {"TORCH_CAM_WINDOW_BYTES": str(vfs.f_bavail * vfs.f_frsize + (64 << 20))} for r in range(2)}
        results = run_ranks(_options_per_rank, 2, env, None, deadline_s=90)
        for r, (status, (msg, elapsed, _)) in sorted(results.items()):
            self.assertEqual(status, "ok")
            self.assertLess(elapsed, 10, f"rank {r}: {msg}")
            self.assertRegex(msg, rf"on rank {r}: (rank \d could not set up its window: )?"
                                  r".*the window needs [\d.]+ MiB of shared memory but /dev/shm has only")


class InitMethodsTest(unittest.TestCase):
    def test_tcp_init_method(self):
        results = run_ranks(_with_init_method, 3, "tcp", _free_port(), deadline_s=90)
        assert_all_ok(self, results)
        self.assertEqual({v for _, v in results.values()}, {"cam"})

    def test_file_init_method(self):
        results = run_ranks(_with_init_method, 2, "file", 0, deadline_s=90)
        assert_all_ok(self, results)

    def test_explicit_store(self):
        results = run_ranks(_with_store, 2, _free_port(), deadline_s=90)
        assert_all_ok(self, results)

    def test_detail_debug_mode(self):
        results = run_ranks(_detail_debug, 2, deadline_s=90, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        assert_all_ok(self, results)
        self.assertEqual({v[0] for _, v in results.values()}, {"cam"})
        self.assertEqual({v[1] for _, v in results.values()}, {"_ProcessGroupWrapper"})

    def test_env_init_under_torchrun(self):
        script = textwrap.dedent("""
            import torch, torch.distributed as dist, torch_cam
            dist.init_process_group("cam")
            r, n = dist.get_rank(), dist.get_world_size()
            t = torch.full((3,), float(r))
            dist.broadcast(t, src=n - 1)
            assert t.tolist() == [float(n - 1)] * 3
            print(f"rank {r}/{n} backend {dist.get_backend()} ok", flush=True)
            dist.destroy_process_group()
        """)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "env_init_probe.py")
            with open(path, "w") as f:
                f.write(script)
            proc = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                 "--master-port", str(_free_port()), path],
                env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        for r in range(3):
            self.assertIn(f"rank {r}/3 backend cam ok", proc.stdout)
        self.assertEqual(cam_segments(), [])


if __name__ == "__main__":
    unittest.main()
