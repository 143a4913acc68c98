"""One lock per ComfyUI home, and temporary folders the next run can tell are abandoned.

tree_lock(home)
    `fcntl.flock` on `<home>/.h3kit/h3kit.lock`, held by install, revert and demo (exclusively) and by the
    service commands that start or stop a server (shared: the several servers of a tree start and stop at
    once, while install and revert exclude them all), for as long as they change the tree or the service.
    A second command waits (bounded, saying for whom), then is refused naming the holder (pid, command,
    since when). The
    kernel drops a flock when its holder dies, however it dies, so a lock is never stale. Within one process
    the lock is re-entrant (demo holds it and calls install and start, which take it too). Order, to rule
    out deadlocks: this lock first, then the service lock of the runtime root (h3kit.service).

owned_tempdir(parent, prefix) / sweep(parent, prefix)
    A temporary folder that holds a flock on its own owner file for the life of the command that made it.
    Folders are created under a private name, locked, then renamed to `prefix...`, so a folder found under
    that prefix whose owner file can be locked belongs to no live h3kit: the next run (any command that
    makes such a folder) removes it. A SIGKILLed clone or scratch copy is thereby cleaned up by the next run
    instead of piling up.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from h3kit.errors import H3kitError

STATE_DIR = ".h3kit"
LOCK_NAME = "h3kit.lock"
LOCK_WAIT_ENV = "H3KIT_LOCK_WAIT"
DEFAULT_LOCK_WAIT = 10.0     # seconds a second command waits for the first before it is refused
OWNER_NAME = ".h3kit-owner"
UNLOCKED_GRACE = 60.0        # a folder under a private name younger than this may be being set up


class TreeBusy(H3kitError):
    code = "tree_busy"


class _Held:
    def __init__(self, fd: int | None, shared: bool = False):
        self.fd = fd
        self.depth = 1
        self.shared = shared


_held: dict[str, _Held] = {}


def lock_wait() -> float:
    try:
        return max(0.0, float(os.environ.get(LOCK_WAIT_ENV, DEFAULT_LOCK_WAIT)))
    except ValueError:
        return DEFAULT_LOCK_WAIT


def lock_path(home: Path) -> Path:
    return Path(home) / STATE_DIR / LOCK_NAME


def _holder(fd: int) -> str:
    """Who holds the flock on `fd`'s file, read from /proc/locks (the lock file itself is never written:
    taking the lock must change nothing on disk, a no-op install on a read-only tree included)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pid = None
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "FLOCK" in parts and inode in parts:
                    pid = int(parts[parts.index(inode) - 1])
                    break
    except (OSError, ValueError, IndexError):
        pass
    if pid is None:
        return "another h3kit command"
    return describe_process(pid)


def describe_process(pid: int) -> str:
    """'pid 123 (h3kit install, since 10:15:02)' as far as the process is readable."""
    import psutil

    try:
        proc = psutil.Process(pid)
        cmd = proc.cmdline()
        since = datetime.datetime.fromtimestamp(proc.create_time()).strftime("%H:%M:%S")
    except (psutil.Error, OSError):
        return f"pid {pid}"
    words = [os.path.basename(a) for a in cmd]
    at = next((i for i, w in enumerate(words) if w == "h3kit"), None)
    what = "h3kit " + words[at + 1] if at is not None and at + 1 < len(words) else " ".join(words[:3])
    return f"pid {pid} ({what}, since {since})"


def _open_lock(path: Path, create: bool) -> int | None:
    """A descriptor on the lock file, creating it (and .h3kit/) when allowed; None when it cannot exist here
    (a read-only tree: nothing can be written there by anyone with this user's rights, so nothing races)."""
    if create:
        try:
            path.parent.mkdir(exist_ok=True)
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR):
            return None
        raise


