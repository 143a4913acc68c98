"""Run the patched ComfyUI as a service: start, stop, restart and status, with a record on disk.

Layout under the runtime root (`<comfy-home>/.h3kit/run` unless overridden):

    server.json                  the record of the server h3kit started (the contract in docs/service.md)
    service.lock                 held (fcntl.flock) while a command starts or stops the server
    logs/comfyui-<stamp>.log     one file per start: the server's stdout and stderr
    logs/latest                  link to the newest log

With the process transport (h3kit.group) the server is rank 0 of a process group and starts one worker per
other device; on the other hosts of a group the record names the host's agent instead of ComfyUI, and the
runtime keeps `ranks.json` (every rank's pid, start time, device, alive, joined) beside the record.

The record names the process by pid, start time and command line; every command re-checks all three
(h3kit.proc.verify), and that the process is the ComfyUI server of this tree (its main.py is the tree's,
its interpreter the one h3kit launched), before it trusts the pid. A record that fails the check is
"stale": reported, cleaned up by `stop` and `start`, and never acted on. Every field of a record is
validated when it is read (read_record): a record that is not what h3kit writes is `bad_record`, and
nothing is signalled on its word.

Locks: the tree lock of the ComfyUI home (h3kit.locks) first, then service.lock of the runtime root; every
command that starts or stops the server takes both in that order. After a failed start, or once the server has died, the
record stays behind naming the dead process, so `status` can show the last log's first error and `restart`
can start the same settings again.

This module never imports click; progress goes through an optional `progress(message)` callback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import ipaddress
import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from h3kit import cliutil, comfyargs, group, health, locks, logscan, monitoring, proc, queuesave, testhooks
from h3kit import devices as h3devices
from h3kit.errors import H3kitError, NotAComfyTree, UsageError

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
    launcher: str | None = None        # written by h3kit before 2026-12-02 (torchrun or h3kit launched the workers); unread

    @property
    def url(self) -> str:
        return health.base_url(proc.probe_host(self.listen), self.port)

    @property
    def group(self) -> group.GroupSettings:
        return group.GroupSettings(self.transport, self.nnodes, self.node_rank, self.master_addr,
                                   self.master_port, self.join_timeout)

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
                 progress: Progress | None = None):
    """Hold the tree lock of `home` (when given), then `<root>/service.lock`, while starting or stopping;
    another holder makes this wait, then fail naming it."""
    # the tree lock is created only in a ComfyUI tree: a record naming another folder must not litter it
    tree = Path(home) if home else None
    with (locks.tree_lock(tree, create=(tree / "main.py").is_file(), progress=progress) if tree
          else contextlib.nullcontext()):
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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


# ---------------------------------------------------------------------------------------------- start


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


@dataclass
class StartResult:
    record: Record
    already_running: bool
    seconds: float
    devices: list[dict]
    health: str = "healthy"      # for an already running server: what /system_stats said
    stale: str | None = None     # what a stale record said, when one replaced it


def validate_listen(listen: str) -> str:
    try:
        addr = ipaddress.ip_address(listen)
    except ValueError:
        raise UsageError(f"--listen {listen!r} is not an IP address", code="bad_listen",
                         hint="give one address, such as 127.0.0.1 (default) or 0.0.0.0") from None
    import errno
    import socket

    # an address of another machine cannot be listened on: say so now, not as a failed server later
    with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((str(addr), 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise UsageError(f"--listen {listen}: not an address of this machine", code="bad_listen",
                                 hint="use 127.0.0.1 (default), 0.0.0.0 or one of this host's addresses") from None
    return str(addr)


def is_public(listen: str) -> bool:
    return not ipaddress.ip_address(listen).is_loopback


def _own_args(spec: "StartSpec") -> list[str]:
    """The arguments h3kit itself gives main.py, before the extra ones."""
    own = ["--listen", spec.listen, "--port", str(spec.port)]
    if spec.device_type == "cpu" and "--cpu" not in spec.extra_args:
        own.append("--cpu")
    return own


def resolve_python(comfy_home: Path, python: str | None) -> str:
    """--python, else the interpreter install recorded in <comfy-home>/.h3kit/state.json, else this one."""
    source = "--python"
    if not python:
        state = comfy_home / ".h3kit" / "state.json"
        if state.is_file():
            try:
                python = json.loads(state.read_text()).get("python")
                source = str(state)
            except ValueError:
                raise UsageError(f"{state} is not valid JSON", code="bad_state",
                                 hint="rerun h3kit install, or pass --python") from None
    if not python:
        return sys.executable
    if os.sep not in python:  # a bare name such as python3.11: look it up like a shell would
        python = shutil.which(python) or python
    path = Path(python)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise UsageError(f"the Python interpreter {python} (from {source}) is not an executable file",
                         code="bad_python", hint="pass --python with the interpreter that runs ComfyUI")
    return os.path.abspath(path)  # the server runs in the tree: a relative path would name another file


def require_torch(home: Path, python: str, device_type: str, what: str) -> None:
    """Refuse early, naming `h3kit doctor`, an interpreter without torch (or, on npu, torch-npu): the server,
    parity or calibration would otherwise fail late, in a worker or a log. Package metadata only (pyenv's
    probe imports nothing). Skipped for a tree whose ComfyUI does not import torch (no
    comfy/model_management.py: a test stand-in)."""
    if not (Path(home) / "comfy" / "model_management.py").is_file():
        return
    from h3kit import pyenv

    from h3kit import doctor, manifest

    hint = (f"{doctor.torch_install_line(manifest.load(), device_type, python)}; then h3kit doctor --comfy-home {home} "
            f"--python {python} --device-type {device_type} checks the rest; or pass --python the interpreter that "
            "runs ComfyUI")
    try:
        info = pyenv.probe(python)
    except pyenv.PythonEnvError as e:
        raise pyenv.PythonEnvError(e.message, hint=hint) from None
    need = [("torch", "torch")] + ([("torch-npu", "torch_npu")] if device_type == "npu" else [])
    missing = [name for name, key in need if not info.get(key)]
    if missing:
        raise pyenv.PythonEnvError(f"{python} has no {' and no '.join(missing)} installed: {what} cannot run with it",
                                   hint=hint, details={"python": python, "missing": missing})


def child_environment(device_type: str, devices: list[int], base: dict | None = None) -> dict:
    """The environment the server runs with: the visible-device variable for the device kind, and
    unbuffered output so `h3kit logs -f` shows print() output as it happens."""
    env = dict(os.environ if base is None else base)
    if device_type == "cpu":
        env[h3devices.SIM_DEVICES_ENV] = str(len(devices))
    else:
        env[h3devices.VISIBLE_ENV[device_type]] = h3devices.format_device_list(devices)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def server_argv(python: str, spec: StartSpec) -> list[str]:
    if spec.group.is_agent:
        return group.agent_argv(python)
    return [python, "-B", "main.py", *_own_args(spec), *spec.extra_args]


def _new_log(root: Path, header: str) -> Path:
    logs = root / LOG_DIR
    logs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    n = 0
    while True:  # two starts within one second get -1, -2 ... suffixes
        path = logs / (f"comfyui-{stamp}.log" if n == 0 else f"comfyui-{stamp}-{n}.log")
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(header + "\n")
            break
        except FileExistsError:
            n += 1
    link = logs / LATEST
    tmp = logs / f".{LATEST}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(path.name)
    os.replace(tmp, link)
    return path


def _check_port(listen: str, port: int) -> None:
    if proc.port_is_free(listen, port):
        return
    holders = proc.port_holders(port)
    if holders:
        names = "; ".join(_describe_holder(h) for h in holders)
        message = f"port {port} is in use by {names}"
    else:
        message = f"port {port} is in use by a process this user cannot see"
    raise PortInUse(message, details={"port": port, "holders": holders},
                    hint="h3kit never stops a process it did not start: choose another --port, or stop that "
                         "program yourself")


def _wait_port_or_name_holder(listen: str, port: int) -> None:
    """Wait up to PORT_WAIT for the port a server of ours held (it lets go within moments of exiting); a
    process seen listening there is named at once (PortInUse): ours are gone by now, and waiting will not
    move another program."""
    deadline = time.monotonic() + PORT_WAIT
    while not proc.port_is_free(listen, port):
        if proc.port_holders(port) or time.monotonic() >= deadline:
            _check_port(listen, port)
            return
        time.sleep(0.05)


def _describe_holder(h: dict) -> str:
    out = f"pid {h['pid']}"
    if h.get("name"):
        out += f" ({h['name']})"
    if h.get("cmdline"):
        out += ": " + " ".join(h["cmdline"])
    return out


def _poll_interval() -> float:
    try:
        return max(0.01, float(os.environ.get(POLL_ENV, "0.05")))
    except ValueError:
        return 0.05


def start(root: Path, spec: StartSpec, *, timeout: float = DEFAULT_START_TIMEOUT,
          progress: Progress = _noop, announce: str = "") -> StartResult:
    """Start the server and return once /system_stats answers (with the expected devices on npu/cuda).

    When the record names our live server on the same port, nothing starts and `already_running` is set.
    Raises PortInUse when anything else holds the port, StartFailed when the child exits or the deadline
    passes (the child is stopped first; the log's last lines are in the error's details). `announce` is
    said (progress) once every check has passed, right before the server is launched.
    """
    spec = validated(spec)  # before the locks create anything under the runtime root
    require_torch(Path(spec.comfy_home), spec.python, spec.device_type, "ComfyUI")
    with service_lock(root, home=spec.comfy_home, progress=progress):
        return start_locked(root, spec, timeout=timeout, progress=progress, announce=announce)


def validated(spec: StartSpec) -> StartSpec:
    """The spec with its tree, devices, address, port, interpreter and extra arguments checked as `start`
    checks a command line (UsageError otherwise): restart and watch start from a record with the same
    checks."""
    home = Path(spec.comfy_home).expanduser().resolve()
    if not (home / "main.py").is_file():
        raise NotAComfyTree(home)
    if spec.device_type not in h3devices.DEVICE_TYPES:
        raise UsageError(f"unknown device type {spec.device_type!r}", hint="use npu, cuda or cpu")
    if type(spec.port) is not int or not 1 <= spec.port <= 65535:
        raise UsageError(f"port {spec.port!r} is not a port number (1-65535)", code="bad_port")
    out = StartSpec(comfy_home=str(home), devices=h3devices.check_device_ids(spec.devices),
                    device_type=spec.device_type, port=spec.port, listen=validate_listen(spec.listen),
                    python=resolve_python(home, spec.python), extra_args=list(spec.extra_args), group=spec.group)
    out.extra_args = comfyargs.check(home, out.extra_args, _own_args(out), out.device_type)
    return out


def _settings(spec_or_record) -> dict:
    settings = spec_or_record.group.as_dict()
    if settings["nnodes"] == 1 and not settings["master_port"]:
        settings.pop("master_port")  # one host: h3kit picks a free one at every start unless one is asked for
    return {"comfy_home": str(Path(spec_or_record.comfy_home).resolve()), "python": spec_or_record.python,
            "devices": list(spec_or_record.devices), "device_type": spec_or_record.device_type,
            "listen": spec_or_record.listen, "extra_args": list(spec_or_record.extra_args), **settings}


def start_locked(root: Path, spec: StartSpec, *, timeout: float, progress: Progress,
                 replacing: int | None = None, announce: str = "") -> StartResult:
    """start() with the service lock already held (restart and watch hold it across stop and start)."""
    spec = validated(spec)
    home, listen, python = Path(spec.comfy_home), spec.listen, spec.python

    stale = None
    rec = read_record(root)
    if rec is not None:
        verdict = rec.verify()
        if verdict.alive:
            if rec.port != spec.port:
                raise ServiceError(f"h3kit already runs a server from {root} on port {rec.port} (pid {rec.pid})",
                                   code="already_running",
                                   hint="stop it first (h3kit stop), or use h3kit restart")
            running, asked = _settings(rec), _settings(spec)
            differ = {k: {"running": running.get(k), "requested": asked.get(k)}
                      for k in running | asked if running.get(k) != asked.get(k)}
            if differ:
                said = "; ".join(f"{k} {v['running']!r}, not the requested {v['requested']!r}"
                                 for k, v in sorted(differ.items()))
                raise ServiceError(f"h3kit's server on port {rec.port} (pid {rec.pid}) runs with other settings: "
                                   f"{said}", code="already_running_other_settings", details={"differ": differ},
                                   hint="h3kit stop, then start with the new settings (a running server is never "
                                        "reconfigured behind a user's back)")
            got = check(rec, root)
            return StartResult(rec, True, 0.0, got.devices, health=got.reason)
        # The stale record is replaced below, once the new server is spawned: until then it keeps the
        # settings, so a start that fails before spawning (port taken) can still be retried by restart.
        if rec.pid != replacing:  # restart has already said what became of the process it replaces
            stale = verdict.reason
            progress(f"replacing the stale server record: {stale}")

    settings = spec.group
    # a port held by no visible process is waited for (a stopped server's sockets close a moment after it exits,
    # later on a busy host); one a process holds is named at once
    if not settings.is_agent:
        _wait_port_or_name_holder(listen, spec.port)
    if settings.is_process and settings.node_rank == 0:
        if settings.master_port == 0:  # one host (several need --master-port): a free one, at every start
            settings = dataclasses.replace(settings, master_port=group.choose_port(settings.master_addr))
        else:  # honoured on one host too
            for port in group.rendezvous_ports(settings):
                _wait_port_or_name_holder(settings.master_addr, port)

    if announce:
        progress(announce)
    argv = server_argv(python, spec)
    env = child_environment(spec.device_type, spec.devices)
    env[monitoring.RUNTIME_ROOT_ENV] = str(root)  # where its /metrics reads the restarts watch and restart count
    shown = {k: env[k] for k in (h3devices.VISIBLE_ENV[spec.device_type],)}
    if settings.is_process:
        worker_args = (["--cpu"] if spec.device_type == "cpu" and "--cpu" not in spec.extra_args else []) + spec.extra_args
        env.update(group.environment(settings, spec.device_type, spec.devices, root, group.group_key(root, settings),
                                     worker_args))
        shown["transport"] = (f"process, node {settings.node_rank} of {settings.nnodes}, "
                              f"master {settings.master_addr}:{settings.master_port}")
    log = _new_log(root, f"h3kit: {datetime.datetime.now().isoformat(timespec='seconds')} starting in {home}: "
                         f"{' '.join(argv)} with {' '.join(f'{k}={v}' for k, v in shown.items())}")
    t0 = time.monotonic()
    # Ctrl-C or SIGTERM from the server's start until the cleanup below is in place waits (else the server, in its
    # own session, would outlive h3kit: unrecorded, holding the port and the devices); the server starts with the
    # signals as they were
    held = cliutil.hold_signals()
    with open(log, "ab") as out:
        try:
            child = subprocess.Popen(argv, cwd=home, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                     preexec_fn=None if held is None else lambda: cliutil.release_signals(held))
        except BaseException as e:
            cliutil.release_signals(held)
            if isinstance(e, OSError):
                raise StartFailed(f"could not run {python}: {e}", hint="check --python") from None
            raise
    testhooks.point("server-started")
    # Popen returns once exec has succeeded, so /proc already shows the server's own command line.
    try:
        try:
            ident = proc.identify(child.pid)
            cmdline = list(ident.cmdline) or argv
            create_time = ident.create_time
        except proc.PSUTIL_GONE:
            cmdline, create_time = argv, 0.0
        rec = Record(pid=child.pid, create_time=create_time, cmdline=cmdline, port=spec.port, listen=listen,
                     device_type=spec.device_type, devices=list(spec.devices), python=python,
                     comfy_home=str(home), log=str(log), extra_args=list(spec.extra_args),
                     started_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     **spec.group.as_dict())  # the port asked for: 0 on one host picks a free one at every start
        write_record(root, rec)
    except BaseException:  # not recorded: the server goes with the failure, and h3kit gets its signals back
        os.killpg(child.pid, signal.SIGKILL)  # its own session; not reaped yet, so the pid is still its
        child.wait()
        cliutil.release_signals(held)
        raise

    expected = None if spec.device_type == "cpu" else len(spec.devices)
    try:
        progress(f"started pid {child.pid}: {' '.join(argv)}")
        progress(f"log: {log}")
        cliutil.release_signals(held)  # a signal that came meanwhile is raised here, inside the cleanup's try
        got = _wait_healthy(child, rec, expected, t0, timeout, progress, root,
                            on_poll=lambda: _follow_exec(root, rec))
        _follow_exec(root, rec)
    except BaseException as e:
        # A failed (or interrupted) start leaves no server behind; the record stays, naming the dead
        # process, so `status` shows why and `restart` can try the same settings again. The child is
        # not reaped yet, so its pid cannot have been recycled: signalling it is safe.
        if child.poll() is None:
            proc.terminate_group(rec.identity(), grace=DEFAULT_GRACE, kill_wait=KILL_WAIT)
            child.poll()
        if not settings.is_agent:
            proc.wait_port_free(listen, spec.port, PORT_WAIT)
        if isinstance(e, StartFailed):
            e.details = dict(e.details or {}, log=str(log), log_tail=logscan.tail(log, 25))
        cliutil.release_signals(held)  # (again, when what failed came before the release: harmless otherwise)
        raise
    return StartResult(rec, False, time.monotonic() - t0, got.devices, stale=stale)


def _follow_exec(root: Path, rec: Record) -> None:
    """A wrapper interpreter execs Python: record the command line it now runs, so that the identity check
    (which compares the executable too) recognises the server from the moment of the exec."""
    try:
        now = list(proc.identify(rec.pid).cmdline)
    except proc.PSUTIL_GONE:
        return
    if now and now != rec.cmdline and proc.server_args(now) == proc.server_args(rec.cmdline):
        rec.cmdline = now
        write_record(root, rec)


def _wait_healthy(child: subprocess.Popen, rec: Record, expected: int | None, t0: float, timeout: float,
                  progress: Progress, root: Path, on_poll: Callable[[], None] = lambda: None) -> health.Health:
    interval = _poll_interval()
    next_note = t0 + PROGRESS_EVERY
    last = health.Health(False, "not polled yet")
    while True:
        rc = child.poll()
        if rc is not None:
            blk = logscan.first_error(rec.log)
            why = f": {blk.summary}" if blk else ""
            raise StartFailed(f"the server exited with code {rc} before it was healthy{why}",
                              code="server_exited", hint=f"read the log: {rec.log}")
        on_poll()
        # a refused connection returns at once; the timeout only matters for a server that is busy
        last = check(rec, root, expected, timeout=2.0)
        if last.ok:
            return last
        if last.stats is not None and not last.reason.startswith("group:"):
            # it answers but shows the wrong devices: waiting will not change that
            raise StartFailed(f"the server does not see the requested devices: {last.reason}",
                              code="device_mismatch",
                              hint=f"check that devices {h3devices.format_device_list(rec.devices)} exist and "
                                   f"are free ({h3devices.VISIBLE_ENV[rec.device_type]} was set for it)")
        if last.reason.startswith("group: the process group failed"):
            raise StartFailed(f"the {'server' if rec.node_rank == 0 else 'agent'} is up but its {last.reason[7:]}",
                              code="group_failed",
                              hint=f"read the log ({rec.log}); every host of the group runs h3kit start with the "
                                   "same --nnodes, --master-addr, --master-port and device count")
        now = time.monotonic()
        if now - t0 >= timeout:
            raise StartFailed(f"the server was not healthy after {timeout:.0f} s ({last.reason}); stopped it",
                              code="start_timeout",
                              hint=f"read the log ({rec.log}); raise --timeout if the first model load is slow")
        if now >= next_note:
            progress(f"waiting for {rec.url if rec.node_rank == 0 else 'the group'} ({now - t0:.0f} s): {last.reason}")
            next_note = now + PROGRESS_EVERY
        time.sleep(interval)


def check(rec: Record, root: Path, expected: int | None = None, timeout: float = 2.0) -> health.Health:
    """Healthy means: the server answers /system_stats (with `expected` devices when given) and, with the
    process transport, every rank of the group is alive and joined (an agent: its own ranks). A group
    problem's reason starts with "group:"."""
    if rec.group.is_agent:
        got = health.Health(True, "healthy")
    else:
        got = health.check_health(rec.url, expected, timeout=timeout)
        if not got.ok or not rec.group.is_process:
            return got
    ok, why = group.ready(group.ranks_view(root, rec.pid, rec.node_rank, rec.comfy_home), rec.node_rank)
    return got if ok else health.Health(False, f"group: {why}", got.stats)


