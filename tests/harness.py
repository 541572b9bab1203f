"""Runs a test body on several ranks, each a separate process, and brings back their results.

Every rank is a forked child with its own fastcomm engine, rendezvousing through a TCPStore
that the parent hosts on a free loopback port. Each run has a hard timeout: on expiry every
child is killed and the test fails, so a hang can never stall the suite.

Inside a child, ``child_store()`` gives a client of the run's store and ``init_child()`` calls
fc.init through it (for tests that run with ``init=False`` or re-init after shutdown);
``job_token()`` is the random token of the current fastcomm session (it names the job's
shared-memory segments). The parent records every token its runs used in ``TOKENS_SEEN``, so
the leak check can tell this suite's segments from those of unrelated jobs on the machine."""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# Every TCPStore connect makes torch reverse-resolve the peer address (::ffff:127.0.0.1 is not
# in /etc/hosts, so the query goes to the DNS server). On this machine a few percent of those
# queries get no answer and glibc waits its default 5 s: a test would start 5 s late for no
# reason of fastcomm's. A 1 s, single-try resolver timeout bounds that stall. (Set before the
# first store is made; forked children inherit it.)
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

_ctx = mp.get_context("fork")

# torch.testing.assert_close imports a lot lazily on its first call (about a second); pay that
# once here, in the parent, instead of once in every forked child.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

# In a child: the run's store port and world size (set before fn runs).
_port = None
_rank = None
_world = None

# In the parent: the fastcomm job tokens of every run so far (for the leak check).
TOKENS_SEEN: set = set()


def child_store():
    """A new client of the run's TCPStore (only inside a child)."""
    assert _port is not None, "child_store() is only available inside harness.run children"
    return dist.TCPStore("127.0.0.1", _port, _world, False, timeout=timedelta(seconds=30))


def init_child(rank, world, timeout=30.0):
    """fc.init through the run's store (only inside a child)."""
    import fastcomm as fc

    fc.init(store=child_store(), rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def job_token():
    """The token of this child's current fastcomm session (only inside a child, after init)."""
    from fastcomm import _state

    return _session_store(child_store(), _state._generation).get("token").decode()


def _session_store(store, generation):
    from fastcomm import _state

    return dist.PrefixStore(_state._store_prefix(generation), store)


def _child(fn, rank, world, port, conn, go, args, env, init_kwargs, dump_path):
    global _port, _rank, _world
    # A hung rank is asked (SIGUSR1) for the Python stacks of all its threads before it is
    # killed, so a hang reports where it hangs.
    dump = open(dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    try:
        # Wait until the parent has forked every rank: see run().
        if not go.poll(60) or go.recv() != "go":
            raise RuntimeError("harness: no start signal from the parent")
        go.close()
        _port, _rank, _world = port, rank, world
        os.environ.update(env)
        torch.set_num_threads(1)
        import fastcomm as fc

        if init_kwargs is not None:
            store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timedelta(seconds=30))
            fc.init(store=store, rank=rank, world_size=world, **init_kwargs)
        result = fn(rank, world, *args)
        if init_kwargs is not None:
            fc.shutdown()
        conn.send(("ok", result))
    except BaseException as e:  # report everything, including assertion failures
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()
        os._exit(0)


def _record_tokens(server):
    for gen in range(1, 9):
        store = _session_store(server, gen)
        try:
            if not store.check(["token"]):
                break
            TOKENS_SEEN.add(store.get("token").decode())
        except Exception:
            break


def run(fn, world, *args, timeout=60.0, env=None, init=True, init_timeout=30.0, allow_fail=()):
    """Runs ``fn(rank, world, *args)`` on ``world`` ranks; returns the list of their results.

    ``allow_fail`` names ranks expected to die (their missing result is None)."""
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    init_kwargs = {"timeout": timedelta(seconds=init_timeout)} if init else None
    # Every child is forked before any of them starts: the parent's store thread is then idle
    # (parked in its event loop) at each fork. Forking while it served an earlier child's
    # connection could copy a lock it held (allocator, resolver) into the new child, which then
    # deadlocks before it ever reaches fn (seen as a rank that never publishes its rendezvous key).
    procs, conns, gos = [], [], []
    dump_dir = tempfile.mkdtemp(prefix="fastcomm-harness-")
    for r in range(world):
        parent, child = _ctx.Pipe(duplex=False)
        go_recv, go_send = _ctx.Pipe(duplex=False)
        p = _ctx.Process(target=_child,
                         args=(fn, r, world, server.port, child, go_recv, args, dict(env or {}),
                               init_kwargs, os.path.join(dump_dir, f"rank{r}.stacks")))
        p.start()
        child.close()
        go_recv.close()
        procs.append(p)
        conns.append(parent)
        gos.append(go_send)
    for g in gos:
        g.send("go")
        g.close()
    deadline = time.monotonic() + timeout
    results, errors = [None] * world, []
    hung_seen = False
    try:
        for r, (p, c) in enumerate(zip(procs, conns)):
            remaining = max(0.0, deadline - time.monotonic())
            if c.poll(remaining):
                try:
                    status, value = c.recv()
                except EOFError:
                    status, value = "error", f"rank {r}: exited without a result (code {p.exitcode})"
            elif r in allow_fail:
                continue
            else:
                alive = not c.closed and p.is_alive()
                # Native stacks (gdb, seconds) only for the first hung rank of a run.
                status, value = "error", (f"rank {r}: no result within {timeout}s (hung)\n"
                                          + _stacks(p.pid, os.path.join(dump_dir, f"rank{r}.stacks"),
                                                    native=not hung_seen)
                                          if alive else f"rank {r}: died (exit code {p.exitcode})")
                hung_seen = hung_seen or alive
            if status == "ok":
                results[r] = value
            elif r not in allow_fail:
                errors.append(value)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=30)  # bounded: a child stuck in a driver call may not die at once
        for c in conns:
            c.close()
        _record_tokens(server)
        del server
        shutil.rmtree(dump_dir, ignore_errors=True)
    if errors:
        raise AssertionError("\n".join(errors))
    return results


def _stacks(pid, dump_path, native=True):
    """Where a hung rank is: its Python stacks (faulthandler) and, where gdb exists, its native
    stacks."""
    out = []
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
        with open(dump_path) as f:
            out.append("Python stacks:\n" + f.read())
    except OSError as e:
        out.append(f"(no Python stacks: {e})")
    if native and shutil.which("gdb"):
        try:
            bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 30"],
                                capture_output=True, text=True, timeout=20).stdout
            out.append("native stacks:\n" + "\n".join(l[:240] for l in bt.splitlines()
                                                        if l.startswith(("#", "Thread"))))
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"(no native stacks: {e})")
    return "\n".join(out)


def shm_entries():
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith("fastcomm-"))
    except FileNotFoundError:
        return []
