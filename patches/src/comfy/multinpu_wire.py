"""What every process of the group shares: its settings (GroupSpec, the environment names, timings and exit codes),
the signed wire format (pickle runs code when it loads: nothing unsigned is unpickled) and the /dev/shm hand-off.
Design: docs/multinpu.md, "The process transport"."""

from __future__ import annotations

import ctypes
import datetime
import errno
import fcntl
import hashlib
import hmac
import io
import json
import logging
import math
import os
import pickle
import re
import signal
import stat
import subprocess
import sys

import psutil
import torch

import comfy.multinpu
import comfy.multinpu_links

# The group contract: what h3kit's service side (toolkit/h3kit/group.py, another interpreter, which cannot import
# this module) writes and this side reads. Both copies are pinned equal by tests/test_group_contract.py.
GROUP_ENV = "H3KIT_GROUP"            # the JSON GroupSpec of this service (set by h3kit start)
KEY_ENV = "H3KIT_GROUP_KEY"          # hex key authenticating every control message
RANK_ENV = "H3KIT_RANK"
LOCAL_RANK_ENV = "H3KIT_LOCAL_RANK"
PARENT_ENV = "H3KIT_PARENT_PID"
HEARTBEAT_ENV = "H3KIT_HEARTBEAT_TIMEOUT"
PROGRESS_ENV = "H3KIT_PROGRESS_TIMEOUT"

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEFAULT_JOIN_TIMEOUT = 300.0         # seconds for every rank to join a generation
WORKER_MODULE = "comfy.multinpu_worker"
RANKS_FILE = "ranks.json"
END = "end"                          # the command that closes a generation

CHANNEL_PORT_OFFSET = 1              # the command channel's TCP listener for other hosts: master port + 1
HEARTBEAT_INTERVAL = 1.0
# The failure detectors' bounds: docs/multinpu.md, "Timeouts and settings". Kernels do not hold the GIL, so a busy
# worker keeps beating: one silent for HEARTBEAT_STALE is hung (stopped, stuck in a driver call).
HEARTBEAT_STALE = float(os.environ.get(HEARTBEAT_ENV, "15"))
PROGRESS_STALE = float(os.environ[PROGRESS_ENV]) if os.environ.get(PROGRESS_ENV) else None  # else progress_timeout's
HOST_STALE = min(10.0, HEARTBEAT_STALE)  # a host whose agent has been silent this long is lost
LOAD_TIMEOUT = 1800.0                # the first read of the H3 weights on a worker takes minutes
REPORTED_EXIT = 70                   # a worker that posted its error exits with this code: not a crash
RECYCLED_EXIT = 75                   # a worker told to leave (its generation was aborted): not a crash
TERM_EXIT = 143                      # a worker that ended on SIGTERM (watch_termination): its launcher stopped it
# In a death's reason: this rank was ended by its launcher (a launcher that stops or dies takes its workers with
# it), so it is not the root cause when another rank died
SECONDARY = "stopped by its launcher"
CRASH_LIMIT = 5                      # deaths of one rank within CRASH_WINDOW before it is not replaced
CRASH_WINDOW = 120.0
POLL = 0.05


class GroupError(RuntimeError):
    """The process group could not run a command (a rank missing, dead or failed)."""


class RankDied(GroupError):
    """A rank's process died (or stopped answering) while the group needed it."""


class RankFailed(GroupError):
    """A rank raised; the message names the rank and carries its exception type and message."""


class RankHung(RankDied):
    """A rank's process was alive and beating but made no progress past its bound; it was killed."""


class ConfigMismatch(GroupError):
    """A worker loaded something other than what rank 0 holds (another file, options or weight patches)."""


# ---- the group's settings -----------------------------------------------------------------------

