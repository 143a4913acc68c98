"""Several servers of one tree (`h3kit start --port 8190 --devices 4,5,6,7` beside one on 0-3): where each keeps its
state, which one a command means, and what each has of its own.

Layout under the tree's runtime root R (`<comfy-home>/.h3kit/run`, or --runtime-root):

    server.json, service.lock, logs/, queue*.json, ranks.json, group.key   the first server, as before
    servers/<port>/ (the same files)                                        every other server, by its port
    servers.lock                                                           held while a start picks its folder

A start takes R when R holds no server (nor the kept queue of another port), or only a stale record while no other
server exists (replaced, as a single server's always was); a server R already records on that port, or a folder
servers/<port> that exists, is that port's; else servers/<port>. So a runtime root of one server reads as it always
did. The choice is made under servers.lock, and the start keeps the chosen folder's service.lock until it is done.

Commands other than start take `--port`; without it they mean the only server of the tree, or the only one
running, and are refused (`several_servers`, listing them) when several run.

What each server has of its own (docs/service.md, "Several servers on one host"):
- its record, service lock, logs, saved and kept queues, ranks file and group key: its folder above;
- devices: a start is refused while another live server of the tree runs on any of the same devices;
- HCCL ports: a band of 256 from H3KIT_HCCL_BASE_PORT (default 60000) + 256 x its lowest device id
  (h3kit.group.hccl_band), and the group's store port, on one host without --master-port, from 29500 + 64 x its
  lowest device id (h3kit.group.store_ports);
- output and temp folders: the server in R keeps ComfyUI's (<home>/output, <home>/temp); another gets
  `--output-directory <home>/output/<port>` and `--temp-directory <its folder>` (ComfyUI empties its temp folder at
  every start), unless its extra arguments set them;
- /dev/shm: the hand-off files carry their driver's pid and token and are swept only once their driver's lock is
  free (comfy/multinpu_wire.py), so servers never remove each other's.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from h3kit import comfyargs, locks, queuesave
from h3kit.service.records import (LOCK_NAME, BadRecord, Progress, Record, ServiceError, StartSpec, read_record,
                                   service_lock)

SERVERS_DIR = "servers"
SLOTS_LOCK = "servers.lock"


class SeveralServers(ServiceError):
    code = "several_servers"


class DevicesInUse(ServiceError):
    code = "devices_in_use"


@dataclass
class Entry:
    """A server of the tree as its folder records it: `record` None with `error` for a record h3kit cannot read."""
    root: Path
    record: Record | None
    alive: bool = False
    error: str | None = None

    @property
    def port(self) -> int | None:
        if self.record is not None:
            return self.record.port
        return int(self.root.name) if self.root.parent.name == SERVERS_DIR and self.root.name.isdigit() else None

    def describe(self) -> str:
        if self.record is None:
            return f"port {self.port or '?'}: unreadable record ({self.error})"
        rec = self.record
        state = f"running, pid {rec.pid}" if self.alive else "not running"
        return f"port {rec.port}: {state}, {rec.device_type} devices {','.join(map(str, rec.devices))} ({self.root})"


def server_root(tree: Path, port: int) -> Path:
    return Path(tree) / SERVERS_DIR / str(port)


def server_roots(tree: Path) -> list[Path]:
    """R, then every servers/<port> folder in port order."""
    tree = Path(tree)
    folder = tree / SERVERS_DIR
    ports = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir()) if folder.is_dir() else []
    return [tree] + [server_root(tree, p) for p in ports]


def list_servers(tree: Path, comfy_home: str | os.PathLike | None = None) -> list[Entry]:
    """Every server recorded under the tree's runtime root, the first server first, then by port."""
    out = []
    for root in server_roots(tree):
        try:
            rec = read_record(root, comfy_home)
        except BadRecord as e:
            out.append(Entry(root, None, error=e.message))
            continue
        if rec is not None:
            out.append(Entry(root, rec, rec.verify().alive))
    return out


