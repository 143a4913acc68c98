"""Who starts, watches and replaces the workers (LocalWorkers; the Agent of another host) and how a worker's end is
told (watch_termination). docs/multinpu.md, "The launcher"."""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import torch
import torch.distributed

import comfy.multinpu_links as links
import comfy.multinpu_zygote as zygote
from comfy.multinpu_wire import (CRASH_LIMIT, CRASH_WINDOW, GROUP_ENV, GroupError, GroupSpec, KEY_ENV,
                                 LOCAL_RANK_ENV, PARENT_ENV, RANKS_FILE, RANK_ENV, RECYCLED_EXIT, REPORTED_EXIT,
                                 SECONDARY, Signer, TERM_EXIT, cpu_threads, key_from_environment, wait_or_kill)
from comfy.multinpu_channel import Control, _store_gone, beat, connect_store


# ---- why a worker ended ---------------------------------------------------------------------------

def secondary(reason) -> bool:
    """Is a death with this reason one its launcher caused after another rank's (not a root cause)?"""
    return SECONDARY in str(reason)


def recycled(reason) -> bool:
    """Is a death with this reason one h3kit caused itself, replacing the group after a failure?"""
    reason = str(reason)
    return "killed by h3kit" in reason or "aborted" in reason


def watch_termination(spec: GroupSpec, rank: int):
    """In a worker: one thread takes SIGTERM, notes who ended this process (signed "term/{rank}") and exits with
    TERM_EXIT, even while the main thread is in a collective (docs/multinpu.md, "Who failed first"). Needs SIGTERM
    blocked in every thread from the worker's first line (comfy.multinpu_worker), else nothing is noted."""
    if signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return
    parent = os.getppid()

    def run():
        signal.sigwait({signal.SIGTERM})
        gone = os.getppid() != parent
        why = (f"{SECONDARY}: its launcher (pid {parent}) ended" if gone else
               f"{SECONDARY} (SIGTERM from pid {parent})")
        try:
            store = connect_store(spec.master_addr, spec.master_port, 2.0, time.monotonic() + 2.0)
            Control(store, Signer(key_from_environment())).put(f"term/{rank}", {"pid": os.getpid(), "why": why,
                                                                               "time": time.time()})
        except Exception:
            pass  # the store is gone too: nobody is left to tell
        logging.warning(f"MultiNPU: rank {rank}: {why}; exiting")
        sys.stdout.flush()
        os._exit(TERM_EXIT)
    threading.Thread(target=run, name="multinpu-sigterm", daemon=True).start()


def termination_note(ctl, rank: int, pid) -> str | None:
    """What a worker noted of its SIGTERM before it exited (watch_termination), when it was process `pid`."""
    note = ctl.peek(f"term/{rank}")
    return note.get("why") if isinstance(note, dict) and note.get("pid") == pid else None


def process_identity(pid: int) -> dict:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "create_time": p.create_time(), "cmdline": p.cmdline()}
    except Exception:  # the process already gone: the pid alone is still worth showing
        return {"pid": pid, "create_time": None, "cmdline": []}


def _exit_reason(code: int) -> str:
    if code == TERM_EXIT:
        return f"{SECONDARY} (SIGTERM, code {code})"
    if code == REPORTED_EXIT:
        return f"exited after reporting its error (code {code})"
    if code == RECYCLED_EXIT:
        return f"left its aborted generation (code {code})"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# ---- this host's workers ---------------------------------------------------------------------------

def _recent(times: collections.deque, now: float) -> int:
    """How many of `times`, now added, fall within CRASH_WINDOW."""
    times.append(now)
    while now - times[0] > CRASH_WINDOW:
        times.popleft()
    return len(times)


