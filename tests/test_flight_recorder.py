"""Observability: the flight recorder keeps each rank's last ops with what they were and how far
they got; a group that times out dumps it by itself; on a forced hang (one rank skips a
collective) `python -m torch_cam.trace` names the rank and the op; TORCH_CAM_LOG_LEVEL logs what
a group chose at init (info) and every op (debug)."""
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import assert_all_ok, cam_segments, run_ranks  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _init(rank, world_size, init_file, timeout_s=60, **opts):
    import torch_cam  # noqa: F401
    dist.init_process_group("cam", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), pg_options=opts or None)


def _skip_one_all_reduce(rank, world_size, init_file, prefix):
    """Every rank runs a few ops; then the last rank skips an all_reduce the others issue."""
    import torch_cam
    _init(rank, world_size, init_file, timeout_s=3, flight_recorder_path=prefix)
    x = torch.ones(4, 8)
    dist.all_reduce(x)
    dist.broadcast(torch.zeros(16, dtype=torch.int64), src=1)
    dist.all_reduce(x)
    if rank == world_size - 1:
        path = torch_cam.dump_flight_recorder(f"{prefix}{rank}.json", reason="test: this rank skipped")
        time.sleep(5)  # alive past the others' timeout: a hang, not a death
        return path
    try:
        dist.all_reduce(torch.ones(1000))
    except RuntimeError as e:
        return str(e)
    raise AssertionError("the all_reduce the last rank skipped completed")


def _ops_recorded(rank, world_size, init_file):
    import torch_cam
    _init(rank, world_size, init_file, flight_recorder_entries=64)
    dist.all_reduce(torch.ones(4, 8))
    dist.broadcast(torch.zeros(3, dtype=torch.int16), src=1)
    if rank == 0:
        dist.send(torch.ones(5, dtype=torch.float64), dst=1)
    else:
        dist.recv(torch.empty(5, dtype=torch.float64), src=0)
    out = torch.empty(2 * world_size)
    dist.all_to_all_single(out, torch.ones(2 * world_size))
    try:
        dist.all_reduce(torch.ones(3) if rank == 0 else torch.ones(4))
    except RuntimeError:
        pass
    # torch names plugin backends "custom" in ProcessGroup.name(); what cam controls says "cam".
    assert dist.get_backend() == "cam" and dist.group.WORLD._get_backend(torch.device("cpu")).name() == "cam"
    rec = torch_cam.flight_recorder()
    assert rec["version"] == 1 and rec["rank"] == rank and rec["pid"] == os.getpid(), rec
    (g,) = [g for g in rec["groups"] if g["group"] == dist.group.WORLD.group_name]
    assert (g["rank"], g["size"]) == (rank, world_size), g
    got = [(e["kind"], e["op"], e["peer"], e["dtype"], e["sizes"], e["state"]) for e in g["entries"]]
    p2p = ("p2p", "send", 1, "Double", [5], "completed") if rank == 0 else ("p2p", "recv", 0, "Double", [5], "completed")
    want = [("collective", "all_reduce", -1, "Float", [4, 8], "completed"),
            ("collective", "broadcast", 1, "Short", [3], "completed"),
            p2p,
            ("collective", "all_to_all_single", -1, "Float", [2 * world_size], "completed"),
            ("collective", "all_reduce", -1, "Float", [3 if rank == 0 else 4], "failed")]
    assert got == want, f"\n{got}\n!=\n{want}"
    colls = [e for e in g["entries"] if e["kind"] == "collective"]
    assert [e["seq"] for e in colls] == [1, 2, 3, 4], colls
    assert "every rank must pass the same dtype and size" in g["entries"][-1]["error"], g["entries"][-1]
    for e in g["entries"]:
        assert 0 < e["issued_us"] <= e["started_us"] <= e["ended_us"], e
    # A small ring keeps the newest entries only.
    dist.destroy_process_group()
    return True


def _ring_wraps(rank, world_size, init_file):
    import torch_cam
    _init(rank, world_size, init_file, flight_recorder_entries=4)
    for i in range(10):
        dist.all_reduce(torch.ones(i + 1))
    (g,) = torch_cam.flight_recorder()["groups"]
    assert [e["seq"] for e in g["entries"]] == [7, 8, 9, 10], g["entries"]
    assert [e["sizes"] for e in g["entries"]] == [[7], [8], [9], [10]], g["entries"]
    dist.destroy_process_group()
    return True


def _logged(rank, world_size, init_file, level, log_path):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.environ["TORCH_CAM_LOG_LEVEL"] = level
    _init(rank, world_size, init_file)
    dist.all_reduce(torch.ones(6))
    dist.destroy_process_group()
    return True


