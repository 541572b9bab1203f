"""What the benchmarks share: the local-rank launchers and the report helpers.

``run_job(body, world, *args, timeout=...)`` runs ``body(store, rank, world, *args)`` on
``world`` local ranks and returns their results in rank order or raises ``JobError``. The ranks
start the way the script's ``--launcher`` says (``use_launcher``), as users start theirs:
``fork`` (children forked from the calling script: quick, no torch re-import), ``spawn``
(``torch.multiprocessing.start_processes(..., start_method="spawn")``, what
``torch.multiprocessing.spawn`` runs: every rank re-imports torch) or ``torchrun`` (the script's
body under ``python -m torch.distributed.run --standalone``, whose workers each start a session
of their own). Each launch rendezvouses through its own store on a free port, has a hard
timeout, and every rank is joined or killed before it returns.

``all_reduce_steps`` is the timed loop the all_reduce benchmarks share (one op per group per
step, then a checked step). ``Progress`` writes a line per launch on stderr with an estimate of
the time left. The rest formats the reports: machine description, Markdown tables, the JSON
dump, the plot's matplotlib import, and the end-of-run check that no child process was left
behind."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import pickle
import platform
import shlex
import shutil
import signal
import subprocess
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

# The fork launcher: a forked child needs no torch re-import (seconds each on 2 cores). Forking
# is safe because the parent never initializes fastcomm or a process group, and never runs a
# parallel torch op (the scripts set one torch thread before the first launch).
_ctx = mp.get_context("fork")

LAUNCHERS = ("fork", "spawn", "torchrun")
_launcher = "fork"
WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torchrun_worker.py")

STORE_TIMEOUT = timedelta(seconds=60)


# Fewest timed steps of a batched loop (a median of a handful of steps is mostly noise).
MIN_BATCHED_STEPS = 20


def batched_steps(iters, k):
    return max(MIN_BATCHED_STEPS, iters // k)


def all_reduce_steps(all_reduce, groups, numel, rank, members, iters, warmup, batch=None,
                     async_wait=False):
    """Mean seconds per op over `iters` steps of one float32 all_reduce of `numel` elements
    per group, then a checked step (each member r contributes r + 1 + i on group i; `members`:
    the global ranks of every group). `batch`: issue each step inside fastcomm's batch;
    `async_wait`: issue every op with async_op=True, then wait for all."""
    k = len(groups)

    def step(ts):
        if batch is not None:
            with batch() as b:
                for t, g in zip(ts, groups):
                    all_reduce(t, group=g)
            b.wait()
        elif async_wait:
            for w in [all_reduce(t, group=g, async_op=True) for t, g in zip(ts, groups)]:
                w.wait()
        else:
            for t, g in zip(ts, groups):
                all_reduce(t, group=g)

    ts = [torch.zeros(numel) for _ in groups]  # zeros: sums stay 0 however many steps
    for _ in range(warmup):
        step(ts)
    per = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step(ts)
        per.append((time.perf_counter() - t0) / k)
    ts = [torch.full((numel,), float(rank + 1 + i)) for i in range(k)]
    step(ts)
    for i, t in enumerate(ts):
        exp = float(sum(r + 1 + i for r in members))
        if not torch.equal(t, torch.full_like(t, exp)):
            raise AssertionError(f"wrong all_reduce result {t[:3]} != {exp}")
    return statistics.fmean(per)  # the mean, as a user's loop sees it (one slow step included)


class JobError(RuntimeError):
    """A launch that failed: a rank raised (a wrong result included), died or hung."""


# --------------------------------------------------------------------------------------------
# Launching local ranks
# --------------------------------------------------------------------------------------------

class Progress:
    """A line per launch on stderr, where the reports' tables (stdout) do not see it: which
    launch of the run starts, and about how long the rest will take (the mean launch so far
    times the launches left; launches differ in length, so the first estimates are rough)."""

    def __init__(self, total):
        self.total, self.started = total, 0
        self.t0 = time.monotonic()

    def launch(self, what):
        """Announces the next launch; ``what`` says what it measures."""
        eta = ""
        if self.started:
            mean = (time.monotonic() - self.t0) / self.started
            eta = f", ~{_duration(mean * (self.total - self.started))} left"
        self.started += 1
        print(f"[{self.started}/{self.total} launches{eta}] {what}", file=sys.stderr, flush=True)

    def skip(self, n=1):
        """``n`` counted launches will not run after all (those left of a failed cell)."""
        self.total -= n


def timed_loops(step, barrier, iters, warmup, reps=3):
    """(mean, best) seconds per call of ``step`` on this rank over ``reps`` timed loops of
    ``iters`` calls, each started by all ranks together after ``barrier``: the mean over all
    the calls, as a user's loop sees it, and the best loop's (the machine may be shared)."""
    for _ in range(warmup):
        step()
    loops = []
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        loops.append((time.perf_counter() - start) / iters)
    return sum(loops) / len(loops), min(loops)


def best_of_loops(step, barrier, iters, warmup, reps=3):
    """Seconds per call of ``step``: the best of timed_loops' loops."""
    return timed_loops(step, barrier, iters, warmup, reps)[1]


