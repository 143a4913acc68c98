"""Process identity, group termination and port ownership, for the server h3kit starts.

Safety rules, in the order the code applies them:
- A process is ours only when its pid, its start time (psutil create_time) and its command line all match
  the record written when h3kit spawned it, and the caller's owner check (for the server: its main.py is
  the tree's, its executable the interpreter h3kit launched) accepts it. A bare pid is never enough: pids
  are recycled, and a record on disk can be edited.
- Nothing is signalled on HTTP evidence alone, and nothing that fails the identity check is signalled at all.
- The server runs as the leader of its own session and process group (pgid == pid), so one signal reaches
  the children it spawned; the SIGKILL phase re-checks each process before signalling it.
- Teardown is bounded: SIGTERM, wait the grace period, SIGKILL the survivors, wait again, and report who is
  left instead of claiming success.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import time
from dataclasses import dataclass, field

import psutil

# Errors psutil raises when a process vanishes or hides between two calls: each means "not readable now".
PSUTIL_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)

# psutil derives create_time from the kernel's boot time (/proc/stat btime, whole seconds), which moves when the
# wall clock is stepped (NTP, a resumed VM), so two h3kit commands may read one process's start a second apart
# (seen in CI: 1.00 s, which a 1.0 s tolerance let through or not by rounding). A recycled pid belongs to a
# process started after ours ended; with the command line also compared, only a server that lived under a second
# and a half, replaced within that time by the same command line, would pass unnoticed.
CREATE_TIME_TOLERANCE = 1.5

ALIVE = "alive"
GONE = "gone"
RECYCLED = "recycled"


@dataclass(frozen=True)
class Identity:
    pid: int
    create_time: float
    cmdline: tuple[str, ...]


@dataclass(frozen=True)
class Verdict:
    """What became of a recorded process: ALIVE (the same process), GONE (exited) or RECYCLED (the pid now
    names another process, described by `now`)."""
    state: str
    reason: str
    now: dict | None = None

    @property
    def alive(self) -> bool:
        return self.state == ALIVE


@dataclass
class Teardown:
    pid: int
    signals: list[str] = field(default_factory=list)
    survivors: list[int] = field(default_factory=list)
    seconds: float = 0.0


def identify(pid: int) -> Identity:
    """The identity of a live process. Raises psutil.NoSuchProcess (or AccessDenied) when unreadable."""
    proc = psutil.Process(pid)
    with proc.oneshot():
        return Identity(pid, proc.create_time(), tuple(proc.cmdline()))


def start_time(pid: int, default: float) -> float:
    """When a process started, readable for a zombie too (its command line is not); `default` when unreadable."""
    try:
        return psutil.Process(pid).create_time()
    except PSUTIL_GONE:
        return default


def describe(pid: int) -> dict:
    """pid, name and command line of a process, as far as they are readable (for messages only)."""
    out: dict = {"pid": pid}
    try:
        proc = psutil.Process(pid)
        out["name"] = proc.name()
        out["cmdline"] = proc.cmdline()
    except PSUTIL_GONE:
        pass
    return out


def _is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def _reap(pid: int) -> None:
    # A zombie is only reaped by its parent; when that parent is this process (watch, restart from the
    # library), collect it so the pid stops looking alive.
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def server_args(cmdline) -> list[str]:
    """The part of a command line that names the server: from its `main.py` on, else all of it.

    An interpreter given as a wrapper (a script sourcing CANN's set_env.sh, a pyenv shim) execs Python: the
    pid and start time stay, the executable part of the command line changes, the server's own arguments
    do not. Comparing from main.py on keeps such a server recognisable as ours without accepting a
    different program.
    """
    cmd = list(cmdline)
    for i, arg in enumerate(cmd):
        if os.path.basename(arg) == "main.py":
            return cmd[i:]
    return cmd


def verify(pid: int, create_time: float, cmdline, owner=None) -> Verdict:
    """Is `pid` still the process that was recorded with this start time and command line?

    `owner(psutil.Process)`, when given, returns why the process is not the program the caller started (or
    None): a process it rejects is not ours even when pid, start time and command line match."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            now_ct = proc.create_time()
            now_cmd = proc.cmdline()
            zombie = proc.status() == psutil.STATUS_ZOMBIE
            why_not = owner(proc) if owner is not None and not zombie else None
    except psutil.NoSuchProcess:
        return Verdict(GONE, f"process {pid} has exited")
    except (psutil.ZombieProcess, psutil.AccessDenied) as e:
        if isinstance(e, psutil.ZombieProcess):
            _reap(pid)
            return Verdict(GONE, f"process {pid} has exited")
        return Verdict(RECYCLED, f"process {pid} is not readable by this user, so it is not ours",
                       describe(pid))
    if abs(now_ct - float(create_time)) > CREATE_TIME_TOLERANCE:
        return Verdict(RECYCLED, f"pid {pid} now belongs to another process (started at {now_ct:.2f}, "
                                 f"the record says {float(create_time):.2f})", describe(pid))
    if server_args(now_cmd) != server_args(cmdline):
        return Verdict(RECYCLED, f"pid {pid} now runs a different command line", describe(pid))
    if zombie:
        _reap(pid)
        return Verdict(GONE, f"process {pid} has exited")
    if why_not:
        return Verdict(RECYCLED, f"pid {pid} is not the server h3kit started: {why_not}", describe(pid))
    return Verdict(ALIVE, f"process {pid} is running")


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (zombies count as exited); return the ones still running."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        still = []
        for p in alive:
            try:
                if not p.is_running() or _is_zombie(p):
                    _reap(p.pid)
                    continue
            except psutil.NoSuchProcess:
                continue
            still.append(p)
        alive = still
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def terminate_group(identity: Identity, grace: float, kill_wait: float = 5.0) -> Teardown:
    """SIGTERM the process group led by `identity`, SIGKILL whatever outlives `grace`, wait `kill_wait`.

    The caller must have verified `identity` just before. Children are listed before the first signal, and
    in the SIGKILL phase each is signalled through psutil, which re-checks its start time, so a pid recycled
    during the grace period is never hit. Returns the signals sent and the pids still alive at the end.
    """
    t0 = time.monotonic()
    result = Teardown(identity.pid)
    try:
        leader = psutil.Process(identity.pid)
    except psutil.NoSuchProcess:  # it exited between the caller's check and now: nothing left to stop
        result.seconds = time.monotonic() - t0
        return result
    try:
        members = [leader] + leader.children(recursive=True)
    except PSUTIL_GONE:
        members = [leader]
    try:
        group = os.getpgid(identity.pid)
    except ProcessLookupError:
        result.seconds = time.monotonic() - t0
        return result
    try:
        if group == identity.pid:
            os.killpg(group, signal.SIGTERM)
        else:  # it left the group h3kit gave it: signal the members one by one
            for p in members:
                p.terminate()
        result.signals.append("SIGTERM")
    except (ProcessLookupError, psutil.NoSuchProcess):
        pass
    survivors = _wait_gone(members, grace)
    if survivors:
        for p in survivors:
            try:
                p.kill()  # psutil refuses if the pid now belongs to a newer process
            except PSUTIL_GONE:
                pass
        result.signals.append("SIGKILL")
        survivors = _wait_gone(survivors, kill_wait)
    result.survivors = [p.pid for p in survivors]
    result.seconds = time.monotonic() - t0
    return result


def probe_host(listen: str) -> str:
    """The address to reach a server listening on `listen` from this machine."""
    addr = ipaddress.ip_address(listen)
    if addr.is_unspecified:
        return "::1" if addr.version == 6 else "127.0.0.1"
    return str(addr)


def port_is_free(listen: str, port: int) -> bool:
    """Could a server bind `listen:port` now? Binds the way aiohttp does (SO_REUSEADDR), so sockets left in
    TIME_WAIT by a stopped server do not count as busy."""
    addr = ipaddress.ip_address(listen)
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((str(addr), port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def wait_port_free(listen: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if port_is_free(listen, port):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def port_holders(port: int) -> list[dict]:
    """Processes listening on TCP `port` (any address), described for a message. May be empty when the
    holder belongs to another user and this one may not read its sockets."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):  # AccessDenied; a process vanishing mid-scan
        return []
    pids = sorted({c.pid for c in conns
                   if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid})
    return [describe(pid) for pid in pids]
