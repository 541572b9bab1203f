"""Runs the C++ unit tests (tests/cpp, built as fastcomm_unit_tests next to the module) as
one pytest case each.

The binary lives in the CMake build directory setup.py uses, or in $FASTCOMM_BUILD_DIR. A
missing binary fails (it does not skip): CI builds it with the module, so its absence means
the build is broken or stale, not that the tests do not apply."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 60
NAME = "fastcomm_unit_tests"


def _binary():
    build_dir = os.environ.get("FASTCOMM_BUILD_DIR")
    if not build_dir:
        try:
            import torch

            variant = "cu" if torch.version.cuda else "cpu"
        except ImportError:
            variant = "cpu"
        build_dir = os.path.join(ROOT, "build", f"py{sys.version_info.major}{sys.version_info.minor}-{variant}")
    return os.path.join(build_dir, NAME)


BINARY = _binary()


def _collect():
    """The C++ test names and None, or [] and why they cannot be listed."""
    if not os.access(BINARY, os.X_OK):
        return [], (f"{BINARY} not found: build it with `pip install --no-build-isolation -e .` "
                    f"(or `cmake --build <build dir> --target {NAME}`), or set FASTCOMM_BUILD_DIR")
    try:
        r = subprocess.run([BINARY, "--list"], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"{BINARY} --list timed out"
    names = r.stdout.split()
    if r.returncode != 0 or not names:
        return [], f"{BINARY} --list failed (rc {r.returncode}):\n{r.stdout}{r.stderr}"
    return names, None


NAMES, PROBLEM = _collect()


_results = None


def _run_all():
    """Runs the whole binary once (libtorch takes a good part of a second to load, per
    process): {name: (passed, report)} for every test it reported on. A test missing from it
    (the run crashed or hung there) is then run alone."""
    global _results
    if _results is None:
        _results = {}
        try:
            r = subprocess.run([BINARY], capture_output=True, text=True, timeout=TIMEOUT_S)
            out = r.stdout
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        current = None
        for line in out.splitlines():
            if line.startswith(("PASS ", "FAIL ")):
                current = line.split()[1]
                _results[current] = (line.startswith("PASS "), [line])
            elif line.startswith("    ") and current is not None:
                _results[current][1].append(line)
            else:
                current = None
    return _results


@pytest.mark.parametrize("name", NAMES or ["<unavailable>"])
def test_cpp(name):
    if PROBLEM:
        pytest.fail(PROBLEM, pytrace=False)
    result = _run_all().get(name)
    if result is not None:
        passed, report = result
        if not passed:
            pytest.fail("\n".join(report), pytrace=False)
        return
    try:
        r = subprocess.run([BINARY, "--exact", name], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{name} ran past {TIMEOUT_S} s\n{out}", pytrace=False)
    out = r.stdout + r.stderr
    if r.returncode != 0:
        pytest.fail(f"{name} failed (rc {r.returncode}):\n{out}", pytrace=False)
    # Exactly this test ran, and passed.
    assert f"PASS {name} " in r.stdout, out
    assert r.stdout.rstrip().endswith("1 passed, 0 failed"), out
