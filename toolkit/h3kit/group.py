"""The process group of a service: one process per device (`h3kit start --transport process`).

With the process transport the ComfyUI server drives a torch.distributed group without being a rank of it: it
starts one worker process per device of its host, rank 0 included (comfy/multinpu_process.py, added by the
patch series). On a group of
several hosts, `h3kit start --nnodes N --node-rank R --master-addr HOST --master-port P` on every other host
runs that host's agent instead of ComfyUI; the agent starts and replaces the host's workers.

This module is the service side of it: the settings and their checks, the environment the server or the
agent is started with (H3KIT_GROUP, the JSON the runtime reads, and H3KIT_GROUP_KEY, the secret that signs
its control messages), and what the ranks file the runtime keeps in the runtime root says: every rank's
pid, start time, device, whether it is alive (verified here for the ranks of this host) and joined.
It never imports torch.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from h3kit import proc
from h3kit.errors import UsageError

TRANSPORTS = ("process", "threads")
# The group contract: what this side writes and comfy/multinpu_wire.py (the ComfyUI interpreter, which this one
# cannot import) reads. Both copies are pinned equal by tests/test_group_contract.py.
DEFAULT_JOIN_TIMEOUT = 300.0
# The group (collective) timeout: every collective and wait of the ranks, behind h3kit's own detectors (heartbeat,
# progress). The runtime's default (comfy.multinpu.DEFAULT_TIMEOUT) everywhere but npu; on npu 900 s, the least
# round figure that keeps HCCL_CONNECT_TIMEOUT at torch_npu's advised 600 s in order below it (connect + 20 <=
# HCCL_EXEC_TIMEOUT, a multiple of 68, < the group timeout: 620 <= 884 < 900; comfy/multinpu_links.py). A longer
# timeout costs nothing while the detectors name a failed rank first (60 s progress bound, 15 s heartbeat).
DEFAULT_GROUP_TIMEOUT = 300.0
NPU_GROUP_TIMEOUT = 900.0
GROUP_TIMEOUT_RANGE = (120.0, 86400.0)
GROUP_ENV = "H3KIT_GROUP"            # read by comfy/multinpu_wire.py
KEY_ENV = "H3KIT_GROUP_KEY"
AGENT_MODULE = "comfy.multinpu_group"
RANKS_FILE = "ranks.json"            # written by the runtime: the driver (node 0) or the agent (other nodes)
KEY_FILE = "group.key"


@dataclass
class GroupSettings:
    transport: str = "threads"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0               # 0: h3kit picks a free port on the master address at start
    join_timeout: float = DEFAULT_JOIN_TIMEOUT
    timeout: float | None = None       # the group timeout; None: the runtime's default (records before 2026-12-06)

    @property
    def is_process(self) -> bool:
        return self.transport == "process"

    @property
    def is_agent(self) -> bool:
        return self.is_process and self.node_rank > 0

    def as_dict(self) -> dict:
        return {"transport": self.transport, "nnodes": self.nnodes, "node_rank": self.node_rank,
                "master_addr": self.master_addr, "master_port": self.master_port, "join_timeout": self.join_timeout,
                "group_timeout": self.timeout}


def default_transport(device_type: str) -> str:
    """process on NPU and CUDA (HCCL/NCCL kernels, several hosts); threads on the CPU simulation."""
    return "threads" if device_type == "cpu" else "process"


def default_group_timeout(device_type: str) -> float:
    """The group timeout `h3kit start` gives a process group on `device_type` (see NPU_GROUP_TIMEOUT)."""
    return NPU_GROUP_TIMEOUT if device_type == "npu" else DEFAULT_GROUP_TIMEOUT


def resolve(device_type: str, transport: str = "auto", nnodes: int = 1, node_rank: int = 0,
            master_addr: str = "127.0.0.1", master_port: int = 0,
            join_timeout: float = DEFAULT_JOIN_TIMEOUT, group_timeout: float | None = None) -> GroupSettings:
    """Checked settings (UsageError naming the fix otherwise); nothing is written or started. group_timeout: None
    for the device type's default (default_group_timeout), with the process transport only."""
    if transport == "auto":
        transport = "process" if nnodes > 1 else default_transport(device_type)
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown transport {transport!r}", code="bad_transport", hint="use process or threads")
    if group_timeout is not None and transport != "process":
        raise UsageError("--group-timeout applies to a process group", code="bad_group",
                         hint="add --transport process, or drop --group-timeout (threads wait the runtime's "
                              f"{DEFAULT_GROUP_TIMEOUT:g} s)")
    lo, hi = GROUP_TIMEOUT_RANGE
    if group_timeout is not None and not lo <= group_timeout <= hi:
        raise UsageError(f"--group-timeout {group_timeout:g} s is out of range", code="bad_group",
                         hint=f"from {lo:g} to {hi:g} s: it must outlast h3kit's detectors (60 s progress bound) and "
                              "HCCL's least timeouts; the default is "
                              f"{NPU_GROUP_TIMEOUT:g} s on npu, {DEFAULT_GROUP_TIMEOUT:g} s elsewhere")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}", code="bad_group",
                         hint="number the hosts 0 .. nnodes-1; node 0 runs ComfyUI")
    if nnodes > 1 and transport != "process":
        raise UsageError("several hosts need the process transport", code="bad_group",
                         hint="drop --transport threads (one process per device spans hosts; threads cannot)")
    try:
        addr = ipaddress.ip_address(master_addr)
    except ValueError:
        raise UsageError(f"--master-addr {master_addr!r} is not an IP address", code="bad_master_addr",
                         hint="give node 0's address on the network the hosts share (HCCL and gloo need an IP)") from None
    if nnodes > 1 and master_port == 0:
        raise UsageError("a group of several hosts needs --master-port", code="bad_group",
                         hint="choose a port that is free on node 0 and open between the hosts, e.g. 29500, "
                              "and give every host the same --master-addr and --master-port")
    if nnodes > 1 and not os.environ.get(KEY_ENV):
        raise UsageError(f"a group of several hosts needs {KEY_ENV}", code="no_group_key",
                         hint=f"set the same secret on every host before h3kit start, e.g. "
                              f"export {KEY_ENV}=$(openssl rand -hex 32); it signs the group's control messages")
    if node_rank == 0 and transport == "process":
        _check_local(str(addr))
    if transport == "process" and nnodes == 1 and not addr.is_loopback:
        raise UsageError(f"--master-addr {master_addr}: a one-host group keeps its rendezvous on the loopback",
                         code="bad_master_addr", hint="drop --master-addr (127.0.0.1), or give --nnodes for several hosts")
    if nnodes > 1 and master_port == 65535:
        raise UsageError(f"--master-port {master_port}: with several hosts the command channel listens on the next "
                         "port (master port + 1)", code="bad_group",
                         hint="choose a port below 65535 whose next port is free too")
    timeout = (group_timeout if group_timeout is not None else default_group_timeout(device_type)) \
        if transport == "process" else None
    return GroupSettings(transport, nnodes, node_rank, str(addr), master_port, join_timeout, timeout)


