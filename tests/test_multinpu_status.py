"""`h3kit status` tells the truth about a process group: its exit code (service.status_code) is non-zero while
the group cannot run prompts, whatever the server process itself is doing."""

from __future__ import annotations

import pytest

from h3kit import service


def _st(state="ready", alive=(True, True), joined=(True, True), running=True, world_size=2):
    ranks = [{"rank": r, "alive": a, "joined": j} for r, (a, j) in enumerate(zip(alive, joined))]
    return {"running": running, "group": {"node_rank": 0, "state": state, "error": None, "world_size": world_size,
                                          "ranks": ranks}}


def test_a_ready_group_and_a_plain_server_exit_0():
    assert service.status_code(_st()) == 0
    assert service.status_code({"running": True}) == 0  # the thread transport: no group


def test_a_stopped_server_exits_1():
    assert service.status_code(_st(running=False)) == 1


@pytest.mark.parametrize("st", [_st(state="failed"), _st(state="forming"), _st(state="broken"),
                                _st(alive=(True, False)), _st(joined=(True, False)), _st(world_size=4)],
                         ids=["failed", "forming", "broken", "rank-dead", "rank-not-joined", "ranks-missing"])
def test_a_group_that_cannot_run_prompts_exits_4(st):
    assert service.status_code(st) == 4


def test_doctor_checks_dev_shm_for_the_process_transport():
    from h3kit import doctor
    GB = doctor.GB
    assert doctor.shm_verdict(16 * GB, True)[0] == "ok"
    severity, message, fix = doctor.shm_verdict(64 << 20, True)  # a container's default 64 MB
    assert severity == "error" and "0.1 GB free" in message and "4.5 GB" in message and "--shm-size" in fix
    assert doctor.shm_verdict(3 * GB, True)[0] == "warning"
    assert doctor.shm_verdict(64 << 20, False)[0] == "info"  # one device: nothing goes through it
    assert doctor.shm_verdict(None, True)[0] == "warning"


# ---- the launcher and the rendezvous port, as h3kit start records them (no torch) ----------------------------

import json  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from h3kit import group  # noqa: E402
from h3kit.errors import UsageError  # noqa: E402
from tests.support.service_helpers import StandinHome, free_port, kill_started_under  # noqa: E402


@pytest.fixture
def home(tmp_path):
    h = StandinHome(tmp_path / "comfy", free_port(8470, 8499))
    yield h
    kill_started_under(h.path)


def test_the_runtime_gets_its_settings_and_a_free_master_port(tmp_path):
    settings = group.resolve("cpu", "process")
    spec = json.loads(group.environment(settings, "cpu", [0, 1], tmp_path, "k" * 64, [])[group.GROUP_ENV])
    assert (spec["local_size"], spec["master_addr"], spec["runtime_root"]) == (2, "127.0.0.1", str(tmp_path))
    assert "launcher" not in spec  # one launcher since 2026-12-02 (docs/multinpu.md, "The launcher")
    port = group.choose_port("127.0.0.1")
    assert 1024 <= port <= 65535  # the kernel's choice (never 0, which would let any port through below)
    with socket.socket() as s:  # and free
        s.bind(("127.0.0.1", port))


def test_start_honours_master_port_on_one_host(home):
    port = free_port(29800, 29899, span=2)  # the master port, the channel's + 1
    # a stand-in writes no ranks.json: start times out waiting for the group, after the server was started
    r = home.start("--master-port", port, "--json", devices="0,1", device_type="npu", timeout=3)
    assert r.returncode == 1 and "start_timeout" in r.stdout, r.stdout + r.stderr
    spec = json.loads(home.boots()[0]["env"]["H3KIT_GROUP"])
    assert spec["master_port"] == port
    rec = home.record()
    assert rec["master_port"] == port


