"""comfy/multinpu_process.py, multinpu_group.py, multinpu_wire.py, multinpu_channel.py and multinpu_launch.py, the process group runtime, with real processes on cpu/gloo.

The driver (the server's side, never a rank) is tests/support/process_group_driver.py, every rank 0..N-1 a
worker, tests/support/process_group_worker.py: the real runtime and worker loop with test programs, so a
rank costs an interpreter with torch, not one with ComfyUI (the H3 runners over the same runtime, on two
hosts, are tested in test_multinpu_process_service.py). One group runs every one-host scenario in turn; one more
the attacks on the store and the channel (fixture attacks), and one the store's losses (fixture store_lost).
The fault tests run with H3KIT_EMULATE_NO_RELEASE=1: gloo then keeps HCCL's and NCCL's semantics (a rank's
error, destroy or death releases no peer before the group timeout), so they show what Ascend and CUDA do.
"""

from __future__ import annotations

import json
import os
import re
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
import comfy.multinpu_channel as channel  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_clock as clock  # noqa: E402
import comfy.multinpu_launch as launch  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402
import comfy.multinpu_process as mp  # noqa: E402

HEARTBEAT = 3.0


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "patches" / "src"), str(SUPPORT)]),
               H3KIT_TEST_DEBUG="1", **{wire.HEARTBEAT_ENV: str(HEARTBEAT), **extra})
    env.setdefault(wire.KEY_ENV, wire.new_key())
    return env


def drive(tmp_path, scenario, *args, env=None, timeout=180):
    out = tmp_path / f"{scenario}.json"
    proc = subprocess.run([sys.executable, str(DRIVER), scenario, "--out", str(out), *map(str, args)],
                          env=env or _env(), capture_output=True, text=True, timeout=timeout)
    (tmp_path / f"{scenario}.log").write_text(proc.stdout + proc.stderr)
    # the driver, the store and every worker log to the one stdout, line by line: in the order they happened
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "crash" not in result, result["crash"]["traceback"]
    return result


def sequence(tmp_path, steps, *args, env=None, timeout=600):
    """Several scenarios one after the other in one group (the driver's `sequence`; steps: [(label, scenario,
    {argument: value}), ...]): {label: its record}, each as its own driver run would have written it."""
    result = drive(tmp_path, "sequence", "--steps", json.dumps(steps), *args, env=env, timeout=timeout)
    assert result["form"]["ok"], result["form"]
    return result


def scenario_log(tmp_path, label):
    """The part of a sequence's log from the line that starts scenario `label` to the next such line."""
    lines, inside = [], False
    for line in (tmp_path / "sequence.log").read_text().splitlines():
        if line.startswith("[driver] ") and re.search(r" scenario \S+ (begins|ends)$", line):
            inside = line.endswith(f"scenario {label} begins")
            continue
        if inside:
            lines.append(line)
    assert lines, f"no log of scenario {label}"
    return "\n".join(lines)


# The lost host and the keyless client run twice: on plain gloo, and under the twin of the accelerator's clock
# (H3KIT_EMULATE_ASYNC_DEVICE=1: every collective but barrier returns at enqueue and completes on the rank's stream,
# comfy/multinpu_clock.py), as the faults, hangs and full /dev/shm do (test_multinpu_process_faults.py, _hang.py,
# test_multinpu_shm.py). The twin's attacks leave out the closed command connection (a channel, not a collective:
# nothing the device's clock changes; 20 s of its hold and a group replacement).
CLOCKS = ["gloo", "twin"]


def clock_env(which, **extra):
    return _env(**extra, **({clock.ASYNC_ENV: "1"} if which == "twin" else {}))


def ran_on(result, which, world):
    """Every rank's beats named the clock the run was asked for (node 1's workers, started by its agent, too)."""
    clocks = {int(rank): seen for rank, seen in result["clocks"].items()}
    assert sorted(clocks) == list(range(world)), clocks
    if which == "twin":  # a beat before the rank's first marker says "sync"; every rank's later ones "twin"
        assert all("twin" in seen and "event" not in seen for seen in clocks.values()), clocks
    else:
        assert all(seen == ["sync"] for seen in clocks.values()), clocks


