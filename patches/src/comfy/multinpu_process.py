"""The driver of the process transport (GroupRuntime, in the ComfyUI server, never a rank) and the one chooser of a
component's runtime (transport, runtime_for). Design: docs/multinpu.md, "The process transport" (its code map).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import uuid

import torch

import comfy.multinpu
import comfy.multinpu_clock as clock
import comfy.multinpu_channel as channel
import comfy.multinpu_launch as launch
import comfy.multinpu_progress as progress
import comfy.multinpu_runtime_base as base
import comfy.multinpu_wire as wire

from comfy.multinpu_commands import ERROR_WAIT, CommandPath  # noqa: F401 (ERROR_WAIT: the tests' bounds)
from comfy.multinpu_installs import Installs
from comfy.multinpu_members import Generations, GroupMonitor

REFUSED_ARGS = ("--cuda-device", "--default-device")  # in the server's arguments, with the process transport


class RemoteConfig:
    """What every rank must hold before a command uses it (comfy.multinpu_models builds these): program, the
    worker-side builder (@program), gets payload; every rank's digest must equal the server's {component: hex}."""

    def __init__(self, program_name: str, payload, digest: dict, what: str):
        self.id = uuid.uuid4().hex
        self.program = program_name
        self.payload = payload
        self.digest = dict(digest)
        self.what = what
        self.installed = {}  # rank -> pid of the worker that holds it, checked


class GroupRuntime(GroupMonitor, Generations, CommandPath, Installs, base.Runtime):
    """The driver of the process group; its concerns are the mixins, sharing its state."""
    SERVER_IS_RANK0 = False  # every rank is a worker process: device 0 has the server's memory manager and rank 0's

    def __init__(self, spec: wire.GroupSpec, key: str):
        if spec.node_rank != 0:
            raise ValueError("MultiNPU: the driver runs on node 0; other nodes run an agent")
        super().__init__(spec)  # run(), the frees and drops: comfy.multinpu_runtime_base
        self.key = key
        self.signer = wire.Signer(key.encode())
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
        self._remote_seen = {}         # rank -> the newest announcement of another host's worker (_worker)
        self._agent_heard = {}         # node -> monotonic time of its agent's newest beat
        self._agent_beats = {}         # (node, agent pid) -> the newest heartbeat seq on its channel connection
        self._watch_lock = threading.RLock()
        self._last_remote = 0.0
        self._remote_exits = {}        # rank -> last exit report read
        self._retired = set()          # (pid, start time) of aborted generations' workers: never members again
        self._aborted = set()
        self._aborted_members = {}     # rank -> pid of the generation aborted last, until the next one is ready
        self._failed_at = 0.0
        self._token = uuid.uuid4().hex[:12]
        self._shm_claim = None         # the lock file that keeps this driver's /dev/shm hand-off files from sweeps
        self._local = None
        self._thread = None
        self._store = None             # channel.StoreHost: the store's own process
        self._store_ended = {}         # generation -> how the store ended while it was current
        self._channel = None           # channel.ChannelServer: the command channel (this host's workers; beats of all)
        self._own_channel_dir = None   # a temporary folder for it when there is no runtime root
        self._links = {}               # (generation, rank, pid) -> (Link, queue of its messages): command connections
        self._links_lock = threading.Lock()  # _links is written by the channel's threads: read only under it
        self._cmd_links = {}           # rank -> (Link, queue) of the current generation (rank 0's brings the results)
        self._beats = {}               # (rank, pid) -> the newest heartbeat seq on its channel connection (every host)
        self._progress = progress.ProgressWatch(wire.progress_timeout(spec))  # what beats tell
        self._stalled = {}             # generation -> a collective every rank was stuck in (ProgressWatch)
        self.ctl = None

    # -- start and stop --

    def start(self):
        spec = self.spec
        wire.check_timeouts(spec)
        clock.parse_faults(os.environ.get(clock.FAULT_ENV, ""))  # an unknown fault kind is refused, naming the kinds
        self._shm_claim = wire.shm_claim(self._token)  # first, what killed drivers left in /dev/shm is removed
        launch.gloo_on_loopback(spec)
        # the command channel first: a folder other users could enter is refused before anything starts
        self._channel = channel.ChannelServer(self._channel_folder(), self.signer, self._on_link)
        spec.channel = self._channel.path
        self._store = channel.StoreHost(spec.master_addr, spec.master_port, spec.timeout)
        self.port = spec.master_port = self._store.port  # the workers connect to the port the store got (0: any)
        if spec.nnodes > 1:
            # the other hosts' workers and agents reach the channel (their commands and beats) over TCP
            try:
                self._channel.listen_tcp(spec.master_addr, self.port + wire.CHANNEL_PORT_OFFSET)
            except wire.GroupError:
                self._store.stop()
                self._channel.close()
                raise
        self._store.start()
        self._connect_store()
        self._local = launch.LocalWorkers(spec, self.key)
        self._thread = threading.Thread(target=self._monitor, name="multinpu-monitor", daemon=True)
        self._thread.start()
        logging.info(f"MultiNPU: process group of {self.world_size} worker ranks ({spec.backend}) driven from "
                     f"{spec.master_addr}:{self.port}, {spec.nnodes} node(s) of {spec.local_size} device(s)")
        return self

    def _channel_folder(self) -> str:
        if self.spec.runtime_root:
            os.makedirs(self.spec.runtime_root, exist_ok=True)
            return os.path.join(self.spec.runtime_root, channel.CHANNEL_DIR)
        self._own_channel_dir = tempfile.mkdtemp(prefix="h3kit-channel-")  # mode 0700
        return os.path.join(self._own_channel_dir, channel.CHANNEL_DIR)

    def _connect_store(self):
        spec = self.spec
        deadline = time.monotonic() + channel.STORE_START_TIMEOUT
        self.ctl = channel.Control(channel.connect_store(spec.master_addr, self.port, spec.timeout, deadline), self.signer)
        self.ctl.put("layout", spec.layout())
        self._mon = channel.Control(channel.connect_store(spec.master_addr, self.port, spec.timeout, deadline), self.signer)

    def _restart_store(self):
        """The store's process died: start it again on the same socket and replace the whole group."""
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
        wire.shm_release(self._shm_claim)

    # -- the command channel --

    def _on_link(self, link, hello: dict):
        """An authenticated channel connection, on its own thread: a worker's or an agent's beats, or a worker's command
        connection. A beat connection that ends is no death by itself."""
        pid = hello["pid"]
        role = hello.get("role")
        if role in ("beat", "agent") and isinstance(hello.get("rank" if role == "beat" else "node"), int):
            beats, who = (self._beats, (hello["rank"], pid)) if role == "beat" else (self._agent_beats, (hello["node"], pid))
            try:
                while True:
                    beat = link.recv(channel.HELLO_LIMIT)
                    if isinstance(beat, dict) and isinstance(beat.get("seq"), int) and beat["seq"] > beats.get(who, 0):
                        beats[who] = beat["seq"]
                        if role == "beat":
                            self._progress.beat(hello["rank"], pid, beat.get("progress"), time.monotonic())
                            comfy.multinpu.notify(comfy.multinpu.BEAT_LISTENERS, hello["rank"], beat.get("progress"))
                        else:
                            self._agent_heard[hello["node"]] = time.monotonic()
            finally:
                beats.pop(who, None)
                if role == "beat":
                    self._progress.forget(hello["rank"], pid)
        elif (role == "command" and isinstance(hello.get("rank"), int) and 0 <= hello["rank"] < self.world_size
              and (link.remote is None) == (self.spec.node_of(hello["rank"]) == 0)):
            messages = queue.Queue()
            with self._links_lock:
                self._links[(hello.get("generation"), hello["rank"], pid)] = (link, messages)
            try:
                while True:
                    messages.put(link.recv())
            finally:
                messages.put(None)  # the connection ended
        else:
            logging.warning(f"MultiNPU: command channel: pid {pid} says it is {hello!r:.200}; closing it")

    def describe(self) -> str:
        return f"{self.world_size} processes ({self.spec.backend})"

    # -- commands (run(): comfy.multinpu_runtime_base; the command path: comfy.multinpu_commands) --

    def _execute(self, name, payload):
        g, n = self.generation, self.next_cmd
        self.commands += 1
        data, tensors = wire.pack(payload)
        stem = os.path.join(wire.shm_dir(), f"h3kit-{os.getpid()}-{self._token}-{g}-{n}")
        inp, out = f"{stem}-in", f"{stem}-out"
        self.inflight = (name, n)
        try:
            # a full /dev/shm fails here (wire.SharedMemoryFull) before any rank hears of command n: n is used next
            metas, nbytes = wire.shm_write(inp, tensors, f"the inputs of {name}")
            self.next_cmd += 1
            # the workers run in the server's grad and inference modes (ComfyUI executes prompts in inference mode)
            header = {"name": name, "g": g, "n": n, "data": data, "metas": metas, "nbytes": nbytes, "shm": inp,
                      "out": out, "grad": torch.is_grad_enabled(), "inference": torch.is_inference_mode_enabled()}
            self._send_all(header)
            rep = self._await(name, g, n)
            if rep.get("shm_full"):  # rank 0 had no room for the result; the ranks are in step: only this command fails
                raise wire.SharedMemoryFull(rep["shm_full"])
            buf = wire.shm_read(out, rep["nbytes"])
            return wire.unpack(rep["data"], wire.unflatten(buf, rep["metas"]))
        finally:
            self.inflight = None
            wire.shm_remove(inp)
            wire.shm_remove(out)