# ---------------------------------------------------------------------------------------------- stop


@dataclass
class StopResult:
    stopped: bool
    pid: int | None = None
    signals: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""


def stop(root: Path, *, grace: float = DEFAULT_GRACE, progress: Progress = _noop,
         comfy_home: str | os.PathLike | None = None) -> StopResult:
    """Stop the recorded server if it is still the process h3kit started; return when its port is free.

    No record: nothing to do. A stale record (the process exited, or its pid now names another process)
    is removed and nothing is signalled. Raises StopFailed, keeping the record, when a process survives
    SIGKILL; raises StopFailed when the port stays busy after the process has gone.
    """
    rec = read_record(root, comfy_home)
    if rec is None:
        return StopResult(False, note="no server recorded; nothing to stop")
    with service_lock(root, home=rec.comfy_home, progress=progress):
        rec = read_record(root, comfy_home)  # again, under the locks: another command may have acted
        if rec is None:
            return StopResult(False, note="no server recorded; nothing to stop")
        out = stop_locked(root, rec, grace=grace, progress=progress)
        queuesave.discard(root)  # stopped on purpose: its queue goes with it, and no later restart revives it
        return out


def stop_locked(root: Path, rec: Record, *, grace: float, progress: Progress, keep_record: bool = False
                 ) -> StopResult:
    verdict = rec.verify()
    if not verdict.alive:
        if not keep_record:
            remove_record(root)
        return StopResult(False, rec.pid, note=f"stale record removed, nothing signalled: {verdict.reason}")
    progress(f"stopping pid {rec.pid} (SIGTERM, SIGKILL after {grace:g} s)")
    t0 = time.monotonic()
    # the group's workers are the server's (or agent's) children, in its process group: they go with it
    down = proc.terminate_group(rec.identity(), grace=grace, kill_wait=KILL_WAIT)
    if down.survivors:
        raise StopFailed(f"process(es) {', '.join(map(str, down.survivors))} survived SIGKILL",
                         hint="they may be stuck in the device driver; the record is kept so stop can be retried")
    if rec.group.is_agent:
        pass  # an agent listens on no port
    elif not proc.wait_port_free(rec.listen, rec.port, PORT_WAIT):
        holders = proc.port_holders(rec.port)
        if not keep_record:
            remove_record(root)
        raise StopFailed(f"the server is gone but port {rec.port} is still busy after {PORT_WAIT:g} s"
                         + (f" (held by {'; '.join(_describe_holder(h) for h in holders)})" if holders else ""),
                         code="port_still_busy", details={"holders": holders})
    if not keep_record:
        remove_record(root)
    return StopResult(True, rec.pid, down.signals, time.monotonic() - t0)