def test_the_group_timeout_reaches_the_runtime_and_the_record(home):
    """--group-timeout (issue 45: on npu 900 s by default, so HCCL_CONNECT_TIMEOUT keeps torch_npu's 600 s below it)
    is written into the runtime's settings and the record; out of range or with threads it is refused, naming it."""
    for args, want in (((), 900.0), (("--group-timeout", "1800"), 1800.0)):
        r = home.start("--master-port", free_port(29800, 29899, span=2), *args, devices="0,1", device_type="npu",
                       timeout=3)
        assert r.returncode == 1 and home.record() is not None, r.stderr
        assert json.loads(home.boots()[-1]["env"]["H3KIT_GROUP"])["timeout"] == want
        assert home.record()["group_timeout"] == want
        home.run("stop")
    for args, words in ((("--group-timeout", "30"), "from 120 to 86400"),
                        (("--group-timeout", "600", "--transport", "threads"), "applies to a process group")):
        r = home.start(*args, devices="0,1", device_type="npu", timeout=3)
        assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_record_of_an_earlier_h3kit_naming_its_launcher_is_still_read(home):
    """Records written before 2026-12-02 name a launcher (torchrun or h3kit): status and stop still trust them."""
    r = home.start("--master-port", free_port(29800, 29899, span=2), devices="0,1", device_type="npu", timeout=3)
    assert r.returncode == 1 and home.record() is not None, r.stderr
    path = home.root / "server.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "launcher": "torchrun"}))
    st = home.run("status", "--json")
    assert "bad_record" not in st.stdout and json.loads(st.stdout)["data"]["pid"] == home.record()["pid"], st.stdout
    path.write_text(json.dumps({**json.loads(path.read_text()), "launcher": "mpirun"}))
    st = home.run("status", "--json")
    assert st.returncode != 0 and "bad_record" in st.stdout, st.stdout


def _held_by_no_visible_process(port: int, seconds: float, run):
    """run() while `port` is bound, not listening (in use, by no process psutil can name), for `seconds`:
    (its result, whether the port was let go before run() returned)."""
    released = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        threading.Timer(seconds, lambda: (released.append(time.monotonic()), s.close())).start()
        result = run()
        finished = time.monotonic()
    return result, bool(released) and released[0] < finished


@pytest.mark.parametrize("command", ["start", "restart"])
def test_a_master_port_of_no_visible_holder_is_waited_for(home, command):
    """Under load a stopped group's store can hold its port for a moment after its process is gone: start and
    restart wait for it, as for the HTTP port, instead of refusing the master port asked for as taken (seen in a
    full CI run: restart's port_in_use, holders [], the whole group down). A port a process holds is still named
    at once (test_a_taken_rendezvous_port_is_named_before_anything_starts)."""
    port = free_port(29800, 29899, span=2)
    args = ("--master-port", port)
    if command == "restart":
        r = home.start(*args, devices="0,1", device_type="npu", timeout=3)
        assert r.returncode == 1 and home.record() is not None, r.stderr  # timed out waiting for the group (below)
        run = lambda: home.run("restart", "--json", "--timeout", 3)  # noqa: E731
    else:
        run = lambda: home.start(*args, "--json", devices="0,1", device_type="npu", timeout=3)  # noqa: E731
    r, released = _held_by_no_visible_process(port, 1.5, run)
    doc = json.loads(r.stdout)
    # the stand-in writes no ranks.json: the command times out waiting for the group, after the port was free
    assert doc["error"]["code"] == "start_timeout", doc
    assert released
    assert home.boots()[-1]["env"]["H3KIT_GROUP"] and len(home.boots()) == (2 if command == "restart" else 1)


def test_a_taken_rendezvous_port_is_named_before_anything_starts(home):
    port = free_port(29800, 29899, span=2)
    with socket.socket() as s:  # the group's store port is taken (by this process: it is named)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(1)
        r = home.start("--master-port", port, devices="0,1", device_type="npu", timeout=3)
    assert r.returncode == 1 and f"port {port} is in use" in r.stderr, r.stderr
    assert home.boots() == []


def test_a_taken_channel_port_of_several_hosts_is_named_before_anything_starts(home, monkeypatch):
    """With several hosts node 0 also listens on the master port + 1 (the command channel, where the other hosts'
    workers and agents beat): start checks it is free, and refuses a master port with no room for it."""
    monkeypatch.setenv(group.KEY_ENV, "ab" * 32)
    port = free_port(29800, 29899, span=2)  # the master port, the channel's + 1
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port + 1))
        s.listen(1)
        r = home.start("--nnodes", 2, "--node-rank", 0, "--master-addr", "127.0.0.1", "--master-port", port,
                       devices="0,1", device_type="npu", timeout=3)
    assert r.returncode == 1 and f"port {port + 1} is in use" in r.stderr, r.stderr
    assert home.boots() == []
    settings = group.resolve("npu", "process", nnodes=2, node_rank=0, master_port=port)
    assert group.rendezvous_ports(settings) == [port, port + 1]
    assert group.rendezvous_ports(group.resolve("npu", "process", master_port=port)) == [port]
    with pytest.raises(UsageError) as e:
        group.resolve("npu", "process", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=65535)
    assert e.value.code == "bad_group" and "master port + 1" in e.value.message
    group.resolve("npu", "process", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=65534)
