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
