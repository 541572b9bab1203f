"""all_gather into a list whose tensors differ in size per member ("uneven").

torch's Gloo backend (torch 2.13, CPU) refuses it on every member, before sending anything:
"ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (2), got (3))", and the
same for all_gather_coalesced; all_gather_into_tensor has no uneven form. (torch's NCCL backend
runs the uneven list form as broadcasts; this suite is about CPU tensors.) fastcomm matches Gloo:
natively and through the backend an uneven list is refused with a ValueError naming rank, group
and the block at fault, before anything is sent; all_to_all is the collective whose sizes may
differ. One leniency: fastcomm compares sizes, not shapes, so blocks of the input's size but
another shape (which Gloo refuses) are filled as flat copies.

Each refusal is made by every member of the group; the group then runs correct all_gathers,
which would fail or hang had a refused call sent anything."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import harness
from _helpers import expect
from test_collectives import RING_ENV, same, shape_groups

import fastcomm as fc


def value(rank, n, salt=0):
    return torch.arange(n, dtype=torch.float32) * 3 + 100 * rank + salt


def uneven_sizes(k, case):
    """Per group rank block sizes, never all equal: 0 and odd counts among them."""
    table = [[0, 5, 1, 7], [3, 1, 3, 3], [1001, 0, 2, 9], [7, 7, 7, 8]]
    sizes = table[case % len(table)][:k]
    if len(set(sizes)) == 1:
        sizes[-1] += 1
    return sizes


def _native_body(rank, world, shape):
    got = shape_groups(shape, rank, world)
    if got is None:
        return None
    g, ranks = got
    k, me = len(ranks), ranks.index(rank)
    msgs = []
    for case in range(8):
        sizes = uneven_sizes(k, case)
        outs = [torch.full((n,), -1.0) for n in sizes]
        inp = value(rank, sizes[me])
        bad = next(i for i, n in enumerate(sizes) if n != sizes[me])
        needles = [f"rank {rank}", str(ranks), f"'tensor_list[{bad}]'", f"{sizes[bad]} elements",
                   f"expected {sizes[me]}", "Gloo"]
        form = case % 3
        if form == 0:
            msgs.append(expect(ValueError, lambda: fc.all_gather(outs, inp, group=g), *needles))
        elif form == 1:
            msgs.append(expect(ValueError, lambda: fc.all_gather(outs, inp, group=g, async_op=True), *needles))
        else:
            def in_batch():
                with fc.batch():
                    fc.all_gather(outs, inp, group=g)
            msgs.append(expect(ValueError, in_batch, *needles))
        assert all(torch.equal(o, torch.full((n,), -1.0)) for o, n in zip(outs, sizes)), "outputs touched"
    # Nothing was sent: equal sizes (0 and odd included) work on the group at once.
    for n in (0, 1, 7, 1001):
        outs = [torch.full((n,), -1.0) for _ in ranks]
        fc.all_gather(outs, value(rank, n), group=g)
        for o, r in zip(outs, ranks):
            err = same(o, value(r, n), f"rank {rank}, group {ranks}, all_gather n={n}")
            assert err is None, err
    # Blocks of the input's size in another shape: filled as flat copies.
    outs = [torch.zeros(2, 3) if i % 2 else torch.zeros(6) for i in range(k)]
    fc.all_gather(outs, value(rank, 6), group=g)
    for o, r in zip(outs, ranks):
        assert torch.equal(o.reshape(-1), value(r, 6)), (o, r)
    return msgs


@pytest.mark.parametrize("shape", ["pair", "triple", "world"])
def test_uneven_all_gather_is_refused_natively(shape):
    results = harness.run(_native_body, 4, shape, timeout=90, env=RING_ENV, init_timeout=10.0)
    assert sum(len(m) for m in results if m) == 8 * (3 if shape == "triple" else 4)


def _backend_body(rank, world):
    # Gloo for the reference, the "fastcomm" backend and fastcomm itself, side by side.
    dist.init_process_group("gloo", store=harness.child_store(), rank=rank, world_size=world)
    fc.init()
    fcg = dist.new_group(list(range(world)), backend="fastcomm", use_local_synchronization=True)
    native = fc.new_group(list(range(world)))
    seen = {}
    for case in range(4):
        sizes = uneven_sizes(world, case)
        bad = next(i for i, n in enumerate(sizes) if n != sizes[rank])
        for name, call in [
            ("gloo", lambda outs, inp: dist.all_gather(outs, inp, group=dist.new_group(backend="gloo"))),
            ("backend", lambda outs, inp: dist.all_gather(outs, inp, group=fcg)),
            ("backend-async", lambda outs, inp: dist.all_gather(outs, inp, group=fcg, async_op=True).wait()),
            ("native", lambda outs, inp: fc.all_gather(outs, inp, group=native)),
        ]:
            outs = [torch.full((n,), -1.0) for n in sizes]
            if name == "gloo":
                seen[name] = expect(RuntimeError, lambda: call(outs, value(rank, sizes[rank])), "invalid tensor size")
            else:
                seen[name] = expect(ValueError, lambda: call(outs, value(rank, sizes[rank])), f"rank {rank}",
                                    f"'tensor_list[{bad}]'")
        # all_gather_coalesced: one uneven block refuses the whole call, as on Gloo
        lists = [[torch.zeros(2), torch.zeros(sizes[r])] for r in range(world)]
        expect(RuntimeError, lambda: dist.all_gather_coalesced(lists, [torch.ones(2), value(rank, sizes[rank])],
                                                               group=dist.new_group(backend="gloo")),
               "invalid size")
        expect(ValueError, lambda: dist.all_gather_coalesced(lists, [torch.ones(2), value(rank, sizes[rank])],
                                                             group=fcg), f"'tensor_list[{bad}]'")
    # The even form: all three agree, and fastcomm's groups were left in step by the refusals.
    for n in (0, 1, 7, 1001):
        results = []
        for call in (lambda o, i: dist.all_gather(o, i), lambda o, i: dist.all_gather(o, i, group=fcg),
                     lambda o, i: fc.all_gather(o, i, group=native)):
            outs = [torch.full((n,), -1.0) for _ in range(world)]
            call(outs, value(rank, n))
            results.append(torch.cat(outs))
        assert torch.equal(results[0], torch.cat([value(r, n) for r in range(world)])), results[0]
        assert torch.equal(results[1], results[0]) and torch.equal(results[2], results[0]), results
    fc.shutdown()
    dist.destroy_process_group()
    return seen


def test_uneven_all_gather_is_refused_like_gloo_through_the_backend():
    results = harness.run(_backend_body, 3, init=False, timeout=120)
    assert all(set(r) == {"gloo", "backend", "backend-async", "native"} for r in results), results
