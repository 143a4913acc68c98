"""Who starts, watches and replaces the workers (LocalWorkers, TorchrunWorkers; the Agent of another host) and how a
worker's end is told (watch_termination). docs/multinpu.md, "Launchers: torchrun or h3kit's own".
"""

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

from comfy.multinpu_wire import (CRASH_LIMIT, CRASH_WINDOW, GROUP_ENV, GroupError, GroupSpec, KEEP_ALIVE,
                                 KEEP_ALIVE_ATTEMPTS, KEY_ENV, LOCAL_RANK_ENV, PARENT_ENV, RANKS_FILE, RANK_ENV,
                                 RDZV_READ_TIMEOUT, RECYCLED_EXIT, REPORTED_EXIT, SECONDARY, Signer, TERM_EXIT,
                                 TORCHRUN_MAX_RESTARTS, TORCHRUN_RETRY, _die_with_parent_signal, cpu_threads,
                                 key_from_environment, wait_or_kill)
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


# ---- this host's workers: two launchers ------------------------------------------------------------

class _Workers:
    """What both launchers share: this host's ranks, what status shows of each, the workers' environment, recycle.
    Each provides poll() -> [(rank, pid, reason)] of the workers that ended, pid(rank), kill(rank, why, recycle),
    stop(grace)."""

    def __init__(self, spec: GroupSpec, key: str):
        self.spec = spec
        self.key = key
        self.cwd = os.getcwd()         # the ComfyUI tree, as it was at the start: the workers run there
        self.ctl = None                # the store's client (TorchrunWorkers reads the workers' announcements there)
        self.ranks = [spec.rank_of(spec.node_rank, lr) for lr in range(spec.local_size)]
        self.failed = {}               # rank -> why it is not replaced again
        self.recycled = set()          # ranks killed to replace the whole group: not crashes
        self.stopping = False
        self.info = {r: {"rank": r, "node": spec.node_rank, "local_rank": r % spec.local_size,
                         "host": socket.gethostname(), "device": spec.device_name(r), "pid": None,
                         "create_time": None, "cmdline": [], "alive": False, "restarts": 0, "last_exit": None}
                     for r in self.ranks}

    def _env(self, **ranks) -> dict:
        """The workers' environment; ranks: H3KIT_RANK and the like (LocalWorkers'; torchrun numbers its own)."""
        # H3KIT_SIM_DEVICES: a worker is one device, whatever the server simulates
        env = {k: v for k, v in os.environ.items()
               if k not in (RANK_ENV, LOCAL_RANK_ENV, PARENT_ENV, "H3KIT_SIM_DEVICES")}
        env.update(ranks, **{GROUP_ENV: self.spec.to_json(), KEY_ENV: self.key, "PYTHONUNBUFFERED": "1"})
        # NCCL's watchdog ends a worker whose collective passes the group timeout: a death like any other (never the
        # server's, which is in no collective); with 0 a collective stuck on every rank would hang while ranks beat
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        threads = cpu_threads(self.spec)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def recycle(self, why: str):
        """Kill every worker of this host (SIGKILL: one stopped or inside a wedged collective must go too), to be
        replaced at once, not counted as a crash. The reliable reset of a rank that saw an error is a fresh process."""
        for rank in self.ranks:
            self.kill(rank, why, recycle=True)


def workers(spec: GroupSpec, key: str, ctl: Control):
    """This host's workers under the group's launcher (GroupSpec.launcher)."""
    local = TorchrunWorkers(spec, key) if spec.launcher == "torchrun" else LocalWorkers(spec, key)
    local.ctl = ctl
    return local


def _recent(times: collections.deque, now: float) -> int:
    """How many of `times`, now added, fall within CRASH_WINDOW."""
    times.append(now)
    while now - times[0] > CRASH_WINDOW:
        times.popleft()
    return len(times)


class LocalWorkers(_Workers):
    """h3kit's own launcher: this host's worker processes, children of this one (they die with it), started,
    watched and replaced one by one; not past CRASH_LIMIT deaths within CRASH_WINDOW."""

    def __init__(self, spec: GroupSpec, key: str):
        super().__init__(spec, key)
        self.procs = {}
        self.deaths = collections.defaultdict(collections.deque)
        self.killed = {}               # rank -> why this object killed it
        self.respawn_at = {}           # rank -> monotonic time its replacement starts

    def spawn(self, rank: int):
        argv = [sys.executable, "-B", "-m", self.spec.worker_module, *self.spec.worker_args]
        env = self._env(**{RANK_ENV: str(rank), LOCAL_RANK_ENV: str(rank % self.spec.local_size),
                           PARENT_ENV: str(os.getpid())})
        proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, close_fds=True)
        self.procs[rank] = proc
        info = self.info[rank]
        info.update(process_identity(proc.pid), alive=True)
        # read at once, /proc can show an empty command line while the new image starts; it is argv
        info["cmdline"] = info["cmdline"] or list(argv)
        logging.info(f"MultiNPU: started {self.spec.describe_rank(rank)} as pid {proc.pid}")
        return proc

    def start(self):
        for rank in self.ranks:
            self.spawn(rank)

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