def error_of(attempt):
    assert not attempt["ok"], attempt
    return attempt["error"]["type"], attempt["error"]["message"], attempt["seconds"]


@pytest.fixture(scope="module")
def one_host(tmp_path_factory):
    """Three ranks, collective timeout 4 s: every one-host scenario, one after the other."""
    return drive(tmp_path_factory.mktemp("pg"), "all", "--world", 3, "--timeout", 4, "--idle", 5)


@pytest.fixture(scope="module")
def attacks(request, tmp_path_factory):
    """Three ranks, collective timeout 30 s, HCCL/NCCL's semantics (H3KIT_EMULATE_NO_RELEASE=1): what a local user
    without the key writes (hostile: first, in the group's first generation, which its log lines name), the store's
    keys deleted while commands run, then (on plain gloo) a rank's command connection closed (which replaces the
    group), one after the other in one group: {label: record}, and the folder of the log (scenario_log); on the clock
    each test names (CLOCKS, indirect: one group per clock for the module)."""
    tmp = tmp_path_factory.mktemp(f"attacks-{request.param}")
    steps = [("hostile", "hostile", {"flood": FLOOD}), ("deleted_command", "deleted_command", {"sleep": 1})]
    if request.param == "gloo":
        steps.append(("closed_link", "closed_link", {"victim": 1, "sleep": 20}))
    result = sequence(tmp, steps, "--world", 3, "--timeout", 30,
                      env=clock_env(request.param, H3KIT_EMULATE_NO_RELEASE="1"))
    ran_on(result, request.param, 3)
    return tmp, result


@pytest.fixture(scope="module")
def store_lost(tmp_path_factory):
    """Two ranks, collective timeout 20 s, the store's growth limit at 64 MiB: the store killed (idle, then while a
    command runs), then flooded past its limit, one after the other in one group."""
    tmp = tmp_path_factory.mktemp("store")
    result = sequence(tmp, [("killed", "store_lost", {}), ("flooded", "store_lost", {"flood": 40})],
                      "--world", 2, "--timeout", 20, env=_env(**{channel.STORE_GROWTH_ENV: "64"}))
    return tmp, result


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
    # rank 0 is a worker process too: on the CPU forked from the driver's fork server, whose command line it shows
    assert all(r["cmdline"][-1] == "process_group_worker" or "comfy.multinpu_zygote" in r["cmdline"] for r in ranks)


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


def test_comfyuis_free_reaches_the_workers_before_the_next_command(one_host):
    # POST /free and ComfyUI's OOM handler empty the model cache (comfy.model_cache.clear): its listener asks the
    # workers to free theirs, sent before the next command, which then installs its model again
    c = one_host["configs"]
    before = c["freed_before"]["value"]["freed"]
    assert c["after_free"]["ok"] and c["after_free"]["value"] == 6.0, "the model was installed again after the free"
    assert c["freed_after"]["value"]["freed"] == [n + 1 for n in before], "every rank freed once"
    assert c["no_free"]["ok"] and c["freed_last"]["value"]["freed"] == [n + 1 for n in before], "no free, none sent"


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
    # the bound is on the forming the driver timed (wait_ready gives up at the join timeout + 5 s), not on the
    # wall clock around it, which counted the interpreters' start: 25.3 s against 18 s on a loaded CI machine
    result = drive(tmp_path, "form_only", "--world", 4, "--nnodes", 2, "--join-timeout", 3)
    kind, message, seconds = error_of(result["form"])
    assert "node 1 (ranks 2, 3) never arrived" in message and "--node-rank 1" in message
    assert result["state"] == "failed" and seconds < 3 + 5 + 20, seconds