# ---------------------------------------------------------------------------------------------- restart


@dataclass
class RestartResult:
    previous_pid: int
    was_running: bool
    previous_error: dict | None
    queue: tuple[int, int] | None
    stop: StopResult | None
    start: StartResult
    phases: dict[str, float]
    restored: queuesave.Restored | None = None


def restart(root: Path, *, force: bool = False, requeue_running: bool = False, grace: float = DEFAULT_GRACE,
            timeout: float = DEFAULT_START_TIMEOUT, progress: Progress = _noop,
            comfy_home: str | os.PathLike | None = None) -> RestartResult:
    """Stop the recorded server (if still running) and start it again with the recorded settings, keeping
    its queue (h3kit.queuesave): the pending prompts are saved first and queued again once the new server
    is healthy.

    A running prompt makes it refuse (QueueBusy) unless `force` (the prompt is dropped, and reported) or
    `requeue_running` (it is queued again, first). Works when the server has already died: the record's
    settings are used, nothing is signalled, and the last save of that server (watch refreshes it every
    tick) is restored.
    """
    t_all = time.monotonic()
    rec = read_record(root, comfy_home)
    if rec is None:
        raise NotStarted(f"no server record under {root}", hint="start it once with h3kit start")
    spec = validated(rec.spec())  # the settings are checked as start checks them before anything is stopped
    require_torch(Path(spec.comfy_home), spec.python, spec.device_type, "ComfyUI")
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    alive = rec.verify().alive
    saved = _saved_queue(root, rec, alive, progress)
    queue = (len(saved.running), len(saved.pending)) if saved else None
    if alive and saved and saved.running and not (force or requeue_running):
        raise QueueBusy(f"prompt {saved.running[0].prompt_id} is running ({len(saved.pending)} pending prompt(s) "
                        "would be kept)", details={"running": queue[0], "pending": queue[1],
                                                   "running_ids": [i.prompt_id for i in saved.running]},
                        hint="wait for it; or --requeue-running (it runs again from the start after the restart), "
                             "or --force (it is dropped); pending prompts are queued again either way")
    blk = logscan.first_error(rec.log)
    previous_error = blk.to_dict() if blk else None
    phases["check"] = time.monotonic() - t0

    with service_lock(root, home=rec.comfy_home, progress=progress):
        current = read_record(root, comfy_home)
        if current is None or current.pid != rec.pid:
            raise ServiceError("the server record changed while restarting (another h3kit command ran)",
                               code="record_changed", hint="check h3kit status, then retry")
        if alive and not rec.group.is_agent:
            # read again under the locks, right before the stop: what was queued meanwhile is kept too
            with contextlib.suppress(health.HttpError):
                saved = queuesave.read_queue(rec.url, rec.pid, rec.create_time)
                queue = (len(saved.running), len(saved.pending))
            if saved and saved.running and not (force or requeue_running):
                raise QueueBusy(f"prompt {saved.running[0].prompt_id} started meanwhile",
                                details={"running": queue[0], "pending": queue[1]},
                                hint="wait for it, or pass --requeue-running or --force")
        if saved and alive and (saved.running or saved.pending):
            queuesave.save(root, saved)  # before anything is stopped: a failed restart keeps it
        monitoring.count_restart(root, "manual")  # h3kit_service_restarts_total on the server's /metrics
        stopped = None
        if alive:
            t0 = time.monotonic()
            stopped = stop_locked(root, rec, grace=grace, progress=progress, keep_record=True)
            phases["stop"] = time.monotonic() - t0
        t0 = time.monotonic()
        if not rec.group.is_agent:
            _wait_port_or_name_holder(rec.listen, rec.port)
        phases["port"] = time.monotonic() - t0
        t0 = time.monotonic()
        started = start_keeping_queue(root, rec, timeout=timeout, progress=progress)
        phases["start"] = time.monotonic() - t0
        restored = None
        if saved and (saved.running or saved.pending):
            t0 = time.monotonic()
            restored = queuesave.restore(root, started.record.url, saved, requeue_running=requeue_running,
                                         first_error=blk.summary if blk else None)
            phases["restore"] = time.monotonic() - t0
    phases["total"] = time.monotonic() - t_all
    return RestartResult(rec.pid, alive, previous_error, queue, stopped, started, phases, restored)


