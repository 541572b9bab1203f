"""Runs torch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
as shipped in the torch wheel) against one backend and writes every test's outcome as JSON.

    python tests/torch_suite/run_suite.py --backend fastcomm --out fastcomm.json
    python tests/torch_suite/run_suite.py --backend gloo -k allreduce --out gloo.json
    python tests/torch_suite/run_suite.py --compare gloo.json fastcomm.json
    python tests/torch_suite/run_suite.py --ran-in gloo.json fastcomm.json   # tests not skipped

It sets up what torch's CI sets up before running that suite for a backend (BACKEND,
WORLD_SIZE, a TEMP_DIR holding barrier/ and test_dir/) and builds the same test class torch's
CI builds from TestDistBackend and DistributedTest._DistTestBase; each test then runs on
WORLD_SIZE ranks that initialize the default group with a file:// init method, as in torch's
CI. Two differences, both for speed and isolation: ranks are forked from this process rather
than spawned (a spawned rank re-imports torch, seconds per rank per test on a small machine),
and every temporary file of the run lives under one directory removed at the end.

Outcome per test: "pass", "skip", "fail" (an assertion or an error, in any rank), with the
seconds it took and, for skips and failures, the reason. The JSON is rewritten after every
test, so a run killed from outside still leaves what it finished. Each test has a hard
timeout (--test-timeout): on expiry torch's harness terminates the ranks and reports a failure,
and any rank still alive after that is killed here."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import unittest

BACKENDS = ("gloo", "fastcomm")


# Tests torch's suite runs only for a backend *named* gloo (or in its "gpu" set), though their
# bodies only use the default group's backend on CPU tensors, whichever it is. With --ungate
# they run on fastcomm too, so that its result says whether fastcomm has the feature. Each has
# no other skip decorator whose condition this would drop (skip flags share one attribute);
# only a skip whose reason names gloo is lifted. Not here: test_accumulate_gradients_no_sync*
# (the body builds its model only for gloo, mpi or nccl), test_monitored_barrier_gloo* (torch
# allows monitored_barrier on Gloo only).
UNGATED = {
    "test_get_future": "get_future of an all_reduce",
    "test_grads_same_across_ranks_with_no_sync": "DDP no_sync",
    "test_all_reduce_coalesced_sum": "all_reduce_coalesced",
    "test_all_reduce_coalesced_product": "all_reduce_coalesced",
    "test_all_reduce_coalesced_min": "all_reduce_coalesced",
    "test_all_reduce_coalesced_max": "all_reduce_coalesced",
    "test_all_reduce_coalesced_full_group_sum": "all_reduce_coalesced on a new group",
    "test_all_reduce_coalesced_full_group_product": "all_reduce_coalesced on a new group",
    "test_all_reduce_coalesced_full_group_min": "all_reduce_coalesced on a new group",
    "test_all_reduce_coalesced_full_group_max": "all_reduce_coalesced on a new group",
    "test_barrier_timeout_full_group": "a group's timeout fails a barrier one rank skips",
    "test_batch_isend_irecv_gloo": "batch_isend_irecv on CPU",
    "test_batch_isend_irecv_gloo_tags": "batch_isend_irecv with tags",
    "test_scatter_object_list": "scatter_object_list",
    "test_all_gather_object_default_pg": "all_gather_object (CPU unless the backend is nccl)",
    "test_all_gather_object_subgroup": "all_gather_object on a new group",
    "test_sparse_all_reduce_sum": "all_reduce of sparse tensors",
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", required=True, choices=BACKENDS)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--out", help="JSON file for the outcomes (default: print a summary only)")
    p.add_argument("-k", dest="patterns", action="append", default=[],
                   help="regular expression a test name must match (any of several); default all")
    p.add_argument("--tests-file", help="file of exact test names, one a line (# comments)")
    p.add_argument("--work-dir", help="where the run's temporary directory is made (default: "
                   "the system's); a caller that may kill the run removes this one itself")
    p.add_argument("--test-timeout", type=int, default=120,
                   help="seconds one test may take before its ranks are terminated")
    p.add_argument("--ungate", action="store_true",
                   help="run the tests of UNGATED on fastcomm too (see there)")
    p.add_argument("--list", action="store_true", help="print the selected test names and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per test on stderr")
    return p.parse_args(argv)


def read_names(path):
    with open(path) as f:
        return [l.split("#")[0].strip() for l in f if l.split("#")[0].strip()]


def setup_environment(args, run_dir):
    """What the suite reads from the environment, set before it is imported: it decides at
    import time which tests run for which backend."""
    os.environ["BACKEND"] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    os.environ["TEMP_DIR"] = run_dir
    os.makedirs(os.path.join(run_dir, "barrier"))
    os.makedirs(os.path.join(run_dir, "test_dir"))
    # torch's harness reads its per-test timeout from here when common_distributed is imported.
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(args.test_timeout)
    # The harness makes a temp dir and an init file per test; keep them all inside this run.
    os.environ["TMPDIR"] = run_dir
    tempfile.tempdir = run_dir
    # The suite's own command-line parsing must not see this script's arguments.
    sys.argv = sys.argv[:1]


def declare_fastcomm_features():
    """The suite chooses tests by backend name: a third-party backend gets only the tests meant
    for every backend, unless its name is in the feature sets below. fastcomm is added to each
    set Gloo is in whose feature it has on CPU: it is a plugin (so require_backend_is_available
    accepts it), it has subgroups (dist.new_group), and DistributedDataParallel runs on it.
    It is left out of "gpu" and "cuda": the backend is registered for CPU tensors only."""
    from torch.testing._internal.common_distributed import DistTestCases

    for feature in ("plugin", "subgroup", "ddp"):
        DistTestCases.backend_feature[feature].add("fastcomm")


def build_test_class(args):
    import multiprocessing

    import torch
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest, TestDistBackend)

    # Tests with their own, longer timeout in torch's table get ours too: a hard bound per test.
    for name in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[name] = min(
            common_distributed.TIMEOUT_OVERRIDE[name], args.test_timeout)
    fork = multiprocessing.get_context("fork").Process
    if args.ungate and args.backend != "gloo":
        for name in UNGATED:
            fn = getattr(DistributedTest._DistTestBase, name)
            if "gloo" in getattr(fn, "__unittest_skip_why__", "").lower():
                fn.__unittest_skip__ = False

    class TorchDistributedSuite(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._start_processes(fork)
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

        def tearDown(self):
            procs = list(self.processes)
            super().tearDown()  # terminates ranks left running (a timed-out test)
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():  # a rank stuck where SIGTERM does not reach it
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(timeout=10)

    TorchDistributedSuite.__name__ = TorchDistributedSuite.__qualname__ = (
        f"TorchDistributedSuite_{args.backend}")
    return TorchDistributedSuite


def select(names, args):
    if args.tests_file:
        wanted = read_names(args.tests_file)
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"not in torch's suite: {unknown}")
        names = [n for n in names if n in set(wanted)]
    if args.patterns:
        names = [n for n in names if any(re.search(p, n) for p in args.patterns)]
    return names


class Recorder(unittest.TestResult):
    """Keeps one outcome per test; calls write() after each."""

    def __init__(self, write, verbose):
        super().__init__()
        self.outcomes = {}
        self._write, self._verbose, self._t0 = write, verbose, 0.0

    def startTest(self, test):
        super().startTest(test)
        self._t0 = time.monotonic()

    def _set(self, test, outcome, detail=""):
        name = test.id().split(".")[-1]
        self.outcomes[name] = {"outcome": outcome, "seconds": round(time.monotonic() - self._t0, 2),
                               "detail": detail}
        if self._verbose:
            print(f"{name}: {outcome} ({self.outcomes[name]['seconds']} s)", file=sys.stderr,
                  flush=True)
        self._write()

    def addSuccess(self, test):
        super().addSuccess(test)
        self._set(test, "pass")

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._set(test, "skip", reason)

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._set(test, "fail", _tail(err))

    def addError(self, test, err):
        super().addError(test, err)
        self._set(test, "fail", _tail(err))

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._set(test, "xfail", _tail(err))

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._set(test, "fail", "unexpected success")


def _tail(err, lines=40):
    text = "".join(traceback.format_exception(*err))
    return "\n".join(text.splitlines()[-lines:])


def reason(detail):
    """The line of a skip reason or failure that says what happened: a failure's last
    exception line (torch's harness appends lines on how to rerun it)."""
    lines = [l for l in detail.splitlines() if l.strip()]
    errors = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)]
    return (errors or lines or [""])[-1][:300]