def test_a_rank_that_never_makes_its_command_connection_is_named_within_the_join_timeout(tmp_path):
    """The driver sends no command before every member's command connection is there: a worker of rank 2 that
    never makes it (its process alive and beating) fails the forming within --join-timeout, naming rank 2 and the
    channel."""
    result = drive(tmp_path, "form_only", "--world", 3, "--join-timeout", 30,
                   env=_env(H3KIT_TEST_NO_COMMAND_LINK="2"))
    kind, message, seconds = error_of(result["form"])
    assert "rank 2 (cpu) did not connect to the command channel" in message, message
    assert "rank 0" not in message and "rank 1" not in message, message
    assert result["state"] == "failed" and seconds < 30 + 5 + 30, seconds


@pytest.mark.parametrize("attacks", ["gloo"], indirect=True)  # plain gloo only: a channel, no collective (CLOCKS)
def test_a_rank_whose_command_connection_closes_during_a_command_is_named(attacks):
    """Worker rank 1 closes its command connection during a command and holds it 20 s (alive, in no collective): the
    command fails within seconds naming rank 1 (the connection's end), the group is replaced, the next runs."""
    result = attacks[1]["closed_link"]
    assert result["first"]["ok"], result["first"]
    kind, message, seconds = error_of(result["closed"])
    assert kind == "RankDied" and "rank 1 (cpu)" in message and "closed the command channel" in message, message
    assert f"pid {result['pids_before']['1']}" in message and seconds < 15, (message, seconds)
    assert result["after"]["ok"] and result["after"]["value"] == [3.0] * 4, result["after"]
    assert set(result["pids_after"].values()).isdisjoint(result["pids_before"].values())


def test_messages_signed_with_another_key_are_refused():
    obj = {"name": "install", "payload": [1, 2]}
    mine, theirs = wire.Signer(b"k" * 64), wire.Signer(b"x" * 64)
    assert mine.loads(mine.dumps(obj), "test") == obj
    with pytest.raises(wire.GroupError, match="not signed with this service's key"):
        mine.loads(theirs.dumps(obj), "store key 'cmd/1/1'")
    with pytest.raises(wire.GroupError):
        mine.loads(b"\0" * 32 + mine.dumps(obj)[32:], "tampered")


FLOOD = 40          # the probe: 40 values of 4 MiB (they grew the server by 171 MiB when it hosted the store)
FLOOD_BOUND = 32 << 20


@pytest.mark.parametrize("attacks", CLOCKS, indirect=True)
def test_what_a_local_user_without_the_key_writes_is_dropped(attacks):
    """The issue's probes: garbage in the next command's old slot, in `gen`, in a result and an error slot, a
    bumped failure counter, a signed value replayed into the next command's error slot, a flood of keys; then
    the command channel: garbage, an oversized frame, a hello signed with another key, one replayed from another
    connection, one naming worker rank 0's pid, a flood of 4 MiB frames, and a connection by another user. No worker dies or acts
    on them, the driver fails no command and does not grow, the next commands run on the same processes."""
    tmp, results = attacks
    result = results["hostile"]
    assert result["during_replay"]["ok"] and result["during_replay"]["value"] == result["pids_before"]["0"], \
        "a signed value replayed as a rank's error report: refused, the command ran"
    for step in ("first", "after_garbage", "after_replay", "after_flood", "after_channel"):
        assert result[step]["ok"] and result[step]["value"] == [3.0] * 4, (step, result[step])
    assert result["during_forgery"]["ok"] and result["during_forgery"]["value"] == result["pids_before"]["0"], \
        "a forged result, error report and failure count while a command ran: the real result came back"
    assert result["pids_after"] == result["pids_before"] and result["restarts_after"] == result["restarts_before"]
    assert result["generation_after"] == result["generation_before"]
    # the store runs in a process of its own: the flood grows that one, not the server
    assert result["flood_rss_growth"] < FLOOD_BOUND, result["flood_rss_growth"]
    assert result["flood_store_rss_growth"] > FLOOD * (4 << 20) // 2, "the flood did reach the store"
    log = scenario_log(tmp, "hostile")
    assert "dropped store key 'cmd/" not in log  # every rank takes its commands from the channel: none reads cmd/
    assert any("dropped store key 'err/1/4/1' (" in line and "signed for 'up/1/1'" in line for line in log.splitlines())
    assert "dropped store key 'err/1/3/1'" in log  # the driver's side

    ch = result["channel"]
    assert ch["folder_mode"] == 0o700 and ch["socket_mode"] == 0o600, ch
    for probe in ("garbage", "oversized", "foreign", "replayed", "impostor"):
        assert ch[probe] is True, (probe, ch)  # closed by the driver, nothing acted on
    assert ch["flood_closed"] == FLOOD and ch["flood_rss_growth"] < FLOOD_BOUND, ch
    assert ch["dropped"] >= 5 + FLOOD
    dropped = "MultiNPU: command channel: dropped a connection from pid "
    for words in ("its first frame (16 bytes) is MultiNPU: channel frame is not signed with this service's key",
                  "a frame of 4294967295 bytes (the limit is 4096)",
                  "MultiNPU: a channel frame signed for another connection: a replay",
                  f"its hello names pid {result['pids_before']['0']}"):
        assert any(dropped in line and words in line for line in log.splitlines()), words
    if "other_user" in ch:  # as root: another user is refused by the folder's mode before the driver sees it
        assert ch["other_user"]["rc"] != 0 and "Permission denied" in ch["other_user"]["stderr"], ch["other_user"]


