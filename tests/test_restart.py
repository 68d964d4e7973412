"""cam under torchrun --max-restarts: the group must come back on the restarted attempt.

With torchrun's defaults (c10d rendezvous, TCPStore shared with the agent) every attempt's
workers connect to the same TCPStore server, and torch gives the group the same key prefix
each time ("default_pg" / "0/" / "cpu/"): nothing in the keys tells attempt 1 from attempt 0
(pytorch issue 135712). The restarted group must not pick up the dead attempt's records."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import cam_segments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 120
MARKER = "CAM-RESTART-OK attempt=1"

WORKER = textwrap.dedent("""
    import os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import torch_cam  # noqa: F401

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("cam", timeout=timedelta(seconds=20))
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(r + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 4, (attempt, r, t)
    print(f"attempt={attempt} rank={r} first all_reduce ok", flush=True)

    if attempt == 0:
        if r == 1:
            os._exit(1)  # dies after the group is up: the agent restarts the whole group
        # rank 0 waits in a collective that cannot finish; the agent kills it. If cam notices
        # the dead peer and raises first, stay alive all the same: the agent does the killing.
        try:
            dist.all_reduce(torch.ones(1))
            print(f"attempt=0 rank={r} second all_reduce returned", flush=True)
        except Exception as e:
            print(f"attempt=0 rank={r} second all_reduce raised: {e}", flush=True)
        time.sleep(120)
        sys.exit(3)

    assert attempt == 1, attempt
    t = torch.arange(6, dtype=torch.float64) * (r + 1)
    dist.all_reduce(t)
    assert t.tolist() == [i * n * (n + 1) / 2 for i in range(6)], (r, t)
    out = [torch.empty(3, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(out, torch.full((3,), 10 * r + attempt, dtype=torch.int64))
    assert [o.tolist() for o in out] == [[10 * j + attempt] * 3 for j in range(n)], (r, out)
    dist.barrier()
    if r == 0:
        print("CAM-RESTART-OK attempt=1 run_id=" + os.environ.get("TORCHELASTIC_RUN_ID", "?"),
              flush=True)
    dist.destroy_process_group()
""")


def _torchrun():
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def run_with_restart(extra_env: dict | None = None):
    """Runs WORKER on 2 ranks under torchrun --max-restarts 1; returns (rc, output, seconds).
    rc is None when it ran past DEADLINE_S (then its whole process group is killed)."""
    # Not /tmp: the repo's ignored build/ folder.
    base = os.path.join(ROOT, "build")
    os.makedirs(base, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="cam_restart_", dir=base)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TORCH_CAM_WINDOW_BYTES=str(1 << 20))
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # torchrun's default unless asked
    env.update(extra_env or {})
    try:
        path = os.path.join(tmp, "restart_worker.py")
        with open(path, "w") as f:
            f.write(WORKER)
        cmd = _torchrun() + ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                             "--monitor-interval", "0.5", path]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=DEADLINE_S)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            rc = None
        return rc, out, time.monotonic() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class TorchrunRestartTest(unittest.TestCase):
    def _check(self, extra_env=None):
        before = set(cam_segments())
        rc, out, secs = run_with_restart(extra_env)
        what = "timed out" if rc is None else f"rc={rc}"
        msg = f"torchrun {what} after {secs:.1f} s:\n{out}"
        self.assertIsNotNone(rc, msg)
        self.assertIn("attempt=0 rank=1 first all_reduce ok", out, msg)
        self.assertEqual(rc, 0, msg)
        self.assertIn(MARKER, out, msg)
        self.assertEqual(sorted(set(cam_segments()) - before), [], msg)

    def test_restart_with_shared_rendezvous_store(self):
        """torchrun defaults: attempt 1 reuses attempt 0's TCPStore and key prefix."""
        self._check()

    def test_restart_with_unshared_rendezvous_store(self):
        """Control: a fresh store per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
        self._check({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})


if __name__ == "__main__":
    unittest.main()