def _saved_queue(root: Path, rec: Record, alive: bool, progress: Progress) -> queuesave.Saved | None:
    """The queue to keep across a restart of `rec`: read now from a server that answers, else the last save of
    that server (watch's, or a restart's that failed to start). An agent serves no HTTP: no queue."""
    if rec.group.is_agent:
        return None
    if alive:
        try:
            return queuesave.read_queue(rec.url, rec.pid, rec.create_time)
        except health.HttpError as e:
            progress(f"could not read the queue ({e}); restoring the last save, if any")
    saved = queuesave.load(root)
    if saved is not None and saved.is_of(rec.pid, rec.create_time):
        progress(f"the queue as saved at {saved.saved_at}: {len(saved.running)} running, "
                 f"{len(saved.pending)} pending")
        return saved
    return None


def start_keeping_queue(root: Path, rec: Record, *, timeout: float, progress: Progress) -> StartResult:
    """start_locked with `rec`'s settings; when the start fails, the save of `rec`'s server goes to the record
    the failed start left, so the next restart restores it."""
    try:
        return start_locked(root, rec.spec(), timeout=timeout, progress=progress, replacing=rec.pid)
    except BaseException:
        with contextlib.suppress(BadRecord, OSError):
            now = read_record(root)
            if now is not None and now.pid != rec.pid:
                queuesave.hand_over(root, rec.pid, rec.create_time, now.pid, now.create_time)
        raise


