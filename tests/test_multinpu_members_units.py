"""comfy/multinpu_members.py unit by unit, without a process group: the driver's membership (GroupMonitor: which
death or silence ends a generation, which is ignored, lost hosts, who is announced, what status shows) and its
generations (Generations: forming one, failing to, aborting one). The runtime is a GroupRuntime built as the server
builds it; its store, launcher, clock and command connections are small fakes here. The groups that run the same
code with real workers: test_multinpu_process*.py (a minute or more a run). Written for tools/mutate.py --module
members (issue 40)."""

from __future__ import annotations

import json
import logging
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_members as members  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_process as mp  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402

JOIN = 30.0          # the join timeout of these groups (fake seconds)
STALE = wire.HEARTBEAT_STALE
PORT = "4242"        # the store's port in messages (nothing listens: only the words are read)


class Runaway(BaseException):
    """A loop that never ends under the fake clock (no `except Exception` in the driver swallows this)."""


class Clock:
    """time.monotonic and time.sleep for the members module: time passes only when the driver sleeps."""

    def __init__(self):
        self.now = 1000.0
        self.reads = 0

    def monotonic(self):
        self.reads += 1
        if self.reads > 200_000:
            raise Runaway("the fake clock was read 200000 times: a loop that never waits or never ends")
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Store:
    """The group's store as the driver's Control shows it (peek/put of signed values by key); `fail` makes put raise.
    history: the driver's puts in order; on_put(key, value): the other side of the store reacting to one."""

    def __init__(self):
        self.data = {}
        self.history = []
        self.fail = False
        self.on_put = None

    def peek(self, key, default=None):
        return self.data.get(key, default)

    def put(self, key, value):
        if self.fail:
            raise ConnectionError("the store is gone")
        self.data[key] = value
        self.history.append((key, value))
        if self.on_put is not None:
            self.on_put(key, value)


class Workers:
    """LocalWorkers as the driver uses it: this host's ranks, their live pids and info, the ends since the last poll,
    kills and recycles asked for. A recycle replaces every live worker by a fresh pid (pid + 100), as the launcher
    does, unless `respawn` is off."""

    def __init__(self, spec):
        self.ranks = [spec.node_rank * spec.local_size + lr for lr in range(spec.local_size)]
        self.failed = {}
        self.live = {}
        self.info = {}
        self.ended, self.kills, self.recycles = [], [], []
        self.started = 0
        self.respawn = True
        for r in self.ranks:
            self.info[r] = {"rank": r, "node": spec.node_rank, "local_rank": r % spec.local_size,
                            "host": "driver-host", "device": spec.device_name(r), "pid": None, "create_time": None,
                            "cmdline": [], "alive": False, "restarts": 0, "last_exit": None}
            self.spawn(r, 1000 + r)

    def spawn(self, rank, pid):
        self.live[rank] = pid
        self.info[rank].update(pid=pid, create_time=float(pid), alive=True, cmdline=["python", "-m", "worker"])

    def die(self, rank, reason, new_pid=None):
        """The worker of `rank` ended (seen at the next poll); its replacement `new_pid` starts at once."""
        pid = self.live.pop(rank)
        self.ended.append((rank, pid, reason))
        self.info[rank].update(alive=False, last_exit=reason)
        if new_pid is not None:
            self.spawn(rank, new_pid)
        return pid

    def start(self):
        self.started += 1

    def poll(self):
        ended, self.ended = self.ended, []
        return ended

    def pid(self, rank):
        return self.live.get(rank)

    def kill(self, rank, why, recycle=False):
        self.kills.append((rank, why))

    def recycle(self, why):
        self.recycles.append(why)
        if self.respawn:
            for rank, pid in list(self.live.items()):
                self.die(rank, f"{why}: killed by SIGKILL", new_pid=pid + 100)


class Link:
    """A command connection: what was sent, whether it was closed; `fail`: a send that raises."""

    def __init__(self, fail=False):
        self.sent, self.closed, self.fail = [], False, fail

    def send(self, message, timeout=None):
        if self.fail:
            raise OSError("connection reset")
        self.sent.append(message)

    def close(self):
        self.closed = True


class Peers:
    """The workers and node 1's agent on the other side of the store: a live worker joins when its generation is
    posted, comes up and connects its command connection at go (unless named in skip["joined"|"up"|"link"]); the
    agent kills a remote worker the driver asks it to (an exit report, a fresh pid + 100 announced). on[key]: run
    once after the driver posts key (before the answers to it)."""

    def __init__(self, rt, store, workers):
        self.rt, self.store, self.workers = rt, store, workers
        self.skip = {"joined": set(), "up": set(), "link": set()}
        self.on = {}
        self.agent = True
        store.on_put = self.posted

    def alive(self, rank, pid):
        if self.rt.spec.node_of(rank) == 0:
            return self.workers.pid(rank) == pid
        announced = self.store.data.get(f"worker/{rank}") or {}
        return announced.get("pid") == pid and (self.store.data.get(f"exit/{rank}") or {}).get("pid") != pid

    def posted(self, key, value):
        if key in self.on:
            self.on.pop(key)()
        kind, _, rest = key.partition("/")
        if kind == "gen" and rest:
            for r, pid in value["members"].items():
                if r not in self.skip["joined"] and self.alive(r, pid):
                    self.store.data[f"joined/{rest}/{r}"] = pid
        elif kind == "go":
            g = int(rest)
            for r, pid in self.store.data[f"gen/{g}"]["members"].items():
                if not self.alive(r, pid):
                    continue
                if r not in self.skip["up"]:
                    self.store.data[f"up/{g}/{r}"] = pid
                if r not in self.skip["link"]:
                    self.rt._links[(g, r, pid)] = (Link(), None)
        elif kind == "kill" and self.agent and self.alive(int(rest), value["pid"]):
            exit_remote(self.store, int(rest), f"{value['why']}: killed by SIGKILL", new_pid=value["pid"] + 100)


