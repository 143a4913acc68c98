"""One process per device: rank 0 of the torch.distributed group the multi-device H3 runners use.

With `h3kit start --transport process` (the default on NPU and CUDA) every device is a process, and the
ranks of one service form one torch.distributed group: hccl on Ascend, nccl on CUDA, gloo on CPU. Rank 0 is
the ComfyUI server (or the parity and benchmark scripts): GroupRuntime hosts the group's store on the port
h3kit recorded, starts one worker per other device of its host, replaces a worker that dies, forms the
group, and runs every multi-device command (run()). The members' side (settings, wire format, the worker
loop, the agents of other hosts) is comfy.multinpu_group.

Failures are bounded. Every command ends with a barrier, so all ranks know when one failed. A rank that
raises posts its error and destroys its process group, so the others' pending collectives fail at once;
rank 0 re-raises the root cause naming the rank (an out-of-memory error as torch.OutOfMemoryError, so
ComfyUI's unload-and-retry path runs), and the next command forms a new generation. A liveness monitor on
rank 0 checks every rank before each command and while one runs: local workers by their process, remote
ones by the reports of their agent and by the heartbeat each worker keeps in the store. A dead rank fails
the command at once, named, and is replaced. On hccl/nccl a collective does not notice a dead peer by
itself (HCCL_EXEC_TIMEOUT: 68 s at best), so the monitor also aborts the process group there: written
against torch's documented _abort_process_group, unmeasured on Ascend and CUDA hardware. On gloo (its CPU
twin, the path the tests run) a dead or killed peer closes its sockets, which fails the collective within
milliseconds.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import sys
import threading
import time
import uuid
import weakref

import torch
import torch.distributed

import comfy.multinpu
import comfy.multinpu_group as group

LOAD_TIMEOUT = 1800.0                # the first read of the H3 weights on a worker takes minutes
ERROR_WAIT = 3.0                     # after a failure, for the other ranks' reports and deaths to arrive
DEATH_WAIT = 0.5                     # ... once a dead rank is known

# ---- rank 0 ----------------------------------------------------------------------------------------

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


class GroupRuntime:
    """Rank 0 of the process group: owns the store, this host's workers, the group and every command.

    One command runs at a time (`run`); the monitor thread forms the group, watches every rank, replaces
    dead local workers and re-forms the group when the server is idle, so `h3kit status` shows every
    rank joined without waiting for the next prompt.
    """

    def __init__(self, spec: group.GroupSpec, key: str, device=None):
        if spec.node_rank != 0:
            raise ValueError("MultiNPU: rank 0 runs on node 0; other nodes run an agent")
        self.spec = spec
        self.key = key
        self.signer = group.Signer(key.encode())
        self.world_size = spec.world_size
        self.rank = 0
        self.device = torch.device(device if device is not None else spec.device_name(0))
        self.state = "starting"
        self.error = None
        self.generation = 0
        self.comm = None
        self.members = {}              # rank -> pid in the current generation
        self.commands = 0
        self.next_cmd = 1
        self.port = None
        self.inflight = None           # (program, command number) while a command runs
        self.dead = {}                 # rank -> "pid X: reason" noticed since the last command
        self.configs = weakref.WeakSet()  # RemoteConfigs the workers were asked to hold
        self._drops = []
        self._free_pending = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ranks_changed = True
        self._hb = {}                  # rank -> (pid, heartbeat counter, monotonic time it last changed)
        self._watch_lock = threading.RLock()
        self._last_remote = 0.0
        self._ended = True             # the current generation's END has been posted
        self._remote_exits = {}        # rank -> last exit report read
        self._local = None
        self._thread = None
        self._sock = None
        self._threads = None           # torch's intra-op threads before start() took a share of the cores
        self.ctl = None

    # -- start and stop --

    def start(self):
        spec = self.spec
        if spec.device_type == "cpu" and group.is_loopback(spec.master_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", group.loopback_interface())
        group.set_hccl_timeout(spec)
        threads = group.cpu_threads(spec)
        if threads is not None:  # rank 0 takes its share of the cores too (given back at shutdown)
            self._threads = torch.get_num_threads()
            torch.set_num_threads(threads)
        store, self._sock, self.port = group.host_store(spec.master_addr, spec.master_port, spec.timeout)
        spec.master_port = self.port  # the workers connect to the port the store got (0 asks for a free one)
        self._base = store
        self.ctl = group.Control(store, self.signer)
        self.ctl.put("layout", spec.layout())
        self._mon = group.Control(group.connect_store(spec.master_addr, self.port, spec.timeout), self.signer)
        self._local = group.LocalWorkers(spec, self.key, range(1, spec.local_size))
        self._thread = threading.Thread(target=self._monitor, name="multinpu-monitor", daemon=True)
        self._thread.start()
        logging.info(f"MultiNPU: process group of {self.world_size} ranks ({spec.backend}) on "
                     f"{spec.master_addr}:{self.port}, {spec.nnodes} node(s) of {spec.local_size} device(s)")
        return self

    def shutdown(self, grace: float = 5.0):
        self._stop.set()
        with self._lock:
            if self.comm is not None:
                self._close_generation()
            if self._local is not None:
                self._local.stop(grace)
        if self._thread is not None:
            self._thread.join(5.0)
        self._write_ranks()
        if self._threads is not None:
            torch.set_num_threads(self._threads)
            self._threads = None

    # -- the monitor --

    def _monitor(self):
        # the local workers are started by this thread (PR_SET_PDEATHSIG follows the thread that forks)
        self._local.start()
        last_write = 0.0
        while not self._stop.is_set():
            try:
                self._watch()
                if self.state not in ("ready", "failed") and self._lock.acquire(blocking=False):
                    try:
                        self._form()
                    except group.GroupError as e:
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

    def _watch(self):
        """Notice dead and hung ranks: local processes at once, agents' exit reports and heartbeats twice a
        second."""
        with self._watch_lock:
            for rank, pid, reason in self._local.poll():
                self._note_death(rank, pid, reason)
            if self._local.failed and self.state != "failed":
                self._fail("; ".join(self._local.failed.values()))
            now = time.monotonic()
            if now - self._last_remote < 0.5:
                return
            self._last_remote = now
            for rank in range(1, self.world_size):
                self._check_heartbeat(rank, now)
                if self.spec.node_of(rank) != 0:
                    report = self._mon.peek(f"exit/{rank}")
                    if report is not None and report != self._remote_exits.get(rank):
                        self._remote_exits[rank] = report
                        self._note_death(rank, report["pid"], report["reason"])

    def _check_heartbeat(self, rank: int, now: float):
        pid = self.members.get(rank)
        if pid is None:
            return  # not joined yet: a starting worker may take a while to import its modules
        count = self._mon.counter(f"hb/{rank}")
        last = self._hb.get(rank)
        if last is None or last[0] != pid or last[1] != count:
            self._hb[rank] = (pid, count, now)
            return
        if now - last[2] <= group.HEARTBEAT_STALE:
            return
        why = f"no heartbeat for {now - last[2]:.0f} s (hung)"
        self._hb[rank] = (pid, count, now)
        if self.spec.node_of(rank) == 0:
            if self._local.pid(rank) == pid:  # never its replacement, which beats on the same key
                self._local.kill(rank, why)  # its death is noticed (and it is replaced) like any other
        else:
            self._mon.put(f"kill/{rank}", {"pid": pid, "why": why})
            self._note_death(rank, pid, why)

    def _note_death(self, rank: int, pid, reason: str):
        self._ranks_changed = True
        if pid is None or self.members.get(rank) != pid:
            return  # not a member of the current generation (a replacement that had not joined yet)
        self.dead[rank] = f"pid {pid}: {reason}"
        if self.state == "ready":
            self.state = "broken"
            self._put_state()
            if self.inflight is not None:
                logging.error(f"MultiNPU: {self.spec.describe_rank(rank)} (pid {pid}) {reason} during "
                              f"{self.inflight[0]}")
                if self.spec.backend != "gloo":
                    _abort_group()

    def _fail(self, message: str):
        self.state = "failed"
        self.error = message
        self._ranks_changed = True
        self._put_state()

    def _put_state(self):
        try:
            self._mon.put("state", {"state": self.state, "generation": self.generation, "error": self.error,
                                   "members": dict(self.members)})
        except Exception:
            pass

    # -- forming a generation --

    def _announced(self) -> dict:
        """rank -> pid of the live worker announced for each rank (None where none is)."""
        out = {}
        for rank in range(1, self.world_size):
            if self.spec.node_of(rank) == 0:
                out[rank] = self._local.pid(rank)
                continue
            info = self._mon.peek(f"worker/{rank}")
            exited = self._remote_exits.get(rank)
            if info is None or (exited is not None and exited["pid"] == info["pid"]):
                out[rank] = None
            else:
                out[rank] = info["pid"]
        return out

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

    def _close_generation(self):
        """Tell the workers of the current generation it is over (they leave their command loop) and
        destroy rank 0's process group."""
        if not self._ended:
            self._ended = True
            try:
                self.ctl.put(f"cmd/{self.generation}/{self.next_cmd}", {"name": group.END})
            except Exception:
                pass
        if self.comm is not None or torch.distributed.is_initialized():
            group.destroy_group()
        self.comm = None

    def _form(self):
        """Form generation g+1 with every rank; bounded by join_timeout (group.GroupError naming who is missing)."""
        self._close_generation()
        self.state = "forming"
        self._ranks_changed = True
        deadline = time.monotonic() + self.spec.join_timeout
        while True:
            members = self._wait_members(deadline)
            g = self.generation + 1
            self.generation = g
            self.ctl.put(f"gen/{g}", {"members": members})
            self.ctl.set("gen", str(g))
            self._put_state()
            if self._wait_joined(g, members, deadline):
                break
        self.ctl.set(f"go/{g}", "1")
        torch.distributed.init_process_group(self.spec.backend, store=torch.distributed.PrefixStore(f"pg{g}", self._base),
                                             rank=0, world_size=self.world_size, timeout=group.td(self.spec.timeout))
        self.comm = comfy.multinpu.ProcessComm(device=self.device, timeout=self.spec.timeout)
        self.members = {0: os.getpid(), **members}
        self.next_cmd = 1
        self._ended = False
        self.dead = {}
        self.state = "ready"
        self.error = None
        self._ranks_changed = True
        self._put_state()
        for cfg in self.configs:
            # a replaced worker holds nothing; the others keep what they loaded
            cfg.installed = {r: pid for r, pid in cfg.installed.items() if self.members.get(r) == pid}
        logging.info(f"MultiNPU: process group generation {g} ready: {self.world_size} ranks")

    def _wait_members(self, deadline: float) -> dict:
        def attempt():
            if self.state == "failed":
                raise group.GroupError(f"MultiNPU: the process group failed: {self.error}")
            announced = self._announced()
            return announced if all(pid is not None for pid in announced.values()) else None
        return self._poll(deadline, attempt,
                          lambda: self._missing([r for r, pid in self._announced().items() if pid is None]))

    def _wait_joined(self, g: int, members: dict, deadline: float) -> bool:
        """True once every member has joined g; False when one died meanwhile (form again)."""
        def waiting():
            return [r for r in members if not self.ctl.has(f"joined/{g}/{r}")]

        def attempt():
            if any(self._announced().get(r) != pid for r, pid in members.items()):
                return False
            return True if not waiting() else None
        return self._poll(deadline, attempt, lambda: f"{', '.join(self.spec.describe_rank(r) for r in waiting())} "
                                                     "started but did not join")

    def _poll(self, deadline: float, attempt, late):
        """attempt() after each look at the ranks until it returns something other than None; past the deadline
        the group fails with late()'s words."""
        while True:
            self._watch()
            result = attempt()
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                message = f"MultiNPU: the process group did not form within {self.spec.join_timeout:g} s: {late()}"
                self._fail(message)
                raise group.GroupError(message)
            time.sleep(group.POLL)

    # -- commands --

    def _ensure_ready(self, what: str):
        self._watch()
        if self.state == "failed":
            raise group.GroupError(f"MultiNPU: the process group failed: {self.error}")
        if self.state != "ready":
            logging.info(f"MultiNPU: re-forming the process group before {what}")
            self._form()

    def _post(self, name: str, payload) -> tuple:
        data, tensors = group.pack(payload)
        buf, metas = group.flatten(tensors, self.comm.device)
        n = self.next_cmd
        self.next_cmd += 1
        self.commands += 1
        # the workers run in rank 0's grad and inference modes (ComfyUI executes prompts in inference mode)
        self.ctl.put(f"cmd/{self.generation}/{n}", {"name": name, "data": data, "metas": metas, "nbytes": buf.numel(),
                                                   "grad": torch.is_grad_enabled(),
                                                   "inference": torch.is_inference_mode_enabled()})
        return n, buf

    def run(self, name: str, payload, body, configs=()):
        """Run command `name` on every rank: the workers run PROGRAMS[name](context, comm, payload), rank 0
        runs body(comm) here; returns body's result.

        configs: RemoteConfigs the workers must hold first (installed and checked where missing). Raises
        group.GroupError subclasses naming the rank that failed or died (group.RankFailed, group.RankDied, group.ConfigMismatch),
        torch.OutOfMemoryError for a worker that ran out of memory, or rank 0's own exception.
        """
        with self._lock:
            self._ensure_ready(name)
            self._housekeeping()
            for cfg in configs:
                self._install(cfg)
            return self._execute(name, payload, body)

    def _execute(self, name, payload, body):
        n, buf = self._post(name, payload)
        self.inflight = (name, n)
        try:
            if buf.numel():
                self.comm.broadcast(buf, 0)
            result = body(self.comm)
            self.comm.barrier()
            return result
        except BaseException as e:
            root = self._after_failure(e, name, n)
            if root is e:
                raise
            raise root from e
        finally:
            self.inflight = None

    def _housekeeping(self):
        if self._free_pending:
            self._free_pending = False
            self._execute("free", None, lambda comm: None)
            for cfg in self.configs:
                cfg.installed = {}
        if self._drops:
            ids, self._drops = self._drops, []
            self._execute("drop", ids, lambda comm: None)

    def _install(self, cfg: RemoteConfig):
        todo = [r for r in range(1, self.world_size) if cfg.installed.get(r) != self.members.get(r)]
        if not todo:
            return
        if cfg not in self.configs:
            self.configs.add(cfg)
            weakref.finalize(cfg, self._drops.append, cfg.id)  # the workers let go of it with rank 0
        t0 = time.monotonic()
        self._execute("install", {"id": cfg.id, "program": cfg.program, "payload": cfg.payload, "ranks": todo},
                      lambda comm: None)
        reports = self._wait_reports(f"ready/{cfg.id}", todo, LOAD_TIMEOUT, f"loading {cfg.what}")
        failed = {r: rep for r, rep in reports.items() if "error" in rep}
        if failed:
            r = min(failed)
            raise _rank_exception(self.spec, r, failed[r]["error"], f"loading {cfg.what}")
        bad = {}
        for r, rep in reports.items():
            diff = [k for k in sorted(set(cfg.digest) | set(rep["digest"])) if cfg.digest.get(k) != rep["digest"].get(k)]
            if diff:
                bad[r] = diff
        if bad:
            lines = [f"{self.spec.describe_rank(r)} differs in {', '.join(d)} ("
                     + "; ".join(f"{k}: rank 0 {cfg.digest.get(k)!s:.40}, rank {r} {reports[r]['digest'].get(k)!s:.40}"
                                 for k in d) + ")" for r, d in sorted(bad.items())]
            raise group.ConfigMismatch(f"MultiNPU: the ranks do not hold the same {cfg.what}: " + "; ".join(lines)
                                 + ". Fix: the same model files at the same paths on every host")
        for r in todo:
            cfg.installed[r] = self.members[r]
        logging.info(f"MultiNPU: {cfg.what} loaded and checked on {len(todo)} worker(s) in "
                     f"{time.monotonic() - t0:.1f} s")

    def _wait_reports(self, prefix: str, ranks, timeout: float, what: str) -> dict:
        """{rank: report} of `prefix/{rank}` keys written by the current members; bounded, dead ranks named."""
        deadline = time.monotonic() + timeout
        reports = {}
        while True:
            for r in ranks:
                if r in reports or not self.ctl.has(f"{prefix}/{r}"):
                    continue
                rep = self.ctl.get(f"{prefix}/{r}")
                if rep.get("pid") == self.members.get(r):
                    reports[r] = rep
            if len(reports) == len(ranks):
                return reports
            self._watch()
            gone = [r for r in ranks if r not in reports and r in self.dead]
            if gone:
                r = gone[0]
                self.state = "broken"
                raise group.RankDied(f"MultiNPU: {self.spec.describe_rank(r)} died while {what} ({self.dead[r]}); "
                               "it is being replaced")
            if time.monotonic() >= deadline:
                late = [r for r in ranks if r not in reports]
                raise group.GroupError(f"MultiNPU: {', '.join(self.spec.describe_rank(r) for r in late)} did not finish "
                                 f"{what} within {timeout:g} s")
            time.sleep(group.POLL)

    def _after_failure(self, exc: BaseException, name: str, n: int) -> BaseException:
        """Break the generation and find the root cause of a failed command."""
        self.state = "broken"
        self._ranks_changed = True
        self._close_generation()  # the others leave their collectives now instead of at the timeout
        self._put_state()
        if not isinstance(exc, comfy.multinpu.CollectiveError):
            return exc  # rank 0 itself failed first (an interrupt, an OOM on rank 0): the others followed
        t0 = time.monotonic()
        g = self.generation
        reports = {}
        deadline = time.monotonic() + ERROR_WAIT
        while True:
            for r in range(1, self.world_size):
                if r not in reports and self.ctl.has(f"err/{g}/{n}/{r}"):
                    reports[r] = self.ctl.get(f"err/{g}/{n}/{r}")
            self._watch()
            settled = all(r in reports or r in self.dead for r in range(1, self.world_size))
            if self.dead:
                # a death is a root cause by itself: a live rank blocked on the dead one may only fail at
                # the collective timeout, so its report is waited for briefly
                deadline = min(deadline, t0 + DEATH_WAIT)
            if settled or time.monotonic() >= deadline:
                break
            time.sleep(group.POLL)
        logging.debug(f"MultiNPU: {name} failed ({exc}); reports from {sorted(reports)}, dead {sorted(self.dead)} "
                      f"after {time.monotonic() - t0:.2f} s")
        primary = {r: rep for r, rep in reports.items() if not rep.get("collective")}
        if primary:
            r = min(primary)
            return _rank_exception(self.spec, r, primary[r], name)
        dead = sorted(r for r in self.dead if r in self.members)
        if dead:
            r = dead[0]
            return group.RankDied(f"MultiNPU: {self.spec.describe_rank(r)} died during {name} ({self.dead[r]}); the "
                            "group is re-formed with its replacement for the next command")
        return exc

    # -- frees and drops --

    def request_free(self):
        """The workers unload their models with rank 0's (POST /free, the OOM handler); sent before the next
        command, since the caller may be the prompt thread inside a failed command."""
        self._free_pending = True

    # -- the ranks file --

    def ranks(self) -> list:
        out = []
        me = group.process_identity(os.getpid())
        out.append({"rank": 0, "node": 0, "local_rank": 0, "host": socket.gethostname(),
                    "device": str(self.device), **me, "alive": True, "joined": self.state == "ready",
                    "restarts": 0, "last_exit": None})
        for rank in range(1, self.world_size):
            if self.spec.node_of(rank) == 0:
                info = dict(self._local.info[rank])
            else:
                info = {"rank": rank, "node": self.spec.node_of(rank), "local_rank": rank % self.spec.local_size,
                        "device": self.spec.device_name(rank)}
                announced = self._mon.peek(f"worker/{rank}") if self.ctl is not None else None
                if announced:
                    info.update({k: announced[k] for k in ("host", "pid", "create_time", "cmdline")})
                exited = self._remote_exits.get(rank)
                info["alive"] = bool(announced) and not (exited and exited["pid"] == announced["pid"])
                info["last_exit"] = exited["reason"] if exited else None
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
        group.write_ranks_file(self.spec.runtime_root, {
            "role": "rank0", "pid": os.getpid(), "updated": group.now(), "state": self.state, "error": self.error,
            "generation": self.generation, "world_size": self.world_size, "backend": self.spec.backend,
            "master": f"{self.spec.master_addr}:{self.port}", "nnodes": self.spec.nnodes,
            "commands": self.commands, "ranks": ranks})


