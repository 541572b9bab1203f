"""The changing-partners workload, shared by changing_partners.py and its MPI worker.

Every rank builds the same workload from the same seed: `n_groups` groups of 2 to 4 distinct
ranks drawn at random, and a sequence of `n_ops` indices into them. Each rank walks the
sequence and all_reduces on the groups it belongs to, skipping the others, as gossip
training does when partners change every step. Imports neither torch nor mpi4py."""
from __future__ import annotations

import random

NUMEL = 64  # float32 per all_reduce


def workload(world, n_groups, n_ops, seed):
    """(groups, sequence): `groups` a list of sorted rank lists, `sequence` indices into it."""
    rng = random.Random(seed)
    sizes = [s for s in (2, 3, 4) if s <= world]
    groups = [sorted(rng.sample(range(world), rng.choice(sizes))) for _ in range(n_groups)]
    sequence = [rng.randrange(n_groups) for _ in range(n_ops)]
    return groups, sequence


def issue_mode(i, mixed):
    """How op i of the sequence is issued: 'blocking', or in the mixed run every third op
    'async' (then waited for) and every seventh 'batch' (a batch of one)."""
    if not mixed:
        return "blocking"
    if i % 7 == 0:
        return "batch"
    if i % 3 == 0:
        return "async"
    return "blocking"
