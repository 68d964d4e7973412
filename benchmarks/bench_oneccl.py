"""Intel oneCCL (CPU) reference for bench_collectives.py, driven from C++ (oneccl_worker.cpp).

Measures the ops of bench_collectives.py that oneCCL has (the 8-byte round trip, broadcast,
all_to_all_single, all_reduce fp32 and bf16, all_gather_into_tensor, reduce_scatter_tensor) with
the same timing method (_common.py) and the same checks as bench_mpi.py, once per setting in
SETTINGS, and keeps each cell's best median (the setting is named in the row): the "best
setting" figure the targets compare against.

Setup, done on first use: the ``oneccl-cpu``, ``oneccl-cpu-devel`` and ``intel-cmplr-lib-rt``
wheels (library, headers, the Intel runtime the library links) are fetched with pip into
``~/.cache/torch_cam/oneccl`` (``TORCH_CAM_ONECCL_DIR`` overrides) and the worker is compiled
there with g++. oneCCL's transport is libfabric's (``CCL_ATL_TRANSPORT=ofi``), which the wheels
do not carry: on Debian ``apt-get install libfabric1`` (done here when running as root with apt).
Ranks are started by this script (``CCL_PROCESS_LAUNCHER=none``), rank 0's key-value store
address passed through a file.

Alone::

    .venv/bin/python benchmarks/bench_oneccl.py --ranks 2 4 [--quick] [--pin] [--single-shot]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

VERSION = "2022.2.0"
WHEELS = [f"oneccl-cpu=={VERSION}", f"oneccl-cpu-devel=={VERSION}", "intel-cmplr-lib-rt"]
OPS = ("roundtrip", "broadcast", "all_to_all_single", "all_reduce", "all_reduce_bf16", "all_gather_into_tensor",
       "reduce_scatter_tensor")
# Each cell is measured under every setting; the fastest median is reported. oneCCL's default
# offloads every op to a busy-polling worker thread, which on a machine with fewer cores than
# ranks x 2 waits for time slices (8-16 ms per 1 KiB op here); the calling thread progressing
# its own ops (CCL_WORKER_OFFLOAD=0) and oneCCL's shared-memory layer between local ranks
# (CCL_ATL_SHM=1) measured fastest, so the settings vary around them. tcp is libfabric's
# provider (its shm provider aborts at startup in this container).
SETTINGS = {
    "atl-shm, no offload": {"FI_PROVIDER": "tcp", "CCL_ATL_SHM": "1", "CCL_WORKER_OFFLOAD": "0"},
    "tcp, no offload": {"FI_PROVIDER": "tcp", "CCL_WORKER_OFFLOAD": "0"},
    "atl-shm, worker yields": {"FI_PROVIDER": "tcp", "CCL_ATL_SHM": "1", "CCL_YIELD": "sched_yield"},
}
_WORKER_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "oneccl_worker.cpp")


class OneCCLUnavailable(RuntimeError):
    pass


def _home() -> str:
    return os.environ.get("TORCH_CAM_ONECCL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_cam",
                                                                   "oneccl")


def _data_dirs(root: str) -> tuple[str, str, str]:
    """(include dir, oneCCL lib dir, Intel runtime lib dir) of the unpacked wheels."""
    def find(pkg_prefix: str, sub: str) -> str:
        for name in sorted(os.listdir(root)):
            if name.startswith(pkg_prefix) and name.endswith(".data"):
                path = os.path.join(root, name, "data", sub)
                if os.path.isdir(path):
                    return path
        raise OneCCLUnavailable(f"oneCCL: {pkg_prefix}*.data/data/{sub} missing under {root}")
    return (find("oneccl_cpu_devel-", "include"), find("oneccl_cpu-", "lib"), find("intel_cmplr_lib_rt-", "lib"))


def _libfabric_present() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libfabric.so.1" in out


def ensure_worker() -> tuple[str, dict]:
    """Fetches the wheels and builds the worker if needed; returns (worker path, env additions)."""
    root = _home()
    pkgs = os.path.join(root, VERSION)
    if not os.path.isdir(pkgs):
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=root)
        dl = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *WHEELS],
                            capture_output=True, text=True, timeout=600)
        if dl.returncode != 0:
            raise OneCCLUnavailable(f"oneCCL: pip download {' '.join(WHEELS)} failed: {dl.stderr.strip()[-400:]}")
        unpacked = tmp + ".unpacked"
        for whl in os.listdir(tmp):
            with zipfile.ZipFile(os.path.join(tmp, whl)) as z:
                z.extractall(unpacked)
        shutil.rmtree(tmp)
        os.replace(unpacked, pkgs)
    inc, lib, rtlib = _data_dirs(pkgs)
    # The library names libccl.so.2 as a dependency but the wheel ships it as libccl.so.1.
    so2 = os.path.join(lib, "libccl.so.2")
    if not os.path.exists(so2):
        os.symlink("libccl.so.1", so2)
    if not _libfabric_present():
        if os.geteuid() == 0 and shutil.which("apt-get"):
            subprocess.run(["apt-get", "install", "-y", "-q", "libfabric1"], capture_output=True, timeout=600)
        if not _libfabric_present():
            raise OneCCLUnavailable("oneCCL: libfabric.so.1 not found (Debian: apt-get install libfabric1)")
    with open(_WORKER_SRC, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    exe = os.path.join(root, f"oneccl_worker-{digest}")
    if not os.path.exists(exe):
        cmd = ["g++", "-O2", "-std=c++17", f"-I{inc}", _WORKER_SRC, f"-L{lib}", f"-L{rtlib}", "-lccl", "-lirc",
               "-lintlc", f"-Wl,-rpath,{lib}:{rtlib}", "-o", exe + ".tmp"]
        cc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if cc.returncode != 0:
            raise OneCCLUnavailable(f"oneCCL: building the worker failed: {cc.stderr.strip()[-800:]}")
        os.replace(exe + ".tmp", exe)
    return exe, {"CCL_ATL_TRANSPORT": "ofi", "CCL_PROCESS_LAUNCHER": "none", "CCL_LOG_LEVEL": "warn"}


def _cells(quick: bool, single_shot: bool) -> str:
    plan = C.plan_for(quick, single_shot)
    # the round trip warms up 10x longer, as bench_collectives.py and bench_mpi.py do
    return ",".join(f"{op}:{n}:{plan.warmup(n) * (10 if op == 'roundtrip' else 1)}" for op in OPS
                    for n in C.op_sizes(op, quick))


def _plan_arg(quick: bool, single_shot: bool) -> str:
    p = C.plan_for(quick, single_shot)
    return ",".join(str(x) for x in (p.target_batch_s, p.cell_budget_s, p.min_samples, p.max_samples, p.max_batch,
                                     p.barrier_overhead_s))


def _run_setting(exe: str, env_base: dict, setting: dict, world: int, quick: bool, deadline_s: float, pin: bool,
                 single_shot: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        kvs, out = os.path.join(tmp, "kvs"), os.path.join(tmp, "rows.json")
        env = dict(os.environ, **env_base, **setting)
        ncores = os.cpu_count() or 1
        procs, logs = [], []
        for r in range(world):
            cmd = [exe, str(r), str(world), kvs, _plan_arg(quick, single_shot), _cells(quick, single_shot), out]
            if pin:
                cmd = ["taskset", "-c", str(r % ncores)] + cmd
            # stderr to a file, not a pipe read after exit: a rank's warnings cannot fill it and stall the rank
            logs.append(os.path.join(tmp, f"rank{r}.err"))
            with open(logs[-1], "w") as err:
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                              start_new_session=True))
        until = time.time() + deadline_s
        error = None
        # Until every rank is done, one fails (its peers would then wait in oneCCL, which has no
        # deadline of its own) or the deadline passes.
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.time() > until:
                error = f"past the {deadline_s:g} s deadline"
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        if error is None:
            bad = [(r, p.returncode, open(logs[r]).read().strip()[-300:]) for r, p in enumerate(procs)
                   if p.returncode and p.returncode != -9]  # -9: killed here after a peer failed
            if bad:
                error = "; ".join(f"rank {r} exited {rc}: {err}" for r, rc, err in bad)
        res = {"rows": [], "complete": False}
        if os.path.exists(out):
            with open(out) as f:
                res = json.load(f)
        if error:
            res["error"] = error
        return res


def run_world(world: int, quick: bool, deadline_s: float, pin: bool = False, single_shot: bool = False) -> dict:
    """Every setting for `world` ranks; returns {"world", "rows", "complete", "error"?, "cmd"} with each
    (op, size) row the best median over the settings."""
    try:
        exe, env_base = ensure_worker()
    except (OneCCLUnavailable, OSError, subprocess.SubprocessError) as e:
        return {"world": world, "rows": [], "complete": False, "error": str(e), "cmd": ""}
    best: dict[tuple[str, int], dict] = {}
    errors = []
    for name, setting in SETTINGS.items():
        res = _run_setting(exe, env_base, setting, world, quick, deadline_s / len(SETTINGS), pin, single_shot)
        if res.get("error"):
            errors.append(f"{name}: {res['error']}")
        for r in res.get("rows", []):
            row = {k: v for k, v in r.items() if k != "times_s"}
            row.update(C.summarize(r["times_s"]), setting=name)
            key = (r["op"], r["size"])
            rank = lambda x: (not x["ok"], x["median_us"])  # noqa: E731  a checked row first, then the faster
            if key not in best or rank(row) < rank(best[key]):
                best[key] = row
    env_desc = " ".join(f"{k}={v}" for k, v in env_base.items())
    out = {"world": world, "rows": list(best.values()), "complete": not errors,
           "cmd": f"{env_desc} {'taskset ' if pin else ''}oneccl_worker (settings: " +
                  ", ".join(f"{n}: {' '.join(f'{k}={v}' for k, v in s.items())}" for n, s in SETTINGS.items()) + ")"}
    if errors:
        out["error"] = "; ".join(errors)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--single-shot", action="store_true")
    ap.add_argument("--timeout", type=float, default=600, help="deadline per world size (s)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    allres = []
    for world in args.ranks:
        res = run_world(world, args.quick, args.timeout, args.pin, args.single_shot)
        allres.append(res)
        print(f"## oneCCL, world size {world}" + (f" (error: {res['error']})" if res.get("error") else ""))
        print("| op | size | median | p90 | setting | check |\n|---|---|---|---|---|---|")
        for r in res["rows"]:
            print(f"| {C.label(r['op'])} | {C.fmt_size(r['size'])} | {C.fmt_time(r['median_us'])} | "
                  f"{C.fmt_time(r['p90_us'])} | {r['setting']} | {'ok' if r['ok'] else 'WRONG'} |")
        print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(allres, f, indent=1)


if __name__ == "__main__":
    main()