class FlightRecorderTest(unittest.TestCase):
    def test_forced_hang_trace_names_missing_rank(self):
        with tempfile.TemporaryDirectory() as d:
            prefix = os.path.join(d, "trace_rank_")
            res = run_ranks(_skip_one_all_reduce, 3, prefix, deadline_s=60)
            assert_all_ok(self, res)
            for r in (0, 1):
                self.assertRegex(res[r][1], "all_reduce \\(seq 4\\)")
            dumps = sorted(os.path.join(d, f) for f in os.listdir(d))
            self.assertEqual([os.path.basename(p) for p in dumps], [f"trace_rank_{r}.json" for r in range(3)])
            with open(dumps[0]) as f:
                rank0 = json.load(f)
            last = rank0["groups"][0]["entries"][-1]
            self.assertEqual((last["op"], last["seq"], last["state"], last["sizes"]), ("all_reduce", 4, "failed", [1000]))
            self.assertRegex(last["error"], "timeout|failed")
            out = subprocess.run([sys.executable, "-m", "torch_cam.trace", *dumps], capture_output=True, text=True,
                                 timeout=60, cwd=REPO)
            self.assertEqual(out.returncode, 0, out.stderr)
            text = out.stdout
            self.assertIn("first collective not completed everywhere: seq 4 (all_reduce)", text)
            self.assertRegex(text, r"rank 2 \(global 2, [^)]*\): NEVER ISSUED seq 4; its last collective is "
                                   r"all_reduce \(seq 3 Float\[4, 8\]\), completed")
            self.assertIn("=> rank 2 did not issue all_reduce (seq 4); ranks 0, 1 wait on it", text)
        self.assertEqual(cam_segments(), [])

    def test_entries_say_what_each_op_was(self):
        assert_all_ok(self, run_ranks(_ops_recorded, 2, deadline_s=60))

    def test_ring_keeps_newest(self):
        assert_all_ok(self, run_ranks(_ring_wraps, 2, deadline_s=60))

    def test_log_levels(self):
        with tempfile.TemporaryDirectory() as d:
            for level in ("warn", "info", "debug"):
                logs = [os.path.join(d, f"{level}{r}.log") for r in range(2)]
                # Each rank writes its own file: run_ranks passes the same args to both, so
                # the path is chosen per rank inside.
                assert_all_ok(self, run_ranks(_logged_rank_file, 2, level, d, deadline_s=60))
                text = [open(p).read() for p in logs]
                for r, t in enumerate(text):
                    if level == "warn":
                        self.assertNotIn("torch_cam I", t)
                    else:
                        self.assertIn(f"rank {r} of 2; transport: shared memory to all 1 peers", t)
                        self.assertRegex(t, r"window \d+ B per rank")
                        self.assertRegex(t, r"wait policy: spin \d+ us")
                        self.assertRegex(t, r"usable CPUs \d+")
                    if level == "debug":
                        self.assertIn("issue all_reduce seq 1 peer -1 Float[6]", t)
                        self.assertIn("done all_reduce seq 1", t)
                    else:
                        self.assertNotIn("issue all_reduce", t)


def _logged_rank_file(rank, world_size, init_file, level, d):
    return _logged(rank, world_size, init_file, level, os.path.join(d, f"{level}{rank}.log"))


def _entry(seq, state, op="all_reduce", error=None):
    return {"id": seq, "seq": seq, "op": op, "kind": "collective", "peer": -1, "dtype": "Float", "sizes": [4],
            "tensors": 1, "numel": 4, "state": state, "issued_us": 1, "started_us": 1, "ended_us": 2, "error": error}


def _dump(d, rank, size, entries):
    path = os.path.join(d, f"r{rank}.json")
    with open(path, "w") as f:
        json.dump({"version": 1, "rank": rank, "pid": 1, "host": "h", "reason": "x", "dumped_us": 1,
                   "groups": [{"group": "0", "desc": "'0'", "rank": rank, "size": size, "capacity": 8,
                               "entries": entries}]}, f)
    return path


class TraceToolTest(unittest.TestCase):
    def _trace(self, *paths):
        out = subprocess.run([sys.executable, "-m", "torch_cam.trace", *paths], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        self.assertEqual(out.returncode, 0, out.stderr)
        return out.stdout

    def test_refusal_everywhere_is_passed_over(self):
        """A collective every rank failed alike (refused arguments) is not what the group waits on."""
        with tempfile.TemporaryDirectory() as d:
            refused = "rank 1 refused its arguments: bad"
            a = _dump(d, 0, 2, [_entry(1, "completed"), _entry(2, "failed", error=refused),
                                _entry(3, "failed", error="timeout after 3000 ms waiting for rank 1")])
            b = _dump(d, 1, 2, [_entry(1, "completed"), _entry(2, "failed", error=refused)])
            text = self._trace(a, b)
            self.assertIn("first collective not completed everywhere: seq 3 (all_reduce)", text)
            self.assertIn("=> rank 1 did not issue all_reduce (seq 3); rank 0 waits on it", text)

    def test_every_rank_completed(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r0.json")
            dump = {"version": 1, "rank": 0, "pid": 1, "host": "h", "reason": "x", "dumped_us": 1,
                    "groups": [{"group": "0", "desc": "'0'", "rank": 0, "size": 1, "capacity": 4, "entries": [
                        {"id": 1, "seq": 1, "op": "barrier", "kind": "collective", "peer": -1, "dtype": None,
                         "sizes": [], "tensors": 0, "numel": 0, "state": "completed", "issued_us": 1,
                         "started_us": 1, "ended_us": 2, "error": None}]}]}
            with open(path, "w") as f:
                json.dump(dump, f)
            out = subprocess.run([sys.executable, "-m", "torch_cam.trace", path], capture_output=True, text=True,
                                 timeout=60, cwd=REPO)
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("every recorded collective completed", out.stdout)


if __name__ == "__main__":
    unittest.main()
