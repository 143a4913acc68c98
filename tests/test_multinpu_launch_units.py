"""comfy/multinpu_launch.py's failure naming, unit by unit (the process group around it is
test_multinpu_process.py): how a worker's end is worded and classified, what a worker's environment holds, its
incarnations, and the SIGTERM watcher of a worker. Written for the survivors of tools/mutate.py --module naming."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_launch as launch  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_wire as wire  # noqa: E402
import comfy.multinpu_zygote as zygote  # noqa: E402


def test_how_a_worker_ended_is_worded_and_which_ends_h3kit_caused():
    assert launch._exit_reason(3) == "exited with code 3"
    assert launch._exit_reason(-9) == "killed by SIGKILL" and launch._exit_reason(-999) == "killed by signal 999"
    assert launch._exit_reason(wire.REPORTED_EXIT) == f"exited after reporting its error (code {wire.REPORTED_EXIT})"
    aborted = launch._exit_reason(wire.RECYCLED_EXIT)
    assert aborted == f"left its aborted generation (code {wire.RECYCLED_EXIT})"
    # recycled: h3kit replaced the group (it killed the rank, or the rank left its aborted generation)
    assert launch.recycled(aborted) is True
    assert launch.recycled("killed by h3kit (replacing the group): killed by SIGKILL") is True
    assert launch.recycled(launch._exit_reason(-9)) is False and launch.recycled(launch._exit_reason(3)) is False


def test_a_worker_is_one_device_with_its_rank_whatever_the_server_simulates(monkeypatch):
    monkeypatch.setenv("H3KIT_SIM_DEVICES", "2")
    monkeypatch.setenv(zygote.WORKER_START_ENV, "exec")  # the environment as Popen gets it (fork: test_multinpu_zygote)
    workers = launch.LocalWorkers(wire.GroupSpec(local_size=2), "the-key")
    seen = {}

    class Started:  # what spawn reads of a Popen: this process stands in for the worker
        pid = os.getpid()

    def popen(argv, env, **kw):
        seen.update(env)
        return Started()
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    workers.spawn(1)
    assert "H3KIT_SIM_DEVICES" not in seen and os.environ["H3KIT_SIM_DEVICES"] == "2"
    assert (seen[wire.RANK_ENV], seen[wire.LOCAL_RANK_ENV], seen[wire.KEY_ENV]) == ("1", "1", "the-key")
    assert seen["PYTHONUNBUFFERED"] == "1" and seen[wire.PARENT_ENV] == str(os.getpid())


@pytest.mark.parametrize("start", zygote.WORKER_STARTS)
def test_each_start_of_a_rank_records_its_process(tmp_path, monkeypatch, start):
    monkeypatch.setenv(zygote.WORKER_START_ENV, start)
    (tmp_path / "quick_worker.py").write_text("")  # a worker that ends at once
    workers = launch.LocalWorkers(wire.GroupSpec(local_size=1, worker_module="quick_worker"), "k")
    workers.cwd = tmp_path  # the folder the workers run in (the ComfyUI tree in a server)
    pids = set()
    for _ in (1, 2):
        proc = workers.spawn(0)
        assert proc.wait(timeout=60) == 0
        info = workers.info[0]
        assert info["pid"] == proc.pid and info["alive"] and info["create_time"], info
        # what h3kit's status verifies it by: its own command line, or (forked) its fork server's
        assert info["cmdline"][-1] == "quick_worker" if start == "exec" else "comfy.multinpu_zygote" in info["cmdline"]
        assert isinstance(proc, zygote.ForkedWorker) == (start == "fork")  # no fallback to exec taken
        pids.add(proc.pid)
    workers.stop()
    assert len(pids) == 2


WATCHED = textwrap.dedent("""
    import signal, sys, threading
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # as comfy.multinpu_worker does first
    import comfy.multinpu_launch as launch, comfy.multinpu_wire as wire
    launch.watch_termination(wire.GroupSpec(master_port=int(sys.argv[1])), 1)
    print("ready", flush=True)
    print("written before SIGTERM")  # stdout is a pipe: buffered until the watcher flushes it
    threading.Event().wait(120)