# ---- the driver in this process --------------------------------------------------------------

_RUNTIME = None


def get_runtime():
    """The GroupRuntime of this process when it drives a process group, else None (threads, one device)."""
    return _RUNTIME


def transport():
    """The one place the transport is chosen: this server's process group, else comfy.multinpu_threads.THREADS."""
    import comfy.multinpu_threads
    return _RUNTIME or comfy.multinpu_threads.THREADS


def runtime_for(devices, primary, what: str, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT) -> base.Runtime:
    """The runtime a component runs on: this server's process group, or threads on `devices` (its own, rank 0 on
    `primary`, the device of `what`)."""
    return transport().runtime_for(devices, primary, what, timeout)


def start_runtime(spec: wire.GroupSpec, key: str) -> GroupRuntime:
    global _RUNTIME
    if _RUNTIME is not None:
        raise wire.GroupError("MultiNPU: this process already runs a process group")
    _RUNTIME = GroupRuntime(spec, key).start()
    return _RUNTIME


def stop_runtime():
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.shutdown()
        _RUNTIME = None


def start_from_environment():
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
    return start_runtime(spec, wire.key_from_environment().decode())


def wait_ready(runtime: GroupRuntime, timeout: float):
    """Block until the group has formed (scripts that drive it directly), `timeout` counted from its workers' start
    (a fork server's imports come first, comfy.multinpu_zygote); wire.GroupError when it cannot."""
    deadline = None
    while runtime.state != "ready":
        if runtime.state == "failed":
            raise wire.GroupError(f"MultiNPU: the process group failed: {runtime.error}")
        if deadline is None and runtime._local.started:
            deadline = time.monotonic() + timeout
        if deadline is not None and time.monotonic() > deadline:
            raise wire.GroupError(f"MultiNPU: the process group did not form within {timeout:g} s")
        time.sleep(wire.POLL)

