"""The examples, run as a user runs them (one command that starts its own ranks), each with
``--compare --check --json``: the run on fastcomm must match the same program on torch Gloo
and the one-process reference the example computes, the loss must fall, and gossip replicas
must end close together. Each run is its own process session with a hard timeout, and must
leave no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_TIMEOUT_S = 120  # hard limit per example run; the example's own --timeout fires first


def run_example(name, *args, env=None):
    """Runs examples/<name> with ``args --compare --check --json`` (``env``: variables added to
    the run's environment); returns its JSON summary."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", name), *args,
           "--compare", "--check", "--json", "--timeout", str(RUN_TIMEOUT_S - 30)]
    # A short resolver timeout: a TCPStore connect reverse-resolves its peer, and an unanswered
    # DNS query would otherwise stall the run by glibc's default 5 s.
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:1", **(env or {}))
    # Its own session, so that a hung run's ranks can be killed together with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{name} {' '.join(args)}: no result within {RUN_TIMEOUT_S} s")
    finally:
        _assert_session_gone(proc.pid)
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{out}\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _assert_session_gone(sid):
    """No process of the run's session (its launcher's forked ranks) may outlive it."""
    try:
        os.killpg(sid, 0)
    except ProcessLookupError:
        return
    os.killpg(sid, signal.SIGKILL)
    pytest.fail(f"processes of the example run (process group {sid}) were left behind")


def _assert_trained(r, shrink):
    assert r["loss_final"] < shrink * r["loss_first"], (r["loss_first"], r["loss_final"])
    assert r["check_max_abs_diff"] <= 1e-5, r["check_max_abs_diff"]
    assert r["step_ms"] > 0 and r["comm_ms"] >= 0


def test_gossip_sgd():
    summary = run_example("gossip_sgd.py", "--nproc", "4", "--steps", "60")
    torch_run, fc_run = summary["backends"]["torch"], summary["backends"]["fastcomm"]
    for r in (torch_run, fc_run):
        assert r["ranks"] == 4 and r["steps"] == 60
        _assert_trained(r, shrink=0.25)
        # Averaging with a changing partner keeps the replicas together.
        assert r["replica_spread"] < 0.05, r["replica_spread"]
        assert r["loss_of_mean"] < 0.25 * r["loss_first"]
    assert fc_run["replica_losses"] == pytest.approx(torch_run["replica_losses"], rel=1e-5)
    assert summary["speedup_step"] > 0


# fastcomm's CUDA path on CPU tensors, over the fake GPU runtime: what `--device cuda` runs on a
# GPU (the examples then wait for the fake's streams before the host reads a result).
PATHS = pytest.mark.parametrize("path", [{}, {"FASTCOMM_FAKE_DEVICE": "1"}], ids=["host", "device"])


@PATHS
@pytest.mark.parametrize("mode", [[], ["--blocking"]], ids=["isend-irecv", "send-recv"])
def test_pipeline(mode, path):
    summary = run_example("pipeline.py", "--nproc", "2", "--steps", "12", "--micro-batches", "3",
                          *mode, env=path)
    torch_run, fc_run = summary["backends"]["torch"], summary["backends"]["fastcomm"]
    for r in (torch_run, fc_run):
        assert r["stages"] == 2 and len(r["loss_curve"]) == 12
        _assert_trained(r, shrink=0.5)
    assert fc_run["loss_curve"] == pytest.approx(torch_run["loss_curve"], rel=1e-6)


@PATHS
def test_moe(path):
    summary = run_example("moe.py", "--nproc", "4", "--steps", "30", env=path)
    torch_run, fc_run = summary["backends"]["torch"], summary["backends"]["fastcomm"]
    for r in (torch_run, fc_run):
        assert r["ranks"] == 4 and r["groups"] == 1 and len(r["loss_curve"]) == 30
        _assert_trained(r, shrink=0.6)
        # Every token reaches one expert, and the gate spreads them over all four.
        assert sum(r["expert_load"]) == 4 * r["tokens"] and min(r["expert_load"]) > 0
    assert fc_run["loss_curve"] == pytest.approx(torch_run["loss_curve"], rel=1e-6)


_NO_CUDA_IN_PARENT = r"""
import argparse, os, sys
import torch
sys.path.insert(0, os.path.join(sys.argv[1], "examples"))
import _common

parent = os.getpid()
asked = []

def ask(value):
    def f(*a, **k):
        if os.getpid() == parent:
            asked.append(1)
        return value
    return f

# A GPU build of torch refuses CUDA in a rank forked after the parent queried it.
torch.cuda.is_available, torch.cuda.device_count = ask(False), ask(0)
args = argparse.Namespace(device="cuda", nproc=2, timeout=60, compare=False, backend="fastcomm")
status = _common.run(lambda *a: {}, args, lambda world: "")
print(status, len(asked))
"""


def test_the_launcher_asks_nothing_of_cuda_before_it_forks_the_ranks():
    """--device cuda on a machine without one: the ranks (not the parent, which would make
    CUDA unusable in the ranks it forks) find no device and the run exits with status 2."""
    proc = subprocess.run([sys.executable, "-c", _NO_CUDA_IN_PARENT, ROOT], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, parent_calls = proc.stdout.split()[-2:]
    assert (status, parent_calls) == ("2", "0"), proc.stdout + proc.stderr[-2000:]
    assert "torch sees no CUDA device here" in proc.stderr