def _acquire(home: Path, path: Path, create: bool, wait: float, progress, shared: bool) -> int | None:
    """The descriptor holding the lock of `home` (None: it cannot exist here); TreeBusy after `wait` seconds."""
    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            fd = _open_lock(path, create)
        except OSError as e:
            raise H3kitError(f"cannot open the lock {path}: {e.strerror or e}", code="lock_failed",
                             hint="check the permissions of the folder") from None
        if fd is None:
            return None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise TreeBusy(f"{home} is in use by {holder}",
                               hint=f"wait for it to finish, then run this again (waited {wait:g} s; "
                                    f"{LOCK_WAIT_ENV} sets how long)") from None
            if progress is not None and not said:
                progress(f"waiting up to {wait:g} s for {holder} to finish with {home}")
                said = True
            time.sleep(0.1)
            continue
        # the file may have been removed (a failed fresh install cleans up its folder) between open and flock
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def tree_lock(home: Path, *, wait: float | None = None, create: bool = True,
              progress: Callable[[str], None] | None = None, shared: bool = False):
    """Hold the lock of `home` (see the module docstring). `create=False` takes it only if the lock file
    already exists (dry runs and verify change nothing). A home that does not exist yet is not locked: there
    is nothing in it to protect (install creates it first when it needs the lock). `shared`: the service
    commands' hold (several servers of one tree start and stop at once; install, revert and demo, which hold
    it exclusively, exclude them all)."""
    home = Path(home).expanduser().resolve()  # one key per tree, however the caller spelled its path
    path = lock_path(home)
    key = str(path)
    held = _held.get(key)
    if held is not None:
        if held.shared and not shared:
            raise RuntimeError(f"{path}: an exclusive hold inside a shared one")  # a programming error, not a user's
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
        return
    if not home.is_dir():
        yield
        return
    fd = _acquire(home, path, create, lock_wait() if wait is None else wait, progress, shared)
    _held[key] = _Held(fd, shared)
    try:
        yield
    finally:
        del _held[key]
        if fd is not None:
            os.close(fd)  # closing the descriptor releases the lock


def is_locked(home: Path) -> str | None:
    """Who holds the lock of `home` right now (None if nobody, or this process)."""
    path = lock_path(Path(home).expanduser().resolve())
    if str(path) in _held:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- temporary folders


def _owner_is_alive(folder: Path) -> bool:
    return flock_held(folder / OWNER_NAME, unreadable=True)  # unreadable: not ours to judge


def flock_held(path: Path, unreadable: bool = False) -> bool:
    """Does another open file hold an flock on `path` now? False when there is no such file; `unreadable` when it
    cannot be opened. Probes without waiting and keeps nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return unreadable
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _init_prefix(prefix: str) -> str:
    return ".init" + prefix if not prefix.startswith(".") else ".init-" + prefix[1:]


def sweep(parent: Path, prefix: str) -> list[str]:
    """Remove the folders `parent/prefix*` that no live h3kit holds; returns their names."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    init = _init_prefix(prefix)
    for entry in entries:
        if not entry.name.startswith((prefix, init)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        path = Path(entry.path)
        if entry.name.startswith(init):
            if time.time() - st.st_mtime < UNLOCKED_GRACE:  # being set up by a live command right now
                continue
        elif _owner_is_alive(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(entry.name)
    return removed


@contextlib.contextmanager
def owned_tempdir(parent: Path, prefix: str):
    """A folder `parent/prefix*` held by this process until the block ends, then removed (see the module
    docstring). Abandoned ones from earlier runs are swept first."""
    parent = Path(parent)
    sweep(parent, prefix)
    tmp = Path(tempfile.mkdtemp(prefix=_init_prefix(prefix), dir=parent))
    fd = None
    try:
        fd = os.open(tmp / OWNER_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        final = parent / (prefix + tmp.name[len(_init_prefix(prefix)):])
        os.rename(tmp, final)
        tmp = final
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if fd is not None:
            os.close(fd)


LEGACY_PREFIXES = ("h3kit-scratch-", "h3kit-applied-")  # what h3kit before the owned folders left in the temp dir
LEGACY_AGE = 3600.0                                      # no command held one for an hour
_legacy_swept = False


def _sweep_legacy(base: Path) -> None:
    global _legacy_swept
    if _legacy_swept:
        return
    _legacy_swept = True
    try:
        entries = list(os.scandir(base))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith(LEGACY_PREFIXES):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and time.time() - st.st_mtime > LEGACY_AGE:
            shutil.rmtree(entry.path, ignore_errors=True)


def scratch_parent() -> Path:
    """Where scratch copies live: a private folder of this user under the system temporary folder, so that
    every run finds (and sweeps) what a killed run left. Falls back to the temporary folder itself when that
    private folder cannot be trusted (not ours, or a link). Scratch folders older h3kit versions left
    directly in the temporary folder are removed once they are an hour old."""
    base = Path(tempfile.gettempdir())
    _sweep_legacy(base)
    private = base / f"h3kit-{os.getuid()}"
    with contextlib.suppress(FileExistsError, OSError):
        private.mkdir(mode=0o700)
    try:
        st = os.lstat(private)
    except OSError:
        return base
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        return private
    return base