class GroupSpec:
    """Where and how big the group is, as h3kit start writes it into H3KIT_GROUP; rank = node_rank * local_size +
    local_rank."""

    FIELDS = ("nnodes", "node_rank", "local_size", "device_type", "master_addr", "master_port",
              "timeout", "join_timeout", "runtime_root", "worker_args", "worker_module", "channel")

    def __init__(self, nnodes=1, node_rank=0, local_size=1, device_type="cpu",
                 master_addr="127.0.0.1", master_port=0, timeout=comfy.multinpu.DEFAULT_TIMEOUT,
                 join_timeout=DEFAULT_JOIN_TIMEOUT, runtime_root=None, worker_args=(), worker_module=WORKER_MODULE,
                 channel=None):
        if device_type not in BACKENDS:
            raise ValueError(f"MultiNPU: device type {device_type!r} is not one of {sorted(BACKENDS)}")
        if not (nnodes >= 1 and 0 <= node_rank < nnodes and local_size >= 1):
            raise ValueError(f"MultiNPU: node {node_rank} of {nnodes} with {local_size} devices is not a group")
        self.nnodes = int(nnodes)
        self.node_rank = int(node_rank)
        self.local_size = int(local_size)
        self.device_type = device_type
        self.master_addr = master_addr
        self.master_port = int(master_port)
        self.timeout = float(timeout)
        self.join_timeout = float(join_timeout)
        self.runtime_root = runtime_root
        self.worker_args = list(worker_args)
        self.worker_module = worker_module
        self.channel = channel  # the driver's command channel (a Unix socket path; set by the driver)

    def channel_address(self):
        """The driver's command channel from this host: its Unix socket on node 0, else its TCP listener."""
        if self.node_rank == 0:
            return self.channel
        return (self.master_addr, self.master_port + CHANNEL_PORT_OFFSET)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.local_size

    @property
    def backend(self) -> str:
        return BACKENDS[self.device_type]

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def device_name(self, rank: int) -> str:
        """Rank `rank`'s device as its process names it ("npu:1": the logical index of its local rank)."""
        return "cpu" if self.device_type == "cpu" else f"{self.device_type}:{rank % self.local_size}"

    def describe_rank(self, rank: int) -> str:
        where = f", node {self.node_of(rank)}" if self.nnodes > 1 else ""
        return f"rank {rank} ({self.device_name(rank)}{where})"

    def to_json(self) -> str:
        return json.dumps({f: getattr(self, f) for f in self.FIELDS})

    @classmethod
    def from_json(cls, text: str) -> GroupSpec:
        data = json.loads(text)
        return cls(**{f: data[f] for f in cls.FIELDS if f in data})

    def layout(self) -> dict:
        """What every node must agree on (an agent started with other settings is refused, named)."""
        return {"nnodes": self.nnodes, "local_size": self.local_size, "device_type": self.device_type,
                "master": f"{self.master_addr}:{self.master_port}"}


def key_from_environment() -> bytes:
    value = os.environ.get(KEY_ENV, "")
    if not value:
        raise GroupError(f"MultiNPU: {KEY_ENV} is not set: the ranks of a service share a key that "
                         "authenticates their messages (h3kit start sets it)")
    return value.encode()


def new_key() -> str:
    return os.urandom(32).hex()


# ---- wire format ---------------------------------------------------------------------------------

class Signer:
    """Pickles with an HMAC-SHA256 under the service's key in front."""

    def __init__(self, key: bytes):
        self.key = key

    def dumps(self, obj) -> bytes:
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return hmac.new(self.key, body, hashlib.sha256).digest() + body

    def loads(self, data: bytes, what: str):
        mac, body = data[:32], data[32:]
        if not hmac.compare_digest(mac, hmac.new(self.key, body, hashlib.sha256).digest()):
            # never unpickle what another key (or no key) wrote: pickle would run it
            raise GroupError(f"MultiNPU: {what} is not signed with this service's key; refusing it")
        return pickle.loads(body)


def pack(obj):
    """(pickle bytes, tensors): obj with every tensor taken out (pickled as its index in tensors), for a header plus
    one broadcast."""
    tensors, seen = [], {}

    def index(o):
        if not isinstance(o, torch.Tensor):
            return None
        if id(o) not in seen:  # a tensor named twice (rank 0's and the others' arguments) travels once
            seen[id(o)] = len(tensors)
            tensors.append(o)
        return seen[id(o)]
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = index
    pickler.dump(obj)
    return buf.getvalue(), tensors


def unpack(data: bytes, tensors):
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = tensors.__getitem__
    return unpickler.load()


_ALIGN = 64


def flatten(tensors, device) -> tuple:
    """One uint8 buffer on `device` holding every tensor, and the layout [(offset, nbytes, shape, dtype, on_cpu)]."""
    metas, offset = shm_layout(tensors)
    return _fill(torch.empty(offset, dtype=torch.uint8, device=device), tensors, metas), metas


