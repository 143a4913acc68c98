"""comfy/multinpu_process.py and multinpu_group.py, the process group runtime, with real processes on cpu/gloo.

The driver (the server's side, never a rank) is tests/support/process_group_driver.py, every rank 0..N-1 a
worker, tests/support/process_group_worker.py: the real runtime and worker loop with test programs, so a
rank costs an interpreter with torch, not one with ComfyUI (the H3 runners over the same runtime, on two
hosts, are tested in test_multinpu_process_service.py). One group runs every one-host scenario in turn.
The fault tests run with H3KIT_EMULATE_NO_RELEASE=1: gloo then keeps HCCL's and NCCL's semantics (a rank's
error, destroy or death releases no peer before the group timeout), so they show what Ascend and CUDA do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"
DRIVER = SUPPORT / "process_group_driver.py"
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_group as group  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_process as mp  # noqa: E402

HEARTBEAT = 3.0


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "patches" / "src"), str(SUPPORT)]),
               H3KIT_TEST_DEBUG="1", **{group.HEARTBEAT_ENV: str(HEARTBEAT), **extra})
    env.setdefault(group.KEY_ENV, group.new_key())
    return env


def _two_ports() -> int:
    """A free port whose next port is free too (torchrun's rendezvous listens on the store's port + 1)."""
    from tests.support.service_helpers import free_port
    for p in range(29700, 29790, 2):
        try:
            first, second = free_port(p, p), free_port(p + 1, p + 1)
        except RuntimeError:
            continue
        if second == first + 1:
            return first
    raise RuntimeError("no two free ports in a row")


def drive(tmp_path, scenario, *args, env=None, timeout=180):
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), scenario, "--out", str(out), *map(str, args)],
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)
    (tmp_path / f"{scenario}.log").write_text(proc.stdout + proc.stderr)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "crash" not in result, result["crash"]["traceback"]
    return result


def error_of(attempt):
    assert not attempt["ok"], attempt
    return attempt["error"]["type"], attempt["error"]["message"], attempt["seconds"]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """Three ranks, collective timeout 4 s: every one-host scenario, one after the other."""
    return drive(tmp_path_factory.mktemp("pg"), "all", "--world", 3, "--timeout", 4, "--idle", 5)


def test_commands_and_payloads_reach_every_rank(one_host):
    basics = one_host["basics"]
    assert one_host["form"]["ok"] and basics["first"]["value"] == [3.0] * 4  # 0 + 1 + 2 on every element
    assert basics["echo"]["value"] is True, "fp32, bool, bf16, empty and 0-d tensors reached every rank and came back"
    assert basics["big"]["ok"] and basics["big"]["bytes"] == 256 << 20, "a large result through shared memory"
    assert basics["shm_left"] == [], "every command's shared-memory files are removed"


def test_the_driver_is_never_a_rank(one_host):
    ranks = one_host["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert one_host["basics"]["driver_pid"] not in [r["pid"] for r in ranks]
    assert all(r["cmdline"][-1] == "process_group_worker" for r in ranks), "rank 0 is a worker process too"


def test_idle_longer_than_the_collective_timeout(one_host):
    # workers wait for commands in the store, not in a collective: 5 s idle past a 4 s collective timeout
    assert one_host["idle"]["after_idle"]["ok"], one_host["idle"]


def test_a_failing_rank_is_named_and_the_next_command_runs(one_host):
    f = one_host["failures"]
    kind, message, seconds = error_of(f["raise"])
    assert kind == "RankFailed" and "rank 2 (cpu)" in message and "ValueError: injected failure on rank 2" in message
    assert seconds < 4.0, "named as it failed, not after the 4 s collective timeout"
    kind, message, _ = error_of(f["oom"])
    assert kind == "OutOfMemoryError" and "rank 1 (cpu)" in message and "ran out of memory" in message
    kind, message, _ = error_of(f["rank0"])
    assert kind == "RankFailed" and "rank 0 (cpu)" in message, "worker rank 0 fails like any other rank"
    for after in ("after_raise", "after_oom", "after_rank0"):
        assert f[after]["ok"] and f[after]["value"] == [3.0] * 4, after


def test_configs_are_checked_before_use(one_host):
    c = one_host["configs"]
    assert c["install"]["ok"] and c["install"]["value"] == 6.0 and sorted(c["installed"]) == ["0", "1", "2"]
    kind, message, _ = error_of(c["mismatch"])
    assert kind == "ConfigMismatch" and "rank 2 (cpu) differs in files" in message and "another-file" in message
    kind, message, _ = error_of(c["missing"])
    assert kind == "RankFailed" and "rank 1 (cpu)" in message and "FileNotFoundError" in message
    assert c["after"]["ok"]


def test_a_killed_worker_fails_the_command_at_once_and_the_group_is_replaced(one_host):
    k = one_host["kill"]
    kind, message, seconds = error_of(k["killed"])
    assert kind == "RankDied" and "rank 2 (cpu)" in message and f"pid {k['victim_pid']}" in message
    assert "SIGKILL" in message and seconds < 5.0
    assert k["after_kill"]["ok"] and k["replacement_pid"] not in (None, k["victim_pid"])


def test_a_hung_worker_is_noticed_by_its_heartbeat(one_host):
    h = one_host["hang"]
    kind, message, seconds = error_of(h["hung"])
    assert kind == "RankDied" and "rank 2 (cpu)" in message and "no heartbeat" in message
    assert seconds < HEARTBEAT + mp.ERROR_WAIT + 3.0, "bounded by the heartbeat, not the collective timeout"
    assert h["after_hang"]["ok"] and h["replacement_pid"] != h["victim_pid"]
    assert not psutil.pid_exists(h["victim_pid"]) or psutil.Process(h["victim_pid"]).status() == psutil.STATUS_ZOMBIE


def test_every_rank_listed_alive_and_joined(one_host):
    assert one_host["state"] == "ready"
    ranks = one_host["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert all(r["alive"] and r["joined"] and r["pid"] and r["create_time"] for r in ranks)
    # the whole group was replaced after each failure: rank 2 as often as the others
    assert ranks[2]["restarts"] >= 6 and "no heartbeat" in ranks[2]["last_exit"]


def test_a_node_that_never_arrives_fails_within_the_bound(tmp_path):
    t0 = time.monotonic()
    result = drive(tmp_path, "form_only", "--world", 4, "--nnodes", 2, "--join-timeout", 3)
    kind, message, _ = error_of(result["form"])
    assert "node 1 (ranks 2, 3) never arrived" in message and "--node-rank 1" in message
    assert result["state"] == "failed" and time.monotonic() - t0 < 3 + 15


def test_messages_signed_with_another_key_are_refused():
    obj = {"name": "install", "payload": [1, 2]}
    mine, theirs = group.Signer(b"k" * 64), group.Signer(b"x" * 64)
    assert mine.loads(mine.dumps(obj), "test") == obj
    with pytest.raises(group.GroupError, match="not signed with this service's key"):
        mine.loads(theirs.dumps(obj), "store key 'cmd/1/1'")
    with pytest.raises(group.GroupError):
        mine.loads(b"\0" * 32 + mine.dumps(obj)[32:], "tampered")


def test_what_a_local_user_without_the_key_writes_is_dropped(tmp_path):
    """The issue's probes: garbage in the next command's slot, in `gen`, in a result and an error slot, a bumped
    failure counter, a signed command replayed into the next slot, a flood of keys. No worker dies or acts on
    them, the driver fails no command, the next commands run on the same processes (same generation)."""
    result = drive(tmp_path, "hostile", "--world", 3, "--timeout", 20, "--flood", 10)
    for step in ("first", "after_garbage", "after_replay", "after_flood"):
        assert result[step]["ok"] and result[step]["value"] == [3.0] * 4, (step, result[step])
    assert result["during_forgery"]["ok"] and result["during_forgery"]["value"] == result["pids_before"]["0"], \
        "a forged result, error report and failure count while a command ran: the real result came back"
    assert result["pids_after"] == result["pids_before"] and result["restarts_after"] == result["restarts_before"]
    assert result["generation_after"] == result["generation_before"]
    log = (tmp_path / "hostile.log").read_text()
    for r in range(3):
        assert f"[rank {r}] MultiNPU: dropped store key 'cmd/1/2'" in log  # the garbage, logged once per rank
        assert f"[rank {r}] MultiNPU: dropped store key 'cmd/1/4' (" in log and "signed for 'cmd/1/3'" in log
    assert "dropped store key 'res/1/3'" in log and "dropped store key 'err/1/3/1'" in log  # the driver's side


@pytest.mark.parametrize("launcher", ["h3kit", "torchrun"])
def test_a_lost_host_fails_fast_and_the_group_comes_back_by_itself(tmp_path, launcher):
    """Two nodes, node 1's agent SIGKILLed mid-command (its workers die with it; with torchrun, torchrun and
    then its workers), with HCCL/NCCL's semantics and the default heartbeat (15 s): the command fails naming a
    rank of node 1 within 15 s of the kill, before the command would have ended by itself (rank 0 holds it 20 s);
    the next fails naming the lost node instead of holding the queue for the join timeout, and once the agent is
    started again the group forms by itself."""
    result = drive(tmp_path, "agent_lost", "--agent", "--nnodes", 2, "--world", 4, "--timeout", 60,
                   "--join-timeout", 120, "--launcher", launcher, "--sleep", 20,
                   "--port", _two_ports() if launcher == "torchrun" else 0,
                   env=_env(H3KIT_EMULATE_NO_RELEASE="1", **{group.HEARTBEAT_ENV: "15"}), timeout=400)
    assert result["first"]["ok"]
    kind, message, seconds = error_of(result["lost"])
    assert kind == "RankDied" and ("rank 2 (cpu, node 1)" in message or "rank 3 (cpu, node 1)" in message), message
    assert "host " in message and result["kill_to_error"] < 15, (message, result["kill_to_error"])
    kind, message, seconds = error_of(result["while_lost"])
    assert "node 1 (ranks 2, 3) is lost" in message and "--node-rank 1" in message and seconds < 30, message
    assert result["state_while_lost"] == "failed"
    assert result["after"]["ok"] and result["after"]["value"] == [6.0] * 4
    assert result["driver_pid_after"] == result["driver_pid"]
    assert not set(result["pids_before"].values()) & set(result["pids_after"].values())


@pytest.mark.parametrize("arg", [["--cuda-device", "1"], ["--default-device=1"]])
def test_device_choosing_arguments_are_refused_with_the_process_transport(monkeypatch, arg):
    # upstream would move the visible devices under the workers: rank r would not be on device r
    monkeypatch.setenv(group.GROUP_ENV, group.GroupSpec(local_size=2).to_json())
    monkeypatch.setenv(group.KEY_ENV, group.new_key())
    monkeypatch.setattr(sys, "argv", ["main.py", "--listen", "127.0.0.1", *arg])
    with pytest.raises(group.GroupError, match="cannot be used with the process transport"):
        mp.start_from_environment()
    assert mp.get_runtime() is None


def test_every_failure_detector_fires_before_the_collective_timeout():
    """Timeouts in order: torchrun's keep-alive < a silent agent < a rank's heartbeat = torchrun's store reads <
    the collective timeout; a group whose collective timeout would fire first is refused, naming the detector."""
    spec = group.GroupSpec(local_size=2, launcher="torchrun", timeout=300)
    detectors = group.failure_detectors(spec)
    assert max(detectors.values()) < spec.timeout
    assert (detectors["torchrun's rendezvous keep-alive"] < detectors["a host's agent heartbeat"]
            <= detectors["a rank's heartbeat"])
    group.check_timeouts(spec)
    with pytest.raises(group.GroupError, match="collective timeout .10 s. must be longer than"):
        group.check_timeouts(group.GroupSpec(local_size=2, launcher="torchrun", timeout=10))
    group.check_timeouts(group.GroupSpec(local_size=2, launcher="h3kit", timeout=max(detectors.values()) + 1))


def test_a_death_its_launcher_caused_is_not_named_first():
    assert group.secondary(group._exit_reason(group.TERM_EXIT))
    assert group.secondary(f"{group.SECONDARY} (SIGTERM from pid 12)")
    assert not group.secondary("died (not stopped by torchrun: killed or crashed); torchrun restarts the group")
    assert not group.secondary(group._exit_reason(-9))
