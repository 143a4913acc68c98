"""Progress by what the device finished (issue 45): the clock's markers, the CPU twin of the accelerator's asynchrony
(H3KIT_EMULATE_ASYNC_DEVICE=1), the faults `slow` and `stuck`, the progress watch judging the device, and a heartbeat
that never waits on the allocator (comfy/multinpu_clock.py, multinpu_progress.py, multinpu_group.py).

These run in one process on a world-1 gloo group or on beats made up here; the same paths on real process groups run
in tests/test_multinpu_process_hang.py and test_multinpu_process_faults.py (with and without the twin) and through the
real server in tests/test_multinpu_clock_service.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.support import requires

torch = requires.torch_module()
from tests.test_multinpu_process import ROOT  # noqa: E402,F401  (patches/src on sys.path)

import comfy.multinpu  # noqa: E402
import comfy.multinpu_clock as clock  # noqa: E402
import comfy.multinpu_group as group  # noqa: E402
import comfy.multinpu_progress as progress  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402
from tests.test_multinpu_process_hang import _run  # noqa: E402  (beats once a second, checks twice)

CPU = torch.device("cpu")


@pytest.fixture
def world1(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield comfy.multinpu.ProcessComm()
    finally:
        dist.destroy_process_group()


@pytest.fixture
def twin(monkeypatch):
    """This process's device made the twin (as H3KIT_EMULATE_ASYNC_DEVICE=1 makes it at import)."""
    monkeypatch.setenv(clock.ASYNC_ENV, "1")
    device = clock.Device()
    monkeypatch.setattr(clock, "DEVICE", device)
    monkeypatch.setattr(clock, "PROGRESS", clock.CollectiveProgress())
    monkeypatch.setattr(comfy.multinpu, "PROGRESS", clock.PROGRESS)
    return device


def test_on_plain_gloo_the_device_is_the_host(world1):
    """gloo's calls return when done: the device's fields equal the host's after each collective (one code path)."""
    before = comfy.multinpu.PROGRESS.snapshot()
    world1.all_reduce(torch.ones(2))
    world1.barrier()
    after = comfy.multinpu.PROGRESS.snapshot()
    assert after["clock"] == "sync" and after["coll"] == before["coll"] + 2
    assert after["dev_coll"] == after["coll"] and after["dev_op"] == "barrier" and after["dev_in"] is None
    assert after["dev_steps"] == before["dev_steps"] + 4  # each collective reached and completed


def test_on_the_twin_a_collective_returns_at_enqueue_and_completes_on_the_stream(world1, twin):
    """The host queues a collective the device cannot start yet (its stream busy): the host's count moves, the
    device's does not; the beat says so; the barrier (a host sync) waits for the stream and then both agree."""
    gate = threading.Event()
    clock.DEVICE.run(gate.wait)                        # device work queued before the collective
    work = world1._call("all_reduce", lambda group=None: "moved", reads=False)
    queued = clock.PROGRESS.snapshot()
    assert isinstance(work, clock.Work) and not work.query()
    assert queued["clock"] == "twin" and queued["coll"] == 1 and not queued["inside"]
    assert queued["dev_coll"] == 0 and queued["dev_in"] is None and queued["dev_steps"] == 0
    assert progress.describe({"g": 1, "n": 1, **queued}, 1, 1) == \
        "its host queued collective #1 (all_reduce) last; its device has completed no collective"
    done = threading.Thread(target=world1.barrier)
    done.start()
    time.sleep(0.3)
    assert done.is_alive(), "the barrier waits for the device"
    assert clock.PROGRESS.snapshot()["op"] == "barrier" and clock.PROGRESS.snapshot()["inside"]
    gate.set()
    done.join(30)
    assert not done.is_alive() and work.wait() == "moved"
    after = clock.PROGRESS.snapshot()
    assert after["dev_coll"] == after["coll"] == 2 and after["dev_op"] == "barrier" and after["dev_steps"] == 4


def test_a_collective_whose_result_the_host_reads_waits_for_the_device(world1, twin):
    gate = threading.Event()
    clock.DEVICE.run(gate.wait)
    threading.Timer(0.5, gate.set).start()
    t0 = time.monotonic()
    out = world1.all_reduce(torch.ones(3))
    assert time.monotonic() - t0 >= 0.4 and out.tolist() == [1.0, 1.0, 1.0]


def test_the_stream_runs_each_collective_in_the_modes_of_the_thread_that_queued_it(world1, twin):
    """Workers run programs in inference mode (thread-local): a backend writing into an inference tensor from the
    stream's thread outside it is refused ("Inplace update to inference tensor outside InferenceMode")."""
    with torch.inference_mode():
        x = torch.ones(3)
        out, wait = world1.all_gather_flat(x, async_op=True)
        assert wait().tolist() == [1.0] * 3 and world1.all_reduce(x).tolist() == [1.0] * 3


