"""SPMD test cases for patches/src/comfy/multinpu.py, shared by every transport.

Each case is fn(comm, mn, **params) -> dict and runs on every rank with that rank's communicator:
threads in one process (tests/test_multinpu_collectives.py) or gloo processes
(tests/support/multinpu_gloo.py). Full tensors are built from a seed on every rank, each rank takes
its shard with multinpu.shard_sizes (the split the DiT uses), and results must match the full tensor
exactly: collectives only move data, so atol is 0.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MULTINPU_SRC = ROOT / "patches" / "src" / "comfy" / "multinpu.py"


def load_multinpu(path=MULTINPU_SRC):
    """Import patches/src/comfy/multinpu.py on its own (it needs torch only)."""
    name = "h3kit_test_multinpu"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _full(shape, seed, integer=False):
    import torch
    g = torch.Generator().manual_seed(seed)
    if integer:  # small integers: sums are exact in any order, so reductions compare with atol 0
        return torch.randint(-50, 50, shape, generator=g).to(torch.float32)
    return torch.randn(shape, generator=g)


def _shard(full, sizes, rank, dim):
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank])


def _check(cond, what):
    if not cond:
        raise AssertionError(what)


def case_collectives(comm, mn, heads=56, head_dim=4):
    """Every collective against a single-device reference, uneven shards included."""
    import torch
    p, r = comm.world_size, comm.rank
    checked = []

    # all_gather_v, dim 0, sizes known and exchanged; S = 3P + 1 is uneven for every P > 1
    for total in (3 * p + 1, max(p - 1, 1)):  # the second leaves the last rank(s) empty when P > 1
        sizes = mn.shard_sizes(total, p)
        full = _full((total, 5), seed=total)
        local = _shard(full, sizes, r, 0).clone()
        got = mn.all_gather_v(local, comm, sizes=sizes)
        _check(torch.equal(got, full), f"all_gather_v dim 0, S={total}, sizes {sizes}")
        got = mn.all_gather_v(local, comm)
        _check(torch.equal(got, full), f"all_gather_v dim 0 with exchanged sizes, S={total}")
        checked.append(f"all_gather_v S={total}")

    # all_gather_v along the sequence dim of packed K/V, [2, H, s_r, D] -> [2, H, S, D]
    total = 5 * p + p // 2 + 1
    sizes = mn.shard_sizes(total, p)
    kv = _full((2, heads, total, head_dim), seed=11)
    got = mn.all_gather_v(_shard(kv, sizes, r, 2).contiguous(), comm, sizes=sizes, dim=2)
    _check(torch.equal(got, kv), "all_gather_v dim 2")
    checked.append("all_gather_v dim 2")

    # Ulysses: [1, H, s_r, D] -> [1, H/P, S, D] and back
    q = _full((1, heads, total, head_dim), seed=12)
    hp = heads // p
    scattered = mn.all_to_all_scatter_heads(_shard(q, sizes, r, 2).contiguous(), comm, sizes)
    _check(torch.equal(scattered, q[:, r * hp:(r + 1) * hp]), "all_to_all_scatter_heads")
    out = _full((1, total, heads, head_dim), seed=13)
    back = mn.all_to_all_gather_heads(out[:, :, r * hp:(r + 1) * hp].contiguous(), comm, sizes)
    _check(torch.equal(back, _shard(out, sizes, r, 1)), "all_to_all_gather_heads")
    round_trip = mn.all_to_all_gather_heads(scattered.transpose(1, 2).contiguous(), comm, sizes)
    _check(torch.equal(round_trip, _shard(q, sizes, r, 2).transpose(1, 2)), "scatter then gather heads is the identity")
    # q, k, v in one exchange, k as a transposed view (the fused RoPE's [B, S, H, D] layout seen as [B, H, S, D])
    k = _full((1, total, heads, head_dim), seed=14).transpose(1, 2)
    v = _full((1, heads, total, head_dim), seed=15)
    got = mn.all_to_all_scatter_heads([_shard(t, sizes, r, 2) for t in (q, k, v)], comm, sizes)
    _check(len(got) == 3 and all(torch.equal(g, t[:, r * hp:(r + 1) * hp]) for g, t in zip(got, (q, k, v))),
           "all_to_all_scatter_heads of q, k, v together")
    checked.append("all_to_all both directions")

    # reductions and broadcast
    parts = _full((p, 3, 7), seed=14, integer=True)
    _check(torch.equal(mn.all_reduce(parts[r].clone(), comm), parts.sum(0)), "all_reduce")
    red = mn.reduce(parts[r].clone(), comm, dst=p - 1)
    if r == p - 1:
        _check(red is not None and torch.equal(red, parts.sum(0)), "reduce onto the last rank")
    else:
        _check(red is None, "reduce returns None off dst")
    src_data = _full((4, 6), seed=15)
    mine = src_data.clone() if r == p - 1 else torch.zeros(4, 6)
    _check(torch.equal(mn.broadcast(mine, comm, src=p - 1), src_data), "broadcast from the last rank")
    checked.append("all_reduce, reduce, broadcast")

    # 16-bit partial sums: added in fp32 and rounded once, as one device's fp32-accumulating matmul does.
    # Magnitudes in [0.5, 4) keep every fp32 sum of P bf16 values exact, so the reference (the exact sum,
    # rounded once to bf16) is the one right answer; adding in bf16 rounds after every addition and misses it
    g = torch.Generator().manual_seed(17)
    mags = torch.rand((p, 64), generator=g) * 3.5 + 0.5
    signs = torch.randint(0, 2, (p, 64), generator=g) * 2 - 1
    halves = (mags * signs).to(torch.bfloat16)
    exact = halves.double().sum(0).to(torch.bfloat16)
    got = mn.all_reduce(halves[r].clone(), comm)
    _check(got.dtype == torch.bfloat16 and torch.equal(got, exact), "bf16 all_reduce sums in fp32, rounds once")
    red = mn.reduce(halves[r].clone(), comm, dst=0)
    if r == 0:
        _check(red.dtype == torch.bfloat16 and torch.equal(red, exact), "bf16 reduce sums in fp32, rounds once")
    checked.append("bf16 all_reduce, reduce")

    # gather_v onto one rank: uneven shards, dims 0 and 1, sizes known and exchanged
    total = 3 * p + 1
    sizes = mn.shard_sizes(total, p)
    full = _full((2, total, 5), seed=18)
    for dst in {0, p - 1}:
        got = mn.gather_v(_shard(full, sizes, r, 1).contiguous(), comm, sizes=sizes, dst=dst, dim=1)
        _check(torch.equal(got, full) if r == dst else got is None, f"gather_v onto rank {dst}")
    got = mn.gather_v(_shard(full, sizes, r, 1).contiguous(), comm, dst=0, dim=1)
    _check(torch.equal(got, full) if r == 0 else got is None, "gather_v with exchanged sizes")
    checked.append("gather_v")

    # all_gather_flat: equal byte slices (a sharded DiT block's) in rank order, into one new tensor, counted
    flat = torch.randint(0, 256, (p * 96,), generator=torch.Generator().manual_seed(19), dtype=torch.uint8)
    before = comm.bytes_received
    got = mn.all_gather_flat(flat[r * 96:(r + 1) * 96].clone(), comm)
    _check(torch.equal(got, flat) and (p == 1 or got.data_ptr() != flat.data_ptr()), "all_gather_flat")
    _check(comm.bytes_received - before == (p - 1) * 96, "all_gather_flat counts the other ranks' slices")
    checked.append("all_gather_flat")

    # peer copy 0 -> P-1; on dst the buffer is filled, and is not the sender's memory
    payload = _full((3, 4), seed=16)
    buf = payload.clone() if r == 0 else torch.zeros(3, 4)
    got = mn.peer_copy(buf, comm, src=0, dst=p - 1)
    if r == p - 1:
        _check(torch.equal(got, payload), "peer_copy delivers the data")
    elif r != 0:
        _check(got is None, "peer_copy returns None on bystanders")
    mn.barrier(comm)
    checked.append("peer_copy, barrier")
    return {"rank": r, "checked": checked}


def case_rank_dies(comm, mn, mode="raise"):
    """Rank 1 dies before a collective; the others must raise CollectiveError, quickly."""
    import torch
    if comm.rank == 1:
        if mode == "exit":
            os._exit(3)
        raise RuntimeError("rank 1 injected failure")
    t0 = time.monotonic()
    try:
        mn.all_gather_v(torch.ones(2, 3), comm, sizes=[2] * comm.world_size)
    except mn.CollectiveError as e:
        return {"rank": comm.rank, "raised": type(e).__name__, "message": str(e), "after_s": time.monotonic() - t0}
    raise AssertionError("all_gather_v returned although rank 1 died")


def case_stall(comm, mn, stall_s=6.0):
    """Rank 1 sleeps past the group's timeout; the others must raise within the bound, naming it."""
    import torch
    if comm.rank == 1:
        time.sleep(stall_s)
        return {"rank": 1, "slept": stall_s}
    t0 = time.monotonic()
    try:
        mn.all_to_all_scatter_heads(torch.ones(1, 2 * comm.world_size, 2, 3), comm, [2] * comm.world_size)
    except mn.CollectiveError as e:
        return {"rank": comm.rank, "raised": type(e).__name__, "message": str(e), "after_s": time.monotonic() - t0}
    raise AssertionError("all_to_all returned although rank 1 stalled")