# ---------------------------------------------------------------------------------------------- status


def status(root: Path, *, timeout: float = 3.0, comfy_home: str | os.PathLike | None = None) -> dict:
    """What runs, as a JSON-ready dict; `running` is about the process, not the record file."""
    rec = read_record(root, comfy_home)
    out: dict = {"running": False, "healthy": False, "runtime_root": str(root), "record": rec is not None}
    if rec is not None:
        verdict = rec.verify()
        out.update(running=verdict.alive, pid=rec.pid, port=rec.port, listen=rec.listen, url=rec.url,
                   device_type=rec.device_type, requested_devices=rec.devices, started_at=rec.started_at,
                   python=rec.python, comfy_home=rec.comfy_home, extra_args=rec.extra_args,
                   transport=rec.transport)
        if rec.group.is_process:
            out["group"] = {**rec.group.as_dict(), **group.ranks_view(root, rec.pid, rec.node_rank, rec.comfy_home)}
        if verdict.alive:
            out["uptime_s"] = round(time.time() - rec.create_time, 1)
            got = check(rec, root, timeout=timeout)
            out["healthy"] = got.ok
            out["health"] = got.reason
            out["devices"] = got.devices
            if rec.group.is_agent:
                out["queue"] = None
                out["queue_error"] = "an agent of a multi-host group: the queue is on node 0"
                return _with_log(out, rec, root)
            try:
                running, pending = health.queue_counts(rec.url, timeout=timeout)
                out["queue"] = {"running": running, "pending": pending}
            except health.HttpError as e:
                out["queue"] = None
                out["queue_error"] = str(e)
        else:
            out["stale"] = verdict.reason
    return _with_log(out, rec, root)


def status_code(st: dict) -> int:
    """status's exit code: 0 running (and, with the process transport, its group able to run prompts), 1 not
    running, 4 running while its group cannot run prompts (failed, re-forming, a rank down)."""
    if not st["running"]:
        return 1
    if st.get("group") is not None and not group.ready(st["group"], st["group"].get("node_rank") or 0)[0]:
        return 4
    return 0


def _with_log(out: dict, rec: Record | None, root: Path) -> dict:
    log = Path(rec.log) if rec else latest_log(root)
    out["log"] = str(log.resolve()) if log.exists() else None
    blk = logscan.first_error(log) if log.exists() else None
    out["first_error"] = blk.to_dict() if blk else None
    return out