def test_the_channel_folder_must_be_private(tmp_path):
    """The command channel's folder is made 0700; one open to the group or others, a link or another user's is
    refused with the fix, before the driver starts anything."""
    made = channel.private_dir(str(tmp_path / "channel"))
    assert (os.stat(made).st_mode & 0o777) == 0o700
    open_one = tmp_path / "open"
    open_one.mkdir(mode=0o755)
    open_one.chmod(0o755)
    with pytest.raises(wire.GroupError, match=f"open to other users \\(mode 755\\).*chmod 700 {open_one}"):
        channel.private_dir(str(open_one))
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(wire.GroupError, match="is not a folder"):
        channel.private_dir(str(tmp_path / "link"))
    root = tmp_path / "root"
    (root / channel.CHANNEL_DIR).mkdir(parents=True, mode=0o777)
    (root / channel.CHANNEL_DIR).chmod(0o777)
    spec = wire.GroupSpec(local_size=1, runtime_root=str(root))
    with pytest.raises(wire.GroupError, match="open to other users"):
        mp.GroupRuntime(spec, wire.new_key()).start()


@pytest.mark.parametrize("attacks", CLOCKS, indirect=True)
def test_deleting_the_stores_keys_while_commands_run_costs_no_prompt(attacks):
    """A store client without the key deletes, while five commands run, every command key it sees (cmd/{g}/{n}) and
    every other key it lists but `layout` and the process groups' rendezvous keys: every command still runs, on
    the same processes (each rank takes its commands on its own channel connection, none from the store). When
    worker rank 0 relayed each command to the others through the store, deleting it failed 3 or 4 of the 5
    commands after the group timeout and replaced the group."""
    result = attacks[1]["deleted_command"]
    assert result["first"]["ok"], result["first"]
    for i, (held, attempt) in enumerate(zip(result["held"], result["attacked"])):
        assert held["ok"] and held["value"] == result["pids_before"]["0"], (i, held)
        assert attempt["ok"] and attempt["value"] == [3.0] * 4, (i, attempt)
    assert result["deleted"] == [], "no command is in the store"
    assert sum(result["deleted_keys"].values()) > 0, "the deleter did reach the store"
    assert result["pids_attacked"] == result["pids_before"] == result["pids_after"]
    assert result["generation_attacked"] == result["generation_before"]
    assert result["after"]["ok"] and result["after"]["value"] == [3.0] * 4, result["after"]


