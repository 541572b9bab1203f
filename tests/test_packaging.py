"""Packaging: the source distribution carries everything the native build reads (so
``pip install --no-build-isolation`` of it builds against the installed torch, like the
checkout does), and no build output; the version is pyproject.toml's, once."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile

import fastcomm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject_version():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        return re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.MULTILINE).group(1)


def test_version_is_pyprojects():
    assert fastcomm.__version__ == _pyproject_version()


def test_sdist_carries_the_build(tmp_path):
    # egg_info into tmp_path: building the sdist must not write into the checkout.
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                    "sdist", "--dist-dir", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    name = f"fastcomm-{_pyproject_version()}"
    with tarfile.open(tmp_path / f"{name}.tar.gz") as tar:
        files = {m.name[len(name) + 1:] for m in tar.getmembers() if m.isfile()}
    needed = {"CMakeLists.txt", "setup.py", "pyproject.toml", "README.md", "MANIFEST.in"}
    for top in ("csrc", "fastcomm"):
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            needed |= {os.path.relpath(os.path.join(d, n), ROOT) for n in names
                       if n.endswith((".cpp", ".h", ".cu", ".py"))}
    assert not needed - files, f"missing from the sdist: {sorted(needed - files)}"
    built = sorted(f for f in files if f.endswith((".so", ".o", ".pyc")) or f.startswith("build/"))
    assert not built, f"build outputs in the sdist: {built}"