def _fill(buf: torch.Tensor, tensors, metas) -> torch.Tensor:
    for t, (start, nbytes, _, _, _) in zip(tensors, metas):
        if nbytes:
            buf[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unflatten(buf: torch.Tensor, metas) -> list:
    """The tensors of a buffer made by flatten: views of it (copied to the host where the sender's tensor was)."""
    out = []
    for start, nbytes, shape, dtype, on_cpu in metas:
        t = buf[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
        out.append(t.cpu() if on_cpu and t.device.type != "cpu" else t)
    return out


def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


# ---- shared memory between the driver and worker rank 0: docs/multinpu.md, "The /dev/shm hand-off" ---------

SHM_DIR_ENV = "H3KIT_SHM_DIR"        # where the hand-off files live (default /dev/shm; tests put a small tmpfs here)
SHM_LOCK_PREFIX = "h3kit-lock-"
_SHM_NAME = re.compile(r"h3kit-(?:lock-)?(\d+)-([0-9a-f]+)(?:-\d+-\d+-(?:in|out))?")


class SharedMemoryFull(GroupError):
    """The hand-off's shared memory has no room for a command's tensors: that command fails, the group stays."""


def shm_dir() -> str:
    if os.environ.get(SHM_DIR_ENV):
        return os.environ[SHM_DIR_ENV]
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def shm_layout(tensors) -> tuple:
    """(metas, nbytes) of tensors laid out in one buffer (flatten, shm_write)."""
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((offset, nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type == "cpu"))
        offset += -(-nbytes // _ALIGN) * _ALIGN  # aligned, so every slice can be viewed as its dtype
    return metas, offset


def _size(nbytes: float) -> str:
    return (f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5
            else f"{nbytes / 1e3:.1f} KB" if nbytes >= 1e3 else f"{nbytes:.0f} bytes")


def shm_full_message(path: str, nbytes: int, what: str) -> str:
    """What a full hand-off folder fails a command with: what needed how much, what was free, the fix."""
    folder = os.path.dirname(path) or "."
    size = 16
    try:
        st = os.statvfs(folder)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        room = f"{_size(free)} free of {_size(total)}"
        size = max(size, math.ceil((total - free + nbytes) / 2**30) + 1)  # GiB: room for what is there and this
    except OSError as e:
        room = f"free space unknown ({e.strerror})"
    return (f"MultiNPU: shared memory is full: the hand-off of {what} between the server and worker rank 0 needs "
            f"{_size(nbytes)} in {folder}, which has {room}. Fix: enlarge it (`mount -o remount,size={size}G "
            f"{folder}`; docker: `--shm-size {size}g`; Kubernetes: an emptyDir with medium Memory on /dev/shm) or "
            f"free it (what other programs left there), then run the prompt again")


def _reserve(fd: int, path: str, nbytes: int, what: str):
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG):
            raise SharedMemoryFull(shm_full_message(path, nbytes, what)) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # a file system without fallocate (the TMPDIR fallback): sized only, as before
        os.ftruncate(fd, nbytes)


def shm_write(path: str, tensors, what: str = "a command's tensors") -> tuple:
    """Write tensors into a new file `path` (0600) laid out as flatten() does: (metas, nbytes); no file for no bytes.
    The space is reserved before anything is written through the mapping (a full tmpfs raises SIGBUS there):
    SharedMemoryFull, and no file left, when the folder has no room."""
    metas, offset = shm_layout(tensors)
    if offset == 0:
        return metas, 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _reserve(fd, path, offset, what)
    except BaseException:
        os.close(fd)
        shm_remove(path)
        raise
    os.close(fd)
    _fill(torch.from_file(path, shared=True, size=offset, dtype=torch.uint8), tensors, metas)
    return metas, offset


def shm_read(path: str, nbytes: int) -> torch.Tensor:
    """The bytes of a file shm_write made, mapped (no copy); the file can be removed at once."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def shm_remove(path: str):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning(f"MultiNPU: cannot remove {path}: {e}")


def shm_claim(token: str, folder: str = None) -> tuple:
    """At a driver's start: shm_sweep, then hold this driver's lock file for its life (flock'd before it has its
    name, so no sweep ever sees it unlocked). (path, fd) for shm_release; (None, None) when no lock can be held."""
    folder = folder or shm_dir()
    shm_sweep(folder)
    path = os.path.join(folder, f"{SHM_LOCK_PREFIX}{os.getpid()}-{token}")
    fd = None
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.link(f"/proc/self/fd/{fd}", path)
    except (OSError, AttributeError):
        if fd is not None:
            os.close(fd)
        try:  # no O_TMPFILE, or no link to it (EXDEV in some sandboxes): the pid check of shm_sweep covers the
            # moment before the flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:
            logging.warning(f"MultiNPU: cannot hold a lock file in {folder} ({e}): a driver started later may "
                            "remove this one's hand-off files only when its pid is gone")
            return None, None
    return path, fd


def shm_release(claim):
    path, fd = claim or (None, None)
    if path is not None:
        shm_remove(path)
    if fd is not None:
        os.close(fd)


def _pid_may_own(pid: int, mtime: float) -> bool:
    """Whether process `pid` (of this pid namespace) may have written a file last changed at mtime: it is alive and
    started before (a pid reused by a later process owns nothing older than itself; 2 s of slack for the boot time's
    whole seconds)."""
    try:
        return psutil.Process(pid).create_time() <= mtime + 2.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # alive, its start unknown
        return True


def _lock_free(path: str):
    """An fd holding the lock at `path` when nobody else holds it (its owner died), else None (held, or absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def shm_sweep(folder: str = None) -> list:
    """Remove the hand-off and lock files that drivers which are gone left in `folder` (the conditions:
    docs/multinpu.md, "Leftovers swept at start"). The names removed."""
    folder = folder or shm_dir()
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    owners = {}
    for name in names:
        m = _SHM_NAME.fullmatch(name)
        if m:
            owners.setdefault((int(m.group(1)), m.group(2)), []).append(name)
    removed = []
    for (pid, token), files in sorted(owners.items()):
        if pid == os.getpid():
            continue
        lock = os.path.join(folder, f"{SHM_LOCK_PREFIX}{pid}-{token}")
        held = _lock_free(lock) if os.path.lexists(lock) else None
        if os.path.lexists(lock) and held is None:
            continue  # a live driver holds it
        try:
            for name in sorted(files, key=lambda n: n.startswith(SHM_LOCK_PREFIX)):  # the lock file last
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or _pid_may_own(pid, st.st_mtime):
                    continue
                shm_remove(path)
                removed.append(name)
        finally:
            if held is not None:
                os.close(held)
    if removed:
        logging.warning(f"MultiNPU: removed {len(removed)} shared-memory file(s) that stopped servers left in "
                        f"{folder}: {', '.join(removed[:8])}{' ...' if len(removed) > 8 else ''}")
    return removed


# ---- what every process of the group does -------------------------------------------------------

def _die_with_parent_signal():
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def die_with_parent():
    """In a worker: get SIGTERM when the process that started it ends, and end now if it already has."""
    _die_with_parent_signal()
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if parent and os.getppid() != parent:
        os._exit(0)


def wait_or_kill(proc, seconds: float):
    """Wait for a subprocess to end; SIGKILL it after `seconds`."""
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5.0)


def cpu_threads(spec: GroupSpec):
    """The intra-op threads of one rank on the CPU simulation: the host's cores divided among its local ranks
    (as torchrun does), so P processes do not each spin a full OpenMP team. None off the CPU, or with OMP_NUM_THREADS."""
    if spec.device_type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // spec.local_size)


def failure_detectors(spec: GroupSpec) -> dict:
    """{what: seconds} after which each of h3kit's detectors notices a failed rank or host; every one must fire
    before a collective gives up (docs/multinpu.md, "Timeouts and settings")."""
    return {"a rank's heartbeat": HEARTBEAT_STALE, "a host's agent heartbeat": HOST_STALE,
            "a rank's progress": progress_timeout(spec)}


def check_timeouts(spec: GroupSpec):
    """GroupError unless every failure detector fires before the collective timeout."""
    what, seconds = max(failure_detectors(spec).items(), key=lambda kv: kv[1])
    if spec.timeout <= seconds:
        raise GroupError(f"MultiNPU: the collective timeout ({spec.timeout:g} s) must be longer than {what} "
                         f"({seconds:g} s): a failed rank would be reported as a peer's collective timing out. "
                         f"Fix: a longer group timeout, or a shorter "
                         f"{PROGRESS_ENV if 'progress' in what else HEARTBEAT_ENV}")
    if progress_timeout(spec) <= HEARTBEAT_INTERVAL:  # progress comes with the beats: every rank would look hung
        raise GroupError(f"MultiNPU: the progress bound ({progress_timeout(spec):g} s) must be longer than the "
                         f"heartbeat interval ({HEARTBEAT_INTERVAL:g} s). Fix: a longer {PROGRESS_ENV}")
    comfy.multinpu_links.check(spec)  # HCCL's own timeouts in order below it, the buffer sizes


def progress_timeout(spec: GroupSpec) -> float:
    """The progress bound: H3KIT_PROGRESS_TIMEOUT, else 60 s or half the group timeout when that is shorter."""
    return PROGRESS_STALE if PROGRESS_STALE is not None else min(60.0, spec.timeout / 2)