def announce(store, rank, pid, host="node1-host"):
    store.data[f"worker/{rank}"] = {"pid": pid, "host": host, "create_time": float(pid),
                                    "cmdline": ["python", "-m", "worker"]}


def exit_remote(store, rank, reason, new_pid=None):
    """Node 1's agent reports its worker of `rank` ended; its replacement `new_pid` announced at once."""
    old = store.data[f"worker/{rank}"]["pid"]
    store.data[f"exit/{rank}"] = {"pid": old, "reason": reason}
    if new_pid is not None:
        announce(store, rank, new_pid)
    return old


class StoreHost:
    def __init__(self):
        self.up = True

    def alive(self):
        return self.up


@pytest.fixture
def group(monkeypatch):
    """Two hosts of two ranks: ranks 0 and 1 here (pids 1000, 1001), 2 and 3 on node 1 (pids 2002, 2003, announced,
    its agent connected); state "starting", nothing formed yet."""
    clock = Clock()
    monkeypatch.setattr(members, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=clock.sleep))
    heard = []
    monkeypatch.setattr(members, "LISTENERS", [lambda state, why: heard.append((state, why))])
    spec = wire.GroupSpec(nnodes=2, local_size=2, join_timeout=JOIN)
    rt = mp.GroupRuntime(spec, "k" * 64)
    store, workers = Store(), Workers(spec)
    rt._local, rt._store, rt.ctl, rt._mon = workers, StoreHost(), store, store
    rt._channel = SimpleNamespace(path="/run/h3kit/channel.sock")
    rt.port = int(PORT)
    store.data["node/1"] = {"pid": 77, "host": "node1-host", "local_size": 2}
    for r in (2, 3):
        announce(store, r, 2000 + r)
    peers = Peers(rt, store, workers)
    return SimpleNamespace(rt=rt, store=store, workers=workers, peers=peers, clock=clock, heard=heard, spec=spec)


def formed(group):
    """The group of the fixture with generation 1 formed: every rank a member, idle."""
    group.rt._form()
    assert group.rt.state == "ready" and group.rt.members == {0: 1000, 1: 1001, 2: 2002, 3: 2003}
    group.heard.clear()
    group.clock.now += 1.0  # the next look at the ranks reads the other hosts too
    return group.rt


def puts(store, prefix):
    return [(k, v) for k, v in store.history if k.startswith(prefix)]


# ---- forming a generation -------------------------------------------------------------------------------------

class Config:
    def __init__(self, installed):
        self.installed = installed


def test_a_generation_forms_with_every_announced_rank_and_the_group_is_ready(group, caplog):
    rt, store = group.rt, group.store
    stale = Link()
    rt._links[(0, 1, 999)] = (stale, None)  # a connection of a generation given up on
    rt.dead, rt._aborted_members, rt.next_cmd = {1: "pid 999: killed by SIGKILL"}, {1: 999}, 7
    cfg = Config({0: 1000, 1: 999})  # rank 1's holder was a worker since replaced
    rt.configs.add(cfg)
    with caplog.at_level(logging.INFO):
        rt._form()
    assert "process group generation 1 ready: 4 ranks (pids 1000, 1001, 2002, 2003)" in caplog.text
    want = {0: 1000, 1: 1001, 2: 2002, 3: 2003}
    assert (rt.state, rt.error, rt.generation, rt.members) == ("ready", None, 1, want)
    assert store.data["gen/1"] == {"members": want} and store.data["gen"] == 1 and store.data["go/1"] is True
    # the generation is posted before its go, and go only once every member joined
    keys = [k for k, _ in store.history]
    assert keys.index("gen/1") < keys.index("go/1")
    assert sorted(rt._cmd_links) == [0, 1, 2, 3] and all(isinstance(v[0], Link) for v in rt._cmd_links.values())
    assert stale.closed and (0, 1, 999) not in rt._links
    assert rt.next_cmd == 1 and rt.dead == {} and rt._aborted_members == {}
    assert cfg.installed == {0: 1000}
    # monitoring and the agents hear: forming, the generation being formed, ready
    assert group.heard == [("forming", None), ("forming", None), ("ready", None)]
    states = [v for k, v in store.history if k == "state"]
    assert [(s["state"], s["generation"]) for s in states] == [("forming", 0), ("forming", 1), ("ready", 1)]
    assert states[-1]["members"] == want and states[-1]["error"] is None


def test_a_member_that_dies_before_go_makes_the_others_wait_for_the_next_generation(group):
    rt, store = group.rt, group.store
    group.peers.on["gen/1"] = lambda: group.workers.die(1, "killed by SIGSEGV", new_pid=1101)
    rt._form()
    assert rt.state == "ready" and rt.generation == 2
    assert rt.members == {0: 1000, 1: 1101, 2: 2002, 3: 2003} == store.data["gen/2"]["members"]
    assert "go/1" not in store.data and store.data["go/2"] is True
    assert not puts(store, "abort/") and group.workers.recycles == []  # nobody passed go: nothing to abort


def test_a_member_that_reports_a_join_error_makes_the_others_wait_for_the_next_generation(group, caplog):
    rt, store = group.rt, group.store

    def join_error():
        group.peers.skip["joined"] = {2}
        store.data["joinerr/1/2"] = {"type": "RuntimeError", "message": "device busy"}
    group.peers.on["gen/1"] = join_error
    group.peers.on["gen/2"] = lambda: group.peers.skip["joined"].clear()
    with caplog.at_level(logging.ERROR):
        rt._form()
    assert rt.state == "ready" and rt.generation == 2 and "go/1" not in store.data
    assert "rank 2 (cpu, node 1) could not join generation 1: RuntimeError: device busy" in caplog.text
    assert group.clock.now - 1000.0 < JOIN  # at once, not at the join timeout


