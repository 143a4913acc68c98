"""Collectives of patches/src/comfy/multinpu.py through every transport, on CPU.

- threads: ranks are threads of this process, every device "cpu" (the CPU simulation; on NPU/CUDA the
  same code moves data with peer copies between cards);
- gloo: ranks are real processes in a torch.distributed process group (the HCCL/NCCL code path with
  another backend name), run by tests/support/multinpu_gloo.py with a deadline.
Uneven shards everywhere; results must equal the single-device tensors exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.torch_module()

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import multinpu_cases  # noqa: E402

mn = multinpu_cases.load_multinpu()
GLOO = Path(__file__).resolve().parent / "support" / "multinpu_gloo.py"
WORLDS = [1, 2, 4, 7, 8]  # 7 and 8 divide the 56 heads too


def run_threads(world, fn, timeout=20.0, **params):
    group = mn.ThreadGroup(["cpu"] * world, timeout=timeout)
    threads = mn.RankThreads(group.devices)
    try:
        return group, group.run(lambda comm: fn(comm, mn, **params), threads)
    finally:
        threads.shutdown()


def run_gloo(tmp_path, worlds, case, timeout=20.0, deadline=60.0, **params):
    cmd = [sys.executable, str(GLOO), "--world", ",".join(str(w) for w in worlds), "--case", case,
           "--rdv", str(tmp_path / "rdv"), "--timeout", str(timeout), "--deadline", str(deadline),
           "--params", json.dumps(params)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline * len(worlds) + 60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["groups"]


@pytest.mark.parametrize("world", WORLDS, ids=[f"P{w}" for w in WORLDS])
def test_collectives_threads(world):
    _, results = run_threads(world, multinpu_cases.case_collectives)
    assert [r["rank"] for r in results] == list(range(world))
    assert all(len(r["checked"]) == 9 for r in results)


def test_collectives_gloo_processes(tmp_path):
    groups = run_gloo(tmp_path, WORLDS, "collectives")
    assert [g["world"] for g in groups] == WORLDS
    for g in groups:
        for rank in g["ranks"]:
            assert rank["status"] == "ok", f"P={g['world']} rank {rank['rank']}: {rank.get('traceback') or rank}"
            assert rank["exitcode"] == 0 and len(rank["result"]["checked"]) == 9


def test_world_size_one_moves_nothing():
    group = mn.ThreadGroup(["cpu"])
    comm = group.comm(0)
    x = torch.randn(3, 4)
    assert mn.all_gather_v(x, comm) is x
    # the Ulysses exchange hands back its inputs themselves: no send or receive buffer at P = 1
    q, k, out = torch.randn(1, 4, 3, 2), torch.randn(1, 4, 3, 2), torch.randn(1, 3, 4, 2)
    assert mn.all_to_all_scatter_heads(q, comm, [3]) is q
    got = mn.all_to_all_scatter_heads((q, k), comm, [3])
    assert len(got) == 2 and got[0] is q and got[1] is k
    assert mn.all_to_all_gather_heads(out, comm, [3]) is out
    assert mn.all_reduce(x, comm) is x
    assert group.bytes_moved == 0


def test_thread_copies_are_real_and_counted():
    # the simulation must not alias: a peer's shard is a clone, and every byte crossing ranks is counted
    world, sizes = 4, [3, 3, 2, 2]
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)

    def fn(comm, mn):
        start = sum(sizes[:comm.rank])
        local = full[start:start + sizes[comm.rank]].clone()
        got = mn.all_gather_v(local, comm, sizes=sizes)
        return got, local

    group, results = run_threads(world, fn)
    for got, local in results:
        assert torch.equal(got, full)
        assert got.data_ptr() != local.data_ptr()
    other_ptrs = {r[1].data_ptr() for r in results}
    assert not any(results[0][0].data_ptr() == p for p in other_ptrs)
    # pad to max(sizes) = 3 rows of 6 fp32, P * (P - 1) shards cross ranks
    assert group.bytes_moved == world * (world - 1) * 3 * 6 * 4


def test_gather_v_moves_each_shard_once_to_one_rank():
    # the DiT's final gather: only the destination receives, every other shard crosses once, unpadded
    world, sizes = 4, [3, 3, 2, 2]
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)

    def fn(comm, mn):
        start = sum(sizes[:comm.rank])
        return mn.gather_v(full[start:start + sizes[comm.rank]].clone(), comm, sizes=sizes, dst=0)

    group, results = run_threads(world, fn)
    assert torch.equal(results[0], full) and results[1:] == [None] * 3
    assert group.bytes_moved == (10 - 3) * 6 * 4


def test_heads_not_divisible_names_the_shapes():
    def fn(comm, mn):
        return mn.all_to_all_scatter_heads(torch.zeros(1, 6, 2, 3), comm, [2] * comm.world_size)

    with pytest.raises(AssertionError, match=r"6 heads do not split over 4 ranks \(x \(1, 6, 2, 3\)\)"):
        run_threads(4, fn)


def test_rank_failure_aborts_the_others_fast_threads():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 injected failure") as e:
        run_threads(4, multinpu_cases.case_rank_dies, timeout=300.0)
    assert time.monotonic() - t0 < 150.0, "the other ranks waited for the timeout instead of failing fast"
    assert "raised on rank 1 (cpu) of 4" in "".join(getattr(e.value, "__notes__", []))


def test_stalled_rank_times_out_threads():
    timeout = 1.0
    t0 = time.monotonic()
    with pytest.raises(mn.CollectiveTimeout, match=r"rank\(s\) 1 \(cpu\) did not reach collective #1 within 1 s"):
        run_threads(3, multinpu_cases.case_stall, timeout=timeout, stall_s=6.0)
    # rank 0 waits one timeout at the barrier, then at most one more for the stalled worker's result; the bound is
    # that of a hang, far from the 6 s stall (a busy machine must not fail it)
    assert time.monotonic() - t0 < 2 * timeout + 60


def test_rank_death_surfaces_gloo(tmp_path):
    (group,) = run_gloo(tmp_path, [3], "rank_dies", timeout=20.0, deadline=30.0, mode="exit")
    dead = group["ranks"][1]
    assert dead["exitcode"] == 3 and dead["status"] == "no_result"
    for rank in (group["ranks"][0], group["ranks"][2]):
        assert rank["status"] == "ok", rank
        assert rank["result"]["raised"] == "CollectiveError"
        assert rank["result"]["after_s"] < 10.0, "a dead peer must not cost the whole timeout"


def test_stalled_rank_times_out_gloo(tmp_path):
    (group,) = run_gloo(tmp_path, [3], "stall", timeout=2.0, deadline=6.0, stall_s=60.0)
    for rank in (group["ranks"][0], group["ranks"][2]):
        assert rank["status"] == "ok", rank
        assert rank["result"]["raised"] == "CollectiveError" and "Timed out" in rank["result"]["message"]
        assert rank["result"]["after_s"] < 2.0 + 3.0
    stalled = group["ranks"][1]
    assert stalled["status"] == "hung" and stalled["killed"], "the harness must kill a rank past its deadline"


def test_peer_copy_timeout_when_receiver_never_comes():
    group = mn.ThreadGroup(["cpu", "cpu"], timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(mn.CollectiveTimeout, match="rank 1 .* did not receive"):
        mn.peer_copy(torch.ones(2), group.comm(0), src=0, dst=1)
    assert time.monotonic() - t0 < 60.0  # a hang's bound: nothing ever arrives, so only the timeout ends it
    with pytest.raises(mn.CollectiveError):  # the group stays broken for later calls
        mn.barrier(group.comm(1))



@pytest.mark.parametrize("world", [2, 4, 8], ids=["P2", "P4", "P8"])
def test_ulysses_makes_at_most_two_copies_per_direction_threads(world):
    # threads: the receive copies are aten copies too, so everything the exchange writes is counted: the send
    # buffer packed from q, k, v and the receive buffer one way; the receive buffer and the heads put back the other
    _, results = run_threads(world, multinpu_cases.case_exchange_copies)
    for r in results:
        assert r == {"scatter": 2.0, "gather": 2.0}, r


def test_ulysses_makes_at_most_two_copies_per_direction_gloo(tmp_path):
    # processes: the backend writes the receive buffer (one copy, not an aten operator the counter sees); what the
    # exchange itself writes around it is one copy each way, so two in all
    groups = run_gloo(tmp_path, [2, 4], "exchange_copies")
    for g in groups:
        for rank in g["ranks"]:
            assert rank["status"] == "ok", rank.get("traceback") or rank
            assert rank["result"] == {"scatter": 1.0, "gather": 1.0}, rank["result"]


def test_copy_counter_sees_a_spare_copy():
    # the measuring instrument itself: a concatenation before the exchange is one more full copy, counted
    from h3kit.runtime import copycount
    x = torch.randn(3, 8, 16)
    _, n, ops = copycount.copies(lambda: torch.cat([x, x]).permute(1, 0, 2).contiguous(), x.numel() * 4)
    assert n == 4.0 and set(ops) == {"aten.cat.default", "aten.clone.default"}
    _, n, _ = copycount.copies(lambda: x.permute(1, 0, 2).unflatten(0, (2, 4))[0], x.numel() * 4)
    assert n == 0.0
    # an uninitialised buffer writes nothing, a zero-filled one writes its bytes
    assert copycount.copies(lambda: torch.empty(3, 8, 16), x.numel() * 4)[1] == 0.0
    assert copycount.copies(lambda: torch.zeros(3, 8, 16), x.numel() * 4)[1] == 1.0


def test_weight_gathers_run_on_a_group_of_their_own_gloo(tmp_path):
    # the sharded weights' gathers (comm.side()) must not queue behind the attention's collectives: issued in the
    # opposite order on two ranks, they complete (one group would hold both until the timeout)
    groups = run_gloo(tmp_path, [2, 4], "side_group", timeout=10.0, deadline=40.0)
    for g in groups:
        for rank in g["ranks"]:
            assert rank["status"] == "ok", rank.get("traceback") or rank


def test_bf16_all_reduce_is_one_fp32_all_reduce_gloo(tmp_path):
    """Issue 45 item 7: the text encoder's tensor-parallel sum of bf16 partials is one all_reduce in fp32 (a ring moves
    2 (P-1)/P x 4 bytes an element), not an all_gather of every partial summed on each rank ((P-1) x 2: 8x the bytes at
    8 ranks), with the parity kept: the exact sum rounded once to bf16, bit-identical on every rank. Before: the ops
    were one bf16 all_gather of P x 64 elements."""
    groups = run_gloo(tmp_path, [2, 4, 8], "bf16_all_reduce")
    for g in groups:
        results = [rank["result"] for rank in g["ranks"]]
        assert all(rank["status"] == "ok" for rank in g["ranks"]), g
        for res in results:
            assert res["ops"] == [["all_reduce", "float32", 64]], res["ops"]
            assert res["dtype"] == "bfloat16" and res["exact"]
        assert all(res["sum"] == results[0]["sum"] for res in results), "the same bits on every rank"
