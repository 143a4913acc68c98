"""A failure costs one prompt, with HCCL's and NCCL's failure semantics (comfy/multinpu_process.py).

On gloo a rank that raises, destroys its group or dies releases its peers at once; on HCCL and NCCL nobody
is released before the group timeout (H3_FACTS 9). H3KIT_EMULATE_NO_RELEASE=1 makes the process comm's
gloo collectives keep those semantics: a failed collective waits out the group timeout (here 60 s) before it
raises. Under it, on 4 ranks, each fault below must end its command in the driver well inside 30 s
naming the rank, the next command must succeed with nobody acting, on a group of fresh processes, with the
driver's pid unchanged and none of the old workers left running. Before the driver stopped being rank 0,
the same exception held the command for the whole group timeout (measured: 20.1 s at a 20 s timeout,
300.6 s at the default 300 s).
"""

from __future__ import annotations

import pytest

from tests.support import requires

torch = requires.torch_module()
from tests.test_multinpu_process import HEARTBEAT, _env, drive  # noqa: E402

pytestmark = pytest.mark.slow

GROUP_TIMEOUT = 60   # the collective timeout: an error seen only when it expires would take this long
BOUND = 30           # the bound from a fault to the error


# 4 ranks: the faulty rank is the last (3), a middle one (1) or worker rank 0, with peers on either side. The same
# faults on 2 ranks ran here until 2026-12-03 (the last rank then also the only peer): they cost a group formation and
# six replacements (about 30 CPU-s of the 2-core CI) for no check the 4-rank run lacks; the one-host group of
# test_multinpu_process.py (3 ranks, gloo's own semantics) fails, kills and stops rank 2 of 3.
# Twice: on plain gloo, and under the twin of the accelerator's clock (H3KIT_EMULATE_ASYNC_DEVICE=1: collectives
# return at enqueue and complete on each rank's stream, comfy/multinpu_clock.py) with one fault of each kind: an
# exception, an OOM, a death, a stop. raise_later_block and raise_rank0 are left out there: the same exception path
# as raise_block0 at another step or rank, and each costs a group formation (measured: docs/performance.md).
TWIN_FAULTS = "raise_block0,oom_last_rank,kill9,sigstop"


@pytest.fixture(scope="module", params=["gloo", "twin"])
def faults(request, tmp_path_factory):
    world = 4
    env = _env(H3KIT_EMULATE_NO_RELEASE="1")
    args = []
    if request.param == "twin":
        env["H3KIT_EMULATE_ASYNC_DEVICE"] = "1"
        args = ["--faults", TWIN_FAULTS]
    return drive(tmp_path_factory.mktemp(f"faults-{world}-{request.param}"), "faults", "--world", world, "--timeout",
                 GROUP_TIMEOUT, *args, env=env, timeout=900) | {"world": world, "clock": request.param}


def _check(faults, name, kind, rank, words):
    if name not in faults:
        requires.skip(f"{name} runs on plain gloo only (TWIN_FAULTS)", by_design=True)
    f = faults[name]
    assert not f["error"]["ok"], f
    error = f["error"]["error"]
    assert error["type"] == kind, error
    assert f"rank {rank} (cpu), host " in error["message"], error["message"]
    assert words in error["message"], error["message"]
    assert f["error"]["seconds"] < BOUND, f"{name}: {f['error']['seconds']:.1f} s from the command to its error"
    assert f["next"]["ok"] and f["next"]["value"] == [float(sum(range(faults["world"])))] * 4, f["next"]
    before, after = f["pids_before"], f["pids_after"]
    assert sorted(before) == sorted(after) and not set(before.values()) & set(after.values()), \
        "every rank is a fresh process after a failure"
    assert f["left_behind"] == [], "no worker of the failed generation is left running"


def test_an_exception_at_block_0(faults):
    last = faults["world"] - 1
    _check(faults, "raise_block0", "RankFailed", last, f"ValueError: injected failure on rank {last} at step 0")


def test_an_exception_at_a_later_block(faults):
    last = faults["world"] - 1
    _check(faults, "raise_later_block", "RankFailed", last, f"injected failure on rank {last} at step 3")


def test_an_oom_on_the_last_rank_stays_an_oom(faults):
    _check(faults, "oom_last_rank", "OutOfMemoryError", faults["world"] - 1, "ran out of memory")


def test_an_exception_on_worker_rank_0(faults):
    _check(faults, "raise_rank0", "RankFailed", 0, "injected failure on rank 0 at step 2")


def test_kill_9_of_a_worker(faults):
    # the launcher reaps its workers and knows the signal
    _check(faults, "kill9", "RankDied", 1, "killed by SIGKILL")
    assert f"pid {faults['kill9']['victim_pid']}" in faults["kill9"]["error"]["error"]["message"]


def test_sigstop_of_a_worker_is_seen_by_its_heartbeat(faults):
    _check(faults, "sigstop", "RankDied", 1, "no heartbeat")
    assert faults["sigstop"]["error"]["seconds"] < HEARTBEAT + 10


def test_the_driver_lives_on(faults):
    assert faults["first"]["ok"] and faults["driver_pid_after"] == faults["driver_pid"]
    assert faults["state"] == "ready" and all(r["alive"] and r["joined"] for r in faults["ranks"])


def test_the_workers_and_the_store_end_with_a_killed_driver(tmp_path):
    """SIGKILL of the server's process (the driver): its workers and the group's store (its children) get a
    parent-death signal; nothing is left behind."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.test_multinpu_process import DRIVER
    out = tmp_path / "held.json"
    driver = subprocess.Popen([sys.executable, str(DRIVER), "form_only", "--out", str(out), "--world", "2",
                               "--hold", "120"],
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        result = json.loads(out.read_text())
        assert result["form"]["ok"], result
        workers = [psutil.Process(r["pid"]) for r in result["ranks"]]
        children = psutil.Process(driver.pid).children()
        store = [p for p in children if "--store" in p.cmdline()]
        assert len(store) == 1
        # on the CPU the workers are forked by the driver's fork server (comfy.multinpu_zygote), which ends with it
        forks = [p for p in children if "comfy.multinpu_zygote" in p.cmdline()]
        assert len(forks) == 1 and {p.parent().pid for p in workers} == {forks[0].pid}
        procs = workers + store + forks
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def test_a_death_after_its_load_was_reported_fails_the_load_at_once(tmp_path):
    """Issue 19's 300 s wait: while a model loads (no command in flight), rank 2 reports its load done and dies
    while rank 3 still loads. The death aborted the group as if idle, and the driver went on waiting for rank 3's
    report (or, rank 3 dying too, for nobody) until the load timeout. Now the load fails at once naming rank 2; the
    next command runs."""
    result = drive(tmp_path, "death_after_load_report", "--agent", "--nnodes", 2, "--world", 4, "--timeout",
                   GROUP_TIMEOUT, "--join-timeout", 120, "--load-timeout", 60, env=_env(H3KIT_EMULATE_NO_RELEASE="1"),
                   timeout=400)
    assert result["victim_reported"], "rank 2 had reported its load before it was killed"
    killed = result["killed"]
    assert not killed["ok"] and killed["error"]["type"] == "RankDied", killed
    assert "rank 2 (cpu, node 1), host " in killed["error"]["message"], killed
    assert f"pid {result['victim_pid']}" in killed["error"]["message"] and "while loading" in killed["error"]["message"]
    assert result["kill_to_error"] < BOUND, result["kill_to_error"]
    assert result["after"]["ok"] and result["after"]["value"] == [6.0] * 4, result["after"]