def test_a_generation_that_does_not_come_up_is_aborted_and_formed_again_with_fresh_processes(group):
    rt, store = group.rt, group.store

    def hang_in_init():
        group.peers.skip["up"] = {3}
        exit_remote(store, 3, "killed by SIGABRT", new_pid=2103)
    group.peers.on["go/1"] = hang_in_init
    group.peers.on["gen/2"] = lambda: group.peers.skip["up"].clear()
    rt._form()
    assert store.data["abort/1"] == {"why": "generation 1 did not form"}
    assert group.workers.recycles == ["generation 1 aborted: generation 1 did not form"]
    # the abort asks node 1's agent to kill its members of generation 1 (the one that is gone as well)
    for r in (2, 3):
        kill = {"pid": 2000 + r, "why": "generation 1 aborted: generation 1 did not form", "abort": True}
        assert (f"kill/{r}", kill) in store.history
    assert rt.state == "ready" and rt.generation == 2
    assert rt.members == {0: 1100, 1: 1101, 2: 2102, 3: 2103}  # none of generation 1's processes


def test_a_member_that_dies_before_connecting_its_command_connection_is_replaced_at_once(group):
    rt, store = group.rt, group.store
    group.peers.skip["link"] = {2}
    group.peers.on["gen/2"] = lambda: group.peers.skip["link"].clear()
    wait_link = rt._wait_link

    def dying(g, members, deadline):  # rank 2 came up, then ends before it connects
        if g == 1:
            exit_remote(store, 2, "killed by SIGKILL", new_pid=2102)
        return wait_link(g, members, deadline)
    rt._wait_link = dying
    rt._form()
    assert rt.state == "ready" and rt.generation == 2 and rt.members[2] == 2102 and "abort/1" in store.data
    assert group.clock.now - 1000.0 < JOIN  # at once, not at the join timeout


def test_the_join_timeout_fails_the_group_naming_the_ranks_that_did_not_join(group):
    rt, store = group.rt, group.store
    del store.data["worker/3"]  # node 1's agent is here, its rank 3 never started
    with pytest.raises(wire.GroupError) as e:
        rt._form()
    message = str(e.value)
    assert message == f"MultiNPU: the process group did not form within {JOIN:g} s: rank 3 (cpu, node 1) did not join"
    assert group.clock.now - 1000.0 >= JOIN
    assert (rt.state, rt.error) == ("failed", message) and group.heard[-1] == ("failed", None)
    assert store.data["state"]["state"] == "failed" and rt.generation == 0


def test_a_node_that_never_arrived_is_named_with_how_to_start_it(group):
    rt, store = group.rt, group.store
    for key in ("node/1", "worker/2", "worker/3"):
        del store.data[key]
    group.workers.live.pop(1)
    assert rt._missing([3, 1, 2]) == (
        "rank 1 (cpu, node 0) did not join; node 1 (ranks 2, 3) never arrived: no agent connected to "
        f"127.0.0.1:{PORT} (start it there with h3kit start --nnodes 2 --node-rank 1 ...)")
    store.data["node/1"] = {"pid": 77}  # the agent came, its workers did not
    assert rt._missing([2, 3]) == "rank 2 (cpu, node 1), rank 3 (cpu, node 1) did not join"
    with pytest.raises(wire.GroupError, match=r"did not form within 30 s: rank 1 \(cpu, node 0\) did not join; rank 2"):
        rt._form()


def test_a_member_that_never_connected_its_command_connection_is_named_with_the_channel(group):
    rt = group.rt
    group.peers.skip["link"] = {0, 2}
    with pytest.raises(wire.GroupError) as e:
        rt._form()
    assert str(e.value).endswith(
        "rank 0 (cpu, node 0) did not connect to the command channel /run/h3kit/channel.sock; "
        f"rank 2 (cpu, node 1) did not connect to the command channel 127.0.0.1:{int(PORT) + 1}")
    assert rt._cmd_links == {} and rt.state == "failed"


def test_a_member_that_joined_but_never_came_up_is_named(group):
    group.peers.skip["up"] = {1}
    late = r"within 30 s: rank 1 \(cpu, node 0\) joined but did not form the group$"
    with pytest.raises(wire.GroupError, match=late):
        group.rt._form()
    group.peers.skip["up"].clear()
    group.peers.skip["joined"] = {3}
    with pytest.raises(wire.GroupError, match=r"within 30 s: rank 3 \(cpu, node 1\) started but did not join$"):
        group.rt._form()


def test_a_node_whose_agent_cannot_run_its_ranks_fails_the_forming_at_once(group):
    rt, store = group.rt, group.store
    for key in ("worker/2", "worker/3"):  # node 1 runs none of its ranks
        del store.data[key]
    store.data["nodefail/1"] = {"pid": 77, "message": None}  # the agent's all-clear: no failure
    store.data["nodefail/0"] = {"pid": 1, "message": "not this host's agent"}  # node 0 has no agent
    group.workers.live.pop(1)
    with pytest.raises(wire.GroupError, match="did not form within 30 s"):
        rt._form()
    t0 = group.clock.now
    store.data["nodefail/1"] = {"pid": 77, "message": "no npu:1: torch_npu reports 1 device"}
    with pytest.raises(wire.GroupError) as e:
        rt._wait_members(t0 + JOIN)
    assert str(e.value) == ("MultiNPU: node 1 cannot run its ranks: no npu:1: torch_npu reports 1 device (its agent, "
                            "pid 77, keeps trying; the group re-forms by itself)")
    assert group.clock.now - t0 < 1.0 and rt.state == "failed" and rt.error == str(e.value)


