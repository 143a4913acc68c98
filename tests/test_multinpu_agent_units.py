"""comfy/multinpu_launch.py's agent side, unit by unit: the agent of a node R > 0 (Agent.run, _serve, _write),
the ranks file it writes (write_ranks_file), gloo on the loopback, and agent_main. No test drives the agent with a
real multi-host group (minutes a run); here the store, the control keys, the workers and the clock are fakes in the
module's namespace. Written for tools/mutate.py --module agent (docs/testing.md)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import sys
import threading
import types
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.torch_module()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_launch as launch  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_wire as wire  # noqa: E402

KEY = "ab" * 32


def node1(tmp_path=None, **kw) -> wire.GroupSpec:
    """Node 1 of two, two cpu ranks each (ranks 2 and 3 here)."""
    args = dict(nnodes=2, node_rank=1, local_size=2, master_addr="10.1.2.3", master_port=29500, join_timeout=300)
    args.update(kw)
    return wire.GroupSpec(runtime_root=str(tmp_path / "run") if tmp_path is not None else None, **args)


def ranks_file(tmp_path) -> dict:
    return json.loads((tmp_path / "run" / wire.RANKS_FILE).read_text())


class Clock:
    """launch.time in the module's namespace: monotonic() is what the test says."""

    def __init__(self, now=100.0):
        self.now = now

    def monotonic(self):
        return self.now


class Stop:
    """Agent.stop: not set for `passes` waits, set from then on; each wait moves the clock 0.25 s on."""

    def __init__(self, passes, clock=None):
        self.left, self.clock, self.flag, self.waits = passes, clock, False, 0

    def is_set(self):
        return self.flag

    def set(self):
        self.flag = True

    def wait(self, timeout=None):
        self.waits += 1
        if self.clock is not None:
            self.clock.now += 0.25
        if self.left <= 0:
            self.flag = True
        self.left -= 1
        return self.flag


class Ctl:
    """The control keys of rank 0's store: put records, peek reads `values`; `gone_at`: the peek of that number
    (1-based) raises ConnectionError, as a read from a store whose master ended does."""

    def __init__(self, values=None, layout=None, gone_at=None, fail=ConnectionError):
        self.values = dict(values or {})
        self.layout = layout
        self.puts, self.waited, self.peeks = [], [], 0
        self.gone_at, self.fail = gone_at, fail

    def put(self, key, obj):
        self.puts.append((key, obj))
        self.values[key] = obj

    def peek(self, key, default=None):
        self.peeks += 1
        if self.peeks == self.gone_at:
            raise self.fail("the store is gone")
        return self.values.get(key, default)

    def wait(self, key, timeout):
        self.waited.append((key, timeout))
        if isinstance(self.layout, Exception):
            raise self.layout
        return self.layout

    def sent(self, prefix):
        return [obj for key, obj in self.puts if key.startswith(prefix)]


class Workers:
    """LocalWorkers of node 1: ranks 2 and 3 with pids 200 and 300; poll() returns the script's next entry (a list
    of ended workers, or a callable run on the workers)."""

    made = []

    def __init__(self, spec, key, script=()):
        self.spec, self.key = spec, key
        self.ranks = [2, 3]
        self.pids = {2: 200, 3: 300}
        self.info = {r: {"rank": r, "node": 1, "pid": self.pids[r], "alive": True} for r in self.ranks}
        self.failed = {}
        self.started = self.stopped = False
        self.kills = []
        self.script = list(script)
        Workers.made.append(self)

    def start(self):
        self.started = True

    def poll(self):
        step = self.script.pop(0) if self.script else []
        return step(self) or [] if callable(step) else step

    def pid(self, rank):
        return self.pids.get(rank)

    def kill(self, rank, why, recycle=False):
        self.kills.append((rank, why, recycle))
        self.pids[rank] = None  # killed: no pid to signal any more

    def stop(self):
        self.stopped = True