def test_the_slow_fault_is_device_time_that_keeps_completing(world1, twin):
    """slow=2: two steps of a second, each a tick the beat reports, the host long past them (it queued them)."""
    t0 = time.monotonic()
    clock.spend(CPU, 2.0, "dit_forward slow")
    assert time.monotonic() - t0 < 0.5, "the host only queued the device time"
    seen = set()
    while clock.PROGRESS.snapshot()["dev_steps"] < 2 and time.monotonic() - t0 < 30:
        seen.add(clock.PROGRESS.snapshot()["dev_tick"])
        time.sleep(0.05)
    assert "dit_forward slow 1/2" in seen and clock.PROGRESS.snapshot()["dev_tick"] == "dit_forward slow 2/2"
    clock.synchronize(CPU)
    assert time.monotonic() - t0 >= 1.9


def test_the_stuck_fault_keeps_the_device_from_its_next_collective(world1, twin, tmp_path):
    """stuck: the device never reaches the next collective while the file exists; the host queued it and runs on."""
    trigger = tmp_path / "stuck"
    trigger.touch()
    clock.DEVICE.stuck = str(trigger)
    world1._call("all_to_all", lambda group=None: None, reads=False)
    time.sleep(0.3)
    beat = clock.PROGRESS.snapshot()
    assert beat["coll"] == 1 and beat["dev_in"] is None and beat["dev_coll"] == 0 and beat["dev_idle"] >= 0.2
    trigger.unlink()
    clock.synchronize(CPU)
    assert clock.PROGRESS.snapshot()["dev_coll"] == 1


def test_an_error_on_the_stream_reaches_the_host_that_reads(world1, twin):
    def broken(group=None):
        raise RuntimeError("connection closed by peer")
    with pytest.raises(comfy.multinpu.CollectiveError, match="all_reduce on rank 0 of 1 failed: connection closed"):
        world1._call("all_reduce", broken)


def test_an_install_waits_for_the_device_before_it_reports_the_model_ready(twin):
    """WorkerContext.place (the built-in install, before ready/{id}/{rank}): a host sync, so a late loader's device
    time is spent under the load bound, not inside the first command's collectives. Before, a load reported ready
    with its device work still queued."""
    ctx = group.WorkerContext(wire.GroupSpec(local_size=1), 0, "cpu")
    gate = threading.Event()
    clock.DEVICE.run(gate.wait)
    placed = threading.Thread(target=ctx.place, args=(object(),))
    placed.start()
    time.sleep(0.3)
    assert placed.is_alive(), "reported before the device finished"
    gate.set()
    placed.join(30)
    assert not placed.is_alive()


# ---- faults ------------------------------------------------------------------------------------------------------

def test_faults_are_parsed_and_an_unknown_kind_is_refused_naming_the_kinds():
    assert clock.parse_faults("dit_forward:slow=15:/t/{rank},vae_decode:stuck:/t/x,te_config:hold:/t/y") == [
        ("dit_forward", "slow", 15.0, "/t/{rank}"), ("vae_decode", "stuck", None, "/t/x"),
        ("te_config", "hold", None, "/t/y")]
    for bad in ("dit_forward:slo:/t/x", "dit_forward:slow:/t/x", "dit_forward:slow=0:/t/x", "dit_forward:slow=a:/t",
                "dit_forward:hang", "dit_forward:stuck=3:/t/x"):
        with pytest.raises(clock.FaultError) as e:
            clock.parse_faults(bad)
        assert repr(bad) in str(e.value) and "oom, raise, hold, hang, slow=SECONDS, stuck" in str(e.value)


def test_the_driver_refuses_an_unknown_fault_at_start(monkeypatch):
    """Before: an unknown kind was ignored, so a misspelt acceptance run tested nothing."""
    import comfy.multinpu_process as mp
    monkeypatch.setenv(clock.FAULT_ENV, "dit_forward:sloow=15:/tmp/x")
    rt = mp.GroupRuntime(wire.GroupSpec(local_size=2, timeout=300), wire.new_key())
    with pytest.raises(clock.FaultError, match="slow=SECONDS"):
        rt.start()
    assert rt._shm_claim is None, "refused before anything was set up"


# ---- the heartbeat never waits on the allocator -------------------------------------------------------------------

