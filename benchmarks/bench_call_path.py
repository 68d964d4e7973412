#!/usr/bin/env python3
"""The per-op cost of the call path, counted instead of timed: instructions and heap allocations
per blocking op, cam beside torch's do-nothing "fake" backend, under valgrind's callgrind.

    python benchmarks/bench_call_path.py [--ops 20000] [--cases all_reduce,recv]

Wall-clock times of a few microseconds move by 2x between runs on a shared VM; instruction and
allocation counts of the same loop do not, so a change to the per-op path (Op, Work, Future,
the engine's pass) can be measured on any machine. Cases:

* all_reduce: ``dist.all_reduce`` of 8 bytes on a group of one rank: the whole issue, progress
  and completion path of a collective, with no peer to wait for;
* recv: ``dist.recv`` of 8 bytes on rank 1 of two, whose partner (not under valgrind) has
  already sent: issue, match, copy and completion, without spinning.

Each case runs its loop 2000 times, then the counters are zeroed, the loop runs ``--ops`` times
and the counters are dumped (``callgrind_control``), so start-up is not counted. The figure is
the whole process's count divided by the ops (Python, pybind and torch.distributed included, as
in the fake backend's column). Needs valgrind (``apt-get install valgrind``); one case takes
one to two minutes.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def worker(backend: str, case: str, ops: int, marks: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    world = 1 if case == "all_reduce" else 2
    if backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=1 if case == "recv" else 0, world_size=world)
    else:
        import torch_cam  # noqa: F401

        dist.init_process_group("cam", timeout=datetime.timedelta(seconds=900), rank=rank, world_size=world)
    x = torch.zeros(2)
    profiled = backend == "fake" or case == "all_reduce" or rank == 1

    def loop(n: int) -> None:
        if case == "all_reduce":
            for _ in range(n):
                dist.all_reduce(x)
        elif not profiled:  # the partner of a cam recv: sends ahead of the profiled receiver
            for _ in range(n):
                dist.send(x, 1)
        else:
            for _ in range(n):
                dist.recv(x, 0)

    def mark(name: str) -> None:
        open(os.path.join(marks, name), "w").close()

    def await_mark(name: str) -> None:  # the parent's timeout bounds a case; this bounds an orphan
        deadline = time.monotonic() + 3600
        while not os.path.exists(os.path.join(marks, name)):
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_call_path worker: no '{name}' from the parent in an hour")
            time.sleep(0.05)

    loop(2000)
    if profiled:
        mark("ready")
    await_mark("go")
    loop(ops)
    if profiled:
        mark("done")
    await_mark("fin")
    if backend == "cam" and world > 1:
        dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(path: str, procs: list[subprocess.Popen], deadline: float) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"bench_call_path: gave up waiting for {os.path.basename(path)}")
        time.sleep(0.2)


def count(backend: str, case: str, ops: int, timeout_s: float) -> tuple[float, float]:
    """(instructions, malloc calls) per op of `case` on `backend`."""
    with tempfile.TemporaryDirectory(prefix="cam_call_path.") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE="1" if case == "all_reduce" else "2")
        cmd = [sys.executable, HERE, "--worker", backend, case, str(ops), tmp]
        ranks = [1, 0] if case == "recv" and backend == "cam" else [0]
        procs, profiled = [], None
        try:
            for r in ranks:
                e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
                if r == ranks[0]:
                    profiled = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + cmd,
                                                env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    procs.append(profiled)
                else:
                    procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            deadline = time.monotonic() + timeout_s
            wait_for(os.path.join(tmp, "ready"), procs, deadline)
            subprocess.run(["callgrind_control", "-z", str(profiled.pid)], check=True, stdout=subprocess.DEVNULL)
            open(os.path.join(tmp, "go"), "w").close()
            wait_for(os.path.join(tmp, "done"), procs, deadline)
            subprocess.run(["callgrind_control", "-d", str(profiled.pid)], check=True, stdout=subprocess.DEVNULL)
            open(os.path.join(tmp, "fin"), "w").close()
            for p in procs:
                p.wait(timeout=max(10.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        dump = out + ".1"  # the dump taken after the timed loop
        return instructions(dump) / ops, calls(dump, "malloc") / ops


def instructions(path: str) -> int:
    """The dump's own cost (its `summary:` line: since the counters were zeroed)."""
    with open(path) as f:
        for line in f:
            if line.startswith("summary:"):
                return int(line.split()[1])
    raise RuntimeError(f"bench_call_path: no summary in {path}")


def calls(path: str, function: str) -> int:
    """Calls into `function` recorded in a callgrind dump (names are compressed to ids)."""
    names, target, total = {}, False, 0
    with open(path) as f:
        for line in f:
            if line.startswith("cfn="):
                m = re.match(r"cfn=\((\d+)\)(?: (.*))?", line.strip())
                if m.group(2):
                    names[m.group(1)] = m.group(2)
                target = names.get(m.group(1)) == function
            elif line.startswith("fn="):
                m = re.match(r"fn=\((\d+)\)(?: (.*))?", line.strip())
                if m and m.group(2):
                    names[m.group(1)] = m.group(2)
            elif line.startswith("calls=") and target:
                total += int(line[6:].split()[0])
                target = False
    return total


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=20000, help="ops counted per case")
    ap.add_argument("--cases", default="all_reduce,recv", help="comma-separated: all_reduce, recv")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per case and backend")
    args = ap.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("bench_call_path: needs valgrind's callgrind (apt-get install valgrind)")
    rows = []
    for case in args.cases.split(","):
        fake = count("fake", case, args.ops, args.timeout)
        cam = count("cam", case, args.ops, args.timeout)
        rows.append((case, fake, cam))
        print(f"{case}: fake {fake[0]:.0f} instructions, {fake[1]:.2f} allocations; "
              f"cam {cam[0]:.0f}, {cam[1]:.2f} per op", flush=True)
    print("\n| op (8 B, blocking) | fake instructions | cam instructions | cam - fake | fake allocations | "
          "cam allocations |")
    print("|---|---|---|---|---|---|")
    for case, (fi, fa), (ci, ca) in rows:
        print(f"| {case} | {fi:.0f} | {ci:.0f} | {ci - fi:.0f} | {fa:.2f} | {ca:.2f} |")


if __name__ == "__main__":
    main()