def differences(reference, other):
    """{test: (reference outcome, other outcome)} for every test the two reports (the JSON this
    script writes) both ran and whose outcomes differ."""
    a, b = reference["tests"], other["tests"]
    return {n: (a[n]["outcome"], b[n]["outcome"]) for n in sorted(set(a) & set(b))
            if a[n]["outcome"] != b[n]["outcome"]}


def selection_main(paths):
    """Prints the tests that ran (did not skip) in any of the given reports: the tests that
    say something about a backend on this kind of machine."""
    ran = set()
    for p in paths:
        ran |= {n for n, o in json.load(open(p))["tests"].items() if o["outcome"] != "skip"}
    print("\n".join(sorted(ran)))
    return 0


def compare_main(paths):
    """Prints the tests whose outcomes differ between two reports, with the second's detail."""
    ref, other = (json.load(open(p)) for p in paths)
    diff = differences(ref, other)
    for name, (x, y) in diff.items():
        detail = other["tests"][name]["detail"] or ref["tests"][name]["detail"]
        print(f"{name}: {ref['backend']} {x}, {other['backend']} {y}: {reason(detail)}")
    print(f"{len(diff)} of {len(set(ref['tests']) & set(other['tests']))} tests differ")
    return 1 if diff else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ran-in"]:
        return selection_main(argv[1:])
    if argv[:1] == ["--compare"]:
        if len(argv) != 3:
            raise SystemExit("usage: run_suite.py --compare REFERENCE.json OTHER.json")
        return compare_main(argv[1:])
    args = parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix=f"torch_suite_{args.backend}_", dir=args.work_dir)
    try:
        setup_environment(args, run_dir)
        import torch.distributed as dist

        if not dist.is_available():
            raise SystemExit("torch.distributed is not available")
        if args.backend == "fastcomm":
            import fastcomm  # noqa: F401  (registers the backend)

            declare_fastcomm_features()
        cls = build_test_class(args)
        names = select(unittest.TestLoader().getTestCaseNames(cls), args)
        if args.list:
            print("\n".join(names))
            return 0

        report = {"backend": args.backend, "world_size": args.world_size,
                  "torch": __import__("torch").__version__, "selected": len(names), "tests": {}}
        start = time.monotonic()

        def write():
            report["tests"] = rec.outcomes
            report["seconds"] = round(time.monotonic() - start, 1)
            if args.out:
                tmp = args.out + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(report, f, indent=1, sort_keys=True)
                os.replace(tmp, args.out)

        rec = Recorder(write, args.verbose)
        unittest.TestSuite(cls(n) for n in names).run(rec)
        write()
        counts = {}
        for o in rec.outcomes.values():
            counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
        print(f"{args.backend}: {len(names)} tests in {report['seconds']} s: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        return 0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