def test_a_beat_is_sent_while_a_stats_call_is_blocked(monkeypatch):
    """The allocator's counters take its mutex, held across a device sync during an OOM retry. A stats call blocked
    for 20 s (here on the worker's computing thread, as the mutex would hold it) must not stop the beats: each beat
    carries the last sample taken. Before, the heartbeat thread read the stats itself and missed every beat meanwhile
    (the heartbeat bound is 15 s)."""
    held = threading.Event()
    release = threading.Event()
    calls = []

    def blocked(device, reset_peak=False):
        calls.append(threading.current_thread().name)
        held.set()
        release.wait(20)
        return {"allocated": 2}
    ctx = group.WorkerContext(wire.GroupSpec(local_size=1), 0, "cpu")
    ctx.generation, ctx.command = 1, 4
    clock.PROGRESS.memory = {"allocated": 1}
    monkeypatch.setattr(clock, "memory_stats", blocked)
    worker = threading.Thread(target=clock.PROGRESS.sample, args=(CPU, True), name="computing")
    worker.start()
    try:
        assert held.wait(10)
        beats = []
        for _ in range(3):
            box = []
            beat = threading.Thread(target=lambda: box.append(group.beat_news(ctx)), daemon=True)
            beat.start()
            beat.join(5)
            assert box, "a beat waited on the allocator"
            beats.append(box[0])
    finally:
        release.set()
        worker.join(30)
    assert all(b["progress"]["memory"] == {"allocated": 1} and b["progress"]["n"] == 4 for b in beats)
    assert calls == ["computing"] and clock.PROGRESS.memory == {"allocated": 2}


# ---- the watch judges the device ----------------------------------------------------------------------------------

def _dev(n, coll, dev_coll, dev_in=None, steps=0, op="all_to_all", inside=True, g=1, tick=None):
    """A beat of the device's clock: the host queued `coll`, the device completed `dev_coll`, is inside `dev_in`."""
    return {"g": g, "n": n, "coll": coll, "p2p": 0, "op": op, "inside": inside, "dev_coll": dev_coll, "dev_op": op,
            "dev_in": dev_in, "dev_in_op": op if dev_in else None, "dev_p2p": 0, "dev_steps": steps, "dev_tick": tick,
            "dev_idle": 0.0, "clock": "twin"}




def test_hosts_waiting_in_the_barrier_while_their_devices_tick_are_never_judged():
    """Every host queued its command up to the closing barrier (#9) and waits there for 40 s, 8 times the bound,
    while each device ticks through its blocks and collectives (the slow fault on every rank; a long forward on a
    device). The host-position watch failed this command after the bound ("every rank is inside it")."""
    beats = {r: (lambda t, r=r: _dev(3, 9, int(t // 5), steps=int(t) + r, op="barrier", tick=f"dit block {int(t)}"))
             for r in range(2)}
    assert _run(progress.ProgressWatch(5.0), beats, 40) is None


def test_a_late_device_that_keeps_completing_work_is_never_judged():
    """Rank 1's device spends 30 s on work before its first collective (a late load: 1 s steps, each completing),
    while rank 0's device waits inside collective #1; both hosts queued up to the barrier."""
    beats = {0: lambda t: _dev(3, 4, 0, dev_in=1, steps=1, op="barrier"),
             1: lambda t: _dev(3, 4, 0, steps=int(t), op="barrier", tick=f"dit_config slow {int(t)}/30")}
    assert _run(progress.ProgressWatch(5.0), beats, 30) is None


def test_a_stuck_device_is_named_with_what_its_host_queued_and_its_device_did_not_complete():
    """Rank 1's host queued collective #7 and waits at the barrier (#9), beating; its device never reached #7 and
    completes nothing; rank 0's device waits inside #7. Named after the bound: the collective its device did not
    complete, never "completed" for what was only queued."""
    beats = {0: lambda t: _dev(3, 9, 6, dev_in=7, steps=14, op="all_to_all"),
             1: lambda t: _dev(3, 9, 6, steps=13, op="all_to_all", tick="dit block 1")}
    t, (rank, why) = _run(progress.ProgressWatch(5.0), beats, 30)
    assert rank == 1 and 5 < t <= 7, (t, why)
    assert "its host queued collective #9 (all_to_all) and waits for it" in why, why
    assert "its device last completed collective #6 (all_to_all), its last tick dit block 1" in why, why
    assert "its device did not complete collective #7 (all_to_all), while rank 0 waits in collective #7" in why, why


def test_every_device_inside_one_collective_with_none_completing_is_the_stuck_collective():
    beats = {r: (lambda t: _dev(3, 9, 6, dev_in=7, steps=14, op="all_reduce")) for r in range(2)}
    t, (rank, why) = _run(progress.ProgressWatch(5.0), beats, 30)
    assert rank is None and "collective #7 (all_reduce) of command 3 (forward) made no progress" in why
    assert "every rank is inside it on its device" in why