def test_a_node_whose_agent_went_silent_fails_the_forming_at_once(group):
    rt, store, clock = group.rt, group.store, group.clock
    del store.data["worker/2"]
    rt._agent_heard[1] = clock.now - 9.0  # silent, but not for HOST_STALE yet: the join timeout decides
    with pytest.raises(wire.GroupError, match="did not form within"):
        rt._wait_members(clock.now + 0.5)
    rt._agent_heard[1] = clock.now - (wire.HOST_STALE + 2)
    t0 = clock.now
    with pytest.raises(wire.GroupError) as e:
        rt._wait_members(t0 + JOIN)
    silent = f"{wire.HOST_STALE + 2:.0f}"
    assert str(e.value).startswith(f"MultiNPU: node 1 (ranks 2, 3) is lost: its agent has not been heard from for "
                                   f"{silent} s. Fix: start it there again (h3kit start --nnodes 2 --node-rank 1")
    assert clock.now - t0 < 1.0 and rt.state == "failed"


def test_a_local_rank_in_a_crash_loop_fails_the_forming_at_once(group):
    rt, clock = group.rt, group.clock
    group.workers.live.pop(1)
    group.workers.failed = {1: "rank 1 (cpu, node 0) died 4 times within 60 s; not replaced again"}
    with pytest.raises(wire.GroupError) as e:
        rt._form()
    assert str(e.value) == ("MultiNPU: the process group failed: rank 1 (cpu, node 0) died 4 times within 60 s; not "
                            "replaced again")
    assert clock.now - 1000.0 < 1.0 and rt.state == "failed"


def test_while_the_group_forms_who_is_missing_is_logged_every_waiting_log(group, caplog):
    del group.store.data["worker/3"]
    with caplog.at_level(logging.WARNING), pytest.raises(wire.GroupError):
        group.rt._form()
    waiting = [r.getMessage() for r in caplog.records if "forming generation 1" in r.getMessage()]
    assert 2 <= len(waiting) <= 3, waiting  # every 10 s of a 30 s wait, not every poll
    assert "rank 3 (cpu, node 1) did not join" in waiting[0] and "announced {0: 1000, 1: 1001, 2: 2002, 3: None}" \
        in waiting[0]


def test_the_launcher_state_says_who_is_announced_or_why_it_cannot(group):
    rt = group.rt
    assert rt._launcher_state() == "announced {0: 1000, 1: 1001, 2: 2002, 3: 2003}"
    rt._local = None
    assert rt._launcher_state().startswith("announced: unreadable (")


# ---- deaths -----------------------------------------------------------------------------------------------------

def test_a_member_that_dies_while_idle_aborts_the_generation_and_its_processes_are_never_members_again(group, caplog):
    rt, store, workers = formed(group), group.store, group.workers
    links = [link for link, _ in rt._cmd_links.values()]
    workers.respawn = False
    group.peers.agent = False  # the kills are asked for; nobody has answered them yet
    workers.die(1, "killed by SIGSEGV", new_pid=1101)  # its replacement starts at once, before the abort
    with caplog.at_level(logging.WARNING):
        rt._watch()
    why = "rank 1 (cpu, node 0) killed by SIGSEGV"
    # no prompt runs: the log is the operator's only word of it
    assert "MultiNPU: rank 1 (cpu, node 0) (pid 1001) killed by SIGSEGV while idle" in caplog.text
    assert rt.dead == {1: "pid 1001: killed by SIGSEGV"}
    assert (rt.state, rt.members, rt._aborted_members) == ("broken", {}, {0: 1000, 1: 1001, 2: 2002, 3: 2003})
    assert store.data["abort/1"] == {"why": why}
    for r in (2, 3):
        assert store.data[f"kill/{r}"] == {"pid": 2000 + r, "why": f"generation 1 aborted: {why}", "abort": True}
    assert "kill/0" not in store.data and "kill/1" not in store.data  # this host's are recycled, not asked
    assert workers.recycles == [f"generation 1 aborted: {why}"]
    assert all(link.closed for link in links) and rt._cmd_links == {}
    assert group.heard == [("broken", why)] and store.data["state"]["state"] == "broken"
    # the members and the replacement that never joined are retired: none is announced, so none can be a member
    assert rt._announced() == {0: None, 1: None, 2: None, 3: None}
    assert rt._should_form() is True


def test_a_death_that_is_no_current_members_is_ignored(group):
    rt, store, workers = formed(group), group.store, group.workers
    rt._note_death(1, 999, "killed by SIGKILL")   # an earlier worker of rank 1
    rt._note_death(2, None, "exited with code 1")  # no pid known
    store.data["exit/3"] = {"pid": 1903, "reason": "exited with code 1"}  # an old incarnation's report
    workers.ended.append((0, 900, "exited with code 1"))
    rt._watch()
    assert rt.dead == {} and rt.state == "ready" and group.heard == [] and not puts(store, "abort/")


def test_a_remote_members_exit_report_is_read_and_named(group):
    rt, store, clock = formed(group), group.store, group.clock
    rt._watch()
    clock.now += 0.6
    exit_remote(store, 2, "killed by SIGKILL")
    rt._watch()
    assert rt.dead == {2: "pid 2002: killed by SIGKILL"} and rt.state == "broken"
    assert rt._remote_exits[2] == {"pid": 2002, "reason": "killed by SIGKILL"}