def _duration(s):
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def alternate_launches(bodies, world, args, repeat, label, failures, progress=None):
    """Times every body of `bodies` (each returning (single, batched) seconds per op per rank)
    over `repeat` fresh launches of `world` ranks with `args`, the bodies alternating, so a slow
    spell of a shared machine hits them alike. Per body: the medians (µs, max over ranks per
    launch) and the launches' values; None for a body whose launch failed (with a line naming
    `label` in `failures`). `progress`: a Progress that counts these launches."""
    runs = {name: ([], []) for name in bodies}
    for rep in range(repeat):
        for name, body in bodies.items():
            if runs[name] is None:
                continue
            if progress:
                progress.launch(f"{label}: {name}, launch {rep + 1}/{repeat}")
            try:
                # Hard limit per launch: generous for the slowest cell (torch Gloo, 1 MB x k ops
                # per step on an oversubscribed machine), short of letting a hang stall the run.
                res = run_job(body, world, *args, timeout=600)
            except JobError as e:
                runs[name] = None
                failures.append(f"{name}, {label}: {e}")
                if progress:
                    progress.skip(repeat - rep - 1)
                continue
            runs[name][0].append(max(r[0] for r in res))
            runs[name][1].append(max(r[1] for r in res))
    return {name: None if r is None else {
        "single_us": statistics.median(r[0]) * 1e6, "batched_us": statistics.median(r[1]) * 1e6,
        "single_runs_us": [x * 1e6 for x in r[0]], "batched_runs_us": [x * 1e6 for x in r[1]]}
        for name, r in runs.items()}


def us_cell(x, kind):
    """A body's median from alternate_launches as a table cell (µs), or "failed"."""
    return f"{x[kind]:,.0f}" if x else "failed"


def ratio_cell(num, den, kind):
    """num's median over den's, and in how many launches den was the faster one: launch i of
    every body ran back to back, so launch i of each is a fair pair even when the machine's
    speed drifts over the run, and the count shows whether a ratio near 1 is a lead or noise."""
    if not num or not den:
        return "-"
    pairs = list(zip(num[kind.replace("_us", "_runs_us")], den[kind.replace("_us", "_runs_us")]))
    won = sum(1 for a, b in pairs if b < a)
    return f"{num[kind] / den[kind]:.1f}x ({won}/{len(pairs)})"


def _child(body, rank, world, conn, args):
    try:
        torch.set_num_threads(1)
        # The port comes once every rank exists (see run_job).
        if not conn.poll(STORE_TIMEOUT.total_seconds()):
            raise TimeoutError("the parent sent no store port")
        store = dist.TCPStore("127.0.0.1", conn.recv(), world, False, timeout=STORE_TIMEOUT)
        conn.send(("ok", body(store, rank, world, *args)))
    except BaseException as e:  # report everything, a failed correctness check included
        where = traceback.extract_tb(e.__traceback__)[-1]
        try:
            conn.send(("error", f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:"
                                f"{where.lineno})"))
        except OSError:
            pass
    finally:
        conn.close()
        # Skip atexit handlers and destructors inherited from the parent.
        os._exit(0)


def _summarize(errors):
    """One line per distinct error, naming the ranks that reported it (rank None: the launch
    as a whole, a hang or a launcher that failed)."""
    by_msg = {}
    for rank, msg in errors:
        by_msg.setdefault(msg[:300] + ("..." if len(msg) > 300 else ""), []).append(rank)
    return "; ".join((f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))}: " if None not in r else "")
                     + m for m, r in by_msg.items())


def add_launcher_arg(ap, default="fork"):
    """The ``--launcher`` option every benchmark takes (pass its value to use_launcher)."""
    ap.add_argument("--launcher", choices=LAUNCHERS, default=default,
                    help=f"how the ranks start (default {default}): fork (children of this "
                         "script), spawn (torch.multiprocessing.spawn's way: each rank a fresh "
                         "Python that re-imports torch, a second or more each), torchrun (python -m "
                         "torch.distributed.run --standalone; each rank in its own session)")


def use_launcher(name):
    """Makes ``run_job`` start ranks with launcher ``name`` (one of LAUNCHERS)."""
    global _launcher
    if name not in LAUNCHERS:
        raise ValueError(f"unknown launcher {name!r}; one of {', '.join(LAUNCHERS)}")
    _launcher = name