def _check_local(addr: str):
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            raise UsageError(f"--master-addr {addr} is not an address of this host, which runs node 0",
                             code="bad_master_addr",
                             hint="run node 0 (ComfyUI and the group's rendezvous) on the host that owns the master "
                                  "address") from None


def choose_port(addr: str) -> int:
    """A free port on `addr` (the kernel's choice, so it never takes one by force)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


# The ports of the servers of one host, in ranges of their own (docs/service.md, "Several servers on one host"):
# a server's ranges follow from the lowest device id it runs on, and servers of one host run on disjoint devices.
HCCL_PORT_ENV = "H3KIT_HCCL_BASE_PORT"  # read by comfy/multinpu_wire.py: the first port of this server's HCCL band
HCCL_PORT_START = 60000              # HCCL's own default HCCL_IF_BASE_PORT: the host's first band
HCCL_PORTS = 16                      # ports HCCL may take from its base port
HCCL_PORT_SLOTS = 16                 # generations before a base port comes round again
HCCL_BAND = HCCL_PORTS * HCCL_PORT_SLOTS
STORE_PORT_START = 29500             # torch.distributed's customary store port: the host's first store range
STORE_PORTS = 64                     # a server's store range (one host, no --master-port): below the kernel's
#                                      ephemeral ports (32768 and up), so no outgoing connection lands in it


def hccl_band(devices: list[int], env: dict | None = None) -> int:
    """The first port of the HCCL band of the server on `devices`: the host's base (H3KIT_HCCL_BASE_PORT in
    h3kit's environment, else 60000) plus one band of 256 ports per device id below the server's lowest; the
    runtime rotates each generation's HCCL_IF_BASE_PORT within it. UsageError when it does not fit."""
    raw = (os.environ if env is None else env).get(HCCL_PORT_ENV) or str(HCCL_PORT_START)
    try:
        base = int(raw)
    except ValueError:
        base = -1
    start = base + min(devices) * HCCL_BAND
    if base < 1024 or start + HCCL_BAND - 1 > 65535:
        raise UsageError(f"{HCCL_PORT_ENV}={raw} leaves no HCCL band of {HCCL_BAND} ports for device {min(devices)}",
                         code="bad_hccl_port",
                         hint=f"unset it (60000), or give the host's first HCCL port, from 1024 to "
                              f"{65536 - HCCL_BAND * (min(devices) + 1)}: each server takes {HCCL_BAND} ports per "
                              "device id below its lowest")
    return start