def test_an_exit_report_gone_from_the_store_is_no_new_death_and_no_error(group):
    rt, store, clock = formed(group), group.store, group.clock
    rt.inflight = ("dit_forward", 3)  # a command runs: the death is noted, the group kept
    exit_remote(store, 2, "killed by SIGKILL")
    rt._watch()
    del store.data["exit/2"]  # a store client can delete any key
    clock.now += 0.6
    rt._watch()
    assert rt._remote_exits[2] == {"pid": 2002, "reason": "killed by SIGKILL"}
    assert rt.dead == {2: "pid 2002: killed by SIGKILL"} and rt.state == "ready"


def test_a_death_during_a_command_is_noted_and_left_to_the_command(group):
    rt, store = formed(group), group.store
    rt.inflight = ("dit_forward", 4)
    group.workers.die(0, "killed by SIGKILL")
    rt._watch()
    assert rt.dead == {0: "pid 1000: killed by SIGKILL"}
    assert rt.state == "ready" and rt.members[0] == 1000 and not puts(store, "abort/")


def test_a_just_aborted_members_death_is_kept_for_naming_unless_h3kit_caused_it(group):
    rt = formed(group)
    rt._abort_generation("rank 2 (cpu, node 1) killed by SIGKILL")
    rt.dead = {}
    rt._note_death(0, 1000, "generation 1 aborted: rank 2 (cpu, node 1) killed by SIGKILL: killed by SIGKILL")
    rt._note_death(1, 1001, "left its aborted generation (code 75)")
    assert rt.dead == {}
    rt._note_death(3, 2003, "ended by SIGTERM: its launcher (pid 77) ended")  # the root cause, perhaps
    rt._note_death(3, 2003, "exited with code 1")
    assert rt.dead == {3: "pid 2003: ended by SIGTERM: its launcher (pid 77) ended"}  # the first reason stays
    assert group.workers.recycles == ["generation 1 aborted: rank 2 (cpu, node 1) killed by SIGKILL"]
    assert len(puts(group.store, "abort/")) == 1


def test_the_first_reason_of_a_members_death_is_the_one_named(group):
    rt = formed(group)
    rt.inflight = ("dit_forward", 2)
    rt._note_death(2, 2002, "killed by SIGKILL")
    rt._note_death(2, 2002, "exited with code 1")
    assert rt.dead == {2: "pid 2002: killed by SIGKILL"}


# ---- heartbeats and progress --------------------------------------------------------------------------------

def test_a_member_whose_beats_stop_for_heartbeat_stale_is_killed_named_and_replaced(group):
    rt, store = formed(group), group.store
    t0 = group.clock.now
    rt._check_heartbeat(2, t0)  # the first look starts its clock
    rt._beats[(2, 2002)] = 1    # its first beat
    rt._check_heartbeat(2, t0 + 10)
    rt._check_heartbeat(2, t0 + 10 + STALE)  # silent for exactly the bound: not yet
    assert rt.dead == {} and "kill/2" not in store.data
    rt._check_heartbeat(2, t0 + 11 + STALE)
    why = f"no heartbeat for {STALE + 1:.0f} s (hung)"
    assert ("kill/2", {"pid": 2002, "why": why}) == store.history[[k for k, _ in store.history].index("kill/2")]
    assert rt.dead == {2: f"pid 2002: {why}"}
    assert rt.state == "broken" and store.data["abort/1"] == {"why": f"rank 2 (cpu, node 1) {why}"}


def test_the_monitors_look_at_the_ranks_kills_a_member_whose_beats_stopped(group):
    rt, store, clock = formed(group), group.store, group.clock
    seq = 0
    while "kill/2" not in store.data and clock.now < 1001.0 + 3 * STALE:
        seq += 1
        for r, pid in ((0, 1000), (1, 1001), (3, 2003)):  # every member beats but rank 2
            rt._beats[(r, pid)] = seq
        rt._watch()
        clock.now += 0.5
    assert store.data["kill/2"]["pid"] == 2002 and STALE < clock.now - 1001.0 <= STALE + 1.5
    assert list(rt.dead) == [2] and rt.state == "broken"


def test_newer_beats_keep_a_member_alive_and_only_its_own_pids_beats_count(group):
    rt = formed(group)
    t0 = group.clock.now
    rt._check_heartbeat(3, t0)
    for i in range(1, 6):
        rt._beats[(3, 2003)] = i
        rt._check_heartbeat(3, t0 + i * (STALE - 1))
    assert rt.dead == {} and rt.state == "ready"
    rt._beats[(3, 1903)] = 99  # beats of an earlier worker of rank 3 on the same key
    rt._check_heartbeat(3, t0 + 5 * (STALE - 1) + STALE + 1)
    assert list(rt.dead) == [3] and rt.state == "broken"


def test_a_rank_is_timed_from_its_current_members_pid(group):
    rt = formed(group)
    t0 = group.clock.now
    rt._hb[2] = (1902, 7, t0 - 100)  # what an earlier member of rank 2 left
    rt._check_heartbeat(2, t0)
    rt._check_heartbeat(2, t0 + STALE)
    assert rt.dead == {}
    rt.members.pop(3)
    rt._check_heartbeat(3, t0)
    rt._check_heartbeat(3, t0 + 10 * STALE)  # not a member: not watched
    assert rt.dead == {} and 3 not in rt._hb


def test_a_hung_local_member_is_killed_here_but_never_its_replacement(group):
    rt, workers = formed(group), group.workers
    workers.respawn = False
    t0 = group.clock.now
    rt._check_heartbeat(1, t0)
    rt._check_heartbeat(1, t0 + STALE + 1)
    why = f"no heartbeat for {STALE + 1:.0f} s (hung)"
    assert workers.kills == [(1, why)] and "kill/1" not in group.store.data and list(rt.dead) == [1]
    workers.kills.clear()
    workers.die(0, "killed by SIGKILL", new_pid=1300)
    rt._kill_hung(0, 1000, "no heartbeat for 20 s (hung)")  # rank 0 is a new process by now
    assert workers.kills == []