def launcher():
    return _launcher


def run_job(body, world, *args, timeout):
    """Runs ``body(store, rank, world, *args)`` on ``world`` ranks started by the launcher of
    use_launcher (fork unless set); returns their results in rank order, or raises JobError.
    Past ``timeout`` seconds every rank still alive is killed and the job fails; nothing
    outlives the call. ``body`` and ``args`` must pickle (a module-level function of the
    script, plain values) for the spawn and torchrun launchers."""
    if _launcher == "spawn":
        return _run_spawned(body, world, args, timeout)
    if _launcher == "torchrun":
        return _run_torchrun(body, world, args, timeout)
    return _run_forked(body, world, args, timeout)


def _run_forked(body, world, args, timeout):
    procs, conns, server = [], [], None
    deadline = time.monotonic() + timeout
    errors, results = [], [None] * world
    try:
        for rank in range(world):
            parent_end, child_end = _ctx.Pipe()
            p = _ctx.Process(target=_child, args=(body, rank, world, child_end, args))
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        # The store server (on a free port, bound as port 0) starts only once every rank is
        # forked, and the ranks learn its port through their pipes. Its thread looks up the
        # names of connecting peers through glibc's resolver (getnameinfo when it accepts a
        # connection), and a fork while it holds the resolver's lock leaves the child
        # deadlocked on that lock forever (seen here: ranks hung in gethostbyaddr, inside the
        # TCPStore client constructor).
        server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=STORE_TIMEOUT,
                               wait_for_workers=False)
        for conn in conns:
            conn.send(server.port)
        for rank, (p, conn) in enumerate(zip(procs, conns)):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                errors.append((rank, f"no result within {timeout:.0f} s (hung)"))
                continue  # the deadline has passed: poll(0) still collects finished ranks
            try:
                status, value = conn.recv()
            except EOFError:
                status, value = "error", "died without a result"
            if status == "ok":
                results[rank] = value
            else:
                errors.append((rank, value))
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()) if not errors else 1.0)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
        for conn in conns:
            conn.close()
        del server
    if errors:
        raise JobError(_summarize(errors))
    return results