@pytest.fixture
def fakes(monkeypatch):
    """The module's store, control, workers and beat replaced; what each was asked is in the namespace returned."""
    seen = types.SimpleNamespace(connects=[], controls=[], beats=[], stores=[], script=[], threads=[])
    def connect_store(addr, port, timeout, deadline, stop):
        seen.connects.append((addr, port, timeout, deadline, stop))
        if not seen.stores:
            stop.set()  # nothing more to connect to: the agent is being stopped
            return None
        store = seen.stores.pop(0)
        if isinstance(store, Exception):
            raise store
        return store

    def control(store, signer):
        ctl = store  # each fake store is its Ctl
        seen.controls.append((ctl, signer))
        return ctl

    def beat(address, signer, hello, stop):
        seen.beats.append((address, signer, hello, stop))

    class Thread:  # started at once, in the caller: the fake beat returns at once
        def __init__(self, target, args, name, daemon):
            seen.threads.append((name, daemon))
            self.target, self.args = target, args

        def start(self):
            self.target(*self.args)

    monkeypatch.setattr(launch, "connect_store", connect_store)
    monkeypatch.setattr(launch, "Control", control)
    monkeypatch.setattr(launch, "beat", beat)
    Workers.made = []
    monkeypatch.setattr(launch, "LocalWorkers", lambda spec, key: Workers(spec, key, seen.script))
    monkeypatch.setattr(launch, "threading", types.SimpleNamespace(Thread=Thread, Event=threading.Event))
    return seen


# ---- write_ranks_file ------------------------------------------------------------------------------

def test_the_ranks_file_holds_what_status_reads_and_replaces_the_old_one_whole(tmp_path):
    spec = node1(tmp_path)
    before = datetime.datetime.now().astimezone().replace(microsecond=0)
    launch.write_ranks_file(spec, "agent", "starting", None, None, [{"rank": 2}])  # makes the runtime root
    launch.write_ranks_file(spec, "agent", "ready", "no error", 4, [{"rank": 2}, {"rank": 3}], node_rank=1)
    text = (tmp_path / "run" / wire.RANKS_FILE).read_text()
    assert text.startswith('{\n  "role": "agent",\n  "pid": ')  # two-space indent: read by people too
    data = json.loads(text)
    updated = datetime.datetime.fromisoformat(data.pop("updated"))
    assert updated.tzinfo is not None and updated >= before
    assert data == {"role": "agent", "pid": os.getpid(), "state": "ready", "error": "no error", "generation": 4,
                    "world_size": 4, "backend": "gloo", "master": "10.1.2.3:29500", "nnodes": 2, "node_rank": 1,
                    "ranks": [{"rank": 2}, {"rank": 3}]}
    # written aside and renamed over the old file: no half-written file is ever read, nothing is left behind
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [wire.RANKS_FILE]


def test_no_runtime_root_writes_nothing_and_an_unwritable_one_only_warns(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    launch.write_ranks_file(node1(), "agent", "ready", None, 1, [])  # runtime_root None: no file anywhere
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "run").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING):
        launch.write_ranks_file(node1(tmp_path), "agent", "ready", None, 1, [])
    assert f"MultiNPU: cannot write {tmp_path / 'run' / wire.RANKS_FILE}" in caplog.text


# ---- gloo_on_loopback ------------------------------------------------------------------------------

