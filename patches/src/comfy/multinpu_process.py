"""The driver of the multi-device process group: the ComfyUI server, which is never a rank.

With `h3kit start --transport process` (the default on NPU and CUDA) every rank of the parallel components
(DiT, text encoder, video VAE decode) is a worker process, rank 0 included (on device 0, beside the server);
the ranks of one service form one torch.distributed group: hccl on Ascend, nccl on CUDA, gloo on CPU. The
server drives them (GroupRuntime): it starts the group's control store in a process of its own on the port
h3kit recorded (a flood of keys grows that process, never the server), opens the command channel (a Unix
socket in the runtime root's 0700 channel folder; with several hosts also a TCP listener on the master port + 2,
where the other hosts' workers and agents connect), starts one worker per device of its host, forms numbered
generations of the group and hands each command to every rank (run()). It never enters a collective: on
HCCL and NCCL a collective whose peer failed, was destroyed or died releases nobody before the group timeout
(H3_FACTS 9), and the server's queue must not wait inside one. The members' side is comfy.multinpu_wire (settings,
wire format), comfy.multinpu_channel (the store's process, the channel), comfy.multinpu_launch (launchers,
agents) and comfy.multinpu_group (the worker loop).

A command: the driver writes its inputs' tensors into one file in /dev/shm (memory; only this host's worker
rank 0 reads it) and sends a signed header to every rank on that rank's own command connection (no command
passes through the store, where any client could delete it); worker rank 0 broadcasts the tensors to the
others, every rank runs the command's program, and rank 0 writes the program's result into another /dev/shm
file, announced by a signed result header on its connection.
The driver waits for it with a bound, watching every rank meanwhile: error reports, deaths (local workers by
their process, remote ones by their agent's reports), heartbeats.

A failure costs one prompt. Any rank's exception, out-of-memory error, death or hang ends the command in
the driver as soon as it is seen (a hang: HEARTBEAT_STALE seconds without a heartbeat), with the first error
named (rank, host, pid, exception type and message; an out-of-memory error as torch.OutOfMemoryError, so
ComfyUI's unload-and-retry path runs). The whole generation is then aborted and every worker replaced by a
fresh process: a worker that saw an error exits by itself, the driver SIGKILLs this host's workers (one that
is stopped or blocked in a collective too) and asks the other hosts' agents to do the same. The next command
forms a new generation; nothing that saw the error is reused (on Ascend a process whose stream held a failed
task usually needs a restart). gloo's early release of peers is not relied on: H3KIT_EMULATE_NO_RELEASE=1
gives the CPU tests HCCL/NCCL's semantics.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid

import torch
import torch.distributed

import comfy.multinpu
import comfy.multinpu_channel as channel
import comfy.multinpu_launch as launch
import comfy.multinpu_runtime_base as base
import comfy.multinpu_wire as wire

ERROR_WAIT = 3.0                     # after a failure, for the other ranks' reports and deaths to arrive
DEATH_WAIT = 0.5                     # ... once a dead rank is known
WAITING_LOG = 10.0                   # while the group forms or loads, what it waits for is logged this often
REFUSED_ARGS = ("--cuda-device", "--default-device")  # in the server's arguments, with the process transport


class RemoteConfig:
    """Something every worker must hold before a command uses it: a model loaded from the same files
    with the same weight patches (comfy.multinpu_models builds these).

    program: the worker-side builder (registered with @program); payload: what it needs (tensors go over
    the group); digest: rank 0's own {component: hex} digest, which every worker's must equal.
    """

    def __init__(self, program_name: str, payload, digest: dict, what: str):
        self.id = uuid.uuid4().hex
        self.program = program_name
        self.payload = payload
        self.digest = dict(digest)
        self.what = what
        self.installed = {}  # rank -> pid of the worker that holds it, checked


class GroupRuntime(base.Runtime):
    """The driver of the process group: owns the store's process, the command channel, this host's workers, the
    generations and every command.

    One command runs at a time (`run`); the monitor thread forms the group, watches every rank, replaces
    the whole group after a failure and re-forms it while the server is idle, so `h3kit status` shows every
    rank joined without waiting for the next prompt.
    """

    def __init__(self, spec: wire.GroupSpec, key: str, device=None):
        if spec.node_rank != 0:
            raise ValueError("MultiNPU: the driver runs on node 0; other nodes run an agent")
        super().__init__(spec)  # run(), the frees and drops: comfy.multinpu_runtime_base
        self.key = key
        self.signer = wire.Signer(key.encode())
        self.device = torch.device(device if device is not None else spec.device_name(0))
        self.state = "starting"
        self.error = None
        self.generation = 0
        self.members = {}              # rank -> pid in the current generation (empty while none is formed)
        self.next_cmd = 1
        self.port = None
        self.inflight = None           # (program, command number) while a command runs
        self.dead = {}                 # rank -> "pid X: reason" noticed in the current generation
        self.last_failure = None       # {"message", "seconds_to_error"} of the last failed command
        self._stop = threading.Event()
        self._ranks_changed = True
        self._hb = {}                  # rank -> (pid, heartbeat counter, monotonic time it last changed)
        self._remote_seen = {}         # rank -> the newest announcement of another host's worker (_remote_worker)
        self._agent_hb = {}            # node -> ({agent pid: newest beat}, monotonic time of the last new one)
        self._agent_beats = {}         # (node, agent pid) -> the newest heartbeat seq on its channel connection
        self._watch_lock = threading.RLock()
        self._last_remote = 0.0
        self._remote_exits = {}        # rank -> last exit report read
        self._retired = set()          # (pid, start time) of aborted generations' workers: never members again
        self._aborted = set()
        self._aborted_members = {}     # rank -> pid of the generation aborted last, until the next one is ready
        self._failed_at = 0.0
        self._token = uuid.uuid4().hex[:12]
        self._local = None
        self._thread = None
        self._store = None             # channel.StoreHost: the store's own process
        self._store_ended = {}         # generation -> how the store ended while it was current
        self._channel = None           # channel.ChannelServer: the command channel (this host's workers; beats of all)
        self._own_channel_dir = None   # a temporary folder for it when there is no runtime root
        self._links = {}               # (generation, rank, pid) -> (Link, queue of its messages): command connections
        self._cmd_links = {}           # rank -> (Link, queue) of the current generation (rank 0's brings the results)
        self._beats = {}               # (rank, pid) -> the newest heartbeat seq on its channel connection (every host)
        self.ctl = None

    # -- start and stop --

    def start(self):
        spec = self.spec
        wire.check_timeouts(spec)
        if spec.device_type == "cpu" and launch.is_loopback(spec.master_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", launch.loopback_interface())
        wire.set_hccl_timeout(spec)
        # the command channel first: a folder other users could enter is refused before anything starts
        self._channel = channel.ChannelServer(self._channel_folder(), self.signer, self._on_link)
        spec.channel = self._channel.path
        self._store = channel.StoreHost(spec.master_addr, spec.master_port, spec.timeout)
        self.port = spec.master_port = self._store.port  # the workers connect to the port the store got (0: any)
        if spec.nnodes > 1:
            # the other hosts' workers and agents beat on the channel too, over TCP (an authenticated connection
            # nobody without the key can make or take away; a store client can delete any key)
            try:
                self._channel.listen_tcp(spec.master_addr, self.port + wire.CHANNEL_PORT_OFFSET)
            except wire.GroupError:
                self._store.stop()
                self._channel.close()
                raise
        self._store.start()
        self._connect_store()
        if spec.launcher == "torchrun":
            self._local = launch.TorchrunWorkers(spec, self.key, range(spec.local_size), self._mon)
        else:
            self._local = launch.LocalWorkers(spec, self.key, range(spec.local_size))
        self._thread = threading.Thread(target=self._monitor, name="multinpu-monitor", daemon=True)
        self._thread.start()
        logging.info(f"MultiNPU: process group of {self.world_size} worker ranks ({spec.backend}) driven from "
                     f"{spec.master_addr}:{self.port}, {spec.nnodes} node(s) of {spec.local_size} device(s)")
        return self

    def _channel_folder(self) -> str:
        """<runtime root>/channel (0700), or a temporary private folder when the driver has no runtime root."""
        if self.spec.runtime_root:
            os.makedirs(self.spec.runtime_root, exist_ok=True)
            return os.path.join(self.spec.runtime_root, channel.CHANNEL_DIR)
        self._own_channel_dir = tempfile.mkdtemp(prefix="h3kit-channel-")  # mode 0700
        return os.path.join(self._own_channel_dir, channel.CHANNEL_DIR)

    def _connect_store(self):
        """The driver's connections to the group's store (it is only a client of it), once its process answers."""
        spec = self.spec
        deadline = time.monotonic() + channel.STORE_START_TIMEOUT
        self.ctl = channel.Control(channel.connect_store(spec.master_addr, self.port, spec.timeout, deadline), self.signer)
        self.ctl.put("layout", spec.layout())
        self._mon = channel.Control(channel.connect_store(spec.master_addr, self.port, spec.timeout, deadline), self.signer)
        if self._local is not None and hasattr(self._local, "ctl"):
            self._local.ctl = self._mon  # TorchrunWorkers reads the workers' announcements through it

    def _restart_store(self):
        """The store's process died (killed, out of memory after a flood of keys): start it again on the same
        socket and replace the whole group (every worker lost its connection to the store)."""
        code = self._store.proc.returncode
        why = "past its memory limit: a flood of keys" if code == channel.STORE_EXIT else launch._exit_reason(code)
        logging.error(f"MultiNPU: the group's store (pid {self._store.proc.pid}) ended ({why}); starting it again "
                      "and replacing the group")
        # a command in flight fails naming the store, not the ranks that left because it was gone
        self._store_ended[self.generation] = f"the group's store (pid {self._store.proc.pid}) ended ({why})"
        self._store.start()
        self._connect_store()
        self._abort_generation("the group's store ended")

    def shutdown(self, grace: float = 5.0):
        self._stop.set()
        with self._lock:
            self._end_generation()
            if self._local is not None:
                self._local.stop(grace)
        if self._thread is not None:
            self._thread.join(5.0)
        self._write_ranks()
        if self._channel is not None:
            self._channel.close()
        if self._store is not None:
            self._store.stop()
        if self._own_channel_dir:
            shutil.rmtree(self._own_channel_dir, ignore_errors=True)

    # -- the command channel --

    def _on_link(self, link, hello: dict):
        """An authenticated connection (on its own thread): a worker's or an agent's heartbeats (from any host), or
        a worker's command connection (this host's ranks on the Unix socket, the other hosts' over TCP; rank 0's
        brings the results back). A beat connection that ends is no death by itself: the silence that follows is
        (_check_heartbeat, _agent_gone)."""
        pid = hello["pid"]
        role = hello.get("role")
        if role in ("beat", "agent") and isinstance(hello.get("rank" if role == "beat" else "node"), int):
            beats, who = (self._beats, (hello["rank"], pid)) if role == "beat" else (self._agent_beats, (hello["node"], pid))
            try:
                while True:
                    beat = link.recv(channel.HELLO_LIMIT)
                    if isinstance(beat, dict) and isinstance(beat.get("seq"), int) and beat["seq"] > beats.get(who, 0):
                        beats[who] = beat["seq"]
            finally:
                beats.pop(who, None)
        elif (role == "command" and isinstance(hello.get("rank"), int) and 0 <= hello["rank"] < self.world_size
              and (link.remote is None) == (self.spec.node_of(hello["rank"]) == 0)):
            messages = queue.Queue()
            self._links[(hello.get("generation"), hello["rank"], pid)] = (link, messages)
            try:
                while True:
                    messages.put(link.recv())
            finally:
                messages.put(None)  # the connection ended
        else:
            logging.warning(f"MultiNPU: command channel: pid {pid} says it is {hello!r:.200}; closing it")

    # -- the monitor --

    def _monitor(self):
        # the local workers are started by this thread (PR_SET_PDEATHSIG follows the thread that forks)
        self._local.start()
        last_write = 0.0
        while not self._stop.is_set():
            try:
                self._watch()
                if self._should_form() and self._lock.acquire(blocking=False):
                    try:
                        if self._should_form():
                            self._form()
                    except wire.GroupError as e:
                        logging.error(str(e))
                    finally:
                        self._lock.release()
                now = time.monotonic()
                if self._ranks_changed or now - last_write > 10.0:
                    self._write_ranks()
                    last_write = now
            except Exception as e:  # the monitor must outlive any single bad read
                if self._stop.is_set():
                    break
                logging.exception(f"MultiNPU: monitor: {e}")
            self._stop.wait(0.1)

    def _should_form(self) -> bool:
        if self.state in ("starting", "broken"):
            return True
        # a group that could not form tries again once every rank is back (a host restarted), not in a loop
        return (self.state == "failed" and not self._local.failed and time.monotonic() - self._failed_at > 5.0
                and all(pid is not None for pid in self._announced().values()))

    def _watch(self):
        """Notice dead and hung ranks: local processes at once, agents' exit reports and heartbeats twice a
        second."""
        with self._watch_lock:
            if not self._store.alive() and not self._stop.is_set():
                self._restart_store()
            for rank, pid, reason in self._local.poll():
                self._note_death(rank, pid, reason)
            if self._local.failed and self.state != "failed":
                self._fail("; ".join(self._local.failed.values()))
            now = time.monotonic()
            if now - self._last_remote < 0.5:
                return
            self._last_remote = now
            for rank in range(self.world_size):
                self._check_heartbeat(rank, now)
                if self.spec.node_of(rank) != 0:
                    report = self._mon.peek(f"exit/{rank}")
                    if isinstance(report, dict) and report != self._remote_exits.get(rank):
                        self._remote_exits[rank] = report
                        self._note_death(rank, report.get("pid"), str(report.get("reason")))
            self._check_hosts()

    def _check_heartbeat(self, rank: int, now: float):
        pid = self.members.get(rank)
        if pid is None:
            return  # not joined yet: a starting worker may take a while to import its modules
        last = self._hb.get(rank)
        if last is None or last[0] != pid:
            self._hb[rank] = (pid, 0, now)
            return
        count = self._beat(rank, pid, last[1])
        if count > last[1]:  # only a newer beat counts: an old signed one copied back is no sign of life
            self._hb[rank] = (pid, count, now)
            return
        if now - last[2] <= wire.HEARTBEAT_STALE:
            return
        why = f"no heartbeat for {now - last[2]:.0f} s (hung)"
        self._hb[rank] = (pid, count, now)
        if self.spec.node_of(rank) == 0:
            if self._local.pid(rank) == pid:  # never its replacement, which beats on the same key
                self._local.kill(rank, why)
        else:
            self._mon.put(f"kill/{rank}", {"pid": pid, "why": why})
        self._note_death(rank, pid, why)

    def _beat(self, rank: int, pid: int, known: int) -> int:
        """The newest heartbeat seq of rank's worker `pid` (known: the newest seen before): every worker beats on
        its own authenticated connection to the command channel (this host's on the Unix socket, another host's
        over TCP), so only the worker itself can make, or stop, its beats."""
        return max(known, self._beats.get((rank, pid), known))

    def _check_hosts(self):
        """Another host's members that are gone although no exit report came (its agent or torchrun was killed):
        a worker its launcher's end took down noted its SIGTERM itself (launch.watch_termination); a host whose
        agent has been silent for HOST_STALE is lost (powered off, cut off), its members dead."""
        for rank, pid in list(self.members.items()):
            if self.spec.node_of(rank) != 0:
                why = launch.termination_note(self._mon, rank, pid)
                if why:
                    self._note_death(rank, pid, why)
        for node in range(1, self.spec.nnodes):
            ranks = {r: pid for r, pid in self.members.items() if self.spec.node_of(r) == node}
            silent = self._agent_gone(node) if ranks else None
            if silent is not None:
                for r, pid in ranks.items():
                    self._note_death(r, pid, f"host lost: its agent has not been heard from for {silent:.0f} s")

    def _note_death(self, rank: int, pid, reason: str):
        self._ranks_changed = True
        if pid is not None and self.members.get(rank) != pid and self._aborted_members.get(rank) == pid:
            # a member of the generation just aborted (an idle abort, or one a load or command waits out), not one
            # h3kit killed to replace it: its death may be the root cause the abort's first death was an effect of
            # (torchrun stops a dead worker's siblings at once), so it is kept for naming the failure
            if not launch.recycled(reason):
                self.dead.setdefault(rank, f"pid {pid}: {reason}")
            return
        if pid is None or self.members.get(rank) != pid:
            return  # not a member of the current generation (a replacement, or one already given up on)
        self.dead.setdefault(rank, f"pid {pid}: {reason}")
        if self.inflight is None and self.state == "ready":
            # idle: replace the whole group now, so the next prompt finds it formed
            logging.error(f"MultiNPU: {self.spec.describe_rank(rank)} (pid {pid}) {reason} while idle")
            self._abort_generation(f"{self.spec.describe_rank(rank)} {reason}")

    def _where(self, rank: int) -> str:
        """A rank and its host, for messages."""
        if self.spec.node_of(rank) == 0:
            host = socket.gethostname()
        else:
            info = self._remote_worker(rank)
            host = info.get("host") if info else None
        return f"{self.spec.describe_rank(rank)}" + (f", host {host}" if host else "")

    def _fail(self, message: str):
        self.state = "failed"
        self.error = message
        self._failed_at = time.monotonic()
        self._ranks_changed = True
        self._put_state()

    def _put_state(self):
        try:
            self._mon.put("state", {"state": self.state, "generation": self.generation, "error": self.error,
                                   "members": dict(self.members)})
        except Exception:
            pass

    # -- generations --

    def _announced(self) -> dict:
        """rank -> pid of the live, fresh worker announced for each rank (None where none is)."""
        out = {}
        for rank in range(self.world_size):
            if self.spec.node_of(rank) == 0:
                pid = self._local.pid(rank)
            else:
                info = self._remote_worker(rank)
                exited = self._remote_exits.get(rank)
                pid = info.get("pid") if info else None
                if exited is not None and exited.get("pid") == pid:
                    pid = None
            out[rank] = None if pid is not None and self._identity(rank, pid) in self._retired else pid
        return out

    def _identity(self, rank: int, pid: int) -> tuple:
        """(pid, start time) of a rank's worker: what is retired after an abort (the OS may reuse a pid)."""
        if self.spec.node_of(rank) == 0:
            info = self._local.info.get(rank) or {}
        else:
            info = self._remote_worker(rank) or {}
        return (pid, info.get("create_time") if info.get("pid") == pid else None)

    def _remote_worker(self, rank: int):
        """The newest signed announcement ({"pid", "host", ...}) of another host's worker for `rank`, else None.
        One gone from the store is no death (a store client can delete any key): the one seen last stands until
        a newer one replaces it, and an exit report or the silence of its beats or of its host ends it."""
        info = self._mon.peek(f"worker/{rank}")
        if isinstance(info, dict):
            self._remote_seen[rank] = info
        return self._remote_seen.get(rank)

    def _missing(self, ranks) -> str:
        """Who is missing, by node where a whole node is."""
        parts, by_node = [], collections.defaultdict(list)
        for r in sorted(ranks):
            by_node[self.spec.node_of(r)].append(r)
        for node, rs in sorted(by_node.items()):
            if node != 0 and not self._mon.has(f"node/{node}"):
                parts.append(f"node {node} (ranks {', '.join(map(str, rs))}) never arrived: no agent connected "
                             f"to {self.spec.master_addr}:{self.port} (start it there with h3kit start "
                             f"--nnodes {self.spec.nnodes} --node-rank {node} ...)")
            else:
                parts.append(", ".join(self.spec.describe_rank(r) for r in rs) + " did not join")
        return "; ".join(parts)

    def _end_generation(self):
        """Shutdown: tell the workers of the current generation it is over (they leave)."""
        if self.members:
            for link, _ in self._cmd_links.values():
                try:
                    link.send({"name": wire.END, "g": self.generation, "n": self.next_cmd})
                except Exception:
                    pass

    def _abort_generation(self, why: str):
        """Replace the whole group: the current generation's workers leave (remote ones when their heartbeat
        thread sees the abort, or are killed by their agent), this host's are SIGKILLed; all are replaced by
        fresh processes, and none of these pids is a member again."""
        g = self.generation
        self.state = "broken"
        self._ranks_changed = True
        if g in self._aborted:
            return
        self._aborted.add(g)
        members, self.members = dict(self.members), {}
        self._aborted_members = dict(members)
        links, self._cmd_links = self._cmd_links, {}
        for link, _ in links.values():
            link.close()  # a worker waiting for its next command leaves
        self._retired.update(self._identity(r, pid) for r, pid in members.items() if pid is not None)
        try:
            self.ctl.put(f"abort/{g}", {"why": why})
            for rank, pid in members.items():
                if self.spec.node_of(rank) != 0:
                    self._mon.put(f"kill/{rank}", {"pid": pid, "why": f"generation {g} aborted: {why}", "abort": True})
        except Exception as e:
            logging.warning(f"MultiNPU: could not post the abort of generation {g}: {e}")
        # this host's workers that had not joined yet are replaced too: fresh means after the failure
        self._retired.update(self._identity(r, self._local.pid(r)) for r in self._local.ranks
                             if self._local.pid(r) is not None)
        self._local.recycle(f"generation {g} aborted: {why}")
        self._put_state()
        logging.warning(f"MultiNPU: generation {g} aborted ({why}); every rank is replaced by a fresh process")

    def _form(self):
        """Form generation g+1 with every rank; bounded by join_timeout (wire.GroupError naming who is missing)."""
        self.state = "forming"
        self._ranks_changed = True
        self._put_state()
        deadline = time.monotonic() + self.spec.join_timeout
        while True:
            members = self._wait_members(deadline)
            g = self.generation + 1
            self.generation = g
            self.ctl.put(f"gen/{g}", {"members": members})
            self.ctl.put("gen", g)
            self._put_state()
            if not self._wait_keys("joined", g, members, deadline, "started but did not join"):
                continue  # a member died before go: the others wait for the next generation
            self.ctl.put(f"go/{g}", True)
            if (self._wait_keys("up", g, members, deadline, "joined but did not form the group")
                    and self._wait_link(g, members, deadline)):
                break
            # a member failed inside init_process_group or the warm-up: the others may be blocked there
            self.members = members
            self._abort_generation(f"generation {g} did not form")
            self.state = "forming"
        self.members = members
        self.next_cmd = 1
        self.dead = {}
        self._aborted_members = {}
        self.state = "ready"
        self.error = None
        self._ranks_changed = True
        self._put_state()
        for cfg in self.configs:
            cfg.installed = {r: pid for r, pid in cfg.installed.items() if self.members.get(r) == pid}
        logging.info(f"MultiNPU: process group generation {g} ready: {self.world_size} ranks "
                     f"(pids {', '.join(str(members[r]) for r in sorted(members))})")

    def _launcher_state(self) -> str:
        """Who runs on each host now, for the waiting log: the ranks announced, and torchrun's pid where it runs."""
        try:
            announced = self._announced()
            proc = getattr(self._local, "proc", None)
            return (f"announced {announced}" + (f", node 0's torchrun pid {proc.pid} "
                                               f"{'running' if proc.poll() is None else f'ended {proc.returncode}'}"
                                               if proc is not None else ""))
        except Exception as e:
            return f"announced: unreadable ({e})"

    def _agent_gone(self, node: int):
        """Seconds since node's agent last beat, when it beat once and has been silent for HOST_STALE
        (the host or its agent is lost); else None."""
        now = time.monotonic()
        seen, since = self._agent_hb.setdefault(node, ({}, now))  # (newest seq of each agent pid, last news)
        news = False
        for (n, pid), seq in list(self._agent_beats.items()):  # the agents' channel connections (_on_link)
            if n == node and seq > seen.get(pid, 0):
                seen[pid], news = seq, True
        if news:
            self._agent_hb[node] = (seen, now)
            return None
        silent = now - since
        return silent if any(seen.values()) and silent > wire.HOST_STALE else None

    def _wait_members(self, deadline: float) -> dict:
        def attempt():
            if self._local.failed:
                raise wire.GroupError(f"MultiNPU: the process group failed: {self.error}")
            announced = self._announced()
            if all(pid is not None for pid in announced.values()):
                return announced
            for node in sorted({self.spec.node_of(r) for r, pid in announced.items() if pid is None} - {0}):
                failed = self._mon.peek(f"nodefail/{node}")
                if isinstance(failed, dict) and failed.get("message"):
                    message = (f"MultiNPU: node {node} cannot run its ranks: {failed['message']} (its agent, pid "
                               f"{failed.get('pid')}, keeps trying; the group re-forms by itself)")
                    self._fail(message)
                    raise wire.GroupError(message)
                silent = self._agent_gone(node)
                if silent is not None:
                    # fail now rather than hold the queue for the join timeout; the monitor forms the group by
                    # itself once the host's ranks are back
                    ranks = [r for r in range(self.world_size) if self.spec.node_of(r) == node]
                    message = (f"MultiNPU: node {node} (ranks {', '.join(map(str, ranks))}) is lost: its agent has "
                               f"not been heard from for {silent:.0f} s. Fix: start it there again (h3kit start "
                               f"--nnodes {self.spec.nnodes} --node-rank {node} ...); the group re-forms by itself")
                    self._fail(message)
                    raise wire.GroupError(message)
            return None
        return self._poll(deadline, attempt,
                          lambda: self._missing([r for r, pid in self._announced().items() if pid is None]))

    def _wait_keys(self, what: str, g: int, members: dict, deadline: float, late: str) -> bool:
        """True once every member wrote what/{g}/{rank} with its pid; False when one died or reported an
        error meanwhile."""
        def waiting():
            return [r for r, pid in members.items() if self.ctl.peek(f"{what}/{g}/{r}") != pid]

        def attempt():
            if any(self._announced().get(r) != pid for r, pid in members.items()):
                return False
            for r in members:
                rep = self.ctl.peek(f"joinerr/{g}/{r}")
                if isinstance(rep, dict):
                    logging.error(f"MultiNPU: {self.spec.describe_rank(r)} could not join generation {g}: "
                                  f"{rep.get('type')}: {rep.get('message')}")
                    return False
            return True if not waiting() else None
        return self._poll(deadline, attempt,
                          lambda: f"{', '.join(self.spec.describe_rank(r) for r in waiting())} {late}")

    def _wait_link(self, g: int, members: dict, deadline: float) -> bool:
        """True once every member of generation g connected to the command channel (no command is sent before);
        False when a member died."""
        for key in [k for k in self._links if k[0] != g]:  # connections of generations given up on
            self._links.pop(key)[0].close()

        def missing():
            return [r for r, pid in members.items() if (g, r, pid) not in self._links]

        def attempt():
            if any(self._announced().get(r) != pid for r, pid in members.items()):
                return False
            if missing():
                return None
            self._cmd_links = {r: self._links.pop((g, r, pid)) for r, pid in members.items()}
            return True

        def late():
            where = [f"{self.spec.describe_rank(r)} did not connect to the command channel "
                     + (self._channel.path if self.spec.node_of(r) == 0
                        else f"{self.spec.master_addr}:{self.port + wire.CHANNEL_PORT_OFFSET}") for r in missing()]
            return "; ".join(where)
        return self._poll(deadline, attempt, late)

    def _poll(self, deadline: float, attempt, late):
        """attempt() after each look at the ranks until it returns something other than None; past the deadline
        the group fails with late()'s words."""
        said = time.monotonic()
        while True:
            self._watch()
            result = attempt()
            if result is not None:
                return result
            if time.monotonic() - said >= WAITING_LOG:
                said = time.monotonic()
                logging.warning(f"MultiNPU: forming generation {self.generation + 1} (state {self.state}), "
                                f"{deadline - said:.0f} s left: {late()}; {self._launcher_state()}")
            if time.monotonic() >= deadline:
                message = f"MultiNPU: the process group did not form within {self.spec.join_timeout:g} s: {late()}"
                self._fail(message)
                raise wire.GroupError(message)
            time.sleep(wire.POLL)

    # -- commands --

    def _ensure_ready(self, what: str):
        self._watch()
        if self.state == "failed":
            raise wire.GroupError(f"MultiNPU: the process group failed: {self.error}")
        if self.state != "ready":
            logging.info(f"MultiNPU: forming the process group before {what}")
            self._form()

    def _execute(self, name, payload):
        g, n = self.generation, self.next_cmd
        self.next_cmd += 1
        self.commands += 1
        data, tensors = wire.pack(payload)
        base = os.path.join(wire.shm_dir(), f"h3kit-{os.getpid()}-{self._token}-{g}-{n}")
        inp, out = f"{base}-in", f"{base}-out"
        self.inflight = (name, n)
        try:
            metas, nbytes = wire.shm_write(inp, tensors)
            # the workers run in the server's grad and inference modes (ComfyUI executes prompts in inference mode)
            header = {"name": name, "g": g, "n": n, "data": data, "metas": metas, "nbytes": nbytes, "shm": inp,
                      "out": out, "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()}
            for r, (link, _) in sorted(self._cmd_links.items()):  # to every rank on its own connection
                try:
                    link.send(header)
                except OSError as e:
                    logging.warning(f"MultiNPU: could not send {name} to worker rank {r}: {e}")  # _await names why
            rep = self._await(name, g, n)
            buf = wire.shm_read(out, rep["nbytes"])
            return wire.unpack(rep["data"], wire.unflatten(buf, rep["metas"]))
        finally:
            self.inflight = None
            wire.shm_remove(inp)
            wire.shm_remove(out)

    def _await(self, name: str, g: int, n: int) -> dict:
        """Worker rank 0's result header of command n, from its channel connection; the root cause of a failure,
        raised, otherwise. Waits at most 0.1 s at a time and watches every rank in between, and every rank's
        command connection: one that ends is a death about to be seen, or named here."""
        links = dict(self._cmd_links)  # empty when the generation was aborted meanwhile (an idle death)
        messages = links[0][1] if 0 in links else None
        t0 = time.monotonic()
        hint = 0
        closed = {} if messages is not None else {0: t0}  # rank -> when its command connection ended
        while True:
            if 0 in closed:
                time.sleep(0.1)
                rep = False
            else:
                try:
                    rep = messages.get(timeout=0.1)
                except queue.Empty:
                    rep = False
            if rep is None:  # rank 0's connection ended: its death is about to be seen, or it is named here
                closed[0] = time.monotonic()
            elif rep is not False:
                if isinstance(rep, dict) and rep.get("g") == g and rep.get("n") == n and rep.get("pid") == self.members.get(0):
                    return rep
                logging.warning(f"MultiNPU: dropped a message of worker rank 0 that is not the result of command {n}")
            for r, (_, q) in links.items():
                while r != 0 and r not in closed:  # the other ranks send nothing on it: only its end matters
                    try:
                        if q.get_nowait() is None:
                            closed[r] = time.monotonic()
                    except queue.Empty:
                        break
            try:
                self._watch()
                for r, at in sorted(closed.items(), key=lambda item: item[1]):
                    if time.monotonic() - at > 2.0 and not self.dead:
                        self._note_death(r, self.members.get(r), "closed the command channel")
                failed = self.dead or self.state != "ready"
                if not failed:
                    count = self.ctl.counter(f"failed/{g}")
                    # the counter only says where to look (anyone reaching the store can add to it): a failure
                    # is a signed report from a member
                    failed = count != hint and bool(self._reports(g, n))
                    hint = count
            except Exception as e:
                if not self._store_ended_now(e):
                    raise
                failed = True
            if failed:
                raise self._failure(name, g, n, t0)

    def _store_ended_now(self, e: BaseException) -> bool:
        """True when `e` is the store's process gone (its connection reset): the store is started again and the
        generation aborted (_watch), and the command in flight fails naming the store."""
        if not channel._store_gone(e):
            return False
        deadline = time.monotonic() + 5.0
        while self._store.alive() and time.monotonic() < deadline:
            time.sleep(wire.POLL)
        if self._store.alive():
            return False
        self._watch()
        return True

    def _reports(self, g: int, n: int) -> dict:
        """{rank: signed error report of command n written by the member itself}."""
        out = {}
        for r, pid in self.members.items():
            rep = self.ctl.peek(f"err/{g}/{n}/{r}")
            if isinstance(rep, dict) and rep.get("pid") == pid:
                out[r] = rep
        return out

    def _failure(self, name: str, g: int, n: int, t0: float) -> BaseException:
        """The first error of a failed command (a rank's own exception before a death, a death before the
        collective errors it caused), after which the whole generation is replaced."""
        members = dict(self.members)
        reports = {}
        first_seen = time.monotonic()
        deadline = first_seen + ERROR_WAIT
        while True:
            for r, pid in members.items():
                if r not in reports:
                    rep = self.ctl.peek(f"err/{g}/{n}/{r}")
                    if isinstance(rep, dict) and rep.get("pid") == pid:
                        reports[r] = rep
            self._watch()
            if any(not rep.get("collective") for rep in reports.values()) or g in self._store_ended:
                break
            if any(r not in reports and not launch.secondary(self.dead[r]) for r in self.dead):
                # a death is a root cause by itself (unless its launcher caused it: then the death that made the
                # launcher act is awaited); a report explaining it is written before its exit
                deadline = min(deadline, first_seen + DEATH_WAIT)
            if time.monotonic() >= deadline:
                break
            time.sleep(wire.POLL)
        primary = {r: rep for r, rep in reports.items() if not rep.get("collective")}
        # in the order they were seen, the first death first; deaths a launcher caused after another rank's last
        dead = sorted((r for r in self.dead if r not in reports), key=lambda r: launch.secondary(self.dead[r]))
        if g in self._store_ended and not primary:
            exc = wire.GroupError(f"MultiNPU: {self._store_ended[g]} during {name}; every rank lost its connection "
                                  "to it")
        elif primary:
            r = min(primary, key=lambda r: (primary[r].get("time") or 0, r))
            exc = _rank_exception(self.spec, r, primary[r], name)
        elif dead:
            r = dead[0]
            exc = wire.RankDied(f"MultiNPU: {self._where(r)} died during {name} ({self.dead[r]})")
        elif reports:
            r = min(reports)
            exc = _rank_exception(self.spec, r, reports[r], name)
        else:
            exc = wire.GroupError(f"MultiNPU: the process group broke during {name} ({self.error or 'no report'})")
        self._abort_generation(str(exc).splitlines()[0][:300])
        self.last_failure = {"message": str(exc), "seconds_to_error": time.monotonic() - t0}
        logging.error(f"{exc}; the next command runs on a fresh group ({time.monotonic() - t0:.2f} s after the "
                      "command started)")
        return exc

    def _install(self, cfg: RemoteConfig):
        todo = [r for r in range(self.world_size) if cfg.installed.get(r) != self.members.get(r)]
        if not todo:
            return
        self._track(cfg)
        t0 = time.monotonic()
        self._execute("install", {"id": cfg.id, "program": cfg.program, "payload": cfg.payload, "ranks": todo})
        reports = self._wait_reports(f"ready/{cfg.id}", todo, wire.LOAD_TIMEOUT, f"loading {cfg.what}")
        failed = {r: rep for r, rep in reports.items() if "error" in rep}
        if failed:
            r = min(failed)
            exc = _rank_exception(self.spec, r, failed[r]["error"], f"loading {cfg.what}")
            self._abort_generation(str(exc)[:300])
            raise exc
        mismatch = base.config_mismatch(self.spec, cfg, {r: rep["digest"] for r, rep in reports.items()})
        if mismatch is not None:
            raise mismatch
        for r in todo:
            cfg.installed[r] = self.members[r]
        logging.info(f"MultiNPU: {cfg.what} loaded and checked on {len(todo)} worker(s) in "
                     f"{time.monotonic() - t0:.1f} s")

    def _wait_reports(self, prefix: str, ranks, timeout: float, what: str) -> dict:
        """{rank: report} of `prefix/{rank}` keys written by the current members; bounded, dead ranks named."""
        deadline = time.monotonic() + timeout
        members = dict(self.members)
        reports = {}
        said = time.monotonic()
        while True:
            if time.monotonic() - said >= WAITING_LOG:
                said = time.monotonic()
                logging.warning(f"MultiNPU: {what}: waiting for {prefix} of "
                                f"{', '.join(str(r) for r in ranks if r not in reports)} (members {members}, "
                                f"dead {self.dead}); {self._launcher_state()}")
            for r in ranks:
                if r not in reports:
                    rep = self.ctl.peek(f"{prefix}/{r}")
                    if isinstance(rep, dict) and rep.get("pid") == members.get(r):
                        reports[r] = rep
            if len(reports) == len(ranks) or any("error" in rep for rep in reports.values()):
                return reports
            self._watch()
            if self.dead or self.state != "ready" or self.members != members:
                # any member's death ends the load (the whole group is replaced: what the others loaded goes with
                # it), also one that reported its load before it died, or one the monitor's idle abort saw first
                raise self._load_failure(what, reports)
            if time.monotonic() >= deadline:
                late = [r for r in ranks if r not in reports]
                exc = wire.GroupError(f"MultiNPU: {', '.join(self.spec.describe_rank(r) for r in late)} did not "
                                       f"finish {what} within {timeout:g} s")
                self._abort_generation(str(exc)[:300])
                raise exc
            time.sleep(wire.POLL)

    def _load_failure(self, what: str, reports: dict) -> BaseException:
        """The first death of a failed load (the root cause before deaths a launcher caused after it, awaited up to
        ERROR_WAIT when only those are known yet), after which the whole generation is replaced."""
        deadline = time.monotonic() + ERROR_WAIT
        while (not self.dead or all(launch.secondary(why) for why in self.dead.values())) and \
                time.monotonic() < deadline:
            time.sleep(wire.POLL)
            self._watch()
        if self.dead:
            r = sorted(self.dead, key=lambda r: launch.secondary(self.dead[r]))[0]
            exc = wire.RankDied(f"MultiNPU: {self._where(r)} died while {what} ({self.dead[r]})")
        else:
            exc = wire.GroupError(f"MultiNPU: the process group broke while {what} ({self.error or 'aborted'})")
        self._abort_generation(str(exc)[:300])
        return exc

    # -- frees and drops --

    def npu_count_error(self, npu_count: int):
        """None when a workflow's npu_count runs on this group (1, or its ranks), else what to change."""
        if npu_count in (1, self.world_size):
            return None
        spec = self.spec
        return (f"npu_count is {npu_count} but this ComfyUI server's process group has {self.world_size} ranks "
                f"({spec.nnodes} node(s) of {spec.local_size} {spec.device_type} device(s)). Fix: set npu_count to "
                f"{self.world_size}, or restart the service with {npu_count} devices.")

    def describe(self) -> str:
        return f"{self.world_size} processes ({self.spec.backend})"

    # -- the ranks file --

    def ranks(self) -> list:
        out = []
        for rank in range(self.world_size):
            if self.spec.node_of(rank) == 0:
                info = dict(self._local.info[rank])
            else:
                info = {"rank": rank, "node": self.spec.node_of(rank), "local_rank": rank % self.spec.local_size,
                        "device": self.spec.device_name(rank)}
                announced = self._remote_worker(rank) if self.ctl is not None else None
                if announced:
                    info.update({k: announced.get(k) for k in ("host", "pid", "create_time", "cmdline")})
                exited = self._remote_exits.get(rank)
                info["alive"] = bool(announced) and not (exited and exited.get("pid") == info.get("pid"))
                info["last_exit"] = exited.get("reason") if exited else None
            info["joined"] = self.state == "ready" and self.members.get(rank) == info.get("pid") is not None
            out.append(info)
        return out

    def _write_ranks(self):
        self._ranks_changed = False
        if not self.spec.runtime_root:
            return
        try:
            with self._watch_lock:
                ranks = self.ranks()
        except Exception as e:
            logging.debug(f"MultiNPU: ranks not readable now: {e}")
            return
        launch.write_ranks_file(self.spec.runtime_root, {
            "role": "driver", "pid": os.getpid(), "updated": launch.now(), "state": self.state, "error": self.error,
            "generation": self.generation, "world_size": self.world_size, "backend": self.spec.backend,
            "master": f"{self.spec.master_addr}:{self.port}", "nnodes": self.spec.nnodes,
            "launcher": self.spec.launcher, "commands": self.commands, "last_failure": self.last_failure, "ranks": ranks})


def _rank_exception(spec: wire.GroupSpec, rank: int, report: dict, what: str) -> BaseException:
    host = f", host {report['host']}" if report.get("host") else ""
    where = f"{spec.describe_rank(rank)}{host}, pid {report.get('pid')}"
    message = f"MultiNPU: {where} failed in {what}: {report.get('type')}: {report.get('message')}"
    if report.get("oom"):
        # torch's own OOM type, so ComfyUI's handler unloads the models and the user can retry
        return torch.OutOfMemoryError(f"MultiNPU: {where} ran out of memory in {what}: {report.get('message')}")
    exc = wire.RankFailed(message)
    exc.remote_traceback = report.get("traceback")
    return exc



# ---- the driver in this process --------------------------------------------------------------

_RUNTIME = None


def get_runtime():
    """The GroupRuntime of this process when it drives a process group, else None (threads, one device)."""
    return _RUNTIME


def transport():
    """The one place the transport of this server's parallel components is chosen: its process group, or the
    thread transport over the devices this process sees (comfy.multinpu_threads.THREADS). Both answer
    npu_count_error(npu_count) and runtime_for(devices, primary, what, timeout)."""
    import comfy.multinpu_threads
    return _RUNTIME or comfy.multinpu_threads.THREADS


def runtime_for(devices, primary, what: str, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT) -> base.Runtime:
    """The runtime a parallel component (the DiT, the text encoder, the VAE) runs its programs on: this server's
    process group, which serves every component, or ranks that are threads of this process on `devices` (a runtime
    of the component's own, whose collectives are bounded by `timeout`). Rank 0 must be on `primary`, the device
    of `what` (ValueError otherwise, with threads; a process group's rank 0 is device 0 by construction)."""
    return transport().runtime_for(devices, primary, what, timeout)


def start_runtime(spec: wire.GroupSpec, key: str, device=None) -> GroupRuntime:
    global _RUNTIME
    if _RUNTIME is not None:
        raise wire.GroupError("MultiNPU: this process already runs a process group")
    _RUNTIME = GroupRuntime(spec, key, device).start()
    return _RUNTIME


def stop_runtime():
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.shutdown()
        _RUNTIME = None


def start_from_environment(device=None):
    """Start the driver when h3kit started this server with the process transport (H3KIT_GROUP set)."""
    text = os.environ.get(wire.GROUP_ENV)
    if not text:
        return None
    spec = wire.GroupSpec.from_json(text)
    if spec.node_rank != 0:
        raise wire.GroupError(f"MultiNPU: {wire.GROUP_ENV} names node {spec.node_rank}; ComfyUI runs on node 0 only")
    refused = [a for a in sys.argv[1:] if a.split("=")[0] in REFUSED_ARGS]
    if refused:
        # upstream rewrites CUDA_VISIBLE_DEVICES / picks another device before the workers start: rank r would
        # not be on device r
        raise wire.GroupError(f"MultiNPU: {', '.join(refused)} cannot be used with the process transport (every "
                               "rank binds its own device). Fix: remove it from the server's arguments, or start "
                               "with --transport threads")
    spec.worker_args = list(sys.argv[1:])  # the workers parse the server's ComfyUI arguments
    return start_runtime(spec, wire.key_from_environment().decode(), device)


def wait_ready(runtime: GroupRuntime, timeout: float):
    """Block until the group has formed (scripts that drive it directly); wire.GroupError when it cannot."""
    deadline = time.monotonic() + timeout
    while runtime.state != "ready":
        if runtime.state == "failed":
            raise wire.GroupError(f"MultiNPU: the process group failed: {runtime.error}")
        if time.monotonic() > deadline:
            raise wire.GroupError(f"MultiNPU: the process group did not form within {timeout:g} s")
        time.sleep(wire.POLL)

