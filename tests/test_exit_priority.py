"""A rank with same-host peers runs its interpreter teardown at a low priority
(``FASTCOMM_EXIT_NICE``, 19 by default), so that a rank that finishes first does not take the
cores from peers still running their ops (docs/design.md, "Waiting").

The ranks are real Python processes that exit normally (the harness's forked ranks leave with
``os._exit``, which runs no atexit handler). Each rank registers, before fastcomm is imported,
an atexit handler that records its nice value: handlers run last-in first-out, so it runs
after fastcomm's."""
from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

TIMEOUT_S = 120


def _rank_main(port: int, rank: int, world: int, out_dir: str) -> None:
    import atexit

    def record_exit_nice():
        with open(os.path.join(out_dir, f"exit.{rank}"), "w") as f:
            f.write(str(os.getpriority(os.PRIO_PROCESS, 0)))

    atexit.register(record_exit_nice)

    import torch
    import torch.distributed as dist

    import fastcomm as fc

    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=60))
    fc.init(store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    t = torch.full((3,), float(rank + 1))
    fc.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 3, t
    with open(os.path.join(out_dir, f"running.{rank}"), "w") as f:
        f.write(str(os.getpriority(os.PRIO_PROCESS, 0)))
    # No shutdown: exiting without one is what most programs do, and atexit covers it.


def _run(tmp_path, world, env_extra, hosts=None):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=60),
                           wait_for_workers=False)
    procs = []
    try:
        for r in range(world):
            env = {k: v for k, v in os.environ.items() if k not in ("FASTCOMM_EXIT_NICE", "FASTCOMM_HOST_ID")}
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
    running = [int((tmp_path / f"running.{r}").read_text()) for r in range(world)]
    at_exit = [int((tmp_path / f"exit.{r}").read_text()) for r in range(world)]
    return running, at_exit


@pytest.mark.parametrize("setting,expected", [(None, 19), ("5", 5), ("0", None)])
def test_exit_runs_at_the_set_priority_when_peers_share_the_host(tmp_path, setting, expected):
    env = {} if setting is None else {"FASTCOMM_EXIT_NICE": setting}
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the ranks inherit it
    running, at_exit = _run(tmp_path, 2, env)
    assert running == [base, base]  # nothing changes while the rank runs
    want = base if expected is None else max(base, expected)
    assert at_exit == [want, want]


def test_a_rank_alone_on_its_host_exits_as_it_ran(tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    running, at_exit = _run(tmp_path, 2, {}, hosts=["host-a", "host-b"])
    assert running == [base, base]
    assert at_exit == [base, base]


@pytest.mark.parametrize("bad", ["20", "-1", "low", "99999999999"])
def test_exit_nice_outside_0_to_19_is_refused(monkeypatch, bad):
    from fastcomm import _C
    monkeypatch.setenv("FASTCOMM_EXIT_NICE", bad)
    with pytest.raises(ValueError, match=f"FASTCOMM_EXIT_NICE must be an integer .*got '{bad}'"):
        _C.Settings.from_env()
    monkeypatch.setenv("FASTCOMM_EXIT_NICE", "7")
    assert _C.Settings.from_env().exit_nice == 7


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
