"""A failure costs one prompt, with HCCL's and NCCL's failure semantics (comfy/multinpu_process.py).

On gloo a rank that raises, destroys its group or dies releases its peers at once; on HCCL and NCCL nobody
is released before the group timeout (H3_FACTS 9). H3KIT_EMULATE_NO_RELEASE=1 makes the process comm's
gloo collectives keep those semantics: a failed collective waits out the group timeout (here 60 s) before it
raises. Under it, on 2 and 4 ranks, each fault below must end its command in the driver well inside 30 s
naming the rank, the next command must succeed with nobody acting, on a group of fresh processes, with the
driver's pid unchanged and none of the old workers left running; with h3kit's own launcher on 2 ranks and with
torchrun's elastic agent (`python -m torch.distributed.run`, which restarts every worker when one fails) on 4. Before the driver stopped being rank 0,
the same exception held the command for the whole group timeout (measured: 20.1 s at a 20 s timeout,
300.6 s at the default 300 s).
"""

from __future__ import annotations

import pytest

from tests.support import requires

torch = requires.torch_module()
from tests.test_multinpu_process import HEARTBEAT, _env, _three_ports, drive  # noqa: E402

pytestmark = pytest.mark.slow

GROUP_TIMEOUT = 60   # the collective timeout: an error seen only when it expires would take this long
BOUND = 30           # the bound from a fault to the error


# Each launcher once and each world size once, not every pair (which doubled the file's minutes in a CPU-bound
# CI): what differs between launchers is who reaps and restarts the workers, what differs between 2 and 4 ranks is
# which rank is "last" and how many peers wait; the default launcher gets the larger group.
@pytest.fixture(scope="module", params=[("h3kit", 2), ("torchrun", 4)], ids=["2-ranks", "torchrun-4-ranks"])
def faults(request, tmp_path_factory):
    launcher, world = request.param
    env = _env(H3KIT_EMULATE_NO_RELEASE="1")
    port = _three_ports()  # torchrun's rendezvous listens on the store's port + 1 (the channel on + 2)
    return drive(tmp_path_factory.mktemp(f"faults-{launcher}-{world}"), "faults", "--world", world, "--timeout",
                 GROUP_TIMEOUT, "--launcher", launcher, "--port", port, env=env, timeout=900) | {
        "world": world, "launcher": launcher}


def _check(faults, name, kind, rank, words):
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
    # h3kit's launcher reaps its workers and knows the signal; torchrun reaps them itself, and the victim is told
    # from the sibling torchrun stops after it by the sibling's note of its SIGTERM
    _check(faults, "kill9", "RankDied", 1, "killed by SIGKILL" if faults["launcher"] == "h3kit" else
           "died (not stopped by torchrun: killed or crashed); torchrun restarts the group")
    assert f"pid {faults['kill9']['victim_pid']}" in faults["kill9"]["error"]["error"]["message"]


def test_sigstop_of_a_worker_is_seen_by_its_heartbeat(faults):
    _check(faults, "sigstop", "RankDied", 1, "no heartbeat")
    assert faults["sigstop"]["error"]["seconds"] < HEARTBEAT + 10


def test_the_driver_lives_on(faults):
    assert faults["first"]["ok"] and faults["driver_pid_after"] == faults["driver_pid"]
    assert faults["state"] == "ready" and all(r["alive"] and r["joined"] for r in faults["ranks"])


def _two_hosts(tmp_path, scenario):
    """2 + 2 ranks on two "hosts" (127.0.0.1), torchrun on each: node 0's under the driver, node 1's under its
    h3kit agent (`python -m comfy.multinpu_group`), with HCCL/NCCL's semantics."""
    return drive(tmp_path, scenario, "--agent", "--nnodes", 2, "--world", 4, "--timeout", GROUP_TIMEOUT,
                 "--join-timeout", 120, "--launcher", "torchrun", "--port", _three_ports(),
                 env=_env(H3KIT_EMULATE_NO_RELEASE="1"), timeout=600)