""")


def test_sigterm_ends_a_worker_with_term_exit_its_note_in_the_store_and_its_output_kept(tmp_path):
    from datetime import timedelta

    from comfy.multinpu_channel import Control
    from tests.support.service_helpers import free_port
    port = free_port(29800, 29899)
    store = torch.distributed.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=30))  # the group's store, for the note
    key = wire.new_key()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "patches" / "src"), **{wire.KEY_ENV: key})
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen([sys.executable, "-c", WATCHED, str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)  # this test's own child
        out, err = proc.communicate(timeout=60)  # bounds a worker that ignores SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    why = f"{wire.SECONDARY} (SIGTERM from pid {os.getpid()})"
    assert proc.returncode == wire.TERM_EXIT, err
    assert out == "written before SIGTERM\n"
    assert f"MultiNPU: rank 1: {why}; exiting" in err
    # the driver tells the sibling its launcher stopped from the rank that failed first by this note
    ctl = Control(store, wire.Signer(key.encode()))
    assert launch.termination_note(ctl, 1, proc.pid) == why
    assert launch.termination_note(ctl, 1, proc.pid + 1) is None and launch.termination_note(ctl, 0, proc.pid) is None


class Ended:
    """A worker process that has ended with `code` (what LocalWorkers.poll reads of a Popen)."""

    def __init__(self, pid, code):
        self.pid, self.code = pid, code

    def poll(self):
        return self.code


def test_a_dying_rank_is_replaced_at_once_then_later_each_time_then_not_at_all(monkeypatch):
    import time
    workers = launch.LocalWorkers(wire.GroupSpec(local_size=1), "k")
    pids = iter(range(1000, 2000))
    started = []

    def spawn(rank):  # a replacement that dies at once with code 1
        started.append(rank)
        workers.procs[rank] = Ended(next(pids), 1)
    monkeypatch.setattr(workers, "spawn", spawn)
    spawn(0)
    started.clear()
    assert workers.poll() == [(0, 1000, "exited with code 1")]
    assert started == [0] and workers.info[0]["restarts"] == 1  # the first death: replaced at once
    before = time.monotonic()
    assert workers.poll() == [(0, 1001, "exited with code 1")]
    assert started == [0] and 0 not in workers.procs  # the second: replaced after 0.5 s, not now
    assert before + 0.5 <= workers.respawn_at[0] <= time.monotonic() + 0.5
    for _ in range(4 * wire.CRASH_LIMIT):  # each backoff has passed: replaced, and dead again
        if 0 in workers.failed:
            break
        if 0 in workers.respawn_at:
            workers.respawn_at[0] = 0.0
        workers.poll()
    assert workers.info[0]["restarts"] == wire.CRASH_LIMIT and 0 not in workers.respawn_at
    assert workers.failed[0].startswith(f"rank 0 (cpu) died {wire.CRASH_LIMIT + 1} times within")
    # a rank h3kit recycled with the group is replaced at once and is no crash
    workers.procs[0] = Ended(5, -9)
    workers.recycled.add(0)
    workers.killed[0] = "replacing the group"
    assert workers.poll() == [(0, 5, "replacing the group: killed by SIGKILL")]


class Running:
    """A worker process still running until killed."""

    def __init__(self, pid):
        self.pid, self.code = pid, None

    def poll(self):
        return self.code

    def kill(self):
        self.code = -9


def test_killing_one_worker_or_recycling_all_says_why_and_recycled_ones_are_no_crash():
    workers = launch.LocalWorkers(wire.GroupSpec(local_size=3), "k")
    workers.procs = {0: Running(10), 1: Running(11), 2: Ended(12, 1)}
    assert [workers.pid(r) for r in range(3)] == [10, 11, None]  # an ended worker has no pid to signal
    workers.kill(1, "its heartbeat stopped")
    assert workers.procs[1].code == -9 and workers.killed == {1: "its heartbeat stopped"} and not workers.recycled
    assert workers.pid(1) is None
    workers.kill(2, "already gone")  # an ended worker is not killed again nor named as killed
    assert 2 not in workers.killed
    workers.procs = {0: Running(20), 1: Running(21)}
    workers.killed.clear()
    workers.recycle("rank 1 failed: replacing the group")
    assert [p.code for p in workers.procs.values()] == [-9, -9] and workers.recycled == {0, 1}
    assert workers.killed == {0: "rank 1 failed: replacing the group", 1: "rank 1 failed: replacing the group"}


def test_a_progress_bound_not_above_the_heartbeat_interval_is_refused(monkeypatch):
    """Issue 40: progress travels with the heartbeat, so a progress bound at or below HEARTBEAT_INTERVAL would call
    every rank hung between two beats; check_timeouts refuses it, naming H3KIT_PROGRESS_TIMEOUT."""
    spec = wire.GroupSpec(local_size=2, timeout=300)
    for bound in (wire.HEARTBEAT_INTERVAL / 2, wire.HEARTBEAT_INTERVAL):
        monkeypatch.setattr(wire, "PROGRESS_STALE", bound)
        try:
            wire.check_timeouts(spec)
        except wire.GroupError as e:
            assert "heartbeat interval" in str(e) and wire.PROGRESS_ENV in str(e), e
        else:
            raise AssertionError(f"a progress bound of {bound:g} s was accepted")
    monkeypatch.setattr(wire, "PROGRESS_STALE", wire.HEARTBEAT_INTERVAL * 2)
    wire.check_timeouts(spec)


def test_a_small_hand_off_is_sized_in_kb_or_bytes():
    """Issue 40: the full-/dev/shm message said "needs 0.0 MB" for a hand-off of a few kilobytes."""
    assert wire._size(512) == "512 bytes"
    assert wire._size(4096) == "4.1 KB"
    assert wire._size(4 << 20) == "4.2 MB"
    assert wire._size(3 * 10 ** 9) == "3.00 GB"
    assert "0.0 MB" not in wire.shm_full_message("/nonexistent-h3kit/x", 2000, "a test")


def test_only_a_replacement_is_told_to_wait_for_its_devices_memory(monkeypatch):
    """Issue 45 item 7: the launcher marks every start of a rank after its first (comfy.multinpu_links.before_device
    then waits for the device's memory); the first start does not wait."""
    import comfy.multinpu_links as links
    monkeypatch.setenv(zygote.WORKER_START_ENV, "exec")  # the environment as Popen gets it
    workers = launch.LocalWorkers(wire.GroupSpec(local_size=2), "the-key")
    seen = []

    class Started:
        pid = os.getpid()

    monkeypatch.setattr(launch.subprocess, "Popen", lambda argv, env, **kw: seen.append(env) or Started())
    workers.spawn(0)
    workers.info[0]["restarts"] += 1  # as poll() counts a replacement before it starts it
    workers.spawn(0)
    assert [env[links.REPLACEMENT_ENV] for env in seen] == ["0", "1"]
