"""MPI worker of forum_mwe.py: the same pairwise all_reduce loop, under mpirun.

    mpirun -np 2P python benchmarks/_mpi_pairs.py NUMEL ITERS WARMUP [fresh|same]

Ranks 2i and 2i+1 form pair i (a communicator split from COMM_WORLD). Each rank times ITERS
in-place Allreduce(SUM) calls on a float32 numpy buffer of NUMEL elements after WARMUP
untimed ones, all ranks entering the timed loop through two barriers; with "fresh", as the
forum post's loop does, a barrier and then a new random array for each call (WARMUP is 0
there). Then it checks one result. Rank 0 prints one JSON line:
{"per_op_s": [seconds per op of every rank], "errors": [...]}. Imports no torch, so that the
ranks start quickly."""
import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main():
    numel, iters, warmup = (int(a) for a in sys.argv[1:4])
    fresh = len(sys.argv) > 4 and sys.argv[4] == "fresh"
    rng = np.random.default_rng(1234)
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    pair = world.Split(color=rank // 2, key=rank)

    buf = np.zeros(numel, dtype=np.float32)  # zeros: the sum never overflows, as in forum_mwe.py
    for _ in range(warmup):
        pair.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    if fresh:
        world.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            pair.Allreduce(MPI.IN_PLACE, rng.standard_normal(numel, dtype=np.float32), op=MPI.SUM)
    else:
        world.Barrier()  # all pairs enter the timed loop together; twice, as forum_mwe.py does
        world.Barrier()
        start = time.perf_counter()
        for _ in range(iters):
            pair.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    per_op = (time.perf_counter() - start) / iters

    lo = 2 * (rank // 2)
    base = np.arange(numel, dtype=np.float32)
    buf = base + np.float32(rank + 1)
    pair.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    expected = 2 * base + np.float32((lo + 1) + (lo + 2))
    error = None if np.array_equal(buf, expected) else f"rank {rank}: wrong Allreduce result"

    per_op_all = world.gather(per_op, root=0)
    errors = world.gather(error, root=0)
    if rank == 0:
        print(json.dumps({"per_op_s": per_op_all, "errors": [e for e in errors if e]}), flush=True)
    pair.Free()


if __name__ == "__main__":
    main()