class LocalWorkers:
    """h3kit's launcher: this host's worker processes, children of this one (they die with it), started, watched
    and replaced one by one; not past CRASH_LIMIT deaths within CRASH_WINDOW. What status shows of each is `info`."""

    def __init__(self, spec: GroupSpec, key: str):
        self.spec = spec
        self.key = key
        self.cwd = os.getcwd()         # the ComfyUI tree, as it was at the start: the workers run there
        self.ranks = [spec.node_rank * spec.local_size + lr for lr in range(spec.local_size)]
        self.failed = {}               # rank -> why it is not replaced again
        self.recycled = set()          # ranks killed to replace the whole group: not crashes
        self.stopping = False
        self.info = {r: {"rank": r, "node": spec.node_rank, "local_rank": r % spec.local_size,
                         "host": socket.gethostname(), "device": spec.device_name(r), "pid": None,
                         "create_time": None, "cmdline": [], "alive": False, "restarts": 0, "last_exit": None}
                     for r in self.ranks}
        self.procs = {}
        self.deaths = collections.defaultdict(collections.deque)
        self.killed = {}               # rank -> why this object killed it
        self.respawn_at = {}           # rank -> monotonic time its replacement starts
        self.fork = zygote.worker_start(spec) == "fork"
        self.fork_server = None        # started with the first worker forked
        self.started = False

    def recycle(self, why: str):
        """Kill every worker of this host (SIGKILL: one stopped or inside a wedged collective must go too), to be
        replaced at once, not counted as a crash. The reliable reset of a rank that saw an error is a fresh process."""
        for rank in self.ranks:
            self.kill(rank, why, recycle=True)

    def spawn(self, rank: int):
        argv = [sys.executable, "-B", "-m", self.spec.worker_module, *self.spec.worker_args]
        # H3KIT_SIM_DEVICES: a worker is one device, whatever the server simulates
        env = {k: v for k, v in os.environ.items() if k != "H3KIT_SIM_DEVICES"}
        env.update({RANK_ENV: str(rank), LOCAL_RANK_ENV: str(rank % self.spec.local_size), PARENT_ENV: str(os.getpid()),
                    GROUP_ENV: self.spec.to_json(), KEY_ENV: self.key, "PYTHONUNBUFFERED": "1"})
        # NCCL's watchdog ends a worker whose collective passes the group timeout: a death like any other (never the
        # server's, which is in no collective); with 0 a collective stuck on every rank would hang while ranks beat
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        env[links.REPLACEMENT_ENV] = "1" if self.info[rank]["restarts"] else "0"  # waits for its device's memory
        if (threads := cpu_threads(self.spec)) is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        proc = zygote.fork_worker(self, rank, env) if self.fork else None  # None: it could not, said
        if proc is None:
            proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, close_fds=True)
        self.procs[rank] = proc
        info = self.info[rank]
        info.update(getattr(proc, "identity", None) or process_identity(proc.pid), alive=True)
        # read at once, /proc can show an empty command line while the new image starts; it is argv (a forked
        # worker's is its fork server's, which h3kit's status takes for a worker's)
        info["cmdline"] = info["cmdline"] or list(argv)
        logging.info(f"MultiNPU: started {self.spec.describe_rank(rank)} as pid {proc.pid}"
                     + (" (forked)" if isinstance(proc, zygote.ForkedWorker) else ""))
        return proc

    def start(self):
        for rank in self.ranks:
            self.spawn(rank)
        self.started = True  # a fork server's imports done: the join's bound is on joining alone

    def poll(self) -> list:
        """[(rank, pid, reason)] of the workers that ended since the last poll; each is replaced unless
        it is in a crash loop or the workers are stopping."""
        ended = []
        now = time.monotonic()
        for rank, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            reason = _exit_reason(code)
            if rank in self.killed:
                reason = f"{self.killed.pop(rank)}: {reason}"
            info = self.info[rank]
            info.update(alive=False, last_exit=reason)
            del self.procs[rank]
            ended.append((rank, proc.pid, reason))
            if self.stopping:
                continue
            if rank in self.recycled or code in (REPORTED_EXIT, RECYCLED_EXIT):
                # replaced with the group (h3kit's decision, or the worker's own error report): at once,
                # and not counted as a crash
                self.recycled.discard(rank)
                self.respawn_at[rank] = now
                continue
            deaths = _recent(self.deaths[rank], now)
            if deaths > CRASH_LIMIT:
                self.failed[rank] = (f"{self.spec.describe_rank(rank)} died {deaths} times within "
                                     f"{CRASH_WINDOW:g} s (last: {reason}); not replaced again")
                logging.error(f"MultiNPU: {self.failed[rank]}")
                continue
            # the first replacement starts at once, repeated deaths wait longer (0.5 s, 1 s, ... up to 8 s)
            delay = 0.0 if deaths == 1 else min(8.0, 0.25 * 2 ** (deaths - 1))
            logging.warning(f"MultiNPU: {self.spec.describe_rank(rank)} (pid {proc.pid}) {reason}; replacing it"
                            + (f" in {delay:g} s" if delay else ""))
            self.respawn_at[rank] = now + delay
        for rank, when in list(self.respawn_at.items()):
            if now >= when and not self.stopping:
                del self.respawn_at[rank]
                self.info[rank]["restarts"] += 1
                self.spawn(rank)
        return ended

    def kill(self, rank: int, why: str, recycle: bool = False):
        """SIGKILL one worker; recycle: as part of replacing the whole group (not counted as a crash)."""
        proc = self.procs.get(rank)
        if proc is not None and proc.poll() is None:
            logging.error(f"MultiNPU: killing {self.spec.describe_rank(rank)} (pid {proc.pid}): {why}")
            self.killed[rank] = why
            if recycle:
                self.recycled.add(rank)
            proc.kill()

    def pid(self, rank: int):
        proc = self.procs.get(rank)
        return proc.pid if proc is not None and proc.poll() is None else None

    def stop(self, grace: float = 5.0):
        self.stopping = True
        procs = [p for p in self.procs.values() if p.poll() is None]
        for p in procs:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            wait_or_kill(p, max(0.0, deadline - time.monotonic()))
        for rank, p in self.procs.items():
            if p.poll() is not None:
                self.info[rank].update(alive=False, last_exit=_exit_reason(p.returncode))
        if self.fork_server is not None:
            self.fork_server.close()