def store_ports(devices: list[int]) -> range:
    """The range the store port of the server on `devices` is chosen from on one host (no --master-port)."""
    first = STORE_PORT_START + min(devices) * STORE_PORTS
    return range(first, first + STORE_PORTS)


def choose_store_port(addr: str, devices: list[int]) -> int:
    """A free port of the server's store range on `addr`, at random among the free ones (two starts at once seldom
    meet); UsageError naming --master-port when the whole range is taken. Never a port by force."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    ports = list(store_ports(devices))
    random.shuffle(ports)
    for port in ports:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
            return port
    raise UsageError(f"every port of the group's store range {ports and min(ports)}-{ports and max(ports)} on {addr} "
                     "is in use", code="no_store_port",
                     hint="pass --master-port with a free port; h3kit never takes a port by force")


CHANNEL_PORT_OFFSET = 1  # comfy.multinpu_wire's: the command channel's TCP listener for the other hosts


def rendezvous_ports(settings: GroupSettings) -> list[int]:
    """The ports node 0 listens on for the group: the control store's and, with several hosts, the command
    channel's (where the other hosts' workers and agents beat) on the next."""
    return [settings.master_port] + ([settings.master_port + CHANNEL_PORT_OFFSET] if settings.nnodes > 1 else [])


def group_key(root: Path, settings: GroupSettings) -> str:
    """The secret signing the group's messages: H3KIT_GROUP_KEY when set (several hosts share it), else the
    one kept in <root>/group.key (mode 0600), made on the first start, so restart keeps it."""
    key = os.environ.get(KEY_ENV)
    if key:
        return key
    path = root / KEY_FILE
    try:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            value = path.read_text().strip()
            if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
                return value
    except FileNotFoundError:
        pass
    value = os.urandom(32).hex()
    tmp = root / f".{KEY_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
    return value


def environment(settings: GroupSettings, device_type: str, devices: list[int], root: Path, key: str,
                worker_args: list[str]) -> dict:
    """The variables the server (node 0) or the agent (other nodes) starts with. worker_args: the ComfyUI
    arguments an agent's workers parse (the server gives its workers its own)."""
    spec = {"nnodes": settings.nnodes, "node_rank": settings.node_rank, "local_size": len(devices),
            "device_type": device_type, "master_addr": settings.master_addr,
            "master_port": settings.master_port, "join_timeout": settings.join_timeout,
            "runtime_root": str(root), "worker_args": list(worker_args)}
    if settings.timeout is not None:
        spec["timeout"] = settings.timeout
    return {GROUP_ENV: json.dumps(spec), KEY_ENV: key, HCCL_PORT_ENV: str(hccl_band(devices))}