def test_forged_heartbeats_neither_keep_a_hung_worker_alive_nor_kill_a_healthy_one(tmp_path):
    """Two nodes: every rank and node 1's agent beat on the command channel (node 0's on its Unix socket, node
    1's on its TCP listener, the master port + 1). A store client without the key writes garbage into the
    heartbeat keys of old and deletes every key the store lists (all but `layout`, see SPARED, while the group is idle; the old beat keys all along), and a channel client floods the TCP port with
    garbage, oversized frames and hellos signed with another key or for another connection, naming node 1's
    workers and agent, and sends hellos on the Unix socket naming a worker: for three heartbeat bounds nothing
    is killed, and a SIGSTOPped worker of node 1, then one of node 0, is still named hung within the bound. On
    the beats in the store of before (a key per beat, named by an HMAC), the deleter made the driver take node
    1's healthy ranks for hung and replace the group; and with torchrun (a launcher until 2026-12-02), a worker's
    announcement deleted was taken for its death."""
    result = drive(tmp_path, "forged_heartbeats", "--agent", "--nnodes", 2, "--world", 4, "--timeout", 60,
                   "--join-timeout", 120, env=_env(H3KIT_EMULATE_NO_RELEASE="1"), timeout=400)
    assert result["first"]["ok"] and result["forged_rounds"] > 20, result
    # the deleter did reach the store: the group's own keys, listed and deleted while it was idle
    assert {"gen", "worker", "up", "joined"} <= set(result["deleted_while_idle"]), result["deleted_while_idle"]
    probes = result["tcp_probes"]
    assert probes["sent"] > 100 and probes["closed"] == probes["sent"], probes
    assert result["healthy"]["ok"] and result["pids_healthy"] == result["pids_before"], \
        "no healthy rank was killed while its heartbeats were forged and the store's keys deleted"
    # and the ranks file tells the truth meanwhile: node 1's announcements deleted are no deaths
    assert {int(r): v for r, v in result["ranks_while_deleted"].items()} == {
        r: {"alive": True, "pid": pid} for r, pid in ((int(r), p) for r, p in result["pids_before"].items())}
    for name, rank in (("remote_stopped", "3 (cpu, node 1)"), ("local_stopped", "1 (cpu, node 0)")):
        kind, message, seconds = error_of(result[name])
        assert kind == "RankDied" and f"rank {rank}" in message and "no heartbeat" in message, message
        assert f"pid {result[name]['victim_pid']}" in message
        assert seconds < HEARTBEAT + mp.ERROR_WAIT + 10, "the forged beats did not keep it alive past the bound"
        assert result[f"after_{name}"]["ok"] and result[f"after_{name}"]["value"] == [6.0] * 4
    log = (tmp_path / "forged_heartbeats.log").read_text()
    dropped = "MultiNPU: command channel: dropped a connection from "
    for words in ("127.0.0.1:", "pid "):  # the TCP listener's drops name the peer's address, the Unix socket's its pid
        assert any(dropped + words in line for line in log.splitlines()), words
    for words in ("a frame of 4294967295 bytes (the limit is 4096)", "is not signed with this service's key",
                  "a channel frame signed for another connection: a replay"):
        assert any(dropped + "127.0.0.1:" in line and words in line for line in log.splitlines()), words
    # "rank 3 (cpu, node 1), host vm died during sum (pid 9: no heartbeat" and "rank 3 (cpu, node 1) (pid 9) no heartbeat"
    hung = set(re.findall(r"(rank \d \(cpu, node \d\))(?:, host \S+ died during \w+)? \(pid \d+(?:: |\) )no heartbeat",
                          log))
    assert hung <= {"rank 3 (cpu, node 1)", "rank 1 (cpu, node 0)"}, f"a healthy rank was taken for hung: {hung}"
    assert "host lost" not in log, "node 1's agent was taken for lost"