class Watch:
    """ProgressWatch.check's verdict, given; what it was asked."""

    def __init__(self, verdict):
        self.verdict, self.asked = verdict, []

    def check(self, members, g, n, program, now):
        self.asked.append((dict(members), g, n, program, now))
        return self.verdict


def test_a_member_the_progress_watch_names_is_killed_while_the_command_fails_by_itself(group):
    rt, store = formed(group), group.store
    why = "rank 2 (cpu, node 1) has not reached all_gather #3 its peers wait in for 61 s"
    rt._progress = Watch((2, why))
    rt._check_progress(group.clock.now)
    assert rt._progress.asked == [], "idle: nothing to watch"
    rt.inflight = ("dit_forward", 5)
    rt._check_progress(group.clock.now)
    assert rt._progress.asked == [({0: 1000, 1: 1001, 2: 2002, 3: 2003}, 1, 5, "dit_forward", group.clock.now)]
    assert store.data["kill/2"] == {"pid": 2002, "why": why} and rt.dead == {2: f"pid 2002: {why}"}
    assert rt.state == "ready" and not puts(store, "abort/")


def test_a_collective_every_member_is_stuck_in_is_recorded_once_per_generation(group, caplog):
    rt, store = formed(group), group.store
    rt._progress = Watch((None, "every rank waits in all_to_all #2 for 61 s"))
    rt.inflight = ("dit_forward", 5)
    with caplog.at_level(logging.ERROR):
        rt._check_progress(group.clock.now)
        rt._check_progress(group.clock.now + 1)
    assert caplog.text.count("MultiNPU: every rank waits in all_to_all #2 for 61 s") == 1  # the operator's word
    assert rt._stalled == {1: "every rank waits in all_to_all #2 for 61 s"} and len(rt._progress.asked) == 1
    assert rt.dead == {} and not puts(store, "kill/")


def test_the_monitors_look_at_the_ranks_asks_the_progress_watch_of_a_running_command(group):
    rt, clock = formed(group), group.clock
    why = "rank 2 (cpu, node 1) has not reached all_gather #3 its peers wait in for 61 s"
    rt._progress = Watch((2, why))
    rt.inflight = ("dit_forward", 5)
    rt._watch()
    assert rt._progress.asked == [({0: 1000, 1: 1001, 2: 2002, 3: 2003}, 1, 5, "dit_forward", clock.now)]
    assert rt.dead == {2: f"pid 2002: {why}"}


def test_the_progress_watch_is_asked_only_of_a_ready_group_with_members(group):
    rt = formed(group)
    rt._progress = Watch(None)
    rt.inflight = ("dit_forward", 5)
    rt.state = "forming"
    rt._check_progress(group.clock.now)
    rt.state, rt.members = "ready", {}
    rt._check_progress(group.clock.now)
    assert rt._progress.asked == []


# ---- hosts -------------------------------------------------------------------------------------------------------

def test_a_remote_member_that_noted_its_sigterm_is_named_by_its_note(group):
    rt, store = formed(group), group.store
    store.data["term/3"] = {"pid": 1903, "why": "ended by SIGTERM (from pid 1)"}  # an earlier worker's note
    rt._check_hosts()
    assert rt.dead == {} and rt.state == "ready"
    store.data["term/3"] = {"pid": 2003, "why": "ended by SIGTERM: its launcher (pid 77) ended"}
    rt._check_hosts()
    assert rt.dead == {3: "pid 2003: ended by SIGTERM: its launcher (pid 77) ended"} and rt.state == "broken"


def test_a_host_whose_agent_is_silent_for_host_stale_is_lost_with_its_members(group):
    rt, clock = formed(group), group.clock
    rt._check_hosts()  # its agent never beat (an old agent): never lost by silence
    rt._agent_heard[1] = clock.now - (wire.HOST_STALE - 1)
    rt._check_hosts()
    assert rt.dead == {} and rt.state == "ready"
    clock.now += 2
    rt._check_hosts()
    why = f"host lost: its agent has not been heard from for {wire.HOST_STALE + 1:.0f} s"
    assert rt.dead == {2: f"pid 2002: {why}", 3: f"pid 2003: {why}"}  # both named, this host's ranks not
    assert rt.state == "broken" and group.store.data["abort/1"] == {"why": f"rank 2 (cpu, node 1) {why}"}


def test_the_monitors_look_at_the_ranks_reads_other_hosts_notes(group):
    rt, store = formed(group), group.store
    store.data["term/3"] = {"pid": 2003, "why": "ended by SIGTERM: its launcher (pid 77) ended"}
    rt._watch()
    assert rt.dead[3] == "pid 2003: ended by SIGTERM: its launcher (pid 77) ended" and rt.state == "broken"


def test_a_kill_that_cannot_reach_another_host_is_logged_and_the_member_still_noted_dead(group, caplog):
    rt, store = formed(group), group.store
    rt.inflight = ("dit_forward", 5)
    store.fail = True
    with caplog.at_level(logging.WARNING):
        rt._kill_hung(2, 2002, "no heartbeat for 21 s (hung)")
    assert "could not ask node 1 to kill rank 2: the store is gone" in caplog.text
    assert rt.dead == {2: "pid 2002: no heartbeat for 21 s (hung)"}


# ---- the monitor's rounds --------------------------------------------------------------------------------------