def pick(tree: Path, port: int | None, comfy_home: str | os.PathLike | None = None) -> Path:
    """The folder of the server a command (stop, restart, watch, logs, status) means: the one on `port`; without a
    port, the only server, or the only one running. SeveralServers, listing them, when several run."""
    tree = Path(tree)
    entries = list_servers(tree, comfy_home)
    if port is not None:
        for e in entries:
            if e.port == port:
                return e.root
        own = server_root(tree, port)
        return own if own.is_dir() or entries else tree
    if len(entries) <= 1:
        return entries[0].root if entries else tree
    live = [e for e in entries if e.alive]
    if len(live) == 1:
        return live[0].root
    listed = "; ".join(e.describe() for e in (live or entries))
    raise SeveralServers(f"{len(live) or len(entries)} servers {'run' if live else 'are recorded'} from this tree: "
                         f"{listed}", details={"ports": [e.port for e in (live or entries)]},
                         hint="say which with --port PORT (h3kit status lists every server of the tree)")


def _busy(root: Path) -> bool:
    """Does another command hold `root`'s service lock now (a start there that has not written its record yet)?"""
    return locks.flock_held(root / LOCK_NAME)


def _kept_port(root: Path) -> int | None:
    kept = queuesave.load(root, queuesave.KEPT_NAME)
    if kept is None:
        return None
    with contextlib.suppress(ValueError):
        return int(kept.url.rsplit(":", 1)[1].split("/")[0])
    return None


def choose(tree: Path, spec: StartSpec, entries: list[Entry]) -> Path:
    """The folder a start of `spec` uses (the module docstring's rule); DevicesInUse when another live server of the
    tree runs on one of its devices."""
    for e in entries:
        if e.record is None and e.root == tree:
            raise BadRecord(e.error,
                            hint="nothing was signalled; if no server runs, delete the file (then h3kit start)")
    mine = next((e.root for e in entries if e.port == spec.port), None)
    taken = [e for e in entries if e.alive and e.root != mine and set(e.record.devices) & set(spec.devices)]
    if taken:
        raise DevicesInUse(f"device(s) {','.join(map(str, sorted(set(taken[0].record.devices) & set(spec.devices))))}"
                           f" already run the server on port {taken[0].port} (pid {taken[0].record.pid})",
                           hint="give this server other devices (--devices), or stop that one first "
                                f"(h3kit stop --port {taken[0].port})")
    if mine is not None:
        return mine
    own = server_root(tree, spec.port)
    if own.is_dir():
        return own
    first = next((e for e in entries if e.root == tree), None)
    if first is None:
        free = not _busy(tree) and _kept_port(tree) in (None, spec.port)
    else:
        free = not first.alive and len(entries) == 1
    return tree if free else own


@contextlib.contextmanager
def start_slot(tree: Path, spec: StartSpec, *, progress: Progress | None = None):
    """Hold the tree lock (shared), pick the folder of the server `spec` starts under servers.lock, and hold that
    folder's service lock until the start is done; yields the folder."""
    tree = Path(tree)
    with contextlib.ExitStack() as stack:
        stack.enter_context(locks.tree_lock(Path(spec.comfy_home), progress=progress, shared=True))
        with service_lock(tree, name=SLOTS_LOCK, progress=progress):
            root = choose(tree, spec, list_servers(tree, spec.comfy_home))
            stack.enter_context(service_lock(root, progress=progress))
        yield root


def own_folders(tree: Path, root: Path, spec: StartSpec) -> StartSpec:
    """`spec` with the output and temp folders of a server that is not the tree's first (module docstring)."""
    if Path(root) == Path(tree):
        return spec
    given = comfyargs.dests(Path(spec.comfy_home), spec.extra_args)
    extra = list(spec.extra_args)
    if "output_directory" not in given:
        extra += ["--output-directory", str(Path(spec.comfy_home) / "output" / str(spec.port))]
    if "temp_directory" not in given:
        extra += ["--temp-directory", str(root)]
    return StartSpec(comfy_home=spec.comfy_home, devices=list(spec.devices), device_type=spec.device_type,
                     port=spec.port, listen=spec.listen, python=spec.python, extra_args=extra, group=spec.group)
