"""The service's records and locks: the runtime root's layout, server.json (every field validated when read:
`RECORD_FIELDS`, `read_record`), the settings a server starts with (`StartSpec`, `server_argv`), the check that a
live process is the server a record names (`server_owner`), and `service_lock`; with the service's constants and
errors. Nothing here starts or signals a process."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import json
import math
import os
import shutil
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from h3kit import comfyargs, group, health, locks, proc
from h3kit import devices as h3devices
from h3kit.errors import H3kitError, UsageError

DEFAULT_PORT = 8189
DEFAULT_LISTEN = "127.0.0.1"
# The first load of the H3 weights on four NPUs takes minutes; the boot itself takes 9-20 s on CPU.
DEFAULT_START_TIMEOUT = 900.0
DEFAULT_GRACE = 10.0                 # SIGTERM to SIGKILL
KILL_WAIT = 5.0                      # after SIGKILL, before reporting survivors
PORT_WAIT = 15.0                     # for the port to be free once the process has gone
LOCK_WAIT = 10.0                     # for another h3kit command to finish starting or stopping
PROGRESS_EVERY = 5.0
POLL_ENV = "H3KIT_POLL_INTERVAL"     # seconds between health polls while starting (default 0.05)
RUNTIME_ROOT_ENV = "H3KIT_RUNTIME_ROOT"

RECORD_NAME = "server.json"
LOCK_NAME = "service.lock"
LOG_DIR = "logs"
LATEST = "latest"

Progress = Callable[[str], None]


class ServiceError(H3kitError):
    code = "service_error"


class PortInUse(ServiceError):
    code = "port_in_use"


class StartFailed(ServiceError):
    code = "start_failed"


class StopFailed(ServiceError):
    code = "stop_failed"


class QueueBusy(ServiceError):
    code = "queue_busy"


class NotStarted(ServiceError):
    code = "not_started"


class LockBusy(ServiceError):
    code = "lock_busy"


class BadRecord(ServiceError):
    code = "bad_record"


def _noop(_msg: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------- layout


def runtime_root(comfy_home: str | os.PathLike | None, override: str | os.PathLike | None = None) -> Path:
    if override:
        return Path(override).expanduser().resolve()
    if not comfy_home:
        raise UsageError("no ComfyUI home given", code="no_comfy_home",
                         hint="pass --comfy-home DIR (or set H3KIT_COMFY_HOME), or --runtime-root DIR")
    return Path(comfy_home).expanduser().resolve() / ".h3kit" / "run"


def record_path(root: Path) -> Path:
    return root / RECORD_NAME


def latest_log(root: Path) -> Path:
    return root / LOG_DIR / LATEST


# ---------------------------------------------------------------------------------------------- record


@dataclass
class Record:
    pid: int
    create_time: float
    cmdline: list[str]
    port: int
    listen: str
    device_type: str
    devices: list[int]
    python: str
    comfy_home: str
    log: str
    extra_args: list[str] = field(default_factory=list)
    started_at: str = ""
    # the process group (h3kit.group); a record without these fields is a one-process server
    transport: str = "threads"
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    join_timeout: float = group.DEFAULT_JOIN_TIMEOUT
    group_timeout: float | None = None  # None: the runtime's default (records written before 2026-12-06)
    launcher: str | None = None        # written by h3kit before 2026-12-02 (torchrun or h3kit launched the workers); unread

    @property
    def url(self) -> str:
        return health.base_url(proc.probe_host(self.listen), self.port)

    @property
    def group(self) -> group.GroupSettings:
        return group.GroupSettings(self.transport, self.nnodes, self.node_rank, self.master_addr,
                                   self.master_port, self.join_timeout, self.group_timeout)

    def verify(self) -> proc.Verdict:
        return proc.verify(self.pid, self.create_time, self.cmdline,
                           owner=server_owner(self.comfy_home, self.python, self.cmdline))

    def identity(self) -> proc.Identity:
        return proc.Identity(self.pid, self.create_time, tuple(self.cmdline))

    def spec(self) -> "StartSpec":
        return StartSpec(comfy_home=self.comfy_home, devices=list(self.devices), device_type=self.device_type,
                         port=self.port, listen=self.listen, python=self.python,
                         extra_args=list(self.extra_args), group=self.group)


def server_owner(comfy_home: str, python: str, cmdline: list[str]):
    """The check that a live process is the ComfyUI server of `comfy_home` that h3kit launched (its main.py is
    the tree's, resolved against the process's own working folder), or, on another host of a process group,
    the group's agent h3kit launched from that tree (h3kit.group.module_owner), and that its executable is
    the recorded interpreter (for a wrapper script, which execs Python, the executable the record's command
    line names). Returns the reason it is not, or None."""
    main = os.path.realpath(os.path.join(comfy_home, "main.py"))
    wrapper = _is_script(python)
    allowed = {os.path.realpath(shutil.which(cmdline[0]) or cmdline[0])} if wrapper else {os.path.realpath(python)}
    agent = group.module_owner(comfy_home, group.AGENT_MODULE) if group.runs_module(cmdline, group.AGENT_MODULE) else None

    def check(p) -> str | None:
        cmd = p.cmdline()
        if agent is not None:
            why = agent(p)
            if why:
                return why
        else:
            arg = next((a for a in cmd if os.path.basename(a) == "main.py"), None)
            if arg is None:
                return "it runs no main.py"
            where = os.path.realpath(os.path.join(p.cwd(), arg))
            if where != main:
                return f"it runs {where}, not {main}"
        exe = os.path.realpath(p.exe())
        if exe not in allowed:
            return f"its interpreter is {exe}, not the one h3kit launched ({python})"
        return None

    return check


def _is_script(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


# The fields of server.json and how each is checked; `_cross_check` then ties them together. A new field
# (the worker processes of a multi-process runtime, say) is one entry here and one field of Record.
MAX_STR = 4096


def _int_range(lo: int, hi: int):
    def check(v, ctx):
        if type(v) is not int or not lo <= v <= hi:
            raise ValueError(f"must be an integer from {lo} to {hi}")
        return v
    return check


def _time(v, ctx):
    if type(v) not in (int, float) or not math.isfinite(v) or v <= 0:
        raise ValueError("must be a positive number of seconds")
    return float(v)


def _time_or_none(v, ctx):
    return None if v is None else _time(v, ctx)


def _text(v, ctx):
    if not isinstance(v, str) or len(v) > MAX_STR or "\0" in v:
        raise ValueError(f"must be a string under {MAX_STR} characters")
    return v


def _abs_path(v, ctx):
    if not _text(v, ctx) or not os.path.isabs(v):
        raise ValueError("must be an absolute path")
    return v


def _str_list(v, ctx):
    if not isinstance(v, list) or len(v) > comfyargs.MAX_ARGS + 16:
        raise ValueError("must be a list of strings")
    return [_text(x, ctx) for x in v]


def _cmdline(v, ctx):
    v = _str_list(v, ctx)
    if not any(os.path.basename(a) == "main.py" for a in v) and not group.runs_module(v, group.AGENT_MODULE):
        raise ValueError(f"does not run main.py (nor the group agent, {group.AGENT_MODULE})")
    return v


def _transport(v, ctx):
    if v not in group.TRANSPORTS:
        raise ValueError(f"must be one of {', '.join(group.TRANSPORTS)}")
    return v


def _launcher(v, ctx):
    if v not in ("torchrun", "h3kit", None):  # a record of an earlier h3kit, which had two launchers
        raise ValueError("must be torchrun, h3kit or null")
    return v


def _listen(v, ctx):
    try:
        return str(ipaddress.ip_address(_text(v, ctx)))
    except ValueError:
        raise ValueError("must be one IP address") from None


def _device_type(v, ctx):
    if v not in h3devices.DEVICE_TYPES:
        raise ValueError(f"must be one of {', '.join(h3devices.DEVICE_TYPES)}")
    return v


def _devices(v, ctx):
    try:
        return h3devices.check_device_ids(v)
    except UsageError as e:
        raise ValueError(e.message) from None


def _log(v, ctx):
    path = Path(_abs_path(v, ctx))
    logs = (ctx["root"] / LOG_DIR).resolve()
    if path.parent.resolve() != logs or not path.name.startswith("comfyui-"):
        raise ValueError(f"must be a log under {logs}")
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO or a link to /dev/zero
        raise ValueError("is not a regular file")
    return v


RECORD_FIELDS = {
    # name: (check, required)
    "pid": (_int_range(2, 2 ** 22), True),        # never 0, 1 or negative: kill(0) would hit our own group
    "create_time": (_time, True),
    "cmdline": (_cmdline, True),
    "port": (_int_range(1, 65535), True),
    "listen": (_listen, True),
    "device_type": (_device_type, True),
    "devices": (_devices, True),
    "python": (_abs_path, True),
    "comfy_home": (_abs_path, True),
    "log": (_log, True),
    "extra_args": (_str_list, False),
    "started_at": (_text, False),
    # the process group (h3kit.group): absent in a one-process server's record
    "transport": (_transport, False),
    "nnodes": (_int_range(1, 64), False),
    "node_rank": (_int_range(0, 63), False),
    "master_addr": (_listen, False),
    "master_port": (_int_range(0, 65535), False),
    "join_timeout": (_time, False),
    "group_timeout": (_time_or_none, False),
    "launcher": (_launcher, False),
}


def _cross_check(rec: Record, comfy_home: str | None) -> None:
    if comfy_home and os.path.realpath(rec.comfy_home) != os.path.realpath(comfy_home):
        raise ValueError(f"it names another ComfyUI tree ({rec.comfy_home})")
    if rec.node_rank >= rec.nnodes or (rec.nnodes > 1 and rec.transport != "process"):
        raise ValueError(f"node {rec.node_rank} of {rec.nnodes} with the {rec.transport} transport is not a group")
    spec = rec.spec()
    if spec.group.is_agent:
        expected = group.agent_argv(rec.python)[1:]  # an agent runs no main.py: all but the interpreter
        if rec.cmdline[1:] != expected:
            raise ValueError(f"its command line is not the group agent's ({' '.join(expected)})")
    elif proc.server_args(rec.cmdline) != server_argv(rec.python, spec)[2:]:  # from main.py on
        raise ValueError("its command line does not match its port, address, device type and extra arguments")
    try:
        comfyargs.check(Path(rec.comfy_home), rec.extra_args, _own_args(spec), rec.device_type)
    except UsageError as e:
        raise ValueError(f"extra_args: {e.message}") from None


def read_record(root: Path, comfy_home: str | os.PathLike | None = None) -> Record | None:
    """The record under `root`, every field validated; None when there is none. Raises BadRecord for
    anything h3kit would not have written (nothing is signalled on the word of such a record)."""
    path = record_path(root)
    try:
        if path.is_file() and path.stat().st_size > 1 << 20:
            raise ValueError("it is larger than any record h3kit writes")
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("it is not a JSON object")
        unknown = sorted(set(data) - set(RECORD_FIELDS))
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)[:200]}")
        ctx = {"root": root}
        values = {}
        for name, (check, required) in RECORD_FIELDS.items():
            if name not in data:
                if required:
                    raise ValueError(f"{name} is missing")
                continue
            try:
                values[name] = check(data[name], ctx)
            except ValueError as e:
                raise ValueError(f"{name} {e}") from None
        rec = Record(**values)
        _cross_check(rec, str(comfy_home) if comfy_home else None)
        return rec
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise BadRecord(f"{path} is not a valid server record: {e}",
                        hint="nothing was signalled; if no server runs, delete the file (then h3kit start)"
                        ) from None


def write_record(root: Path, rec: Record) -> None:
    path = record_path(root)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(rec), indent=2) + "\n")
    os.replace(tmp, path)


def remove_record(root: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        record_path(root).unlink()


def _not_writable(root: Path, e: OSError) -> ServiceError:
    why = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "permission denied", errno.ENOTDIR: "a part of the path is a file",
           errno.ENOSPC: "no space left on the device"}.get(e.errno, e.strerror or str(e))
    return ServiceError(f"cannot write the runtime root {root}: {why}", code="runtime_root_not_writable",
                        hint="h3kit keeps the server's record, lock and logs there: choose a folder you can "
                             "write to (--runtime-root or H3KIT_RUNTIME_ROOT); nothing was started or signalled")


@contextlib.contextmanager
def service_lock(root: Path, wait: float = LOCK_WAIT, *, home: str | os.PathLike | None = None,
                 progress: Progress | None = None, name: str = LOCK_NAME):
    """Hold the tree lock of `home` (when given; shared, so the other servers of the tree start and stop
    meanwhile, but install and revert wait), then `<root>/service.lock` (this server's own), while starting or
    stopping; another holder makes this wait, then fail naming it."""
    # the tree lock is created only in a ComfyUI tree: a record naming another folder must not litter it
    tree = Path(home) if home else None
    with (locks.tree_lock(tree, create=(tree / "main.py").is_file(), progress=progress, shared=True) if tree
          else contextlib.nullcontext()):
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise _not_writable(root, e) from None
        try:
            deadline = time.monotonic() + wait
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                        raise LockBusy(f"another h3kit command (pid {holder}) is starting or stopping the "
                                       f"server under {root}", hint="wait for it to finish, then run this again"
                                       ) from None
                    time.sleep(0.1)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock


# ---------------------------------------------------------------------------------------------- what a record starts


@dataclass
class StartSpec:
    comfy_home: str
    devices: list[int]
    device_type: str = "cpu"
    port: int = DEFAULT_PORT
    listen: str = DEFAULT_LISTEN
    python: str | None = None
    extra_args: list[str] = field(default_factory=list)
    group: group.GroupSettings = field(default_factory=group.GroupSettings)


def _own_args(spec: "StartSpec") -> list[str]:
    """The arguments h3kit itself gives main.py, before the extra ones."""
    own = ["--listen", spec.listen, "--port", str(spec.port)]
    if spec.device_type == "cpu" and "--cpu" not in spec.extra_args:
        own.append("--cpu")
    return own


def server_argv(python: str, spec: StartSpec) -> list[str]:
    if spec.group.is_agent:
        return group.agent_argv(python)
    return [python, "-B", "main.py", *_own_args(spec), *spec.extra_args]