def test_a_dead_store_is_restarted_unless_the_driver_is_stopping(group):
    rt = group.rt
    restarts = []
    rt._restart_store = lambda: restarts.append(True)
    rt._watch()
    assert restarts == []
    rt._store.up = False
    rt._watch()
    assert restarts == [True]
    rt._stop.set()
    rt._watch()
    assert restarts == [True]


def test_a_local_crash_loop_fails_the_group_once(group):
    rt = formed(group)
    group.workers.failed = {0: "rank 0 (cpu, node 0) died 4 times within 60 s; not replaced again"}
    rt._watch()
    rt._watch()
    assert (rt.state, rt.error) == ("failed", "rank 0 (cpu, node 0) died 4 times within 60 s; not replaced again")
    assert group.heard == [("failed", None)]


def test_other_hosts_are_looked_at_twice_a_second(group):
    rt, store, clock = formed(group), group.store, group.clock
    rt._watch()
    exit_remote(store, 2, "killed by SIGKILL")
    clock.now += 0.3
    rt._watch()
    assert rt.dead == {}
    clock.now += 0.3
    rt._watch()
    assert list(rt.dead) == [2]


def test_should_form_when_starting_or_broken_and_after_a_failure_only_once_every_rank_is_back(group):
    rt, store, clock = group.rt, group.store, group.clock
    for state, want in (("starting", True), ("broken", True), ("forming", False), ("ready", False)):
        rt.state = state
        assert rt._should_form() is want, state
    rt._fail("node 1 cannot run its ranks")
    clock.now += 4.9
    assert rt._should_form() is False  # not in a loop
    clock.now += 0.2
    assert rt._should_form() is True
    exit_remote(store, 3, "killed by SIGKILL")
    rt._watch()
    assert rt._should_form() is False  # rank 3 is not back
    announce(store, 3, 2103)
    assert rt._should_form() is True
    group.workers.failed = {1: "rank 1 died 4 times"}
    rt.state = "failed"
    assert rt._should_form() is False


class Stop:
    """The monitor's stop event: set after `rounds` waits; each wait lets its seconds pass on the clock."""

    def __init__(self, clock, rounds):
        self.clock, self.rounds, self.waits = clock, rounds, []

    def is_set(self):
        return len(self.waits) >= self.rounds

    def set(self):
        self.rounds = 0

    def wait(self, seconds):
        self.waits.append(seconds)
        self.clock.now += seconds
        return self.is_set()


def test_the_monitor_starts_the_workers_forms_the_group_and_writes_the_ranks(group, tmp_path):
    rt = group.rt
    rt.spec.runtime_root = str(tmp_path)
    rt._stop = Stop(group.clock, 3)
    rt._monitor()
    assert group.workers.started == 1 and rt.state == "ready" and rt.generation == 1
    assert len(rt._stop.waits) == 3 and all(w > 0 for w in rt._stop.waits)  # it waits between rounds
    ranks = json.loads((tmp_path / wire.RANKS_FILE).read_text())
    assert ranks["state"] == "ready" and [r["joined"] for r in ranks["ranks"]] == [True] * 4
    free = []
    t = threading.Thread(target=lambda: free.append(rt._lock.acquire(blocking=False)))
    t.start()
    t.join(30)
    assert free == [True], "the monitor released the run lock after forming"


def test_the_monitor_leaves_forming_to_whoever_holds_the_run_lock(group):
    rt = group.rt

    class Held:
        def acquire(self, blocking=True):
            return False

        def release(self):
            raise AssertionError("released a lock it does not hold")
    rt._lock = Held()
    rt._stop = Stop(group.clock, 2)
    rt._monitor()
    assert rt.state == "starting" and rt.generation == 0


def test_the_monitor_outlives_a_failed_forming_and_a_bad_round(group, caplog):
    rt, store = group.rt, group.store
    store.data["nodefail/1"] = {"pid": 77, "message": "no device"}
    del store.data["worker/2"]
    answers = iter([RuntimeError("a bad read")])

    def alive():
        for e in answers:
            raise e
        return True
    rt._store.alive = alive
    rt._stop = Stop(group.clock, 3)
    with caplog.at_level(logging.ERROR):
        rt._monitor()
    assert rt.state == "failed" and "node 1 cannot run its ranks: no device" in rt.error
    text = caplog.text
    assert "MultiNPU: monitor: a bad read" in text and "node 1 cannot run its ranks" in text
    assert len(rt._stop.waits) == 3


def test_the_ranks_file_is_written_when_the_ranks_change_and_every_10_s_otherwise(group, tmp_path):
    rt = formed(group)
    rt.spec.runtime_root = str(tmp_path)
    writes = []
    write = rt._write_ranks
    rt._write_ranks = lambda: (writes.append(group.clock.now), write())
    rt._stop = Stop(group.clock, 120)  # 12 s of rounds, nothing changing
    rt._monitor()
    assert len(writes) == 2 and 10.0 < writes[1] - writes[0] < 10.5, writes
    rt._ranks_changed = True
    rt._stop = Stop(group.clock, 1)
    rt._monitor()
    assert len(writes) == 3


# ---- who is announced, and what status shows -------------------------------------------------------------------

def test_announced_is_each_ranks_live_fresh_worker(group):
    rt, store = group.rt, group.store
    assert rt._announced() == {0: 1000, 1: 1001, 2: 2002, 3: 2003}
    group.workers.live.pop(0)
    del store.data["worker/2"]  # a key gone from the store is no death: the last announcement stands
    exit_remote(store, 3, "killed by SIGKILL")
    rt._remote_exits[3] = store.data["exit/3"]
    assert rt._announced() == {0: None, 1: 1001, 2: 2002, 3: None}
    announce(store, 3, 2103)
    assert rt._announced()[3] == 2103


