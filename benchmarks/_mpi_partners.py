"""MPI worker of changing_partners.py: the same walk over random groups, under mpirun.

    mpirun -np W python benchmarks/_mpi_partners.py N_GROUPS N_OPS SEED

Each group the sequence uses gets a communicator made by its members only
(`Comm.Create_group`), in sequence order, so every member makes its communicators in the same
order and no creation waits on a rank busy elsewhere. Each rank then times the walk (blocking
in-place Allreduce of 64 float32 on the groups it is in) after a barrier, and checks the first
ops of the sequence with distinct values. Rank 0 prints one JSON line:
{"setup_s": [...], "walk_s": [...], "ops": [...], "errors": [...]}, lists by rank."""
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _partners import NUMEL, workload  # noqa: E402

CHECKED = 50


def main():
    n_groups, n_ops, seed = (int(a) for a in sys.argv[1:4])
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    groups, sequence = workload(size, n_groups, n_ops, seed)

    world.Barrier()
    t0 = time.perf_counter()
    comms = {}
    for gi in sequence:
        members = groups[gi]
        if rank in members and gi not in comms:
            comms[gi] = world.Create_group(world.Get_group().Incl(members), tag=gi % 32768)
    setup = time.perf_counter() - t0

    buf = np.zeros(NUMEL, dtype=np.float32)
    mine = [gi for gi in sequence if rank in groups[gi]]
    for gi in sequence[:50]:  # warm-up: a prefix of the sequence, the same on every rank
        if rank in groups[gi]:
            comms[gi].Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    world.Barrier()
    t0 = time.perf_counter()
    for gi in sequence:
        if rank in groups[gi]:
            comms[gi].Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    walk = time.perf_counter() - t0

    error = None
    for i, gi in enumerate(sequence[:CHECKED]):
        if rank not in groups[gi]:
            continue
        x = np.full(NUMEL, rank + 1 + i, dtype=np.float32)
        comms[gi].Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
        if not np.all(x == sum(r + 1 + i for r in groups[gi])):
            error = f"rank {rank}: wrong Allreduce result at op {i}"
            break

    out = {k: world.gather(v, root=0) for k, v in
           (("setup_s", setup), ("walk_s", walk), ("ops", len(mine)), ("errors", error))}
    if rank == 0:
        out["errors"] = [e for e in out["errors"] if e]
        print(json.dumps(out), flush=True)
    for c in comms.values():
        c.Free()


if __name__ == "__main__":
    main()