def run_rank(body, rank, world, store, args, outdir):
    """A spawned or torchrun rank: runs the body and leaves ("ok", result) or ("error", text)
    in ``outdir``/rank<N>.pkl for the parent (written to a temporary name first, so the parent
    never reads half a file)."""
    try:
        torch.set_num_threads(1)
        out = ("ok", body(store, rank, world, *args))
    except BaseException as e:  # a failed correctness check included
        where = traceback.extract_tb(e.__traceback__)[-1]
        out = ("error", f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})")
    path = os.path.join(outdir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(path + ".tmp", path)


def _spawned_rank(rank, body, world, port, outdir, args):
    # torch.multiprocessing's entry: fn(i, *args)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=STORE_TIMEOUT)
    run_rank(body, rank, world, store, args, outdir)


def _collect(outdir, world, errors, results):
    """Reads the ranks' result files; a missing one is an error naming the rank."""
    for rank in range(world):
        path = os.path.join(outdir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            if not any(r == rank for r, _ in errors):
                errors.append((rank, "died without a result"))
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "ok":
            results[rank] = value
        else:
            errors.append((rank, value))


def _run_spawned(body, world, args, timeout):
    import torch.multiprocessing as tmp

    deadline = time.monotonic() + timeout
    errors, results = [], [None] * world
    # Spawned children exec a fresh interpreter, so the store server can start first (no fork
    # of its thread to fear) and the port travels in the arguments.
    server = dist.TCPStore("127.0.0.1", 0, world, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="fastcomm-bench-") as outdir:
        ctx = tmp.start_processes(_spawned_rank, args=(body, world, server.port, outdir, args),
                                  nprocs=world, join=False, start_method="spawn")
        try:
            while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    errors.append((None, f"no result within {timeout:.0f} s (hung)"))
                    break
        except Exception as e:  # a rank exited with a non-zero status (the others were stopped)
            errors.append((None, f"{type(e).__name__}: {str(e).strip()[-300:]}"))
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
        _collect(outdir, world, errors, results)
    del server
    if errors:
        raise JobError(_summarize(errors))
    return results


def _run_torchrun(body, world, args, timeout):
    """The body under torchrun: _torchrun_worker.py loads the script that defines it (as a
    module, so its main() does not run), rendezvouses through env:// as init_process_group
    would, and leaves its result in a file."""
    errors, results = [], [None] * world
    main_file = os.path.abspath(sys.modules["__main__"].__file__)
    with tempfile.TemporaryDirectory(prefix="fastcomm-bench-") as outdir:
        spec = os.path.join(outdir, "spec.pkl")
        with open(spec, "wb") as f:
            # (The arguments pickled apart: they may refer to the script's own names, which
            # resolve only once the worker has loaded it.)
            pickle.dump({"script": main_file, "module": body.__module__, "body": body.__name__,
                         "args": pickle.dumps(args), "outdir": outdir, "sys_path": sys.path}, f)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", "--max-restarts=0", WORKER_SCRIPT, spec]
        # Not a session of its own (a user's torchrun runs in the shell's): its own process
        # group, for a timeout to stop it; torchrun starts every worker in a new session, and
        # the workers write their pids for the kill of a hang.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                process_group=0)
        try:
            _, err = proc.communicate(timeout=timeout)
            if proc.returncode != 0:
                errors.append((None, f"torchrun exited with {proc.returncode}: {err.strip()[-300:]}"))
        except subprocess.TimeoutExpired:
            errors.append((None, f"no result within {timeout:.0f} s (hung)"))
            for rank in range(world):
                try:
                    with open(os.path.join(outdir, f"pid{rank}")) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        _collect(outdir, world, errors, results)
    if errors:
        raise JobError(_summarize(errors))
    return results


def find_mpi():
    """The mpirun command prefix, or None with the reason why MPI is skipped."""
    if importlib.util.find_spec("mpi4py") is None:
        return None, "mpi4py is not installed"
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        return None, "mpi4py is installed but neither mpirun nor mpiexec is on PATH"
    cmd = [mpirun]
    version = subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        # Open MPI refuses more ranks than cores, and running as root, unless told.
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd, version.strip().splitlines()[0] if version.strip() else mpirun


def run_mpi_worker(mpirun, world, script, args, timeout):
    """Runs ``script`` (an mpi4py worker printing one JSON line, with an "errors" list) on
    ``world`` ranks under ``mpirun``; returns that line's object, or raises JobError. A hang
    past ``timeout`` seconds kills mpirun and every rank it started."""
    cmd = mpirun + ["-np", str(world), sys.executable, script] + [str(a) for a in args]
    # Its own session, so that a timeout can kill mpirun and every rank it started at once.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise JobError(f"mpirun: no result within {timeout:.0f} s (hung)") from None
    if proc.returncode != 0:
        raise JobError(f"mpirun exited with {proc.returncode}: {err.strip()[-500:]}")
    result = json.loads(out.strip().splitlines()[-1])
    if result["errors"]:
        raise JobError("; ".join(result["errors"]))
    return result


def assert_no_children():
    """Fails the script if any launched rank outlived its job."""
    leftover = mp.active_children()
    assert not leftover, f"child processes left behind: {leftover}"


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def command():
    """This run's command line, as the reports quote it."""
    return f"`python {shlex.join(sys.argv)}`"


def machine():
    return f"{os.cpu_count()} cores ({cpu_model()}), {platform.system()} {platform.release()}"


def print_header(title):
    """The report's title, then what ran where: command, machine, versions, and the FASTCOMM_*
    variables set."""
    print(f"# {title}\n")
    print(f"- command: {command()}")
    print(f"- machine: {machine()}")
    print(f"- torch {torch.__version__}, Python {platform.python_version()}; ranks started by the "
          f"{_launcher} launcher, each with 1 torch thread")
    env = {k: os.environ[k] for k in os.environ if k.startswith("FASTCOMM_")}
    print(f"- fastcomm environment: {env or 'defaults'}")


def print_table(head, rows, left=0):
    """A Markdown table; the first ``left`` columns are left-aligned, the others right."""
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(" :--- " if i < left else " ---: " for i in range(len(head))) + "|")
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def finish(results, failures, t_start, total_label, json_path, plot_path, plot):
    """The end of a report: the failures (if any), the total time, the JSON dump and the plot
    (``plot(plot_path)``) when asked for, and the check that no rank outlived its job.
    Returns the exit status: 1 if anything failed."""
    results["failures"] = failures
    results["total_s"] = time.monotonic() - t_start
    if failures:
        print("\n## Failures\n")
        for f in failures:
            print(f"- {f}")
    print(f"\n{total_label}: {results['total_s']:.1f} s")
    if json_path:
        write_json(json_path, results)
    if plot_path:
        plot(plot_path)
    assert_no_children()
    return 1 if failures else 0


def write_json(path, results):
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"Raw numbers written to {path}")


def pyplot_or_none(path):
    """matplotlib.pyplot on the Agg backend, or None (with a note) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nNote: matplotlib is not installed; skipped the plot ({path}).")
        return None
    return plt


def save_plot(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nPlot written to {path}")