def test_a_retired_worker_is_never_announced_but_a_new_process_with_its_pid_is(group):
    rt, store = group.rt, group.store
    rt._retired.update({rt._identity(1, 1001), rt._identity(3, 2003)})
    assert rt._announced() == {0: 1000, 1: None, 2: 2002, 3: None}
    # the OS gave the same pids to new processes: another start time, another worker
    group.workers.spawn(1, 1001)
    group.workers.info[1]["create_time"] = 5000.0
    store.data["worker/3"]["create_time"] = 6000.0
    assert rt._announced() == {0: 1000, 1: 1001, 2: 2002, 3: 2003}


def test_where_a_rank_is_names_its_host(group):
    rt = group.rt
    assert rt._where(1) == "rank 1 (cpu, node 0), host driver-host"
    assert rt._where(2) == "rank 2 (cpu, node 1), host node1-host"
    del group.store.data["worker/3"]
    assert rt._where(3) == "rank 3 (cpu, node 1)"


def test_ranks_show_each_workers_process_whether_it_joined_and_how_it_last_ended(group):
    rt, store = formed(group), group.store
    ranks = rt.ranks()
    assert ranks[1] == {**group.workers.info[1], "joined": True}
    assert ranks[3] == {"rank": 3, "node": 1, "local_rank": 1, "device": "cpu", "host": "node1-host", "pid": 2003,
                        "create_time": 2003.0, "cmdline": ["python", "-m", "worker"], "alive": True,
                        "last_exit": None, "joined": True}
    group.peers.agent = False
    group.clock.now += 1
    exit_remote(store, 3, "killed by SIGKILL")
    rt._watch()  # the group is replaced: nobody is joined
    ranks = rt.ranks()
    assert [r["joined"] for r in ranks] == [False] * 4
    assert (ranks[3]["alive"], ranks[3]["last_exit"], ranks[2]["alive"]) == (False, "killed by SIGKILL", True)
    announce(store, 3, 2103)
    assert (rt.ranks()[3]["alive"], rt.ranks()[3]["pid"], rt.ranks()[3]["last_exit"]) == (True, 2103,
                                                                                        "killed by SIGKILL")


def test_a_rank_is_joined_only_while_the_group_is_ready_with_that_process(group):
    rt, store = group.rt, group.store
    del store.data["worker/2"]
    ranks = rt.ranks()
    assert [r["joined"] for r in ranks] == [False] * 4 and ranks[2]["alive"] is False and "pid" not in ranks[2]
    rt.state, rt.members = "ready", {0: 1000, 1: 999, 3: 2003}
    assert [r["joined"] for r in rt.ranks()] == [True, False, False, True]
    rt.state = "forming"
    assert [r["joined"] for r in rt.ranks()] == [False] * 4


def test_before_the_store_is_connected_other_hosts_ranks_show_as_not_alive(group):
    rt = group.rt
    rt.ctl = None
    del rt._mon
    ranks = rt.ranks()
    assert [r["alive"] for r in ranks] == [True, True, False, False] and ranks[2]["device"] == "cpu"


def test_the_ranks_file_holds_the_state_and_every_rank(group, tmp_path):
    rt = formed(group)
    rt._write_ranks()
    assert not (tmp_path / wire.RANKS_FILE).exists() and rt._ranks_changed is False  # no runtime root: none
    rt.spec.runtime_root = str(tmp_path)
    rt._ranks_changed = True
    rt._write_ranks()
    data = json.loads((tmp_path / wire.RANKS_FILE).read_text())
    assert (data["role"], data["state"], data["generation"], data["error"]) == ("driver", "ready", 1, None)
    assert [r["pid"] for r in data["ranks"]] == [1000, 1001, 2002, 2003] and rt._ranks_changed is False
    group.workers.info = {}  # unreadable now (a launcher between two states): skipped, not raised
    rt._write_ranks()
    assert json.loads((tmp_path / wire.RANKS_FILE).read_text()) == data


# ---- aborting and ending a generation --------------------------------------------------------------------------

def test_an_abort_is_posted_once_per_generation(group, caplog):
    rt, store = formed(group), group.store
    with caplog.at_level(logging.WARNING):
        rt._abort_generation("rank 1 (cpu, node 0) killed by SIGKILL")
        rt.state = "forming"
        rt._abort_generation("rank 2 (cpu, node 1) killed by SIGKILL")
    assert caplog.text.count("MultiNPU: generation 1 aborted (rank 1 (cpu, node 0) killed by SIGKILL); every rank is "
                             "replaced by a fresh process") == 1 and "rank 2" not in caplog.text
    assert rt.state == "broken"
    assert puts(store, "abort/") == [("abort/1", {"why": "rank 1 (cpu, node 0) killed by SIGKILL"})]
    assert len(group.workers.recycles) == 1 and len(puts(store, "kill/")) == 2


def test_an_abort_that_cannot_reach_the_store_still_replaces_this_hosts_workers(group, caplog):
    rt, store = formed(group), group.store
    store.fail = True
    with caplog.at_level(logging.WARNING):
        rt._abort_generation("the group's store ended")
    assert "could not post the abort of generation 1: the store is gone" in caplog.text
    assert group.workers.recycles == ["generation 1 aborted: the group's store ended"]
    assert rt.state == "broken" and rt.members == {} and group.heard == [("broken", "the group's store ended")]


def test_ending_the_generation_tells_every_member_even_past_a_broken_connection(group):
    rt = formed(group)
    rt.next_cmd = 9
    rt._cmd_links[0] = (Link(fail=True), None)
    rt._end_generation()
    sent = [link.sent for r, (link, _) in sorted(rt._cmd_links.items())]
    assert sent == [[]] + [[{"name": wire.END, "g": 1, "n": 9}]] * 3
