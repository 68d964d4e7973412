"""Packaging for torch_cam. The build itself is defined in CMakeLists.txt; this file only
drives CMake so that `pip install --no-build-isolation .` (or `-e .`) builds the extension
against the torch already installed in the environment."""
import os
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        out_dir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        os.makedirs(build_dir, exist_ok=True)
        src = os.path.dirname(os.path.abspath(__file__))
        cfg = os.environ.get("TORCH_CAM_BUILD_TYPE", "Release")
        subprocess.check_call([
            "cmake", "-S", src, "-B", build_dir,
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCAM_OUTPUT_DIR={out_dir}",
        ])
        jobs = str(os.cpu_count() or 2)
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs])


setup(
    name="torch_cam",
    version="0.1.0",
    description="Memory-semantic torch.distributed backend 'cam' over a symmetric shared-memory heap",
    packages=find_packages(include=["torch_cam", "torch_cam.*"]),
    ext_modules=[CMakeExtension("torch_cam._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=["torch>=2.6"],
)
