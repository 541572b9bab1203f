"""What the examples share: starting the ranks, choosing the library, printing the summary.

Every example runs its ranks either under a launcher that sets RANK and WORLD_SIZE (torchrun,
also MASTER_ADDR and MASTER_PORT) or, without one, on ``--nproc`` local processes it forks
itself, rendezvousing on a free loopback port. ``--backend torch`` runs the same program on
torch.distributed's Gloo; ``--compare`` runs torch Gloo, then fastcomm, in the same processes,
and prints the speed-up. ``--device cuda`` (the examples that take it) puts the model and its
tensors on the GPU (rank r on GPU r mod the GPUs there are, so several ranks may share one) and
compares with torch's NCCL backend instead of Gloo. Rank 0 prints the summary; ``--json`` ends it with one JSON line."""
from __future__ import annotations

import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import fastcomm as fc

LABELS = {"fastcomm": "fastcomm", "torch": "torch Gloo"}


def add_device_arg(ap):
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model and the communicated tensors live (cuda: compared with torch NCCL)")


def add_common_args(ap, nproc, reference):
    """The options every example takes; ``reference``: what --check trains on rank 0 and
    compares with (the report names it)."""
    ap.add_argument("--nproc", type=int, default=nproc,
                    help=f"local ranks to start when no launcher set RANK/WORLD_SIZE "
                         f"(default {nproc})")
    ap.add_argument("--backend", choices=["fastcomm", "torch"], default="fastcomm",
                    help="library that carries the communication (torch: torch.distributed Gloo)")
    ap.add_argument("--compare", action="store_true",
                    help="run torch Gloo, then fastcomm, and print the speed-up")
    ap.add_argument("--json", action="store_true", help="end the output with one JSON line")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds after which a hung local run is killed; also the "
                         "collectives' timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help=f"compare with {reference} (trained on rank 0)")
    ap.set_defaults(reference=reference)


class Library:
    """The library under test, for what every example does besides its own communication:
    gathering each rank's numbers for the summary."""

    def __init__(self, name, rank, world, device="cpu"):
        self.name, self.label, self.rank, self.world = name, LABELS[name], rank, world
        self.device = device
        # The module whose collectives the example calls (same names and arguments).
        self.comm = dist if name == "torch" else _FakeDeviceFastcomm() if _on_fake_device() else fc

    def all_gather(self, t):
        """Every rank's ``t`` (a 1-D float tensor of the same length everywhere), as rows, on
        the CPU (torch's NCCL backend gathers on the GPU)."""
        if self.name == "torch" and self.device == "cuda":
            t = t.to(self.device)
        out = [torch.empty_like(t) for _ in range(self.world)]
        self.comm.all_gather(out, t.contiguous())
        return torch.stack(out).cpu()


def _on_fake_device():
    """Whether fastcomm runs its CUDA path on CPU tensors, over its fake GPU runtime (the
    test suite's FASTCOMM_FAKE_DEVICE=1)."""
    return os.environ.get("FASTCOMM_FAKE_DEVICE") == "1"


class _FakeDeviceFastcomm:
    """fastcomm as the examples call it, for runs on the fake GPU runtime: there a collective
    returns once queued on the fake's streams, as on a GPU, but the host then reads the CPU
    tensors at once, with nothing like torch's ordering of a CUDA tensor's copy to the host
    after the streams' work. So each blocking call, and each Work's wait, also waits for the
    device work queued so far."""

    def __getattr__(self, name):
        f = getattr(fc, name)
        if not callable(f) or name in ("new_group", "new_groups"):
            return f

        def call(*args, **kwargs):
            out = f(*args, **kwargs)
            if not isinstance(out, fc.Work):  # a blocking call (recv returns the sender)
                _fake_device_sync()
                return out
            return _FakeDeviceWork(out)

        return call


class _FakeDeviceWork:
    def __init__(self, w):
        self._w = w

    def wait(self, *args):
        self._w.wait(*args)
        _fake_device_sync()
        return True

    def __getattr__(self, name):
        return getattr(self._w, name)


def _fake_device_sync():
    fc._state._engine.device_synchronize("cpu")