def test_torchrun_two_hosts_a_killed_worker_of_node_1(tmp_path):
    result = _two_hosts(tmp_path, "remote_kill")
    killed = result["killed"]
    assert not killed["ok"] and killed["error"]["type"] == "RankDied" and killed["seconds"] < BOUND, killed
    message = killed["error"]["message"]
    # torchrun on node 1 ends the victim's sibling (rank 2) with SIGTERM as soon as it sees the victim die, and
    # reaps both (h3kit sees no exit code); the sibling notes its SIGTERM before it exits, so the victim is named
    # however the two deaths are seen (on a busy machine, in one look)
    assert result["pids"]["3"] == result["victim_pid"]
    assert f"rank 3 (cpu, node 1), host " in message and f"pid {result['victim_pid']}" in message, message
    assert "not stopped by torchrun" in message, message
    assert result["after_kill"]["ok"] and result["after_kill"]["value"] == [6.0] * 4
    assert result["replacement_pid"] not in (None, result["victim_pid"])


def test_torchrun_two_hosts_node_1s_launcher_killed(tmp_path):
    """kill -9 of node 1's torchrun mid-command: the command fails naming a rank of node 1, node 1's agent starts
    torchrun again, and the next command succeeds with nobody acting (after torchrun's rendezvous read timeout
    at worst: a fresh torchrun cannot join the others' restart round, h3kit restarts them)."""
    result = _two_hosts(tmp_path, "launcher_lost")
    assert result["first"]["ok"]
    lost = result["lost"]
    assert not lost["ok"] and lost["error"]["type"] == "RankDied" and lost["seconds"] < BOUND, lost
    assert "(cpu, node 1), host " in lost["error"]["message"]
    assert result["next"]["ok"] and result["next"]["value"] == [6.0] * 4 and "retries" not in result, result["next"]
    assert result["driver_pid_after"] == result["driver_pid"] and result["agent_alive"]
    assert not set(result["pids_before"].values()) & set(result["pids_after"].values())


def test_torchrun_and_its_workers_end_with_a_killed_driver(tmp_path):
    """SIGKILL of the server's process (the driver): the idle workers leave when the store goes, torchrun with
    them (it also gets a parent-death signal, for workers that could not leave); nothing is left behind."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from tests.test_multinpu_process import DRIVER
    out = tmp_path / "held.json"
    driver = subprocess.Popen([sys.executable, str(DRIVER), "form_only", "--out", str(out), "--world", "2",
                               "--launcher", "torchrun", "--port", str(_three_ports()), "--hold", "120"],
                              env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        result = json.loads(out.read_text())
        assert result["form"]["ok"], result
        workers = [psutil.Process(r["pid"]) for r in result["ranks"]]
        launcher = {p.parent().pid for p in workers}
        assert len(launcher) == 1 and "torch.distributed.run" in " ".join(psutil.Process(launcher.pop()).cmdline())
        procs = workers + [workers[0].parent()]
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
    gone, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


@pytest.mark.parametrize("launcher", ["h3kit", "torchrun"])
def test_a_death_after_its_load_was_reported_fails_the_load_at_once(tmp_path, launcher):
    """Issue 19's 300 s wait: while a model loads (no command in flight), rank 2 reports its load done and dies
    while rank 3 still loads (with torchrun: the sibling torchrun stops after a worker's death, seen first). The
    death aborted the group as if idle, and the driver went on waiting for rank 3's report (or, rank 3 dying too,
    for nobody) until the load timeout. Now the load fails at once naming rank 2; the next command runs."""
    result = drive(tmp_path, "death_after_load_report", "--agent", "--nnodes", 2, "--world", 4, "--timeout",
                   GROUP_TIMEOUT, "--join-timeout", 120, "--launcher", launcher, "--port", _three_ports(),
                   "--load-timeout", 60, env=_env(H3KIT_EMULATE_NO_RELEASE="1"), timeout=400)
    assert result["victim_reported"], "rank 2 had reported its load before it was killed"
    killed = result["killed"]
    assert not killed["ok"] and killed["error"]["type"] == "RankDied", killed
    assert "rank 2 (cpu, node 1), host " in killed["error"]["message"], killed
    assert f"pid {result['victim_pid']}" in killed["error"]["message"] and "while loading" in killed["error"]["message"]
    assert result["kill_to_error"] < BOUND, result["kill_to_error"]
    assert result["after"]["ok"] and result["after"]["value"] == [6.0] * 4, result["after"]