class TorchrunWorkers(_Workers):
    """torchrun's elastic agent as the launcher (docs/multinpu.md, "Launchers"): h3kit kills workers to make it
    restart the group. The workers' pids come from their signed announcements in the store."""

    def __init__(self, spec: GroupSpec, key: str):
        super().__init__(spec, key)
        self.proc = None
        self.seen = {}       # rank -> (pid, create_time) of the announced worker last looked at
        self.exits = collections.deque()
        self.retry_at = None  # monotonic time torchrun is tried again after it kept ending

    def argv(self) -> list:
        s = self.spec
        return [sys.executable, "-B", "-m", "torch.distributed.run", "--nnodes", str(s.nnodes), "--node-rank",
                str(s.node_rank), "--nproc-per-node", str(s.local_size), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{s.master_addr}:{s.master_port + 1}", "--rdzv-id", "h3kit",
                # node 0 hosts the rendezvous store (on one machine every node's address would match); read_timeout:
                # docs/multinpu.md, "Why two launchers"
                "--rdzv-conf", f"is_host={'true' if s.node_rank == 0 else 'false'},read_timeout={RDZV_READ_TIMEOUT},"
                f"keep_alive_interval={KEEP_ALIVE},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS},"
                f"join_timeout={max(1, int(s.join_timeout))}",
                "--max-restarts", str(TORCHRUN_MAX_RESTARTS), "--monitor-interval", "0.5",
                "-m", s.worker_module, *s.worker_args]

    def start(self):
        # torchrun ends with the process that started it (its SIGTERM handler stops the workers): an orphaned
        # elastic agent would restart workers that can never reach the driver again
        self.proc = subprocess.Popen(self.argv(), cwd=self.cwd, env=self._env(), stdin=subprocess.DEVNULL,
                                     close_fds=True, preexec_fn=_die_with_parent_signal)
        logging.info(f"MultiNPU: torchrun (pid {self.proc.pid}) launches ranks {self.ranks}")

    def _announced(self, rank: int):
        """The live worker announced for rank (its signed "worker/{rank}"), else None. One gone from the store is no
        death (a store client can delete any key): the worker seen last, while it lives, is still the rank's."""
        info = self.ctl.peek(f"worker/{rank}")
        if not isinstance(info, dict) and rank in self.seen:
            info = dict(zip(("pid", "create_time"), self.seen[rank]))
        if not isinstance(info, dict) or not _alive(info.get("pid"), info.get("create_time")):
            return None
        return info

    def poll(self) -> list:
        ended = []
        for rank in self.ranks:
            info = self._announced(rank)
            old = self.seen.get(rank)
            if old is not None and (info is None or (info["pid"], info.get("create_time")) != old):
                # torchrun reaps its workers: h3kit sees no exit code, but a worker torchrun stopped noted it
                why = ("killed by h3kit (the group is replaced)" if rank in self.recycled else
                       termination_note(self.ctl, rank, old[0]) or "died (not stopped by torchrun: killed or crashed)")
                self.recycled.discard(rank)
                reason = f"{why}; torchrun restarts the group"
                self.info[rank].update(alive=False, last_exit=reason)
                ended.append((rank, old[0], reason))
                self.seen.pop(rank)
            if info is not None and self.seen.get(rank) != (info["pid"], info.get("create_time")):
                self.seen[rank] = (info["pid"], info.get("create_time"))
                self.info[rank]["restarts"] += self.info[rank]["pid"] is not None  # not the first one announced
                self.info[rank].update({k: info.get(k) for k in ("pid", "create_time", "cmdline", "host")},
                                       alive=True)
        if self.proc is not None and self.proc.poll() is not None and not self.failed and not self.stopping:
            # torchrun itself ended (killed, past --max-restarts, its rendezvous failed): start it again, unless
            # it keeps ending
            reason = _exit_reason(self.proc.returncode)
            now = time.monotonic()
            if _recent(self.exits, now) > CRASH_LIMIT:
                # the group fails now (named, instead of waiting out the join timeout) and comes back by itself:
                # torchrun is tried again after a pause (its rendezvous port was taken, its peer host was away)
                self.retry_at = now + TORCHRUN_RETRY
                self.failed[self.ranks[0]] = (f"torchrun ended {len(self.exits)} times within {CRASH_WINDOW:g} s "
                                              f"(last: pid {self.proc.pid} {reason}); trying again in "
                                              f"{TORCHRUN_RETRY:g} s")
                logging.error(f"MultiNPU: {self.failed[self.ranks[0]]}")
            else:
                logging.warning(f"MultiNPU: torchrun (pid {self.proc.pid}) {reason}; starting it again")
                self.start()
        if self.failed and self.retry_at is not None and time.monotonic() >= self.retry_at and not self.stopping:
            self.failed, self.retry_at = {}, None
            self.exits.clear()
            logging.warning("MultiNPU: starting torchrun again after its pause")
            self.start()
        return ended

    def pid(self, rank: int):
        info = self._announced(rank)
        return info["pid"] if info else None

    def kill(self, rank: int, why: str, recycle: bool = False):
        info = self._announced(rank)
        if info is None:
            return
        logging.error(f"MultiNPU: killing {self.spec.describe_rank(rank)} (pid {info['pid']}): {why}")
        if recycle:
            self.recycled.add(rank)
        try:
            os.kill(info["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 5.0):
        self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # torchrun stops its workers
        wait_or_kill(self.proc, grace + 10.0)


def _alive(pid, create_time) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and (create_time is None or abs(p.create_time() - create_time) < 0.01)
    except Exception:
        return False


def write_ranks_file(spec: GroupSpec, role: str, state, error, generation, ranks: list, **more):
    """What `h3kit status` reads of this host's ranks (toolkit/h3kit/group.py, ranks_view), in the runtime root."""
    if not spec.runtime_root:
        return
    updated = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    data = {"role": role, "pid": os.getpid(), "updated": updated, "state": state, "error": error,
            "generation": generation, "world_size": spec.world_size, "backend": spec.backend, "master": f"{spec.master_addr}:{spec.master_port}", "nnodes": spec.nnodes,
            "launcher": spec.launcher, **more, "ranks": ranks}
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
        local = workers(spec, self.key, ctl)
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