def test_the_channel_reaches_a_socket_past_the_unix_path_limit(tmp_path):
    """A runtime root deep enough that its socket's path passes 107 bytes: bound and reached through the
    folder's descriptor."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    got = []
    server = channel.ChannelServer(str(deep / channel.CHANNEL_DIR), wire.Signer(b"k" * 64),
                                   lambda link, hello: got.append((hello, link.recv())))
    try:
        assert len(server.path) > 107
        link = channel.connect_channel(server.path, wire.Signer(b"k" * 64), {"role": "beat", "rank": 0,
                                                                           "pid": os.getpid()})
        link.send({"seq": 1})
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == [({"role": "beat", "rank": 0, "pid": os.getpid()}, {"seq": 1})]
        link.close()
        with pytest.raises(wire.GroupError, match="another server's command channel answers"):
            channel.ChannelServer(str(deep / channel.CHANNEL_DIR), wire.Signer(b"k" * 64), lambda link, hello: None)
    finally:
        server.close()
    # a socket left by a server that was killed (nobody listens on it) is replaced
    import socket
    folder = channel.private_dir(str(tmp_path / "left"))
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(os.path.join(folder, channel.CHANNEL_SOCKET))
    left.close()
    channel.ChannelServer(folder, wire.Signer(b"k" * 64), lambda link, hello: None).close()


def test_the_channel_listens_on_tcp_for_the_other_hosts_and_beats_come_back_after_a_closed_connection(tmp_path):
    """The channel's TCP listener (the other hosts' beats) runs the Unix socket's handshake: a signed hello is
    taken with the pid it names (no peer credential over TCP) and the peer's address, a foreign one is dropped
    naming that address; a taken port is refused with the fix; beat() makes a closed connection again at the
    next beat and its numbers go on growing, so the driver counts them as new (frames and MAX_PENDING:
    test_multinpu_channel.py)."""
    import socket
    import threading
    signer = wire.Signer(wire.new_key().encode())
    got, first = [], threading.Event()

    def on_link(link, hello):
        while True:
            got.append((hello, link.remote, link.recv()["seq"]))
            if not first.is_set():  # the driver's end of the first connection closes after its first beat
                first.set()
                return
    server = channel.ChannelServer(str(tmp_path / channel.CHANNEL_DIR), signer, on_link)
    stop = threading.Event()
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        other = channel.ChannelServer(str(tmp_path / "other"), signer, on_link)
        with pytest.raises(wire.GroupError, match=f"cannot listen on 127.0.0.1:{port} .*master port \\+ 1\\)"):
            other.listen_tcp("127.0.0.1", port)
        other.close()
        hello = {"role": "agent", "node": 1, "pid": 424242}  # another host's pid: taken as signed
        beats = threading.Thread(target=channel.beat, args=(("127.0.0.1", port), signer, hello, stop), daemon=True)
        beats.start()
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [g[0] for g in got[:3]] == [hello] * 3 and all(g[1].startswith("127.0.0.1:") for g in got[:3]), got
        seqs = [g[2] for g in got[:3]]
        assert seqs == sorted(set(seqs)) and got[1][1] != got[0][1], "a new connection, numbers still growing"
        foreign = wire.Signer(wire.new_key().encode())
        dropped = server.dropped
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            nonce = channel._recv_exact(c, 32)
            body = foreign.dumps((nonce, "w", 1, {"hello": hello}))
            c.sendall(len(body).to_bytes(4, "big") + body)
            assert c.recv(1) == b""  # closed without a word
        assert server.dropped == dropped + 1
    finally:
        stop.set()
        server.close()
    with socket.socket() as s:  # closed: the port is free again at once
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_the_store_runs_apart_from_the_driver_and_comes_back(store_lost):
    """The store is a process of its own (not the server's); killed, it is started again on the same port and the
    group is replaced: the next command runs, the driver lives on."""
    tmp, results = store_lost
    result = results["killed"]
    assert result["first"]["ok"] and result["store_pid"] != result["driver_pid"]
    assert result["store_starts"] == 2 and result["store_pid_after"] != result["store_pid"]
    assert result["next"]["ok"] and result["next"]["value"] == [1.0] * 4, result["next"]
    assert result["driver_pid_after"] == result["driver_pid"]
    assert not set(result["pids_before"].values()) & set(result["pids_after"].values())
    assert "the group's store (pid" in scenario_log(tmp, "killed")
    # killed while a command runs: the command fails naming the store (not a rank that left because it was gone)
    kind, message, seconds = error_of(result["mid_command"])
    assert f"the group's store (pid {result['mid_command_store_pid']}) ended (killed by SIGKILL)" in message, message
    # the bound; the error waits for the new store to answer (its process imports torch: 8-16 s here)
    assert "during fail" in message and seconds < 30, seconds
    assert result["after_mid_command"]["ok"], result["after_mid_command"]


def test_a_store_grown_past_its_limit_by_a_flood_ends_and_comes_back(store_lost):
    """A flood of keys past the store's growth limit (here 64 MiB): the store's process ends itself rather than
    grow until the host's OOM killer picks a process; the driver starts a fresh one, the group is replaced, the
    next command runs, and the server did not grow."""
    tmp, results = store_lost
    result = results["flooded"]
    assert result["store_starts"] == 2 and result["next"]["ok"], result
    assert result["flood_rss_growth"] < FLOOD_BOUND and result["driver_pid_after"] == result["driver_pid"]
    log = scenario_log(tmp, "flooded")
    assert "past its limit (H3KIT_STORE_GROWTH_LIMIT=64)" in log and "past its memory limit: a flood of keys" in log


@pytest.mark.parametrize("which", CLOCKS)
def test_a_lost_host_fails_fast_and_the_group_comes_back_by_itself(tmp_path, which):
    """Two nodes, node 1's agent SIGKILLed mid-command (its workers die with it), with HCCL/NCCL's semantics and the
    default heartbeat (15 s): the command fails naming a rank of node 1 within 15 s of the kill, before the command
    would have ended by itself (rank 0 holds it 20 s); the next fails naming the lost node instead of holding the
    queue for the join timeout, and once the agent is started again the group forms by itself. On plain gloo and
    under the twin (CLOCKS)."""
    result = drive(tmp_path, "agent_lost", "--agent", "--nnodes", 2, "--world", 4, "--timeout", 60,
                   "--join-timeout", 120, "--sleep", 20,
                   env=clock_env(which, H3KIT_EMULATE_NO_RELEASE="1", **{wire.HEARTBEAT_ENV: "15"}), timeout=400)
    ran_on(result, which, 4)
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
    monkeypatch.setenv(wire.GROUP_ENV, wire.GroupSpec(local_size=2).to_json())
    monkeypatch.setenv(wire.KEY_ENV, wire.new_key())
    monkeypatch.setattr(sys, "argv", ["main.py", "--listen", "127.0.0.1", *arg])
    with pytest.raises(wire.GroupError, match="cannot be used with the process transport"):
        mp.start_from_environment()
    assert mp.get_runtime() is None


def test_every_failure_detector_fires_before_the_collective_timeout():
    """Timeouts in order: a silent agent <= a rank's heartbeat < a rank's progress < the collective timeout; a
    group whose collective timeout would fire first is refused, naming the detector."""
    spec = wire.GroupSpec(local_size=2, timeout=300)
    detectors = wire.failure_detectors(spec)
    assert max(detectors.values()) < spec.timeout
    assert (detectors["a host's agent heartbeat"] <= detectors["a rank's heartbeat"] < detectors["a rank's progress"])
    wire.check_timeouts(spec)
    with pytest.raises(wire.GroupError, match="collective timeout .10 s. must be longer than"):
        wire.check_timeouts(wire.GroupSpec(local_size=2, timeout=10))
    wire.check_timeouts(wire.GroupSpec(local_size=2, timeout=max(detectors.values()) + 1))


def test_a_death_its_launcher_caused_is_not_named_first():
    assert launch.secondary(launch._exit_reason(wire.TERM_EXIT))
    assert launch.secondary(f"{wire.SECONDARY} (SIGTERM from pid 12)")
    assert not launch.secondary("killed by h3kit (the group is replaced): killed by SIGKILL")
    assert not launch.secondary(launch._exit_reason(-9))