def _rank_exception(spec: group.GroupSpec, rank: int, report: dict, what: str) -> BaseException:
    where = f"{spec.describe_rank(rank)}, pid {report.get('pid')}"
    message = f"MultiNPU: {where} failed in {what}: {report.get('type')}: {report.get('message')}"
    if report.get("oom"):
        # torch's own OOM type, so ComfyUI's handler unloads the models and the user can retry
        return torch.OutOfMemoryError(f"MultiNPU: {where} ran out of memory in {what}: {report.get('message')}")
    exc = group.RankFailed(message)
    exc.remote_traceback = report.get("traceback")
    return exc


def _abort_group():
    # hccl/nccl: a collective waiting for a dead peer does not return by itself before HCCL_EXEC_TIMEOUT /
    # the NCCL watchdog; abort it. torch's documented abort, unmeasured on Ascend and CUDA hardware.
    try:
        torch.distributed.distributed_c10d._abort_process_group()
    except Exception as e:
        logging.warning(f"MultiNPU: could not abort the process group: {e}")


# ---- rank 0's runtime in this process --------------------------------------------------------------

_RUNTIME = None


def get_runtime():
    """The GroupRuntime of this process when it is rank 0 of a process group, else None (threads)."""
    return _RUNTIME


def start_runtime(spec: group.GroupSpec, key: str, device=None) -> GroupRuntime:
    global _RUNTIME
    if _RUNTIME is not None:
        raise group.GroupError("MultiNPU: this process already runs a process group")
    _RUNTIME = GroupRuntime(spec, key, device).start()
    return _RUNTIME


def stop_runtime():
    global _RUNTIME
    if _RUNTIME is not None:
        _RUNTIME.shutdown()
        _RUNTIME = None


def start_from_environment(device=None):
    """Start rank 0's runtime when h3kit started this server with the process transport (H3KIT_GROUP set)."""
    text = os.environ.get(group.GROUP_ENV)
    if not text:
        return None
    spec = group.GroupSpec.from_json(text)
    if spec.node_rank != 0:
        raise group.GroupError(f"MultiNPU: {group.GROUP_ENV} names node {spec.node_rank}; ComfyUI runs on node 0 only")
    spec.worker_args = list(sys.argv[1:])  # the workers parse the server's ComfyUI arguments
    return start_runtime(spec, group.key_from_environment().decode(), device)


def wait_ready(runtime: GroupRuntime, timeout: float):
    """Block until the group has formed (scripts that drive it directly); group.GroupError when it cannot."""
    deadline = time.monotonic() + timeout
    while runtime.state != "ready":
        if runtime.state == "failed":
            raise group.GroupError(f"MultiNPU: the process group failed: {runtime.error}")
        if time.monotonic() > deadline:
            raise group.GroupError(f"MultiNPU: the process group did not form within {timeout:g} s")
        time.sleep(group.POLL)

