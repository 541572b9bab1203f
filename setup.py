"""Build driver: setuptools hands the native build to CMakeLists.txt (the single description
of sources and flags) and copies the module it produces into the package."""
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def _installed_torch():
    """(environment, cmake prefix path, is a CUDA build) of the torch installed where fastcomm is
    being installed. Under pip's build isolation that torch is hidden (a PYTHONPATH overlay
    drops the environment's site-packages), and the extension must be built against it, not
    against one fetched for the build: so it is looked for without the overlay."""
    env = dict(os.environ)
    for k in ("PYTHONPATH", "PYTHONNOUSERSITE"):
        env.pop(k, None)
    probe = "import torch; print(torch.utils.cmake_prefix_path); print(int(bool(torch.version.cuda)))"
    for e in (os.environ, env):
        out = subprocess.run([sys.executable, "-c", probe], env=e, capture_output=True, text=True)
        if out.returncode == 0:
            prefix, cuda = out.stdout.split()
            return dict(e), prefix, cuda == "1"
    raise RuntimeError("fastcomm builds against an installed torch: install torch first")


def _tool(name, attr):
    """The path of a build tool's own binary. The cmake package's `cmake` command is a Python
    script, which under build isolation needs the overlay that hides torch from CMake's probes."""
    try:
        path = os.path.join(getattr(importlib.import_module(name), attr), name)
        if os.access(path, os.X_OK):
            return path
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        env, torch_prefix, cuda = _installed_torch()
        src = os.path.abspath(os.path.dirname(__file__))
        # One build dir per Python and torch variant: a CPU and a CUDA venv on the same Python
        # must not share CMake caches.
        variant = "cu" if cuda else "cpu"
        build_dir = os.environ.get("FASTCOMM_BUILD_DIR") or os.path.join(
            src, "build", f"py{sys.version_info.major}{sys.version_info.minor}-{variant}")
        os.makedirs(build_dir, exist_ok=True)
        cmake = _tool("cmake", "CMAKE_BIN_DIR") or "cmake"
        ninja = _tool("ninja", "BIN_DIR")
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        cfg = os.environ.get("FASTCOMM_BUILD_TYPE", "Release")
        subprocess.check_call(
            [cmake, "-S", src, "-B", build_dir, *gen,
             f"-DCMAKE_BUILD_TYPE={cfg}",
             f"-DCMAKE_PREFIX_PATH={torch_prefix}",
             f"-DPython_EXECUTABLE={sys.executable}"], env=env)
        subprocess.check_call([cmake, "--build", build_dir, "--parallel", str(os.cpu_count() or 2)], env=env)
        built = os.path.join(build_dir, "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(built, dest)
        if self.inplace is False:
            return
        # Editable installs import the package from the source tree: keep the module there too.
        inplace = os.path.join(src, "fastcomm", os.path.basename(dest))
        if os.path.abspath(inplace) != os.path.abspath(dest):
            shutil.copyfile(built, inplace)


setup(ext_modules=[CMakeExtension("fastcomm._C")], cmdclass={"build_ext": CMakeBuild})
