"""torch's own distributed suite (torch/testing/_internal/distributed/distributed_test.py, from
the installed torch wheel) on the fastcomm backend and on Gloo, world size 2, CPU tensors:
fastcomm's outcome (pass / skip / fail) must be Gloo's, test for test, except for EXCEPTIONS,
each listed with the outcomes it has and why.

tests/torch_suite/run_suite.py runs the suite the way torch's CI runs it for a backend (see
its docstring); here it runs the tests of tests/torch_suite/selection.txt for Gloo and for
fastcomm, live, one after the other, each in its own process session under a hard timeout
(the session is killed on expiry, so no rank outlives the test).

Left out, for time (about 0.5 s per test and backend even to skip):
- the tests that skip on both backends in a full run at world size 2 on a machine without
  GPUs, about 200 of the suite's 285: they need CUDA, 3 or more ranks, or a feature torch
  tests on NCCL or MPI only, or torch disables them. selection.txt is the other tests, made by
  `run_suite.py --ran-in` from full runs of both backends (its header says how);
- other world sizes.
fastcomm runs with --ungate: the tests in run_suite.UNGATED, which the suite runs only for a
backend named "gloo" though their bodies work with any backend, run on fastcomm too."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import fastcomm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "torch_suite"))
import run_suite  # noqa: E402  (only its report helpers: importing it imports no test suite)
DRIVER = os.path.join(HERE, "torch_suite", "run_suite.py")
SELECTION = os.path.join(HERE, "torch_suite", "selection.txt")
TEST_TIMEOUT = 60  # seconds per test of the suite (its ranks are terminated after)
RUN_TIMEOUT = 240  # seconds per backend for the whole selection (about 45 s unloaded)

GATED = ("torch's suite runs it only for a backend named gloo, and its body is specific to "
         "that backend")
EXCEPTIONS = {
    # name: (Gloo's outcome, fastcomm's outcome, why)
    "test_ddp_logging_data_cpu": (
        "pass", "fail", "torch limitation: DDP logs the backend name of ProcessGroup.name(), "
        "which is 'custom' for every third-party backend, and the test expects 'fastcomm'"),
    "test_monitored_barrier_gloo": (
        "pass", "skip", "torch allows dist.monitored_barrier on Gloo only (fastcomm's own is "
        "fc.monitored_barrier)"),
    "test_monitored_barrier_gloo_rank_0_timeout": ("pass", "skip", "monitored_barrier, as above"),
    "test_monitored_barrier_gloo_subgroup": ("pass", "skip", "monitored_barrier, as above"),
    "test_accumulate_gradients_no_sync": (
        "pass", "skip", GATED + " (it builds its model only for gloo, mpi or nccl); DDP's "
        "no_sync runs on fastcomm in test_grads_same_across_ranks_with_no_sync"),
    "test_accumulate_gradients_no_sync_grad_is_view": ("pass", "skip", "as above"),
    "test_accumulate_gradients_no_sync_allreduce_hook": ("pass", "skip", "as above"),
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": ("pass", "skip", "as above"),
}


def run_backend(backend, out_dir, extra=()):
    """Runs the selection on `backend`; returns its report (run_suite.py's JSON)."""
    out = os.path.join(out_dir, f"{backend}.json")
    log = os.path.join(out_dir, f"{backend}.log")
    env = dict(os.environ)
    # The fastcomm this test imported, whether installed or in place.
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastcomm.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, DRIVER, "--backend", backend, "--tests-file", SELECTION,
           "--test-timeout", str(TEST_TIMEOUT), "--out", out, "--work-dir", out_dir, *extra]
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # The session holds the driver and every rank it forked: none may outlive the run.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    tail = open(log, errors="replace").read()[-3000:]
    assert rc is not None, f"{backend}: the selection ran past {RUN_TIMEOUT}s; log tail:\n{tail}"
    assert rc == 0 and os.path.exists(out), f"{backend}: driver exited {rc}; log tail:\n{tail}"
    report = json.load(open(out))
    report["wall"] = time.monotonic() - t0
    return report


@pytest.mark.timeout(2 * RUN_TIMEOUT + 60)
def test_torch_suite_outcomes_match_gloo():
    pytest.importorskip("expecttest", reason="torch's test harness needs expecttest "
                        "(requirements.txt)")
    selected = [l.split("#")[0].strip() for l in open(SELECTION)]
    selected = [n for n in selected if n]
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as d:
        gloo = run_backend("gloo", d)
        fc = run_backend("fastcomm", d, ["--ungate"])
    problems = []
    for name in selected:
        g, f = gloo["tests"].get(name), fc["tests"].get(name)
        if g is None or f is None:
            problems.append(f"{name}: no outcome (gloo {g and g['outcome']}, fastcomm "
                            f"{f and f['outcome']})")
            continue
        expected = EXCEPTIONS.get(name, (g["outcome"], g["outcome"], None))[:2]
        if (g["outcome"], f["outcome"]) != expected:
            why = run_suite.reason(f["detail"] or g["detail"])
            problems.append(f"{name}: gloo {g['outcome']}, fastcomm {f['outcome']} (expected "
                            f"{expected[0]}/{expected[1]}): {why}")
    stale = sorted(set(EXCEPTIONS) - set(selected))
    assert not stale, f"exceptions for tests not in the selection: {stale}"
    assert not problems, "\n".join(problems)
    print(f"gloo {gloo['wall']:.0f}s, fastcomm {fc['wall']:.0f}s for {len(selected)} tests")
