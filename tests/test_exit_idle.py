"""A rank with same-host peers runs its interpreter teardown under SCHED_IDLE
(``FASTCOMM_EXIT_IDLE``, on by default), so that a rank that finishes first does not take the
cores from peers still running their ops (docs/design.md, "Waiting").

The ranks are real Python processes that exit normally (the harness's forked ranks leave with
``os._exit``, which runs no atexit handler). Each rank registers, before fastcomm is imported,
an atexit handler that records its scheduling policy and nice value: handlers run last-in
first-out, so it runs after fastcomm's."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

TIMEOUT_S = 120


def _priority() -> str:
    """This thread's scheduling policy and nice value."""
    return f"{os.sched_getscheduler(0)} {os.getpriority(os.PRIO_PROCESS, 0)}"


def _rank_main(port: int, rank: int, world: int, out_dir: str) -> None:
    import atexit

    def record_at_exit():
        with open(os.path.join(out_dir, f"exit.{rank}"), "w") as f:
            f.write(_priority())

    atexit.register(record_at_exit)

    import torch
    import torch.distributed as dist

    import fastcomm as fc

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 3, t
    with open(os.path.join(out_dir, f"running.{rank}"), "w") as f:
        f.write(_priority())
    # No shutdown: exiting without one is what most programs do, and atexit covers it.


def _run(tmp_path, world, env_extra, hosts=None):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    procs = []
    try:
        for r in range(world):
            env = {k: v for k, v in os.environ.items() if k not in ("FASTCOMM_EXIT_IDLE", "FASTCOMM_HOST_ID")}
            env.update(env_extra)
            if hosts is not None:
                env["FASTCOMM_HOST_ID"] = hosts[r]
            procs.append(subprocess.Popen([sys.executable, __file__, str(server.port), str(r), str(world),
                                           str(tmp_path)], env=env))
        for p in procs:
            assert p.wait(timeout=TIMEOUT_S) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del server
    running = [(tmp_path / f"running.{r}").read_text() for r in range(world)]
    at_exit = [(tmp_path / f"exit.{r}").read_text() for r in range(world)]
    return running, at_exit


@pytest.mark.parametrize("setting", [None, "1", "0"])
def test_exit_runs_idle_when_peers_share_the_host(tmp_path, setting):
    env = {} if setting is None else {"FASTCOMM_EXIT_IDLE": setting}
    base = _priority()  # the ranks inherit it
    running, at_exit = _run(tmp_path, 2, env)
    assert running == [base, base]  # nothing changes while the rank runs
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    want = base if setting == "0" else f"{os.SCHED_IDLE} {nice}"
    assert at_exit == [want, want]


def test_a_rank_alone_on_its_host_exits_as_it_ran(tmp_path):
    base = _priority()
    running, at_exit = _run(tmp_path, 2, {}, hosts=["host-a", "host-b"])
    assert running == [base, base]
    assert at_exit == [base, base]


@pytest.mark.parametrize("bad", ["2", "yes", "on"])
def test_exit_idle_takes_0_or_1(monkeypatch, bad):
    from fastcomm import _C
    monkeypatch.setenv("FASTCOMM_EXIT_IDLE", bad)
    with pytest.raises(ValueError, match=f"FASTCOMM_EXIT_IDLE must be 0 or 1, got '{bad}'"):
        _C.Settings.from_env()
    monkeypatch.setenv("FASTCOMM_EXIT_IDLE", "0")
    assert _C.Settings.from_env().exit_idle is False


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