def gloo_ifname(monkeypatch, spec, preset=None):
    """GLOO_SOCKET_IFNAME after gloo_on_loopback(spec), the variable unset (or `preset`) before; restored after."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "placeholder")  # monkeypatch restores what it set and deleted
    if preset is None:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    else:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", preset)
    launch.gloo_on_loopback(spec)
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_gloo_is_put_on_the_loopback_only_for_a_cpu_group_on_the_loopback_and_never_over_a_set_value(monkeypatch):
    monkeypatch.setattr(launch.socket, "if_nameindex", lambda: [(1, "eth0"), (2, "lo0"), (3, "lo1")])
    for addr in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert gloo_ifname(monkeypatch, node1(master_addr=addr)) == "lo0", addr
    for addr in ("10.1.2.3", "node-a"):  # another host: gloo finds the interface itself
        assert gloo_ifname(monkeypatch, node1(master_addr=addr)) is None, addr
    assert gloo_ifname(monkeypatch, node1(master_addr="127.0.0.1", device_type="cuda")) is None  # nccl's group
    assert gloo_ifname(monkeypatch, node1(master_addr="127.0.0.1"), preset="eth0") == "eth0"
    monkeypatch.setattr(launch.socket, "if_nameindex", lambda: [(1, "eth0")])  # no lo*: the usual name
    assert gloo_ifname(monkeypatch, node1(master_addr="localhost")) == "lo"


# ---- Agent.run ---------------------------------------------------------------------------------------

def test_an_agent_started_with_another_layout_than_rank_0_is_refused_with_both_named(tmp_path, fakes, caplog):
    spec = node1(tmp_path, local_size=1)
    theirs = node1().layout()  # rank 0 runs two devices a node
    fakes.stores = [Ctl(layout=theirs)]
    agent = launch.Agent(spec, KEY)
    agent.stop = Stop(0)  # a served node (a wrong verdict) ends its first pass: the test fails, never hangs
    with caplog.at_level(logging.ERROR):
        assert agent.run() == 2
    assert fakes.controls[0][0].waited == [("layout", 300.0)] and Workers.made == []  # no worker started
    message = (f"MultiNPU: node 1 was started with {spec.layout()}, rank 0 runs {theirs}: start every node with "
               "the same --nnodes, device count and master")
    assert message in caplog.text
    data = ranks_file(tmp_path)
    assert (data["role"], data["state"], data["error"], data["ranks"]) == ("agent", "failed", message, [])
    assert data["node_rank"] == 1 and data["generation"] is None


@pytest.mark.parametrize("where", ["store", "layout"])
def test_rank_0_not_coming_back_within_the_join_timeout_ends_the_agent_with_1(tmp_path, fakes, caplog, where):
    error = wire.GroupError("MultiNPU: cannot reach the group's store at 10.1.2.3:29500: timed out")
    fakes.stores = [error] if where == "store" else [Ctl(layout=error)]
    agent = launch.Agent(node1(tmp_path, join_timeout=120), KEY)
    agent.stop = Stop(0)
    with caplog.at_level(logging.ERROR):
        assert agent.run() == 1
    assert f"MultiNPU: node 1: rank 0 did not come back within 120 s ({error}); the agent gives up" in caplog.text
    data = ranks_file(tmp_path)
    assert (data["state"], data["error"], data["ranks"]) == ("failed", str(error), [])
    assert len(fakes.connects) == 1 and Workers.made == []


def test_the_agent_beats_looks_for_the_master_within_the_join_timeout_and_stops_when_asked(tmp_path, fakes,
                                                                                            monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "placeholder")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    spec = node1(tmp_path, master_addr="127.0.0.1", join_timeout=120, timeout=30)
    agent = launch.Agent(spec, KEY)
    import time
    t0 = time.monotonic()
    assert agent.run() == 0  # the store never came: connect_store gave None, the agent was stopped
    t1 = time.monotonic()
    [(addr, port, timeout, deadline, stop)] = fakes.connects
    assert (addr, port, timeout, stop) == ("127.0.0.1", 29500, 30.0, agent.stop)
    assert t0 + 120 <= deadline <= t1 + 120
    assert fakes.controls == [] and Workers.made == []
    assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo")  # a cpu group on the loopback
    assert fakes.threads == [("multinpu-agent-beat", True)]  # a daemon: it never holds the agent's exit
    [(address, signer, hello, stop)] = fakes.beats
    assert address == ("127.0.0.1", 29500 + wire.CHANNEL_PORT_OFFSET) and stop is agent.stop
    assert hello == {"role": "agent", "node": 1, "pid": os.getpid()} and signer is agent.signer


def test_the_agent_serves_each_master_it_finds_following_it_through_restarts(tmp_path, fakes, monkeypatch):
    first, second = Ctl(layout=node1(tmp_path).layout()), Ctl(layout=node1(tmp_path).layout())
    fakes.stores = [first, second]
    agent = launch.Agent(node1(tmp_path), KEY)
    served = []

    def serve(ctl):
        served.append(ctl)
        if len(served) == 2:
            agent.stop.set()  # asked to stop while serving the second master
    monkeypatch.setattr(agent, "_serve", serve)
    assert agent.run() == 0
    assert served == [first, second] and len(fakes.connects) == 2
    assert [signer for _, signer in fakes.controls] == [agent.signer, agent.signer]


# ---- Agent._serve ------------------------------------------------------------------------------------

def serve_for(tmp_path, fakes, ctl, passes, script=(), clock=None):
    """Agent._serve of node 1 on `ctl` for `passes` passes of its loop; the agent and its (fake) workers."""
    agent = launch.Agent(node1(tmp_path), KEY)
    agent.stop = Stop(passes, clock)
    fakes.script[:] = list(script)
    agent._serve(ctl)
    [workers] = Workers.made
    return agent, workers


def test_serving_announces_the_node_starts_its_workers_and_reports_each_death(tmp_path, fakes, caplog):
    ctl = Ctl()
    ended = [(2, 200, "exited with code 1")]
    with caplog.at_level(logging.INFO):
        agent, workers = serve_for(tmp_path, fakes, ctl, passes=3, script=[[], ended, []])
    assert workers.started and workers.stopped and workers.key == KEY and workers.spec is agent.spec
    assert "MultiNPU: node 1 agent: started ranks [2, 3]" in caplog.text  # what the host's log says it runs
    assert ctl.puts[0] == ("node/1", {"pid": os.getpid(), "host": socket.gethostname(), "local_size": 2})
    assert ctl.puts[1] == ("nodefail/1", {"pid": os.getpid(), "message": None})  # none of its ranks failed
    assert [(k, v) for k, v in ctl.puts if k.startswith("exit/")] == [("exit/2", {"pid": 200,
                                                                                 "reason": "exited with code 1"})]


def test_a_kill_request_is_obeyed_only_for_the_worker_it_names_and_abort_recycles(tmp_path, fakes):
    ctl = Ctl({"kill/2": {"pid": 199, "why": "an earlier incarnation"}, "kill/3": {"pid": 300, "abort": True}})

    def renew(workers):  # rank 2's request now names its current process
        ctl.values["kill/2"] = {"pid": 200, "why": "its heartbeat stopped"}
    agent, workers = serve_for(tmp_path, fakes, ctl, passes=3, script=[[], renew, []])
    # rank 3 at once (the driver aborted the generation: recycled, not a crash), rank 2 once its pid was asked for;
    # each once: a killed worker has no pid, so the request left in the store names none of its processes
    assert workers.kills == [(3, "the driver asked", True), (2, "its heartbeat stopped", False)]


def test_a_host_whose_ranks_cannot_run_says_so_once_each_time_that_changes(tmp_path, fakes):
    ctl = Ctl()

    def fail(*ranks):
        def step(workers):
            workers.failed = {r: f"rank {r} died 6 times" for r in ranks}
        return step
    serve_for(tmp_path, fakes, ctl, passes=6, script=[[], fail(3), [], fail(2, 3), [], fail()])
    assert [m["message"] for m in ctl.sent("nodefail/")] == [None, "rank 3 died 6 times",
                                                            "rank 2 died 6 times; rank 3 died 6 times", None]
    assert {m["pid"] for m in ctl.sent("nodefail/")} == {os.getpid()}


def test_the_ranks_file_follows_the_groups_state_at_most_once_a_second(tmp_path, fakes, monkeypatch):
    clock = Clock(100.0)
    monkeypatch.setattr(launch, "time", clock)
    written = []
    monkeypatch.setattr(launch, "write_ranks_file",
                        lambda spec, role, state, error, generation, ranks, **more: written.append(
                            (clock.now, state, error, generation)))
    ctl = Ctl()

    def ready(workers):
        ctl.values["state"] = {"state": "ready", "error": None, "generation": 3, "members": {2: 200, 3: 300}}
    # each pass is 0.25 s on the fake clock: written on the first, then when more than 1 s has passed
    serve_for(tmp_path, fakes, ctl, passes=8, script=[[], ready], clock=clock)
    assert written == [(100.25, "starting", None, None), (101.5, "ready", None, 3),
                       (102.25, "waiting", "rank 0 is gone", None)]


def test_when_rank_0s_store_goes_away_the_workers_stop_and_the_file_says_waiting(tmp_path, fakes, caplog):
    ctl = Ctl({"state": {"state": "ready", "generation": 2, "members": {2: 200, 3: 300}}}, gone_at=5)
    with caplog.at_level(logging.WARNING):
        agent, workers = serve_for(tmp_path, fakes, ctl, passes=100)
    assert workers.stopped and agent.stop.waits == 2  # gone on the second pass's reads; not stopped by request
    assert "MultiNPU: node 1 agent: rank 0's store went away (the store is gone); stopping the workers" in caplog.text
    data = ranks_file(tmp_path)
    assert (data["state"], data["error"], data["generation"]) == ("waiting", "rank 0 is gone", None)
    assert [r["rank"] for r in data["ranks"]] == [2, 3] and not any(r["joined"] for r in data["ranks"])


@pytest.mark.parametrize("fail", [RuntimeError, torch.distributed.DistNetworkError])
def test_a_store_error_of_torch_also_ends_serving_quietly(tmp_path, fakes, fail):
    agent, workers = serve_for(tmp_path, fakes, Ctl(gone_at=1, fail=fail), passes=100)
    assert workers.stopped and ranks_file(tmp_path)["state"] == "waiting"


def test_any_other_error_while_serving_is_raised_after_the_workers_are_stopped(tmp_path, fakes):
    with pytest.raises(KeyError):
        serve_for(tmp_path, fakes, Ctl(gone_at=1, fail=KeyError), passes=100)
    [workers] = Workers.made
    assert workers.stopped and ranks_file(tmp_path)["state"] == "waiting"


# ---- Agent._write ------------------------------------------------------------------------------------

def test_a_rank_is_joined_when_the_group_is_ready_with_it_as_a_member_in_its_current_process(tmp_path):
    agent = launch.Agent(node1(tmp_path), KEY)
    local = types.SimpleNamespace(ranks=[2, 3], info={2: {"rank": 2, "pid": 200}, 3: {"rank": 3, "pid": 300}})

    def joined(state, members, generation=5):
        group = {"state": state, "generation": generation, "members": members}
        agent._write(local, state, None, group)
        data = ranks_file(tmp_path)
        assert data["generation"] == generation and data["node_rank"] == 1
        return [r["joined"] for r in data["ranks"]]
    assert joined("ready", {2: 200, 3: 300}) == [True, True]
    assert joined("ready", {2: 200, 3: 299}) == [True, False]  # rank 3's member is an earlier process
    assert joined("ready", {2: 200}) == [True, False]
    assert joined("starting", {2: 200, 3: 300}) == [False, False]  # members of a generation not ready yet
    assert joined("ready", None) == [False, False]
    local.info[3]["pid"] = None
    assert joined("ready", {2: 200, 3: None}) == [True, False]  # no process: never joined
    assert local.info[2] == {"rank": 2, "pid": 200}  # the workers' own records are left as they are
    agent._write(local, "starting", None)  # no group state yet
    assert [(r["rank"], r["joined"]) for r in ranks_file(tmp_path)["ranks"]] == [(2, False), (3, False)]
    assert ranks_file(tmp_path)["generation"] is None


# ---- agent_main ----------------------------------------------------------------------------------------

def test_agent_main_runs_the_agent_of_its_environment_and_sigterm_stops_it(monkeypatch):
    spec = node1()
    monkeypatch.setenv(wire.GROUP_ENV, spec.to_json())
    monkeypatch.setenv(wire.KEY_ENV, KEY)
    handlers, configured, ran = {}, [], []
    monkeypatch.setattr(launch.signal, "signal", lambda signum, handler: handlers.update({signum: handler}))
    monkeypatch.setattr(launch.logging, "basicConfig", lambda **kw: configured.append(kw))

    def run(agent):
        ran.append(agent)
        return 7
    monkeypatch.setattr(launch.Agent, "run", run)
    assert launch.agent_main() == 7
    [agent] = ran
    assert agent.key == KEY and agent.spec.to_json() == spec.to_json()
    assert [kw["level"] for kw in configured] == [logging.INFO]  # the agent's INFO lines reach its log
    assert not agent.stop.is_set()
    handlers[signal.SIGTERM](signal.SIGTERM, None)
    assert agent.stop.is_set()