def case_exchange_copies(comm, mn, head_dim=16):
    """Full copies each Ulysses direction writes on this rank (bytes written / the direction's input), measured
    by h3kit.runtime.copycount as torch executes the exchange; even shards."""
    import torch
    from h3kit.runtime import copycount
    p, r = comm.world_size, comm.rank
    heads = 2 * p  # two heads a rank: with one, putting the heads back in place is a view
    sizes = mn.shard_sizes(4 * p, p)
    q, k, v = (torch.randn(1, heads, sizes[r], head_dim) for _ in range(3))
    _, scatter, _ = copycount.copies(lambda: mn.all_to_all_scatter_heads((q, k, v), comm, sizes), 3 * q.numel() * 4)
    out = torch.randn(1, sum(sizes), heads // p, head_dim)
    _, gather, _ = copycount.copies(lambda: mn.all_to_all_gather_heads(out, comm, sizes), out.numel() * 4)
    return {"scatter": scatter, "gather": gather}


def case_side_group(comm, mn):
    """comm.side() is a group of its own: rank 0 issues a side all-gather, then enters a barrier of the main group;
    the others enter that barrier first, then the side gather. On one group, whose collectives a backend runs in
    issue order, the two would wait for each other until the timeout; on two each completes."""
    import torch
    side = comm.side()
    x = torch.full((5,), float(comm.rank))
    before = comm.bytes_received
    if comm.rank == 0:
        wait = mn.all_gather_flat_start(x, side)
        mn.barrier(comm)
        got = wait()
    else:
        mn.barrier(comm)
        got = mn.all_gather_flat(x, side)
    _check(torch.equal(got, torch.arange(comm.world_size, dtype=torch.float32).repeat_interleave(5)), "side all-gather")
    _check(side is comm.side() and side is not comm, "one side group, made once")
    moved = comm.bytes_received - before
    _check(moved == (comm.world_size - 1) * 5 * 4, f"the side group's bytes count on the main communicator ({moved})")
    return {"moved": moved}


def case_bf16_all_reduce(comm, mn):
    """The text encoder's tensor-parallel sum of bf16 partials on a process group: which torch.distributed
    collective runs, in which dtype, and the result (the exact sum rounded once, the same on every rank)."""
    import torch
    import torch.distributed as dist
    seen = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_into_tensor", "all_gather_single")
            if hasattr(dist, name)}

    def spy(name):
        def call(*args, **kwargs):
            t = args[0]
            seen.append([name, str(t.dtype).removeprefix("torch."), t.numel()])
            return real[name](*args, **kwargs)
        return call
    for name in real:
        setattr(dist, name, spy(name))
    try:
        p, r = comm.world_size, comm.rank
        g = torch.Generator().manual_seed(17)
        halves = ((torch.rand((p, 64), generator=g) * 3.5 + 0.5) * (torch.randint(0, 2, (p, 64), generator=g) * 2 - 1)
                  ).to(torch.bfloat16)
        got = mn.all_reduce(halves[r].clone(), comm)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    exact = halves.double().sum(0).to(torch.bfloat16)
    return {"ops": seen, "dtype": str(got.dtype).removeprefix("torch."), "exact": bool(torch.equal(got, exact)),
            "sum": got.float().tolist()}


CASES = {"bf16_all_reduce": case_bf16_all_reduce, "side_group": case_side_group, "collectives": case_collectives, "rank_dies": case_rank_dies, "stall": case_stall,
         "exchange_copies": case_exchange_copies}
