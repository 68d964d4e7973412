"""The CMake-driven build of torch_cam's extension torch_cam._C. The package's metadata is in
pyproject.toml; the build itself is defined in CMakeLists.txt. This file only drives CMake, so
that `pip install --no-build-isolation .` (or `-e .`) and `python -m build --wheel --no-isolation`
build the extension against the torch already installed in the environment.

CMake's build directory is kept in the source tree, one per (interpreter, torch, build type):
build/cmake-<python>-<hash>. setuptools' own build_temp is a fresh temporary directory for
editable installs, so using it would make every install a full rebuild; with a kept directory
`pip install -e .` followed by a wheel build of the same checkout in the same environment
costs an incremental build (usually nothing to compile), not a second full one.
Set TORCH_CAM_CMAKE_BUILD_DIR to use another directory, TORCH_CAM_BUILD_TYPE for the CMake
build type (Release by default)."""
import contextlib
import fcntl
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SRC = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def _torch_location():
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        sys.exit(
            "torch_cam: torch is not importable by the Python that builds it "
            f"({sys.executable}).\n"
            "The extension is compiled against the torch of the environment it is installed into:\n"
            "install torch there first, then build without isolation, e.g.\n"
            "    pip install torch && pip install --no-build-isolation <path or URL of torch_cam>")
    return os.path.dirname(os.path.realpath(spec.origin))


def _python_for_cmake(build_dir):
    # The interpreter as the directory's CMake cache already knows it, if it is this one under
    # another name: a changed Python3_EXECUTABLE would make CMake look for Python again.
    exe = os.path.abspath(sys.executable)
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("Python3_EXECUTABLE:"):
                    cached = line.split("=", 1)[1].strip()
                    if os.path.exists(cached) and os.path.samefile(cached, exe):
                        return cached
    except OSError:
        pass
    return exe


def _cmake_build_dir(cfg):
    override = os.environ.get("TORCH_CAM_CMAKE_BUILD_DIR")
    if override:
        return os.path.abspath(override)
    torch_dir = _torch_location()
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "unknown"
    # sys.prefix names the environment; sys.executable is left out, as one environment's
    # interpreter has several names (python, python3, a path with ..) that must share a directory.
    key = "\0".join([os.path.realpath(sys.prefix), torch_dir, torch_version, cfg])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(SRC, "build", f"cmake-{sys.implementation.cache_tag}-{digest}")


@contextlib.contextmanager
def _locked(build_dir):
    # Two builds of one checkout in one environment at once would share the directory.
    with open(os.path.join(build_dir, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        cmake = shutil.which("cmake")
        if cmake is None:
            sys.exit("torch_cam: cmake (3.18 or newer) is not on PATH; install it "
                     "(e.g. `pip install cmake` or your system's package) and build again.")
        target = os.path.abspath(self.get_ext_fullpath(ext.name))
        cfg = os.environ.get("TORCH_CAM_BUILD_TYPE", "Release")
        build_dir = _cmake_build_dir(cfg)
        # CMake links the module into a fixed directory of its own, so that building for an
        # editable install (target in the source tree) and for a wheel (target in build/lib.*)
        # shares one up-to-date link; the module is then copied to where setuptools wants it.
        lib_dir = os.path.join(build_dir, "lib")
        os.makedirs(lib_dir, exist_ok=True)
        with _locked(build_dir):
            subprocess.check_call([
                cmake, "-S", SRC, "-B", build_dir,
                f"-DPython3_EXECUTABLE={_python_for_cmake(build_dir)}",
                f"-DCMAKE_BUILD_TYPE={cfg}",
                f"-DCAM_OUTPUT_DIR={lib_dir}",
            ])
            jobs = str(os.cpu_count() or 2)
            subprocess.check_call([cmake, "--build", build_dir, "-j", jobs])
            built = os.path.join(lib_dir, os.path.basename(target))
            if not os.path.exists(built):
                found = glob.glob(os.path.join(lib_dir, "_C*.so"))
                sys.exit(f"torch_cam: CMake did not produce {built} (found: {found})")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            # Copy, then rename over the target: a process that has the old module mapped
            # keeps a valid file.
            tmp = f"{target}.tmp{os.getpid()}"
            shutil.copy2(built, tmp)
            os.replace(tmp, target)


setup(
    ext_modules=[CMakeExtension("torch_cam._C")],
    cmdclass={"build_ext": CMakeBuild},
)