def under_launcher():
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size(args):
    """The number of ranks the example will run on: the launcher's, else --nproc."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else args.nproc


def run(body, args, title, details=None):
    """Runs ``body(lib, rank, world, args)`` on every rank, once per library asked for; its
    result on rank 0 (a dict with step_ms, comm_ms, loss_first, loss_final, and with --check
    check_max_abs_diff) is summarized there. ``details(result)`` adds an example-specific line.
    Returns the exit status."""
    # The parent asks nothing of CUDA: torch refuses CUDA in a rank forked after the parent
    # has queried it, so each rank checks for the device itself.
    if under_launcher():
        return _run_rank(body, args, title, details)
    return _spawn(body, args, title, details)


def _run_rank(body, args, title, details):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if getattr(args, "device", "cpu") == "cuda" and not torch.cuda.is_available():
        if rank == 0:
            print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    names = ["torch", "fastcomm"] if args.compare else [args.backend]
    timeout = timedelta(seconds=args.timeout)
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        # Ranks sharing a GPU: NCCL refuses two ranks of one communicator on one device of one
        # host, so each rank names a host of its own (before any NCCL use).
        if world > torch.cuda.device_count():
            os.environ.setdefault("NCCL_HOSTID", f"fastcomm-example-{rank}")
        torch.cuda.set_device(rank % torch.cuda.device_count())
        LABELS["torch"] = "torch NCCL"
    results = {}
    if "torch" in names:
        dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=timeout)  # env://
    try:
        for name in names:
            if name == "fastcomm":
                fc.init(timeout=timeout)  # torch's store when initialized above, else env://
            try:
                results[name] = body(Library(name, rank, world, device), rank, world, args)
            finally:
                if name == "fastcomm":
                    fc.shutdown()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank == 0:
        _report(results, args, title(world), details)
    return 0


def _report(results, args, title, details):
    print(title)
    width = max(len(LABELS[n]) for n in results)
    for name, r in results.items():
        print(f"{LABELS[name] + ':':<{width + 1}} {r['step_ms']:8.3f} ms/step, of which "
              f"communication {r['comm_ms']:.3f} ms; loss {r['loss_first']:.4g} -> "
              f"{r['loss_final']:.4g}" + (f"; {details(r)}" if details else "")
              + (f"; vs {args.reference}: max |diff| {r['check_max_abs_diff']:.1e}"
                 if "check_max_abs_diff" in r else ""))
    summary = {"backends": results}
    if "torch" in results and "fastcomm" in results:
        t, f = results["torch"], results["fastcomm"]
        summary["speedup_step"] = t["step_ms"] / f["step_ms"]
        summary["speedup_comm"] = t["comm_ms"] / f["comm_ms"] if f["comm_ms"] > 0 else None
        comm = f"{summary['speedup_comm']:.1f}x" if summary["speedup_comm"] else "n/a"
        print(f"fastcomm vs {LABELS['torch']}: {summary['speedup_step']:.1f}x faster per step, "
              f"{comm} in communication")
    if args.json:
        print(json.dumps(summary))
    sys.stdout.flush()


class Teacher:
    """The function the examples' models learn: a fixed random one-hidden-layer net, plus a
    little noise."""

    def __init__(self, seed, in_dim):
        g = torch.Generator().manual_seed(seed + 1)
        self.in_dim = in_dim
        self.w1 = torch.randn(in_dim, 16, generator=g) / in_dim ** 0.5
        self.w2 = torch.randn(16, 1, generator=g)

    def sample(self, n, g):
        """n (input, target) pairs drawn with generator g."""
        x = torch.randn(n, self.in_dim, generator=g)
        return x, torch.tanh(x @ self.w1) @ self.w2 + 0.05 * torch.randn(n, 1, generator=g)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CHILD_NO_DEVICE = 75  # a forked rank's exit code when torch sees no CUDA device there


def _child(body, args, title, details, rank, port):
    # A launcher killed outright (SIGKILL, a test's timeout) takes its ranks with it.
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # The ranks share this machine's cores: one rank per core's worth of torch threads.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    rc = _run_rank(body, args, title, details)
    # A code of its own for "no CUDA device", so that no other exit with 2 reads as one.
    sys.exit(_CHILD_NO_DEVICE if rc == 2 else rc)


def _spawn(body, args, title, details):
    """Forks args.nproc ranks and waits for them. A rank that fails gets the others killed
    after a grace period (they may wait for it forever); so does a run past args.timeout."""
    if args.nproc < 1:
        raise SystemExit("--nproc must be at least 1")
    # fork, not spawn: a spawned rank would import torch again (seconds per rank). The parent
    # has made no threads or process groups and asked nothing of CUDA, so forking it is safe.
    ctx = mp.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(body, args, title, details, r, port), daemon=True)
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    status = 0
    while True:
        alive = [p for p in procs if p.exitcode is None]
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed and status == 0:
            status = 2 if failed[0] == _CHILD_NO_DEVICE else 1
            deadline = min(deadline, time.monotonic() + 10.0)
        if not alive:
            break
        if time.monotonic() >= deadline:
            print(f"killing {len(alive)} rank(s) still running after "
                  f"{'a failure' if status else f'{args.timeout:.0f} s'}", file=sys.stderr)
            for p in alive:
                p.kill()
            status = 1
            break
        multiprocessing.connection.wait([p.sentinel for p in alive],
                                        timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.join()
    return status