def agent_argv(python: str) -> list[str]:
    return [python, "-B", "-m", AGENT_MODULE]


WORKER_MODULE = "comfy.multinpu_worker"
# the fork server a CPU group's workers are forked from (comfy.multinpu_zygote): a forked worker's command line is its
ZYGOTE_MODULE = "comfy.multinpu_zygote"


def runs_module(cmdline, module: str) -> bool:
    """Does this command line run `python ... -m module`?"""
    cmd = list(cmdline)
    return any(a == "-m" and i + 1 < len(cmd) and cmd[i + 1] == module for i, a in enumerate(cmd))


def module_owner(comfy_home: str, *modules: str):
    """The check that a live process is the group process h3kit launched from `comfy_home`: it runs
    `-m module` (the agent or a worker; one of `modules`) in that tree. Returns a function of a psutil.Process
    giving the reason it is not, or None."""
    home = os.path.realpath(comfy_home)

    def check(p) -> str | None:
        if not any(runs_module(p.cmdline(), m) for m in modules):
            return f"it does not run {' or '.join(modules)}"
        where = os.path.realpath(p.cwd())
        if where != home:
            return f"it runs in {where}, not in {home}"
        return None

    return check


def read_ranks(root: Path) -> dict | None:
    """The runtime's ranks file, or None when there is none (yet) or it is not readable JSON."""
    path = root / RANKS_FILE
    try:
        if path.stat().st_size > 1 << 20:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("ranks"), list) else None


def ranks_view(root: Path, server_pid: int, node_rank: int, comfy_home: str) -> dict:
    """What status shows: the group's state and every rank, with `alive` verified here for the workers of
    this host (pid, start time and command line must still match, and it must be a worker running in
    `comfy_home`) and taken from the driver's monitor for the others. {"state", "error", "generation",
    "world_size", "ranks": [...], "file": bool}."""
    worker = module_owner(comfy_home, WORKER_MODULE, ZYGOTE_MODULE)
    data = read_ranks(root)
    if data is None:
        return {"state": "unknown", "error": f"no {RANKS_FILE} under {root} yet", "ranks": [], "file": False}
    if data.get("pid") != server_pid:
        # written by a previous run of the service: says nothing about this one
        return {"state": "unknown", "error": f"{RANKS_FILE} is from another run (pid {data.get('pid')})",
                "ranks": [], "file": True}
    out = {k: data.get(k) for k in ("state", "error", "generation", "world_size", "backend", "master", "nnodes")}
    ranks = []
    for r in data["ranks"]:
        if not isinstance(r, dict):
            continue
        item = {k: r.get(k) for k in ("rank", "node", "local_rank", "host", "device", "pid", "create_time",
                                       "joined", "restarts", "last_exit")}
        if r.get("node") == node_rank and isinstance(r.get("pid"), int) and r.get("create_time"):
            # every rank is a worker process (the server is no rank)
            item["alive"] = proc.verify(r["pid"], r["create_time"], r.get("cmdline") or [], owner=worker).alive
        else:
            item["alive"] = bool(r.get("alive"))
        ranks.append(item)
    out["ranks"] = ranks
    out["file"] = True
    return out


def ready(view: dict, node_rank: int) -> tuple[bool, str]:
    """(True, "") when the group has formed and every rank listed is alive and joined; else why not."""
    if view["state"] == "failed":
        return False, f"the process group failed: {view.get('error')}"
    if view["state"] != "ready":
        return False, f"the process group is {view['state']}" + (f" ({view['error']})" if view.get("error") else "")
    down = [r for r in view["ranks"] if not (r.get("alive") and r.get("joined"))]
    if down:
        names = ", ".join(f"rank {r.get('rank')} ({'not alive' if not r.get('alive') else 'not joined'})" for r in down)
        return False, f"not every rank is alive and joined: {names}"
    expected = view.get("world_size") if node_rank == 0 else None
    if expected and len(view["ranks"]) != expected:
        return False, f"{len(view['ranks'])} of {expected} ranks listed"
    return True, ""
