"""A job restarted by ``torchrun --max-restarts`` in its default mode re-initialises and runs.

torchrun's agent keeps one TCPStore for the whole run and hands it to every attempt's workers,
with the keys of the attempts before still in it; fastcomm keys each attempt apart by the run
id and restart count (fastcomm/_state.py, _store_prefix). The test runs this file under
torchrun: on the first attempt one rank kills itself (SIGKILL) after init, the agent restarts
the job, and the second attempt's results are checked, as is that no segment of either
attempt is left in /dev/shm. Ranks sit on two simulated hosts, so both transports (shared
memory and Gloo) are re-made."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

HOSTS = ["A", "A", "B"]
WORLD = len(HOSTS)
VICTIM = 1


def _worker(out_dir: str, api: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import fastcomm as fc
    from fastcomm import _state

    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    os.environ["FASTCOMM_HOST_ID"] = f"host-{HOSTS[rank]}"
    if api == "backend":
        dist.init_process_group("fastcomm", timeout=timedelta(seconds=30))
    else:
        fc.init(timeout=timedelta(seconds=30))
    with open(os.path.join(out_dir, f"token.{attempt}.{rank}"), "w") as f:
        f.write(_state._token)
    t = torch.full((4,), float(rank + 1 + 10 * attempt))
    if api == "backend":
        dist.all_reduce(t)
    else:
        fc.all_reduce(t)
    if attempt == 0:
        if rank == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)
        # The survivors fail once the victim is gone (or are stopped by the agent first).
        for _ in range(1000):
            fc.barrier()
        raise AssertionError(f"rank {rank}: the barrier kept passing without rank {VICTIM}")
    with open(os.path.join(out_dir, f"result.{attempt}.{rank}"), "w") as f:
        f.write(" ".join(str(v) for v in t.tolist()))
    if api == "backend":
        dist.destroy_process_group()
    else:
        fc.shutdown()


def _shm_with(tokens):
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if any(tok in n for tok in tokens))


@pytest.mark.parametrize("api", ["init", "backend"])
def test_torchrun_restart_reinitialises(tmp_path, api):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the default mode: one shared store
    env["OMP_NUM_THREADS"] = "1"
    cmd = [torchrun, "--standalone", "--nnodes", "1", "--nproc-per-node", str(WORLD),
           "--max-restarts", "1", "--monitor-interval", "0.1",
           os.path.abspath(__file__), str(tmp_path), api]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=30)
        pytest.fail(f"torchrun did not finish within 150 s:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    # The first attempt got through init on every rank; the second produced every result.
    files = sorted(os.listdir(tmp_path))
    assert all(f"token.0.{r}" in files and f"token.1.{r}" in files for r in range(WORLD)), files
    assert not any(f.startswith("result.0.") for f in files), files
    expected = float(sum(r + 1 + 10 for r in range(WORLD)))
    for r in range(WORLD):
        got = [float(v) for v in (tmp_path / f"result.1.{r}").read_text().split()]
        assert got == [expected] * 4, (r, got)
    tokens = {(tmp_path / f"token.{a}.{r}").read_text() for a in (0, 1) for r in range(WORLD)}
    assert len(tokens) == 2, tokens  # one job token per attempt
    assert _shm_with(tokens) == []


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
