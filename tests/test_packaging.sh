#!/usr/bin/env bash
# Packaging check: build a wheel of this checkout against the calling environment's torch, install
# it (--no-deps) into a fresh venv that has only that torch, and from outside the checkout import
# torch_cam and run a 2-rank all_reduce on backend "cam".
#   bash tests/test_packaging.sh [python]      (default .venv/bin/python)
# The wheel build reuses the CMake build directory that `make build` (pip install -e .) left in
# build/ (see setup.py), so after it this costs an incremental build, not a full one.
set -euo pipefail
PY=${1:-.venv/bin/python}
cd "$(dirname "$0")/.."
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
repo=$(pwd)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/torch_cam_pkg.XXXXXX")
cleanup() { rm -rf "$tmp"; }
trap cleanup EXIT
trap 'exit 143' TERM INT

step() { echo "-- $* ($SECONDS s)"; }

# setuptools' staging directories are plain copies; clearing them keeps a module deleted from the
# checkout out of the wheel. CMake's build directories (build/cmake-*) are kept.
rm -rf build/lib.* build/bdist.*

step "wheel"
# python -m build --no-isolation checks pyproject's build requirements (setuptools, wheel).
if "$PY" -c "import build, wheel" 2>/dev/null; then
  "$PY" -m build --wheel --no-isolation --outdir "$tmp/dist" . >"$tmp/build.log" 2>&1 ||
    { tail -n 60 "$tmp/build.log"; echo "FAILED: python -m build --wheel --no-isolation"; exit 1; }
else
  echo "(the 'build' or 'wheel' package is not installed in $PY's environment; using pip wheel instead)"
  "$PY" -m pip wheel --no-build-isolation --no-deps -w "$tmp/dist" . >"$tmp/build.log" 2>&1 ||
    { tail -n 60 "$tmp/build.log"; echo "FAILED: pip wheel --no-build-isolation"; exit 1; }
fi
wheels=("$tmp"/dist/torch_cam-*.whl)
[ ${#wheels[@]} -eq 1 ] && [ -f "${wheels[0]}" ] || { echo "FAILED: expected one wheel, got: ${wheels[*]}"; exit 1; }
whl=${wheels[0]}
echo "   $(basename "$whl")"

# The wheel holds the extension and every module of the package (subpackages too), and nothing else.
"$PY" - "$whl" "$repo" <<'EOF'
import os, sys, zipfile
whl, repo = sys.argv[1:]
names = zipfile.ZipFile(whl).namelist()
pkg = sorted(n for n in names if n.endswith(".py"))
src = sorted(os.path.relpath(os.path.join(d, f), repo).replace(os.sep, "/")
             for d, _, fs in os.walk(os.path.join(repo, "torch_cam")) if "__pycache__" not in d
             for f in fs if f.endswith(".py"))
ext = [n for n in names if n.startswith("torch_cam/_C") and n.endswith(".so")]
other = [n for n in names if not n.startswith(("torch_cam/", "torch_cam-"))]
problems = []
if len(ext) != 1:
    problems.append(f"extension modules in the wheel: {ext}")
if pkg != src:
    problems.append(f"modules: wheel has {sorted(set(pkg) - set(src))} extra, lacks {sorted(set(src) - set(pkg))}")
if other:
    problems.append(f"files outside the package: {other}")
if problems:
    sys.exit("FAILED: wheel contents: " + "; ".join(problems))
print(f"   {len(pkg)} modules and {ext[0]}")
EOF

# The sdist carries every source the CMake build needs (MANIFEST.in), so a wheel can be built from it.
if "$PY" -c "import build" 2>/dev/null; then
  step "sdist"
  "$PY" -m build --sdist --no-isolation --outdir "$tmp/sdist" . >"$tmp/sdist.log" 2>&1 ||
    { tail -n 30 "$tmp/sdist.log"; echo "FAILED: python -m build --sdist --no-isolation"; exit 1; }
  "$PY" - "$tmp"/sdist/torch_cam-*.tar.gz "$repo" <<'EOF'
import subprocess, sys, tarfile
sdist, repo = sys.argv[1:]
have = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
need = subprocess.run(["git", "-C", repo, "ls-files", "CMakeLists.txt", "setup.py", "pyproject.toml", "csrc", "kernels",
                       "torch_cam"], capture_output=True, text=True, check=True).stdout.split()
missing = sorted(set(need) - have)
if missing:
    sys.exit(f"FAILED: the sdist lacks {missing}")
print(f"   {len(need)} build sources in the sdist")
EOF
fi

torch_version=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
step "fresh venv with torch==$torch_version"
"$PY" -m venv "$tmp/venv"
VPY=$tmp/venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check --no-compile "torch==$torch_version" >"$tmp/pip.log" 2>&1 ||
  { tail -n 30 "$tmp/pip.log"; echo "FAILED: pip install torch==$torch_version"; exit 1; }
step "install the wheel (--no-deps)"
"$VPY" -m pip install -q --disable-pip-version-check --no-compile --no-deps "$whl"

step "smoke test"
cat >"$tmp/smoke.py" <<'EOF'
import os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def worker(rank, store_path):
    import torch_cam  # noqa: F401  (registers "cam")
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("cam", store=store, rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(x)
    expected = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(WORLD))
    assert torch.equal(x, expected), f"rank {rank}: all_reduce gave {x[:4]}..., expected {expected[:4]}..."
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch_cam
    where = os.path.realpath(torch_cam.__file__)
    if not where.startswith(os.path.realpath(sys.prefix) + os.sep):
        sys.exit(f"FAILED: torch_cam imported from {where}, not from the venv {sys.prefix}")
    print(f"   torch {torch.__version__}, torch_cam {torch_cam.__version__} from {where}")
    mp.spawn(worker, args=(os.path.join(os.path.dirname(os.path.abspath(__file__)), "store"),),
             nprocs=WORLD, join=True)
    print("   all_reduce over 'cam' on 2 ranks: ok")
EOF
(cd "$tmp" && env -u PYTHONPATH timeout --kill-after=10 120 "$VPY" smoke.py) ||
  { echo "FAILED: smoke test of the installed wheel"; exit 1; }
echo "PASSED: tests/test_packaging.sh (${SECONDS} s)"