def write_ranks_file(spec: GroupSpec, role: str, state, error, generation, ranks: list, **more):
    """What `h3kit status` reads of this host's ranks (toolkit/h3kit/group.py, ranks_view), in the runtime root."""
    if not spec.runtime_root:
        return
    updated = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    data = {"role": role, "pid": os.getpid(), "updated": updated, "state": state, "error": error,
            "generation": generation, "world_size": spec.world_size, "backend": spec.backend,
            "master": f"{spec.master_addr}:{spec.master_port}", "nnodes": spec.nnodes, **more, "ranks": ranks}
    path = os.path.join(spec.runtime_root, RANKS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(spec.runtime_root, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        logging.warning(f"MultiNPU: cannot write {path}: {e}")


def gloo_on_loopback(spec: GroupSpec):
    """A CPU group whose master is on the loopback: gloo's sockets on the loopback interface (unless set)."""
    import ipaddress
    try:
        loopback = ipaddress.ip_address(spec.master_addr).is_loopback
    except ValueError:
        loopback = spec.master_addr == "localhost"
    if spec.device_type == "cpu" and loopback:
        name = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)


# ---- the agent of another node -------------------------------------------------------------------

class Agent:
    """Node R > 0: starts and replaces its workers, reports their deaths, beats on the driver's command channel, and
    follows the driver through restarts of the master."""

    def __init__(self, spec: GroupSpec, key: str):
        self.spec = spec
        self.key = key
        self.signer = Signer(key.encode())
        self.stop = threading.Event()

    def run(self):
        gloo_on_loopback(self.spec)
        # the driver tells a lost host by its agent's silence, which nobody without the key can fill or make; one
        # beat for the agent's life (its numbers only grow), also while it waits for the master to come back
        threading.Thread(target=beat, args=(self.spec.channel_address(), self.signer,
                                            {"role": "agent", "node": self.spec.node_rank, "pid": os.getpid()},
                                            self.stop), name="multinpu-agent-beat", daemon=True).start()
        while not self.stop.is_set():
            try:
                store = connect_store(self.spec.master_addr, self.spec.master_port, self.spec.timeout,
                                      time.monotonic() + self.spec.join_timeout, self.stop)
                if store is None:
                    break
                ctl = Control(store, self.signer)
                layout = ctl.wait("layout", self.spec.join_timeout)
            except (GroupError, RuntimeError, torch.distributed.DistError) as e:
                logging.error(f"MultiNPU: node {self.spec.node_rank}: rank 0 did not come back within "
                              f"{self.spec.join_timeout:g} s ({e}); the agent gives up")
                self._write(None, "failed", str(e))
                return 1
            if layout != self.spec.layout():
                message = (f"MultiNPU: node {self.spec.node_rank} was started with {self.spec.layout()}, rank 0 "
                           f"runs {layout}: start every node with the same --nnodes, device count and master")
                logging.error(message)
                self._write(None, "failed", message)
                return 2
            self._serve(ctl)
        return 0

    def _serve(self, ctl: Control):
        spec = self.spec
        ctl.put(f"node/{spec.node_rank}", {"pid": os.getpid(), "host": socket.gethostname(),
                                           "local_size": spec.local_size})
        local = LocalWorkers(spec, self.key)
        local.start()
        logging.info(f"MultiNPU: node {spec.node_rank} agent: started ranks {local.ranks}")
        last_write = 0.0
        reported = None
        ctl.put(f"nodefail/{spec.node_rank}", {"pid": os.getpid(), "message": None})
        try:
            while not self.stop.wait(0.1):
                for rank, pid, reason in local.poll():
                    ctl.put(f"exit/{rank}", {"pid": pid, "reason": reason})
                for rank in local.ranks:
                    req = ctl.peek(f"kill/{rank}")
                    if isinstance(req, dict) and req.get("pid") == local.pid(rank):
                        local.kill(rank, req.get("why", "the driver asked"), recycle=bool(req.get("abort")))
                failed = "; ".join(local.failed.values()) or None
                if failed != reported:  # a host that cannot run its ranks says so: the driver fails at once
                    ctl.put(f"nodefail/{spec.node_rank}", {"pid": os.getpid(), "message": failed})
                    reported = failed
                if time.monotonic() - last_write > 1.0:
                    state = ctl.peek("state") or {"state": "starting"}
                    self._write(local, state.get("state"), state.get("error"), state)
                    last_write = time.monotonic()
        except BaseException as e:
            if not (_store_gone(e) or isinstance(e, (RuntimeError, torch.distributed.DistError))):
                raise
            logging.warning(f"MultiNPU: node {spec.node_rank} agent: rank 0's store went away ({e}); stopping "
                            "the workers and waiting for it to come back")
        finally:
            local.stop()
            self._write(local, "waiting", "rank 0 is gone")

    def _write(self, local, state, error, group=None):
        ranks = []
        if local is not None:
            members = (group or {}).get("members") or {}
            for rank in local.ranks:
                info = dict(local.info[rank])
                info["joined"] = state == "ready" and members.get(rank) == info.get("pid") is not None
                ranks.append(info)
        write_ranks_file(self.spec, "agent", state, error, (group or {}).get("generation"), ranks,
                         node_rank=self.spec.node_rank)


def agent_main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = GroupSpec.from_json(os.environ[GROUP_ENV])
    agent = Agent(spec, key_from_environment().decode())
    signal.signal(signal.SIGTERM, lambda *a: agent.stop.set())
    return agent.run()
