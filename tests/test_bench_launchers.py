"""The benchmarks' launchers (benchmarks/_launch.py): fork, spawn (torch.multiprocessing's way)
and torchrun each run a body on every rank and return the results in rank order, a rank's
exception comes back as a JobError naming it, and a hung launch is killed at its timeout with
no rank left behind."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import _launch  # noqa: E402
from _launch import JobError, run_job, use_launcher  # noqa: E402

from datetime import timedelta  # noqa: E402


def _all_reduce_body(store, rank, world, numel):
    """A fastcomm all_reduce over the world and the rank's session id (so the test can see
    which launcher started it); the result is checked against the local sum."""
    import fastcomm as fc

    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        t = torch.arange(numel, dtype=torch.float32) + rank
        fc.all_reduce(t)
        expected = world * torch.arange(numel, dtype=torch.float32) + sum(range(world))
        assert torch.equal(t, expected), f"rank {rank}: wrong sum"
        return rank, os.getsid(0), os.getpid()
    finally:
        fc.shutdown()


def _failing_body(store, rank, world):
    if rank == 1:
        raise ValueError("rank 1 gives up")
    return rank


def _hanging_body(store, rank, world, pid_dir):
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


@pytest.fixture
def launcher(request):
    use_launcher(request.param)
    yield request.param
    use_launcher("fork")


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (not reaped yet by a parent that is not ours) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


# Spawned and torchrun ranks each import torch (seconds on 2 cores): one size each.
@pytest.mark.parametrize("launcher,numel", [("fork", 0), ("fork", 7), ("spawn", 7), ("torchrun", 0)],
                         indirect=["launcher"])
def test_results_in_rank_order(launcher, numel):
    res = run_job(_all_reduce_body, 3, numel, timeout=240)
    assert [r[0] for r in res] == [0, 1, 2]
    assert len({r[2] for r in res}) == 3
    sessions = {r[1] for r in res}
    if launcher == "torchrun":
        assert len(sessions) == 3  # torchrun starts every worker in a session of its own
    else:
        assert sessions == {os.getsid(0)}  # fork and spawn: the caller's session
    _launch.assert_no_children()


@pytest.mark.parametrize("launcher", ["fork", "spawn", "torchrun"], indirect=True)
def test_rank_error_names_the_rank(launcher):
    with pytest.raises(JobError, match="rank 1: ValueError: rank 1 gives up"):
        run_job(_failing_body, 2, timeout=240)
    _launch.assert_no_children()


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"], indirect=True)
def test_hang_is_killed_at_the_timeout(launcher, tmp_path):
    # Long enough for the ranks to import torch on a loaded 2-core machine. (The fork
    # launcher's kill is the one the benchmarks had before the others.)
    with pytest.raises(JobError, match="hung"):
        run_job(_hanging_body, 2, str(tmp_path), timeout=30)
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2) if (tmp_path / str(r)).exists()]
    assert pids, "no rank started within the timeout"
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), f"ranks left behind: {pids}"
    _launch.assert_no_children()


def test_unknown_launcher_is_refused():
    with pytest.raises(ValueError, match="unknown launcher 'mpirun'"):
        use_launcher("mpirun")


_BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


@pytest.mark.parametrize("launcher_name", ["fork", "spawn"])
def test_device_benchmarks_run_on_the_fake_with_either_launcher(launcher_name, tmp_path):
    """The device benchmarks start their ranks through the shared launchers; on the fake their
    logic runs end to end: ops issued behind a held kernel are still pending when the calls
    return, pair groups are released as pairings change, a same-host pair gets its IPC link and
    fastcomm's rings are gone after shutdown, and nccl_pairs' fastcomm side (blocking ops and
    batches over many groups of one pair) gives the pair's sums."""
    import json
    import subprocess

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = tmp_path / "streams.json"
    subprocess.run([sys.executable, os.path.join(_BENCH, "device_streams.py"), "--fake", "--world", "2",
                    "--ops", "50", "--groups", "60", "--launcher", launcher_name, "--job-timeout", "150",
                    "--json", str(out)], check=True, timeout=200, env=env, capture_output=True)
    ranks = json.loads(out.read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["fc_ahead_last_pending"] for r in ranks)
    assert all(r["mem_steps"]["60"] <= 2 for r in ranks)  # live communicators: the last pairing's
    out = tmp_path / "ipc.json"
    subprocess.run([sys.executable, os.path.join(_BENCH, "device_ipc.py"), "--fake", "--pairs", "1", "--ops", "50",
                    "--big-bytes", str(1 << 16), "--big-ops", "2", "--launcher", launcher_name,
                    "--job-timeout", "150", "--json", str(out)], check=True, timeout=200, env=env,
                   capture_output=True)
    ranks = json.loads(out.read_text())["1"]
    assert [r["ipc_links"] for r in ranks] == [1, 1]
    assert all(r["ipc_ring_bytes"] > 0 and r["mem_after_shutdown"] == 0 for r in ranks)
    # (Each rank checks its all_reduce and batch results against the pair's sum itself.)
    out = tmp_path / "pairs.json"
    subprocess.run([sys.executable, os.path.join(_BENCH, "nccl_pairs.py"), "--fake", "--pairs", "1", "--iters", "40",
                    "--warmup", "4", "--batch", "4", "--launcher", launcher_name, "--job-timeout", "150",
                    "--json", str(out)], check=True, timeout=200, env=env, capture_output=True)
    ranks = json.loads(out.read_text())["1"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["fc"] > 0 and r["fc_batch"] > 0 and r["fc_mem"] is None and "torch" not in r for r in ranks)
    _launch.assert_no_children()


def test_the_launch_queue_probe_checks_its_arguments_and_needs_a_gpu():
    """benchmarks/device_launch_queue.py measures CUDA itself (no ranks, no fastcomm): it refuses
    an unknown kind, and where torch sees no GPU it says so and exits 2 rather than report."""
    import subprocess

    script = os.path.join(_BENCH, "device_launch_queue.py")
    p = subprocess.run([sys.executable, script, "--kinds", "kernel,bogus"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "bogus" in p.stderr
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: scripts/gpu_check.sh runs the probe itself")
    p = subprocess.run([sys.executable, script, "--kinds", "kernel"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "no CUDA device" in p.stderr and p.stdout == ""
