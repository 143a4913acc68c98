"""The service's process start and stop: the checks a start makes (`validated`: tree, devices, address, port,
interpreter, extra arguments; `require_torch`), the server's launch in its own session with its log and record
(`start`, `start_locked`), and its stop (`stop`, `stop_locked`: SIGTERM, SIGKILL after the grace, then the port)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import cliutil, comfyargs, group, health, logscan, monitoring, proc, queuesave, testhooks
from h3kit import devices as h3devices
from h3kit.errors import NotAComfyTree, UsageError
from h3kit.service import servers
from h3kit.service.health import check, wait_healthy
from h3kit.service.records import (DEFAULT_GRACE, DEFAULT_START_TIMEOUT, KILL_WAIT, LATEST, LOG_DIR, PORT_WAIT,
                                   PortInUse, Progress, Record, ServiceError, StartFailed, StartSpec, StopFailed,
                                   _noop, _own_args, read_record, remove_record, server_argv, service_lock,
                                   write_record)


@dataclass
class StartResult:
    record: Record
    already_running: bool
    seconds: float
    devices: list[dict]
    health: str = "healthy"      # for an already running server: what /system_stats said
    stale: str | None = None     # what a stale record said, when one replaced it
    root: Path | None = None     # the server's own folder under the tree's runtime root (h3kit.service.servers)
    restored: queuesave.Restored | None = None  # the queue `stop --keep-queue` kept, queued again


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

    from h3kit import manifest, pairing

    hint = (f"{pairing.torch_install_line(manifest.load(), device_type, python)}; then h3kit doctor "
            f"--comfy-home {home} --python {python} --device-type {device_type} checks the rest; or pass --python the interpreter that "
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
    """The environment the server runs with: the visible-device variable for the device kind, the --devices list
    itself (H3KIT_DEVICES: GET /metrics names each rank's physical device by it, also on cpu), h3kit's version
    (h3kit_build_info), and unbuffered output so `h3kit logs -f` shows print() output as it happens."""
    from h3kit import __version__

    env = dict(os.environ if base is None else base)
    if device_type == "cpu":
        env[h3devices.SIM_DEVICES_ENV] = str(len(devices))
    else:
        env[h3devices.VISIBLE_ENV[device_type]] = h3devices.format_device_list(devices)
    env[monitoring.DEVICES_ENV] = h3devices.format_device_list(devices)
    env[monitoring.VERSION_ENV] = __version__
    env["PYTHONUNBUFFERED"] = "1"
    return env


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


def start(root: Path, spec: StartSpec, *, timeout: float = DEFAULT_START_TIMEOUT,
          progress: Progress = _noop, announce: str = "") -> StartResult:
    """Start a server of the tree whose runtime root is `root` and return once /system_stats answers (with the
    expected devices on npu/cuda). The server gets its own folder there (h3kit.service.servers: the first server
    `root` itself, another `root/servers/<port>`), named by the result's `root`.

    When the record names our live server on the same port, nothing starts and `already_running` is set.
    Raises PortInUse when anything else holds the port, DevicesInUse when another server of the tree runs on one
    of the devices, StartFailed when the child exits or the deadline passes (the child is stopped first; the
    log's last lines are in the error's details). `announce` is said (progress) once every check has passed,
    right before the server is launched. A queue `stop --keep-queue` kept is queued again once it is healthy.
    """
    spec = validated(spec)  # before the locks create anything under the runtime root
    require_torch(Path(spec.comfy_home), spec.python, spec.device_type, "ComfyUI")
    with servers.start_slot(root, spec, progress=progress) as own:
        res = start_locked(own, servers.own_folders(root, own, spec), timeout=timeout, progress=progress,
                           announce=announce)
        res.root = own
        if not res.already_running and not res.record.group.is_agent:
            res.restored = _restore_kept(own, res.record, progress)
        return res


def _restore_kept(root: Path, rec: Record, progress: Progress) -> queuesave.Restored | None:
    """Queue again, running prompt first, what `h3kit stop --keep-queue` kept of this server's queue."""
    kept = queuesave.load(root, queuesave.KEPT_NAME)
    if kept is None or not (kept.running or kept.pending):
        return None
    progress(f"queueing again what the planned stop of {kept.saved_at} kept: {len(kept.running)} running, "
             f"{len(kept.pending)} pending prompt(s)")
    return queuesave.restore(root, rec.url, kept, requeue_running=True, name=queuesave.KEPT_NAME)


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
    if out.group.is_process:
        group.hccl_band(out.devices)  # its HCCL band fits (H3KIT_HCCL_BASE_PORT), else a UsageError before anything
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
    running, stale = _running_or_stale(root, spec, replacing, progress)
    if running is not None:
        return running
    settings = _free_ports(spec)
    if announce:
        progress(announce)
    argv, env, log = _prepare(root, spec, settings)
    t0 = time.monotonic()
    # Ctrl-C or SIGTERM from the server's start until the cleanup below is in place waits (else the server, in its
    # own session, would outlive h3kit: unrecorded, holding the port and the devices); the server starts with the
    # signals as they were
    held = cliutil.hold_signals()
    child = _spawn(argv, env, log, spec, held)
    testhooks.point("server-started")
    rec = _record_child(root, child, argv, spec, log, held)
    got = _await_health(root, child, rec, argv, spec, settings, t0, timeout, progress, held)
    return StartResult(rec, False, time.monotonic() - t0, got.devices, stale=stale)


def _running_or_stale(root: Path, spec: StartSpec, replacing: int | None, progress: Progress):
    """(the result for our server already running with these settings, or None; what a stale record said, or
    None). Raises for our server running on another port or with other settings."""
    rec = read_record(root)
    if rec is None:
        return None, None
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
        return StartResult(rec, True, 0.0, got.devices, health=got.reason), None
    # The stale record is replaced once the new server is spawned: until then it keeps the settings, so a start
    # that fails before spawning (port taken) can still be retried by restart.
    if rec.pid == replacing:  # restart has already said what became of the process it replaces
        return None, None
    progress(f"replacing the stale server record: {verdict.reason}")
    return None, verdict.reason


def _free_ports(spec: StartSpec) -> group.GroupSettings:
    """Wait for the server's port (and the group's rendezvous ports) to be free; the group settings, with the
    master port chosen when none was asked for."""
    settings = spec.group
    # a port held by no visible process is waited for (a stopped server's sockets close a moment after it exits,
    # later on a busy host); one a process holds is named at once
    if not settings.is_agent:
        _wait_port_or_name_holder(spec.listen, spec.port)
    if settings.is_process and settings.node_rank == 0:
        if settings.master_port == 0:  # one host (several need --master-port): a free one of its range, every start
            settings = dataclasses.replace(settings, master_port=group.choose_store_port(settings.master_addr,
                                                                                          spec.devices))
        else:  # honoured on one host too
            for port in group.rendezvous_ports(settings):
                _wait_port_or_name_holder(settings.master_addr, port)
    return settings


def _prepare(root: Path, spec: StartSpec, settings: group.GroupSettings) -> tuple[list[str], dict, Path]:
    """The server's command line, its environment and its new log (whose first line says both)."""
    argv = server_argv(spec.python, spec)
    env = child_environment(spec.device_type, spec.devices)
    env[monitoring.RUNTIME_ROOT_ENV] = str(root)  # where its /metrics reads the restarts watch and restart count
    shown = {k: env[k] for k in (h3devices.VISIBLE_ENV[spec.device_type],)}
    if settings.is_process:
        worker_args = (["--cpu"] if spec.device_type == "cpu" and "--cpu" not in spec.extra_args else []) + spec.extra_args
        env.update(group.environment(settings, spec.device_type, spec.devices, root, group.group_key(root, settings),
                                     worker_args))
        shown["transport"] = (f"process, node {settings.node_rank} of {settings.nnodes}, "
                              f"master {settings.master_addr}:{settings.master_port}")
    log = _new_log(root, f"h3kit: {datetime.datetime.now().isoformat(timespec='seconds')} starting in "
                         f"{spec.comfy_home}: {' '.join(argv)} with {' '.join(f'{k}={v}' for k, v in shown.items())}")
    return argv, env, log


def _spawn(argv: list[str], env: dict, log: Path, spec: StartSpec, held) -> subprocess.Popen:
    """The server, in its own session, its output appended to `log`; the signals held are released on failure."""
    with open(log, "ab") as out:
        try:
            return subprocess.Popen(argv, cwd=Path(spec.comfy_home), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    preexec_fn=None if held is None else lambda: cliutil.release_signals(held))
        except BaseException as e:
            cliutil.release_signals(held)
            if isinstance(e, OSError):
                raise StartFailed(f"could not run {spec.python}: {e}", hint="check --python") from None
            raise


def _record_child(root: Path, child: subprocess.Popen, argv: list[str], spec: StartSpec, log: Path, held) -> Record:
    """Write the record of the server just spawned; on any failure the server is killed, unrecorded."""
    # Popen returns once exec has succeeded, so /proc already shows the server's own command line.
    try:
        try:
            ident = proc.identify(child.pid)
            cmdline = list(ident.cmdline) or argv
            create_time = ident.create_time
        except proc.PSUTIL_GONE:  # it has exited already (seen in CI: argparse's refusal), unreaped; the record
            # must still be valid, since it stays to say why the start failed
            cmdline, create_time = argv, proc.start_time(child.pid, default=time.time())
        rec = Record(pid=child.pid, create_time=create_time, cmdline=cmdline, port=spec.port, listen=spec.listen,
                     device_type=spec.device_type, devices=list(spec.devices), python=spec.python,
                     comfy_home=str(spec.comfy_home), log=str(log), extra_args=list(spec.extra_args),
                     started_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     **spec.group.as_dict())  # the port asked for: 0 on one host picks a free one at every start
        write_record(root, rec)
    except BaseException:  # not recorded: the server goes with the failure, and h3kit gets its signals back
        os.killpg(child.pid, signal.SIGKILL)  # its own session; not reaped yet, so the pid is still its
        child.wait()
        cliutil.release_signals(held)
        raise
    return rec


def _await_health(root: Path, child: subprocess.Popen, rec: Record, argv: list[str], spec: StartSpec,
                  settings: group.GroupSettings, t0: float, timeout: float, progress: Progress, held) -> health.Health:
    """Release the held signals and wait for the recorded server to be healthy; on failure or interruption, stop it
    (the record stays)."""
    expected = None if spec.device_type == "cpu" else len(spec.devices)
    try:
        progress(f"started pid {child.pid}: {' '.join(argv)}")
        progress(f"log: {rec.log}")
        cliutil.release_signals(held)  # a signal that came meanwhile is raised here, inside the cleanup's try
        got = wait_healthy(child, rec, expected, t0, timeout, progress, root, on_poll=lambda: _follow_exec(root, rec))
        _follow_exec(root, rec)
    except BaseException as e:
        # A failed (or interrupted) start leaves no server behind; the record stays, naming the dead
        # process, so `status` shows why and `restart` can try the same settings again. The child is
        # not reaped yet, so its pid cannot have been recycled: signalling it is safe.
        if child.poll() is None:
            proc.terminate_group(rec.identity(), grace=DEFAULT_GRACE, kill_wait=KILL_WAIT)
            child.poll()
        if not settings.is_agent:
            proc.wait_port_free(spec.listen, spec.port, PORT_WAIT)
        if isinstance(e, StartFailed):
            e.details = dict(e.details or {}, log=rec.log, log_tail=logscan.tail(Path(rec.log), 25))
        cliutil.release_signals(held)  # (again, when what failed came before the release: harmless otherwise)
        raise
    return got


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




@dataclass
class StopResult:
    stopped: bool
    pid: int | None = None
    signals: list[str] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    queue: tuple[int, int] | None = None   # (running, pending) when it stopped; None: unknown (no answer) or no server
    kept: bool = False                     # `keep_queue`: saved for the next start


def stop(root: Path, *, grace: float = DEFAULT_GRACE, progress: Progress = _noop,
         comfy_home: str | os.PathLike | None = None, keep_queue: bool = False) -> StopResult:
    """Stop the recorded server if it is still the process h3kit started; return when its port is free.

    No record: nothing to do. A stale record (the process exited, or its pid now names another process)
    is removed and nothing is signalled. Raises StopFailed, keeping the record, when a process survives
    SIGKILL; raises StopFailed when the port stays busy after the process has gone.

    The queue is read first: with `keep_queue` it is kept (queuesave.KEPT_NAME) and the next `start` of this
    server queues it again, the prompt that was running first; without, it is discarded and counted (`queue`).
    A server that does not answer GET /queue, or has died, keeps watch's last save of it (or nothing, said:
    `queue` None).
    """
    rec = read_record(root, comfy_home)
    if rec is None:
        return StopResult(False, note="no server recorded; nothing to stop")
    with service_lock(root, home=rec.comfy_home, progress=progress):
        rec = read_record(root, comfy_home)  # again, under the locks: another command may have acted
        if rec is None:
            return StopResult(False, note="no server recorded; nothing to stop")
        saved = _queue_at_stop(root, rec, keep_queue)
        out = stop_locked(root, rec, grace=grace, progress=progress)
        queuesave.discard(root)  # stopped on purpose: watch's save goes, and no later restart revives it
        if saved is not None:
            out.queue = (len(saved.running), len(saved.pending))
            if keep_queue and (saved.running or saved.pending):
                queuesave.save(root, saved, name=queuesave.KEPT_NAME)
                out.kept = True
        return out


def _queue_at_stop(root: Path, rec: Record, keep_queue: bool) -> queuesave.Saved | None:
    """The live server's queue right before it is stopped; None for an agent, or a server that is gone or does not
    answer. With `keep_queue`, what watch saved of this server at its last healthy check stands in for a server
    that does not answer or has died (a hung server is stopped all the same: systemd's ExecStop must not fail)."""
    if rec.group.is_agent:
        return None
    if rec.verify().alive:
        with contextlib.suppress(health.HttpError):
            return queuesave.read_queue(rec.url, rec.pid, rec.create_time, timeout=3.0)
    saved = queuesave.load(root) if keep_queue else None
    return saved if saved is not None and saved.is_of(rec.pid, rec.create_time) else None


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
