"""What several test files share: deterministic per-rank inputs, the local reference of a
reduction, result digests, a check that a call raises the right exception, and a wait for a
rank that was made to die.

The suites check every result against a reference computed locally: each rank regenerates the
inputs of every member of its group from (global rank, case seed) with ``gen`` and folds them
with ``fold``, left to right in group-rank order (the order the engine promises), in the
tensor's own dtype; all_reduce over a group the engine runs hierarchically (``all_reduce_ref``)
folds each host's members first."""
from __future__ import annotations

import hashlib
import os
import time
import zlib

import torch
from torch.distributed import ReduceOp

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
           "int32": torch.int32, "int64": torch.int64}


def gen(rank, seed, dt, n, op=None, kind="int"):
    """Global rank ``rank``'s input for case ``seed``: n elements of the dtype named ``dt``.

    kind "int": small integers, exact in every dtype for every op (PRODUCT draws from
    {-2, -1, 1, 2} so a product over 4 members stays exact even in bfloat16); kind "randn":
    normal floats, where the fold order shows in the rounding."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + 12345)
    dtype = _DTYPES[dt]
    if kind == "randn":
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    if op == "PRODUCT":
        return torch.tensor([-2, -1, 1, 2])[torch.randint(0, 4, (n,), generator=g)].to(dtype)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def seed_of(*key, mod=100_000):
    """A seed every rank derives alike from ``key`` (ints and strings), however the ranks were
    started: ``hash()`` of a string differs between interpreters unless PYTHONHASHSEED is set."""
    return zlib.crc32(repr(key).encode()) % mod


def fold(inputs, op):
    """Left fold over the members' inputs in group-rank order, in the inputs' dtype (the
    engine's promised order); ``op`` is a ReduceOp's name ("SUM", "AVG", ...)."""
    acc = inputs[0].clone()
    for x in inputs[1:]:
        if op in ("SUM", "AVG"):
            acc = acc + x
        elif op == "PRODUCT":
            acc = acc * x
        elif op == "MIN":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == "AVG":
        acc = acc / len(inputs)
    return acc


# Each global rank's host, when a test simulates several (test_cross_host sets it in every rank
# before running a body); None: one host.
HOSTS = None


def all_reduce_ref(inputs, ranks, op, fold=fold):
    """What all_reduce promises members ``ranks`` (sorted global ranks) with these inputs: the
    left fold in group-rank order; but over a group that spans hosts with several members on
    one of them, which runs hierarchically (csrc/algorithms/collectives.cpp), each host's
    members folded in group-rank order first, then those partials in the order of each host's
    lowest rank, AVG summed and divided once by the group size. ``fold`` takes op names or
    ReduceOps, as ``op`` is given."""
    hosts = None
    if HOSTS is not None and os.environ.get("FASTCOMM_HIERARCHICAL") != "0":
        hosts = [HOSTS[r] for r in ranks]
    order = list(dict.fromkeys(hosts or []))
    if len(order) < 2 or len(order) == len(ranks):
        return fold(inputs, op)
    named = isinstance(op, str)
    avg = op == ("AVG" if named else ReduceOp.AVG)
    inner = ("SUM" if named else ReduceOp.SUM) if avg else op
    partials = [fold([x for x, h in zip(inputs, hosts) if h == host], inner) for host in order]
    out = fold(partials, inner)
    return out / len(inputs) if avg else out


def digest(t):
    """A short hash of the tensor's bytes (0-d tensors included), to compare members' results."""
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def expect(exc_type, fn, *must_contain, nothing="nothing was raised"):
    """Calls fn, requires exc_type (exactly that class or a subclass) and every string of
    must_contain in the message; returns the message. ``nothing`` ends the failure message
    when fn raised nothing."""
    try:
        fn()
    except exc_type as e:
        msg = str(e)
        missing = [s for s in must_contain if s not in msg]
        assert not missing, f"message lacks {missing}: {msg!r}"
        return msg
    except BaseException as e:  # noqa: BLE001
        raise AssertionError(f"expected {exc_type.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {exc_type.__name__}, {nothing}")


def wait_dead(pid_file):
    """Waits (bounded) until the process whose pid is in pid_file has died (zombie or gone)."""
    for _ in range(3000):
        if os.path.exists(pid_file):
            break
        time.sleep(0.01)
    pid = int(open(pid_file).read())
    for _ in range(3000):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)
    raise AssertionError(f"rank with pid {pid} did not die")
