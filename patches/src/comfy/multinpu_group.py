"""The members of a multi-device process group: its settings, its wire format, its workers and agents.

comfy.multinpu_process is rank 0 (the ComfyUI server), which drives the group; this module is what every
rank shares and what the other ranks run:

- GroupSpec: where and how big the group is (h3kit start writes it into H3KIT_GROUP).
- The wire: a command is a small header, pickled. Pickle runs code when it loads, so every value written to
  the store or sent on the command channel carries an HMAC-SHA256 under a key only the ranks of this service
  hold (H3KIT_GROUP_KEY), and nothing unauthenticated is unpickled: pickle is the trusted transport between
  the ranks of one service, nothing more. Tensors never travel through the store or the channel: the driver
  writes a command's tensors into /dev/shm, worker rank 0 broadcasts them over the group.
- The command channel (ChannelServer, Link): a Unix socket in a 0700 folder of the runtime root, from the
  driver to this host's workers: worker rank 0 takes each command there and returns its result there, every
  local worker beats there. Frames are length-prefixed, capped and signed per connection (nonce, direction,
  sequence), so garbage, replays and foreign frames are dropped with a log line.
- The store: one TCPStore for the life of the service, in a small process of its own (StoreHost), listening on
  the master address only. Generation g of the group has its members in "gen/{g}" and its commands, relayed
  by worker rank 0, in "cmd/{g}/{n}", numbered from 1; its process group uses PrefixStore(f"pg{g}"), so
  re-forming needs no new port.
- LocalWorkers: a host's worker processes (`python -B -m comfy.multinpu_worker`), started, watched and
  replaced by rank 0's monitor or by an agent; they die with the process that started them.
- serve(): a worker's life. It waits for its next command in a blocking store wait (no collective is open
  while the server is idle, however long), runs the command's program, and closes every command with a
  barrier. A program that raises posts its error ("err/{g}/{n}/{rank}") and destroys its process group, so
  the others' collectives fail at once instead of at the timeout; the next command forms a new generation.
  A thread beats once a second (authenticated: _heartbeat), so the driver can tell a hung worker from a busy one.
- Agent: a host other than node 0 (`python -B -m comfy.multinpu_group`, no ComfyUI) starts and replaces
  its workers, reports their deaths, and follows rank 0 through restarts of the master.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import hashlib
import hmac
import io
import json
import logging
import os
import pickle
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import torch
import torch.distributed

import comfy.multinpu

GROUP_ENV = "H3KIT_GROUP"            # the JSON GroupSpec of this service (set by h3kit start)
KEY_ENV = "H3KIT_GROUP_KEY"          # hex key authenticating every control message
RANK_ENV = "H3KIT_RANK"
LOCAL_RANK_ENV = "H3KIT_LOCAL_RANK"
PARENT_ENV = "H3KIT_PARENT_PID"
HEARTBEAT_ENV = "H3KIT_HEARTBEAT_TIMEOUT"
# Fault injection, for tests and acceptance runs, a comma-separated list: "PROGRAM:oom:PATH" makes a worker's run
# of PROGRAM ask for an impossible allocation (the CPU or device allocator's own out-of-memory error) while the
# file PATH exists; "PROGRAM:raise:PATH" makes it raise a RuntimeError; "PROGRAM:hold:PATH" holds it while PATH
# exists (at most 120 s). PROGRAM may be a model's loader ("te_config", "dit_config", "vae_config").
FAULT_ENV = "H3KIT_MULTINPU_FAULT"

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
LAUNCHERS = ("h3kit", "torchrun")    # who starts and restarts a host's workers: LocalWorkers or TorchrunWorkers
RDZV_READ_TIMEOUT = 15              # seconds: torchrun's c10d rendezvous store reads (its default is 60)
TORCHRUN_MAX_RESTARTS = 1000         # torchrun's restart limit; the driver restarts torchrun itself past it
TORCHRUN_RETRY = 30.0                # after torchrun ended more than CRASH_LIMIT times in CRASH_WINDOW, the pause
WORKER_MODULE = "comfy.multinpu_worker"
RANKS_FILE = "ranks.json"
STORE_PREFIX = "h3kit"
END = "end"                          # the command that closes a generation

HEARTBEAT_INTERVAL = 1.0
# A worker whose heartbeat stops for this long is hung (stopped, stuck in a driver call): it is killed and
# replaced. Kernels do not hold the GIL, so a busy worker keeps beating.
HEARTBEAT_STALE = float(os.environ.get(HEARTBEAT_ENV, "15"))
# A host whose agent (which beats every second) has been silent this long is lost: its ranks are dead. A killed
# agent or torchrun is seen sooner, by its workers' notes of their SIGTERM (watch_termination)
HOST_STALE = min(10.0, HEARTBEAT_STALE)
# torchrun's c10d rendezvous drops a node whose keep-alives stop for KEEP_ALIVE x KEEP_ALIVE_ATTEMPTS seconds
KEEP_ALIVE, KEEP_ALIVE_ATTEMPTS = 2, 3
LOAD_TIMEOUT = 1800.0                # the first read of the H3 weights on a worker takes minutes
ERROR_WAIT = 3.0                     # after a failure, for the other ranks' reports and deaths to arrive
DEATH_WAIT = 0.5                     # ... once a dead rank is known
REPORTED_EXIT = 70                   # a worker that posted its error exits with this code: not a crash
RECYCLED_EXIT = 75                   # a worker told to leave (its generation was aborted): not a crash
TERM_EXIT = 143                      # a worker that ended on SIGTERM (watch_termination): its launcher stopped it
# In a death's reason: this rank was ended by its launcher (torchrun stops every worker of its host when one
# fails; a launcher that dies takes its workers with it), so it is not the root cause when another rank died
SECONDARY = "stopped by its launcher"
CRASH_LIMIT = 5                      # deaths of one rank within CRASH_WINDOW before it is not replaced
CRASH_WINDOW = 120.0
POLL = 0.05

PROGRAMS = {}                        # name -> fn(context, comm, payload) run by the workers


class GroupError(RuntimeError):
    """The process group could not run a command (a rank missing, dead or failed)."""


class RankDied(GroupError):
    """A rank's process died (or stopped answering) while the group needed it."""


class RankFailed(GroupError):
    """A rank raised; the message names the rank and carries its exception type and message."""


class ConfigMismatch(GroupError):
    """A worker loaded something other than what rank 0 holds (another file, options or weight patches)."""


def program(name: str):
    """Register fn(context, comm, payload) as the worker side of the command `name`.

    It may return a callable, run after the command's closing barrier (work that must not hold the
    group, such as reading model files).
    """
    def register(fn):
        PROGRAMS[name] = fn
        return fn
    return register


# ---- the group's settings -----------------------------------------------------------------------

class GroupSpec:
    """Where and how big the group is, as h3kit start writes it into H3KIT_GROUP.

    Ranks are numbered node by node: rank = node_rank * local_size + local_rank; rank 0 is local rank 0
    of node 0 (the ComfyUI server). Every node runs local_size ranks, one per device in `devices`.
    """

    FIELDS = ("nnodes", "node_rank", "local_size", "device_type", "devices", "master_addr", "master_port",
              "timeout", "join_timeout", "runtime_root", "worker_args", "worker_module", "launcher", "channel")

    def __init__(self, nnodes=1, node_rank=0, local_size=1, device_type="cpu", devices=None,
                 master_addr="127.0.0.1", master_port=0, timeout=comfy.multinpu.DEFAULT_TIMEOUT,
                 join_timeout=300.0, runtime_root=None, worker_args=(), worker_module=WORKER_MODULE, launcher="h3kit",
                 channel=None):
        if launcher not in LAUNCHERS:
            raise ValueError(f"MultiNPU: launcher {launcher!r} is not one of {LAUNCHERS}")
        if device_type not in BACKENDS:
            raise ValueError(f"MultiNPU: device type {device_type!r} is not one of {sorted(BACKENDS)}")
        if not (nnodes >= 1 and 0 <= node_rank < nnodes and local_size >= 1):
            raise ValueError(f"MultiNPU: node {node_rank} of {nnodes} with {local_size} devices is not a group")
        self.nnodes = int(nnodes)
        self.node_rank = int(node_rank)
        self.local_size = int(local_size)
        self.device_type = device_type
        self.devices = list(devices) if devices is not None else list(range(local_size))
        self.master_addr = master_addr
        self.master_port = int(master_port)
        self.timeout = float(timeout)
        self.join_timeout = float(join_timeout)
        self.runtime_root = runtime_root
        self.worker_args = list(worker_args)
        self.worker_module = worker_module
        self.launcher = launcher
        self.channel = channel  # the driver's command channel (a Unix socket path; set by the driver)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.local_size

    @property
    def backend(self) -> str:
        return BACKENDS[self.device_type]

    def rank_of(self, node: int, local_rank: int) -> int:
        return node * self.local_size + local_rank

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
    def __init__(self, key: bytes):
        self.key = key

    def sign(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest() + body

    def verify(self, data: bytes, what: str) -> bytes:
        mac, body = data[:32], data[32:]
        if not hmac.compare_digest(mac, hmac.new(self.key, body, hashlib.sha256).digest()):
            # never unpickle what another key (or no key) wrote: pickle would run it
            raise GroupError(f"MultiNPU: {what} is not signed with this service's key; refusing it")
        return body

    def dumps(self, obj) -> bytes:
        return self.sign(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def loads(self, data: bytes, what: str):
        return pickle.loads(self.verify(data, what))


class _TensorPickler(pickle.Pickler):
    # tensors are replaced by their index in `tensors`; they travel over the group, not in the pickle
    def __init__(self, file, tensors):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.seen = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor):
            index = self.seen.get(id(obj))
            if index is None:  # a tensor named twice (rank 0's and the others' arguments) travels once
                index = self.seen[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
            return index
        return None


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file, tensors):
        super().__init__(file)
        self.tensors = tensors

    def persistent_load(self, pid):
        return self.tensors[pid]


def pack(obj):
    """(pickle bytes, tensors): obj with every tensor taken out, for a header plus one broadcast."""
    tensors = []
    buf = io.BytesIO()
    _TensorPickler(buf, tensors).dump(obj)
    return buf.getvalue(), tensors


def unpack(data: bytes, tensors):
    return _TensorUnpickler(io.BytesIO(data), tensors).load()


_ALIGN = 64


def flatten(tensors, device) -> tuple:
    """One uint8 buffer on `device` holding every tensor, and the layout [(offset, nbytes, shape, dtype, on_cpu)]."""
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((offset, nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type == "cpu"))
        offset += -(-nbytes // _ALIGN) * _ALIGN  # aligned, so every slice can be viewed as its dtype
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    for t, (start, nbytes, _, _, _) in zip(tensors, metas):
        if nbytes:
            buf[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf, metas


def unflatten(buf: torch.Tensor, metas) -> list:
    """The tensors of a buffer made by flatten: views of it, on its device (copied to the host where the
    sender's tensor lived on the host)."""
    out = []
    for start, nbytes, shape, dtype, on_cpu in metas:
        t = buf[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
        out.append(t.cpu() if on_cpu and t.device.type != "cpu" else t)
    return out


# ---- the store -----------------------------------------------------------------------------------

def td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


STORE_START_TIMEOUT = 120.0         # seconds for the store's process to answer (it imports torch)


class StoreHost:
    """The group's TCPStore, in a small process of its own (`python -B -m comfy.multinpu_group --store ...`),
    not in the ComfyUI server: a client that reaches the port can write keys of any size into a TCPStore, and
    that memory is the store's process's, never the server's. The driver binds the listening socket on
    addr:port only (torch's own server would listen on every interface) and keeps it for the life of the
    service: the store's process gets it as a descriptor, and a store that dies is started again on the same
    socket (start()). The process ends with the driver (parent-death signal, and the end of its stdin)."""

    def __init__(self, addr: str, port: int, timeout: float):
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(128)
        self.addr = addr
        self.port = self.sock.getsockname()[1]
        self.timeout = timeout
        self.proc = None
        self.starts = 0

    def start(self):
        fd = self.sock.fileno()
        argv = [sys.executable, "-B", "-m", "comfy.multinpu_group", "--store", self.addr, str(self.port), str(fd),
                str(self.timeout)]
        env = dict(os.environ, **{PARENT_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, pass_fds=(fd,), close_fds=True,
                                     preexec_fn=_die_with_parent_signal)
        self.starts += 1
        logging.info(f"MultiNPU: the group's store runs in pid {self.proc.pid} on {self.addr}:{self.port}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self.sock.close()


STORE_GROWTH_ENV = "H3KIT_STORE_GROWTH_LIMIT"  # MiB the store's process may grow by before it ends itself
STORE_EXIT = 76                      # the store's process ended itself: it grew past its limit


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store_main(argv) -> int:
    """The store's process: host the TCPStore on the listening socket the driver handed over, until the
    driver is gone (its stdin ends). A store that grows by more than H3KIT_STORE_GROWTH_LIMIT MiB (1024; a
    flood of keys: the group's own keys are small) ends itself: the driver starts a fresh one and replaces the
    group, rather than the host's OOM killer choosing a process (a worker holding a model is the biggest)."""
    import select
    addr, port, fd, timeout = argv
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format="[store] %(asctime)s %(message)s", stream=sys.stdout)
    store = torch.distributed.TCPStore(addr, int(port), None, is_master=True, wait_for_workers=False,  # noqa: F841
                                       timeout=td(float(timeout)), master_listen_fd=int(fd), use_libuv=True)
    limit = float(os.environ.get(STORE_GROWTH_ENV, "1024")) * 2**20
    base = _rss()
    while True:
        if select.select([sys.stdin], [], [], 1.0)[0] and not os.read(sys.stdin.fileno(), 4096):
            return 0  # the driver is gone
        if _rss() - base > limit:
            logging.error(f"MultiNPU: the group's store grew by {(_rss() - base) / 2**20:.0f} MiB, past its limit "
                          f"({STORE_GROWTH_ENV}={limit / 2**20:g}): a flood of keys; it ends, the driver starts a "
                          "fresh one")
            sys.stdout.flush()
            os._exit(STORE_EXIT)


def connect_store(addr: str, port: int, timeout: float, deadline: float = None, stop: threading.Event = None):
    """A client of the group's store, retrying until `deadline` (monotonic) while the master is not up;
    None once `stop` is set."""
    deadline = time.monotonic() + timeout if deadline is None else deadline
    while True:
        try:
            # short attempts: TCPStore retries inside for its whole timeout, deaf to a stop request
            store = torch.distributed.TCPStore(addr, port, None, is_master=False,
                                               timeout=td(min(2.0, max(0.5, deadline - time.monotonic()))))
            store.set_timeout(td(timeout))
            return store
        except (RuntimeError, torch.distributed.DistError) as e:
            if time.monotonic() >= deadline:
                raise GroupError(f"MultiNPU: cannot reach the group's store at {addr}:{port}: {e}") from None
            if stop is not None and stop.wait(0.5):
                return None
            if stop is None:
                time.sleep(0.5)


def _store_gone(e: BaseException) -> bool:
    return isinstance(e, (torch.distributed.DistNetworkError, ConnectionError))


class Control:
    """Signed reads and writes of the control keys, under the service's prefix; one call at a time per
    connection (the driver's threads share them).

    Every value is signed together with its key's name (which holds the generation and the command's
    number), so a signed value copied into another slot is refused like garbage. A value that does not
    verify is never unpickled: it is dropped with a log line and reads as absent (peek, wait), so a local
    user who can reach the store cannot make a rank act on, or die of, what they wrote.
    """

    def __init__(self, store, signer: Signer):
        self.raw = store
        self.store = torch.distributed.PrefixStore(STORE_PREFIX, store)
        self.signer = signer
        self._lock = threading.RLock()
        self._dropped = {}  # key -> the bytes last refused there (logged once)

    def put(self, key: str, obj):
        data = self.signer.dumps((key, obj))
        with self._lock:
            self.store.set(key, data)

    def _load(self, key: str, data: bytes):
        """The value of `key`, or _BAD when its bytes are not a value this service signed for that key."""
        try:
            slot, obj = self.signer.loads(data, f"store key {key!r}")
            if slot != key:
                raise GroupError(f"MultiNPU: store key {key!r} holds a value signed for {slot!r}; refusing it")
            return obj
        except Exception as e:
            digest = hashlib.sha256(data).digest()  # not the bytes: a flood of big values must not stay here
            if self._dropped.get(key) != digest:
                self._dropped[key] = digest
                logging.warning(f"MultiNPU: dropped store key {key!r} ({len(data)} bytes): "
                                f"{e if isinstance(e, GroupError) else 'not a signed value'}")
            return _BAD

    def get(self, key: str):
        with self._lock:
            data = self.store.get(key)
        obj = self._load(key, data)
        if obj is _BAD:
            raise GroupError(f"MultiNPU: store key {key!r} does not hold a value signed by this service")
        return obj

    def has(self, key: str) -> bool:
        with self._lock:
            return self.store.check([key])

    def peek(self, key: str, default=None):
        """The signed value of key, else `default` (absent, or dropped as unsigned)."""
        with self._lock:
            if not self.store.check([key]):
                return default
            data = self.store.get(key)
        obj = self._load(key, data)
        return default if obj is _BAD else obj

    def counter(self, key: str, add: int = 0) -> int:
        with self._lock:
            return self.store.add(key, add)

    def delete(self, key: str):
        with self._lock:
            self.store.delete_key(key)

    def wait(self, key: str, timeout: float):
        """The signed value of key once one is there; values that do not verify are dropped and waited past."""
        deadline = time.monotonic() + timeout
        while True:
            # no lock: a worker's main thread is the only user of its connection, and waits here for hours
            self.store.wait([key], td(max(0.001, deadline - time.monotonic())))
            obj = self._load(key, self.store.get(key))
            if obj is not _BAD:
                return obj
            if time.monotonic() >= deadline:
                raise GroupError(f"MultiNPU: no signed value at store key {key!r} within {timeout:g} s")
            time.sleep(POLL)


_BAD = object()


# ---- the command channel: the driver and this host's workers, over a Unix socket --------------------

CHANNEL_DIR = "channel"              # under the runtime root: 0700, the socket in it
CHANNEL_SOCKET = "driver.sock"
HELLO_LIMIT = 4096                   # bytes of a connection's first frame (who it is)
FRAME_LIMIT = 256 << 20              # bytes of any frame (a command's header: its tensors go through /dev/shm)
HANDSHAKE_TIMEOUT = 5.0
MAX_PENDING = 16                     # connections not yet authenticated; more are closed at once


class ChannelClosed(GroupError):
    """The other end of a channel connection went away."""


def private_dir(path: str) -> str:
    """`path` as a folder only this user can enter: made 0700 when absent; GroupError when it is a link, another
    user's or open to the group or others (the command channel's socket lives there)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise GroupError(f"MultiNPU: {path} is not a folder (the command channel's socket lives there). "
                         f"Fix: remove it; the server makes the folder, mode 0700")
    if st.st_uid != os.getuid():
        raise GroupError(f"MultiNPU: {path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): the command "
                         "channel's folder must be this user's alone. Fix: remove it; the server makes it, mode 0700")
    if st.st_mode & 0o077:
        raise GroupError(f"MultiNPU: {path} is open to other users (mode {st.st_mode & 0o777:o}): the command "
                         f"channel's folder must be this user's alone. Fix: chmod 700 {path}")
    return path


def _address(path: str):
    """A path bind/connect take: a Unix socket's path is limited to 107 bytes, a longer one is reached through
    an open descriptor of its folder (/proc/self/fd/N/name). Returns (address, fd to close or None)."""
    if len(path.encode()) < 100:
        return path, None
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    return f"/proc/self/fd/{fd}/{os.path.basename(path)}", fd


def _recv_exact(sock, n: int) -> bytes:
    parts, left = [], n
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise ChannelClosed("MultiNPU: the channel's other end closed it")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def recv_frame(sock, limit: int) -> bytes:
    """One length-prefixed frame's bytes; GroupError for one longer than `limit` (nothing of it is read)."""
    size = int.from_bytes(_recv_exact(sock, 4), "big")
    if size > limit:
        raise GroupError(f"MultiNPU: a frame of {size} bytes (the limit is {limit})")
    return _recv_exact(sock, size)


class Link:
    """One authenticated connection of the command channel. Every frame is length-prefixed and carries an
    HMAC over the connection's nonce (the driver's random challenge), its direction and its sequence number
    with the message: a frame copied from another connection, replayed, reordered or reflected back does not
    verify, and is dropped like garbage (never unpickled)."""

    def __init__(self, sock, signer: Signer, nonce: bytes, mine: str, theirs: str):
        self.sock = sock
        self.signer = signer
        self.nonce = nonce
        self.mine, self.theirs = mine, theirs
        self.sent = self.received = 0
        self._send_lock = threading.Lock()

    def send(self, obj):
        with self._send_lock:
            self.sent += 1
            body = self.signer.dumps((self.nonce, self.mine, self.sent, obj))
            self.sock.sendall(len(body).to_bytes(4, "big") + body)

    def open(self, data: bytes):
        """The message of a frame this connection's peer sent next; GroupError for anything else."""
        nonce, direction, seq, obj = self.signer.loads(data, "channel frame")
        if nonce != self.nonce:
            raise GroupError("MultiNPU: a channel frame signed for another connection: a replay")
        if direction != self.theirs or seq != self.received + 1:
            raise GroupError(f"MultiNPU: a channel frame out of order (sequence {seq} from the "
                             f"{'worker' if direction == 'w' else 'driver'}, expected {self.received + 1}): a replay")
        self.received = seq
        return obj

    def recv(self, limit: int = FRAME_LIMIT):
        """The next verified message (blocking); a frame that does not verify is dropped with a log line."""
        while True:
            data = recv_frame(self.sock, limit)
            try:
                return self.open(data)
            except Exception as e:
                logging.warning(f"MultiNPU: dropped a channel frame ({len(data)} bytes): "
                                f"{e if isinstance(e, GroupError) else 'not signed by this service'}")

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect_channel(path: str, signer: Signer, hello: dict, timeout: float = 30.0) -> Link:
    """A worker's connection to the driver's channel: the driver sends a nonce, the worker answers with a
    signed hello naming itself ({"role", "rank", "pid", ...}); the driver checks it against the socket's peer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address, fd = _address(path)
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        nonce = _recv_exact(sock, 32)
        sock.settimeout(None)
    except OSError as e:
        sock.close()
        raise GroupError(f"MultiNPU: cannot reach the driver's command channel {path}: {e}") from None
    finally:
        if fd is not None:
            os.close(fd)
    link = Link(sock, signer, nonce, "w", "d")
    link.send({"hello": hello})
    return link


class ChannelServer:
    """The driver's end of the command channel: a Unix socket in a folder only this user can enter
    (private_dir), so no other local user can connect. A connection is accepted only when its signed hello
    answers this connection's nonce and names the process at the other end (SO_PEERCRED: same pid, same
    uid); anything else is closed with a log line, its bytes never unpickled, a frame past the size limit
    never read. on_link(link, hello) takes each accepted connection (it runs on the connection's thread)."""

    def __init__(self, folder: str, signer: Signer, on_link):
        self.folder = private_dir(folder)
        self.path = os.path.join(folder, CHANNEL_SOCKET)
        self.signer = signer
        self.on_link = on_link
        self.dropped = 0
        self._pending = threading.Semaphore(MAX_PENDING)
        self._stop = threading.Event()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address, fd = _address(self.path)
        try:
            if os.path.lexists(self.path):
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    try:
                        probe.connect(address)
                    except OSError:
                        os.unlink(self.path)  # a socket left by a server that was killed
                    else:
                        raise GroupError(f"MultiNPU: another server's command channel answers at {self.path}. Fix: "
                                         "stop that server, or give this one its own runtime root")
            self.sock.bind(address)
        finally:
            if fd is not None:
                os.close(fd)
        os.chmod(self.path, 0o600)
        self.sock.listen(64)
        self._thread = threading.Thread(target=self._accept, name="multinpu-channel", daemon=True)
        self._thread.start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self._drop(conn, f"{MAX_PENDING} connections are already being checked")
                continue
            threading.Thread(target=self._handshake, args=(conn,), name="multinpu-channel-link", daemon=True).start()

    def _drop(self, conn, why: str, peer=None):
        self.dropped += 1
        logging.warning(f"MultiNPU: command channel: dropped a connection{f' from pid {peer}' if peer else ''}: {why}")
        try:
            conn.close()
        except OSError:
            pass

    def _handshake(self, conn):
        peer = None
        try:
            try:
                peer, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                   struct.calcsize("3i")))
                if uid != os.getuid():
                    return self._drop(conn, f"uid {uid} is not this service's user", peer)
                conn.settimeout(HANDSHAKE_TIMEOUT)
                nonce = os.urandom(32)
                conn.sendall(nonce)
                link = Link(conn, self.signer, nonce, "d", "w")
                data = recv_frame(conn, HELLO_LIMIT)
                try:
                    hello = link.open(data)["hello"]
                except Exception as e:
                    return self._drop(conn, f"its first frame ({len(data)} bytes) is "
                                      f"{e if isinstance(e, GroupError) else 'not signed by this service'}", peer)
                if not isinstance(hello, dict) or hello.get("pid") != peer:
                    return self._drop(conn, f"its hello names pid {hello.get('pid') if isinstance(hello, dict) else '?'}", peer)
                conn.settimeout(None)
            except (OSError, GroupError) as e:
                return self._drop(conn, str(e) or type(e).__name__, peer)
        finally:
            self._pending.release()
        try:
            self.on_link(link, hello)
        except (ChannelClosed, OSError):  # the worker left, or the driver closed the connection
            pass
        except Exception as e:
            logging.warning(f"MultiNPU: command channel: the connection of pid {peer} ended: {e}")
        finally:
            link.close()

    def close(self):
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


# ---- shared memory between the driver and worker rank 0 ------------------------------------------

def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")


def shm_write(path: str, tensors) -> tuple:
    """Write tensors into a new file `path` (0600; /dev/shm is memory) laid out as flatten() does:
    (metas, nbytes). Nothing is written for no bytes."""
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append((offset, nbytes, tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type == "cpu"))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    if offset == 0:
        return metas, 0
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, offset)
    finally:
        os.close(fd)
    buf = torch.from_file(path, shared=True, size=offset, dtype=torch.uint8)
    for t, (start, nbytes, _, _, _) in zip(tensors, metas):
        if nbytes:
            buf[start:start + nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return metas, offset


def shm_read(path: str, nbytes: int) -> torch.Tensor:
    """The bytes of a file shm_write made, mapped (no copy); the file can be removed at once."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def shm_remove(path):
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            logging.warning(f"MultiNPU: cannot remove {path}: {e}")


# ---- local worker processes ------------------------------------------------------------------------

def rank_from_environment(spec: GroupSpec) -> int:
    """This worker's rank: H3KIT_RANK (LocalWorkers), else the host's node rank and torchrun's LOCAL_RANK (h3kit
    numbers ranks host by host; torchrun's own RANK follows its rendezvous order, which may differ)."""
    if os.environ.get(RANK_ENV):
        return int(os.environ[RANK_ENV])
    return spec.rank_of(spec.node_rank, int(os.environ["LOCAL_RANK"]))


def secondary(reason) -> bool:
    """Is a death with this reason one its launcher caused after another rank's (not a root cause)?"""
    return SECONDARY in str(reason)


def recycled(reason) -> bool:
    """Is a death with this reason one h3kit caused itself, replacing the group after a failure?"""
    reason = str(reason)
    return "killed by h3kit" in reason or "aborted" in reason


def watch_termination(spec: GroupSpec, rank: int):
    """In a worker: one thread takes SIGTERM, notes who ended this process in the store (signed "term/{rank}",
    written before it exits) and exits with TERM_EXIT, even while the main thread is blocked inside a collective.
    torchrun ends every worker of its host with SIGTERM as soon as one fails, and reaps them itself: the note is
    how the driver tells the rank that failed first from the siblings torchrun stopped after it. Needs SIGTERM
    blocked in every thread, from the worker's first line (comfy.multinpu_worker does it before importing torch);
    otherwise SIGTERM keeps its default action and nothing is noted."""
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


def die_with_parent():
    """In a worker: get SIGTERM when the process that started it ends, and end now if it already has."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:
        os._exit(0)


def process_identity(pid: int) -> dict:
    try:
        import psutil
        p = psutil.Process(pid)
        with p.oneshot():
            return {"pid": pid, "create_time": p.create_time(), "cmdline": p.cmdline()}
    except Exception:  # psutil missing or the process already gone: the pid alone is still worth showing
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


class LocalWorkers:
    """This host's worker processes: started, watched and replaced (by rank 0's monitor or an agent).

    Workers are children of the process that owns this object and die with it (PR_SET_PDEATHSIG, and
    their store connection); they stay in its process group, so `h3kit stop` reaches them with the
    server. A rank that dies more than CRASH_LIMIT times within CRASH_WINDOW is not replaced again.
    """

    def __init__(self, spec: GroupSpec, key: str, local_ranks, cwd=None, python=None):
        self.spec = spec
        self.key = key
        self.cwd = cwd or os.getcwd()
        self.python = python or sys.executable
        self.ranks = [spec.rank_of(spec.node_rank, lr) for lr in local_ranks]
        self.procs = {}
        self.info = {}
        self.deaths = collections.defaultdict(collections.deque)
        self.failed = {}
        self.killed = {}               # rank -> why this object killed it
        self.recycled = set()          # ranks killed to replace the whole group: not crashes
        self.respawn_at = {}           # rank -> monotonic time its replacement starts
        self.stopping = False
        for rank in self.ranks:
            self.info[rank] = {"rank": rank, "node": spec.node_rank, "local_rank": rank % spec.local_size,
                               "host": socket.gethostname(), "device": spec.device_name(rank), "pid": None,
                               "create_time": None, "cmdline": [], "alive": False, "restarts": 0,
                               "last_exit": None, "incarnation": 0}

    def _env(self, rank: int) -> dict:
        env = dict(os.environ)
        env[GROUP_ENV] = self.spec.to_json()
        env[KEY_ENV] = self.key
        env[RANK_ENV] = str(rank)
        env[LOCAL_RANK_ENV] = str(rank % self.spec.local_size)
        env[PARENT_ENV] = str(os.getpid())
        env["PYTHONUNBUFFERED"] = "1"
        env.pop("H3KIT_SIM_DEVICES", None)  # a worker is one device, whatever the server simulates
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # see TorchrunWorkers.start
        threads = cpu_threads(self.spec)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def spawn(self, rank: int):
        argv = [self.python, "-B", "-m", self.spec.worker_module, *self.spec.worker_args]
        proc = subprocess.Popen(argv, cwd=self.cwd, env=self._env(rank), stdin=subprocess.DEVNULL, close_fds=True)
        self.procs[rank] = proc
        info = self.info[rank]
        info.update(process_identity(proc.pid), alive=True)
        # read at once, /proc can show an empty command line while the new image starts; it is argv
        info["cmdline"] = info["cmdline"] or list(argv)
        info["incarnation"] += 1
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
            deaths = self.deaths[rank]
            deaths.append(now)
            while deaths and now - deaths[0] > CRASH_WINDOW:
                deaths.popleft()
            if len(deaths) > CRASH_LIMIT:
                self.failed[rank] = (f"{self.spec.describe_rank(rank)} died {len(deaths)} times within "
                                     f"{CRASH_WINDOW:g} s (last: {reason}); not replaced again")
                logging.error(f"MultiNPU: {self.failed[rank]}")
                continue
            # the first replacement starts at once, repeated deaths wait longer (0.5 s, 1 s, ... up to 8 s)
            delay = 0.0 if len(deaths) == 1 else min(8.0, 0.25 * 2 ** (len(deaths) - 1))
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

    def recycle(self, why: str):
        """Kill every worker of this host (SIGKILL: one stopped or inside a wedged collective must go too);
        poll() replaces each at once. The reliable reset of a rank that saw an error is a fresh process."""
        for rank, proc in self.procs.items():
            if proc.poll() is None:
                self.killed[rank] = why
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
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        for rank, p in self.procs.items():
            if p.poll() is not None:
                self.info[rank].update(alive=False, last_exit=_exit_reason(p.returncode))


class TorchrunWorkers:
    """This host's workers, launched and restarted by torchrun (`python -m torch.distributed.run`, the elastic
    agent): c10d rendezvous at the master address on master_port + 1 (the control store holds master_port),
    --max-restarts, --monitor-interval 0.5. On any worker's failure torchrun restarts every worker of the group,
    on every host; h3kit kills workers (SIGKILL, a stopped one too) to make it do so. The same interface as
    LocalWorkers; the workers' pids come from their signed announcements in the store. The driver runs one for
    node 0, each other host's agent one for its node (`h3kit start --launcher torchrun`, the default: GroupSpec.launcher)."""

    def __init__(self, spec: GroupSpec, key: str, local_ranks, ctl, cwd=None, python=None):
        self.spec = spec
        self.key = key
        self.ctl = ctl
        self.cwd = cwd or os.getcwd()
        self.python = python or sys.executable
        self.ranks = [spec.rank_of(spec.node_rank, lr) for lr in local_ranks]
        self.proc = None
        self.failed = {}
        self.recycled = set()
        self.seen = {}       # rank -> (pid, create_time) of the announced worker last looked at
        self.info = {r: {"rank": r, "node": spec.node_rank, "local_rank": r % spec.local_size,
                         "host": socket.gethostname(), "device": spec.device_name(r), "pid": None,
                         "create_time": None, "cmdline": [], "alive": False, "restarts": 0, "last_exit": None,
                         "incarnation": 0} for r in self.ranks}
        self.starts = 0
        self.exits = collections.deque()
        self.retry_at = None  # monotonic time torchrun is tried again after it kept ending
        self.stopping = False

    def argv(self) -> list:
        s = self.spec
        return [self.python, "-B", "-m", "torch.distributed.run", "--nnodes", str(s.nnodes), "--node-rank",
                str(s.node_rank), "--nproc-per-node", str(s.local_size), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{s.master_addr}:{s.master_port + 1}", "--rdzv-id", "h3kit",
                # node 0 hosts the rendezvous store (on one machine every node's address would match)
                # read_timeout bounds a rendezvous that a lost and restarted host's new torchrun cannot complete
                # (it starts at round 0 while the others wait in their restart round): torchrun then exits and is
                # started again here, on every host
                "--rdzv-conf", f"is_host={'true' if s.node_rank == 0 else 'false'},read_timeout={RDZV_READ_TIMEOUT},"
                f"keep_alive_interval={KEEP_ALIVE},keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS},"
                f"join_timeout={max(1, int(s.join_timeout))}",
                "--max-restarts", str(TORCHRUN_MAX_RESTARTS), "--monitor-interval", "0.5",
                "-m", s.worker_module, *s.worker_args]

    def start(self):
        env = dict(os.environ)
        env[GROUP_ENV] = self.spec.to_json()
        env[KEY_ENV] = self.key
        for k in (RANK_ENV, LOCAL_RANK_ENV, PARENT_ENV, "H3KIT_SIM_DEVICES"):
            env.pop(k, None)
        env["PYTHONUNBUFFERED"] = "1"
        threads = cpu_threads(self.spec)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        # NCCL's watchdog tears a worker down when a collective passes the group timeout (3, torch's default,
        # chosen explicitly): its death is a failure the driver handles like any other, replacing the group. The
        # server is never in a collective, so the watchdog can never take the server and its queue down; with 0
        # a collective stuck on every rank would hang while each rank's heartbeat still beats
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        # torchrun ends with the process that started it (its SIGTERM handler stops the workers): an orphaned
        # elastic agent would restart workers that can never reach the driver again
        self.proc = subprocess.Popen(self.argv(), cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, close_fds=True,
                                     preexec_fn=_die_with_parent_signal)
        self.starts += 1
        logging.info(f"MultiNPU: torchrun (pid {self.proc.pid}) launches ranks {self.ranks}")

    def _announced(self, rank: int):
        info = self.ctl.peek(f"worker/{rank}")
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
                self.info[rank].update({k: info.get(k) for k in ("pid", "create_time", "cmdline", "host")},
                                       alive=True)
                self.info[rank]["restarts"] = self.info[rank]["incarnation"]
                self.info[rank]["incarnation"] += 1
        if self.proc is not None and self.proc.poll() is not None and not self.failed and not self.stopping:
            # torchrun itself ended (killed, past --max-restarts, its rendezvous failed): start it again, unless
            # it keeps ending
            reason = _exit_reason(self.proc.returncode)
            now = time.monotonic()
            self.exits.append(now)
            while self.exits and now - self.exits[0] > CRASH_WINDOW:
                self.exits.popleft()
            if len(self.exits) > CRASH_LIMIT:
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

    def recycle(self, why: str):
        for rank in self.ranks:
            self.kill(rank, why, recycle=True)

    def stop(self, grace: float = 5.0):
        self.stopping = True
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # torchrun stops its workers
        try:
            self.proc.wait(grace + 10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5.0)


def _die_with_parent_signal():
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _alive(pid, create_time) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        import psutil
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and (create_time is None or abs(p.create_time() - create_time) < 0.01)
    except Exception:
        return False


def write_ranks_file(root, data: dict):
    if not root:
        return
    path = os.path.join(root, RANKS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(root, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        logging.warning(f"MultiNPU: cannot write {path}: {e}")


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def destroy_group():
    if torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception as e:
            logging.debug(f"MultiNPU: destroy_process_group: {e}")


def cpu_threads(spec: GroupSpec):
    """The intra-op threads of one rank on the CPU simulation: the host's cores divided among its local
    ranks (torchrun's rule), so P processes do not each spin a full OpenMP team on the same cores. None
    elsewhere (an accelerator's ranks compute on their device) or when OMP_NUM_THREADS is set."""
    if spec.device_type != "cpu" or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // spec.local_size)


def failure_detectors(spec: GroupSpec) -> dict:
    """{what: seconds} after which each of h3kit's (and torchrun's) detectors notices a failed rank or host. Every
    one must fire before a collective gives up (spec.timeout; HCCL_EXEC_TIMEOUT is at least that), so a failure
    is named by what saw it, never by a peer's collective timing out."""
    out = {"a rank's heartbeat": HEARTBEAT_STALE, "a host's agent heartbeat": HOST_STALE}
    if spec.launcher == "torchrun":
        out["torchrun's rendezvous keep-alive"] = float(KEEP_ALIVE * KEEP_ALIVE_ATTEMPTS)
        out["torchrun's rendezvous store reads"] = float(RDZV_READ_TIMEOUT)
    return out


def check_timeouts(spec: GroupSpec):
    """GroupError unless every failure detector fires before the collective timeout."""
    what, seconds = max(failure_detectors(spec).items(), key=lambda kv: kv[1])
    if spec.timeout <= seconds:
        raise GroupError(f"MultiNPU: the collective timeout ({spec.timeout:g} s) must be longer than {what} "
                         f"({seconds:g} s): a failed rank would be reported as a peer's collective timing out. "
                         f"Fix: a longer group timeout, or a shorter {HEARTBEAT_ENV}")


def set_hccl_timeout(spec: GroupSpec):
    if spec.device_type == "npu" and "HCCL_EXEC_TIMEOUT" not in os.environ:
        # CANN takes [68, 17340] s, rounded down to a multiple of 68: at least the group's own timeout
        os.environ["HCCL_EXEC_TIMEOUT"] = str(max(68, -(-int(spec.timeout) // 68) * 68))


def is_loopback(addr: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"


# ---- workers -----------------------------------------------------------------------------------------

class WorkerContext:
    """What a worker's programs share: its rank, device and the configurations it holds."""

    def __init__(self, spec: GroupSpec, rank: int, device):
        self.spec = spec
        self.rank = rank
        self.local_rank = rank % spec.local_size
        self.device = torch.device(device)
        self.configs = {}
        self.ctl = None
        self.link = None        # rank 0: its connection to the driver's command channel
        self.generation = None  # the generation this process joins or serves
        self.free = None  # unloads this rank's models (set by comfy.multinpu_worker)


class After:
    """What a program returns for work to run after the command's closing barrier (reading model files):
    it must not hold the group."""

    def __init__(self, fn):
        self.fn = fn


HEARTBEAT_KEEP = 8                   # a remote rank's last beats kept in the store (the driver may read late)


def beat_key(signer: Signer, rank, pid: int, seq: int) -> str:
    """The store key of a remote rank's beat `seq`: named by an HMAC, so nobody without the key can create the
    key of a beat to come (the value does not matter: the beat is that the key exists)."""
    tag = hmac.new(signer.key, f"beat/{rank}/{pid}/{seq}".encode(), hashlib.sha256).hexdigest()[:32]
    return f"hb/{rank}/{pid}/{tag}"


def _heartbeat(spec: GroupSpec, port: int, context: WorkerContext, stop: threading.Event):
    """Beat once a second; leave at once when the driver aborted this process's generation (it replaces the
    whole group after a failure: this process may be blocked in a collective that will not return).

    A beat is authenticated: on the driver's host it is a frame on this process's own connection to the
    command channel (the driver knows the process at the other end); on another host a store key whose name
    only the key can make (beat_key), and a signed pointer hb/{rank}/{pid} to the newest. Nobody without the
    key can make a beat the driver counts, nor replay an old one as new (the driver counts only a higher seq)."""
    try:
        signer = Signer(key_from_environment())
        ctl = Control(connect_store(spec.master_addr, port, spec.timeout), signer)
        pid = os.getpid()
        link = None
        if spec.channel and spec.node_rank == 0:
            link = connect_channel(spec.channel, signer, {"role": "beat", "rank": context.rank, "pid": pid})
        seq = 0
        while not stop.wait(HEARTBEAT_INTERVAL):
            seq += 1
            if link is not None:
                link.send({"seq": seq})
            else:
                ctl.put(beat_key(signer, context.rank, pid, seq), seq)
                ctl.put(f"hb/{context.rank}/{pid}", seq)
                if seq > HEARTBEAT_KEEP:
                    ctl.delete(beat_key(signer, context.rank, pid, seq - HEARTBEAT_KEEP))
            g = context.generation
            if g is not None and ctl.has(f"abort/{g}") and ctl.peek(f"abort/{g}") is not None:
                logging.warning(f"MultiNPU: rank {context.rank}: generation {g} was aborted; this process leaves")
                sys.stdout.flush()
                os._exit(RECYCLED_EXIT)
    except Exception as e:
        # the store or the driver is gone: the main loop notices and exits
        logging.warning(f"MultiNPU: rank {context.rank}: the heartbeat stopped: {e}")


def _report(ctl: Control, key: str, exc: BaseException, collective: bool):
    import traceback
    try:
        ctl.put(key, {"pid": os.getpid(), "host": socket.gethostname(), "type": type(exc).__name__,
                      "message": str(exc)[:2000], "oom": is_oom(exc), "collective": collective, "time": time.time(),
                      "traceback": "".join(traceback.format_exception(exc))[-6000:]})
    except Exception:
        pass


def is_oom(exc: BaseException) -> bool:
    """Out of memory on a device (torch's OOM type, or an accelerator error saying so) or on the host
    (the CPU allocator's "can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text


def _leave(code: int):
    """End this worker now: a process that saw an error is never reused (its communicator, and on Ascend its
    stream, may be wedged), and interpreter teardown can hang in a broken process group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(context: WorkerContext):
    """A worker's life: join the next generation that lists it and run its commands, until the driver ends
    the generation (END) or is gone. A worker whose command or join fails reports it and exits."""
    spec, rank = context.spec, context.rank
    watch_termination(spec, rank)
    signer = Signer(key_from_environment())
    deadline = time.monotonic() + spec.join_timeout
    base = connect_store(spec.master_addr, spec.master_port, spec.timeout, deadline)
    ctl = Control(base, signer)
    context.ctl = ctl
    layout = ctl.wait("layout", spec.join_timeout)
    if layout != spec.layout():
        raise GroupError(f"MultiNPU: rank {rank} was started for {spec.layout()}, the driver runs {layout}")
    ctl.put(f"worker/{rank}", {"pid": os.getpid(), "host": socket.gethostname(), "device": str(context.device),
                               **process_identity(os.getpid())})
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(spec, spec.master_port, context, stop), daemon=True,
                     name="multinpu-heartbeat").start()
    logging.info(f"MultiNPU: rank {rank} ({context.device}) pid {os.getpid()} waiting for the group")
    done = 0
    try:
        while True:
            g = _next_generation(ctl, rank, done)
            done = context.generation = g
            if _join(ctl, base, spec, context, g):
                _commands(ctl, context, g)
                return
    except BaseException as e:
        if _store_gone(e) or isinstance(e, (torch.distributed.DistStoreError, ChannelClosed)):
            logging.info(f"MultiNPU: rank {rank}: the driver is gone; exiting")
            return
        raise
    finally:
        stop.set()


def _next_generation(ctl: Control, rank: int, after: int) -> int:
    """The newest generation after `after` that lists this process."""
    pid = os.getpid()
    while True:
        g = ctl.peek("gen")
        if isinstance(g, int) and g > after:
            gen = ctl.peek(f"gen/{g}")
            if isinstance(gen, dict) and gen.get("members", {}).get(rank) == pid:
                return g
        time.sleep(POLL)


def _join(ctl: Control, base, spec: GroupSpec, context: WorkerContext, g: int) -> bool:
    """Join generation g: announce, wait for the driver's go, form the process group and prove it with a
    warm-up all_reduce ("up" means the communicator works). False when the driver gave up on g."""
    rank = context.rank
    ctl.put(f"joined/{g}/{rank}", os.getpid())
    while ctl.peek(f"go/{g}") is None:
        if ctl.peek("gen") != g:
            return False  # the driver gave up on g (a member died): wait for the next one
        time.sleep(POLL)
    try:
        _init_group(spec, torch.distributed.PrefixStore(f"pg{g}", base), rank, context.device)
        comm = comfy.multinpu.ProcessComm(device=context.device, timeout=spec.timeout)
        total = comm.all_reduce(torch.ones(1, device=context.device))
        if int(total.item()) != spec.world_size:
            raise GroupError(f"MultiNPU: the warm-up all_reduce gave {total.item()}, not {spec.world_size}")
    except Exception as e:
        logging.exception(f"MultiNPU: rank {rank} could not join generation {g}")
        _report(ctl, f"joinerr/{g}/{rank}", e, isinstance(e, comfy.multinpu.CollectiveError))
        _leave(REPORTED_EXIT)
    ctl.put(f"up/{g}/{rank}", os.getpid())
    return True


def _init_group(spec: GroupSpec, store, rank: int, device: torch.device):
    """init_process_group with the device bound (device_id: the communicator is created now, on this rank's
    device, instead of lazily at the first collective; unmeasured on Ascend and CUDA hardware)."""
    kwargs = dict(store=store, rank=rank, world_size=spec.world_size, timeout=td(spec.timeout))
    if device.type != "cpu":
        try:
            torch.distributed.init_process_group(spec.backend, device_id=device, **kwargs)
            return
        except TypeError:  # a torch (or torch_npu backend) without device_id
            pass
    torch.distributed.init_process_group(spec.backend, **kwargs)


def _commands(ctl: Control, context: WorkerContext, g: int):
    comm = comfy.multinpu.ProcessComm(device=context.device, timeout=context.spec.timeout)
    if context.rank == 0:
        # worker rank 0 takes the commands from the driver on its own connection to the command channel
        context.link = connect_channel(context.spec.channel, ctl.signer, {"role": "command", "rank": 0,
                                                                          "pid": os.getpid(), "generation": g})
    n = 1
    while True:
        if context.rank == 0:
            header = _next_command(ctl, context, g, n)
        else:
            header = ctl.wait(f"cmd/{g}/{n}", 365 * 24 * 3600.0)
        name = header["name"]
        if name == END:
            destroy_group()
            return
        after = None
        try:
            if comm.rank == 0:
                buf = shm_read(header["shm"], header["nbytes"]).to(comm.device)
            else:
                buf = torch.empty(header["nbytes"], dtype=torch.uint8, device=comm.device)
            if header["nbytes"]:
                buf = comm.broadcast(buf, 0)
            payload = unpack(header["data"], unflatten(buf, header["metas"]))
            fn = _BUILTINS.get(name) or PROGRAMS.get(name)
            if fn is None:
                raise GroupError(f"MultiNPU: rank {context.rank} has no program {name!r}")
            _inject_fault(context, name)
            # the workers run in the driver's grad and inference modes (ComfyUI executes prompts in inference mode)
            with torch.inference_mode(header.get("inference", True)), torch.set_grad_enabled(header.get("grad", False)):
                result = fn(context, comm, payload)
            if isinstance(result, After):
                after, result = result.fn, None
            comm.barrier()
            if comm.rank == 0:
                _post_result(context, header, g, n, result)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            collective = isinstance(e, comfy.multinpu.CollectiveError)
            if not collective:
                logging.exception(f"MultiNPU: rank {context.rank} failed in {name}")
            else:
                logging.error(f"MultiNPU: rank {context.rank}: {name}: {e}")
            _report(ctl, f"err/{g}/{n}/{context.rank}", e, collective)
            try:
                ctl.counter(f"failed/{g}", 1)
            except Exception:
                pass
            _leave(REPORTED_EXIT)  # never reused: the driver replaces the whole group
        if after is not None:
            with torch.inference_mode(header.get("inference", True)), torch.set_grad_enabled(header.get("grad", False)):
                after()
        n += 1


def _next_command(ctl: Control, context: WorkerContext, g: int, n: int) -> dict:
    """Rank 0: command n of generation g from the driver's channel, relayed to the other ranks through the
    store (cmd/{g}/{n}, signed for that slot; they wait there, in no collective, while the server is idle)."""
    while True:
        header = context.link.recv()
        if isinstance(header, dict) and header.get("g") == g and header.get("n") == n:
            break
        logging.warning(f"MultiNPU: rank 0: dropped a command that is not command {n} of generation {g}")
    if context.spec.world_size > 1:
        ctl.put(f"cmd/{g}/{n}", header)
    return header


def _post_result(context: WorkerContext, header: dict, g: int, n: int, result):
    """Rank 0: the command's result to the driver on the channel, its tensors through shared memory
    (header["out"])."""
    data, tensors = pack(result)
    metas, nbytes = shm_write(header["out"], tensors)
    context.link.send({"g": g, "n": n, "pid": os.getpid(), "data": data, "metas": metas, "nbytes": nbytes})


def _inject_fault(context: WorkerContext, name: str):
    for fault in os.environ.get(FAULT_ENV, "").split(","):
        program, _, rest = fault.partition(":")
        kind, _, trigger = rest.partition(":")
        if program != name or not trigger or not os.path.exists(trigger):
            continue
        if kind == "oom":
            logging.warning(f"MultiNPU: rank {context.rank}: {FAULT_ENV}={fault}: allocating what no host has")
            torch.empty(1 << 62, dtype=torch.uint8, device=context.device)
        if kind == "raise":
            raise RuntimeError(f"{FAULT_ENV}={fault}: injected failure in {name} on rank {context.rank}")
        if kind == "hold":  # a slow step (a model read from a slow disk): it lasts while the file exists
            logging.warning(f"MultiNPU: rank {context.rank}: {FAULT_ENV}={fault}: holding {name}")
            deadline = time.monotonic() + 120.0
            while os.path.exists(trigger) and time.monotonic() < deadline:
                time.sleep(POLL)


def _free_memory(context: WorkerContext):
    free = getattr(context, "free", None)
    if free is not None:
        try:
            free()
        except Exception as e:
            logging.warning(f"MultiNPU: rank {context.rank}: freeing memory failed: {e}")


def _install(context: WorkerContext, comm, payload):
    if context.rank not in payload["ranks"]:
        return None
    ctl = context.ctl

    def load():
        key = f"ready/{payload['id']}/{context.rank}"
        try:
            _inject_fault(context, payload["program"])
            held = PROGRAMS[payload["program"]](context, comm, payload["payload"])
            context.configs[payload["id"]] = held
            ctl.put(key, {"pid": os.getpid(), "digest": held.digest})
        except Exception as e:
            logging.exception(f"MultiNPU: rank {context.rank} could not load {payload['program']}")
            ctl.put(key, {"pid": os.getpid(), "error": {"pid": os.getpid(), "host": socket.gethostname(),
                                                        "type": type(e).__name__, "message": str(e)[:2000],
                                                        "oom": is_oom(e)}})
            _leave(REPORTED_EXIT)
    return After(load)


def _drop(context: WorkerContext, comm, ids):
    for i in ids:
        context.configs.pop(i, None)


def _free(context: WorkerContext, comm, payload):
    context.configs.clear()
    _free_memory(context)


_BUILTINS = {"install": _install, "drop": _drop, "free": _free}


# ---- the agent of another node -------------------------------------------------------------------

class Agent:
    """Node R > 0: starts its workers once the master's store answers, replaces the ones that die, reports
    their deaths and heartbeats, and follows rank 0 through restarts of the master."""

    def __init__(self, spec: GroupSpec, key: str):
        self.spec = spec
        self.key = key
        self.signer = Signer(key.encode())
        self.stop = threading.Event()

    def run(self):
        if self.spec.device_type == "cpu" and is_loopback(self.spec.master_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        set_hccl_timeout(self.spec)
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
        if spec.launcher == "torchrun":
            local = TorchrunWorkers(spec, self.key, range(spec.local_size), ctl)
        else:
            local = LocalWorkers(spec, self.key, range(spec.local_size))
        local.start()
        logging.info(f"MultiNPU: node {spec.node_rank} agent: started ranks {local.ranks}")
        last_write, beat = 0.0, 0
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
                    # the driver tells a lost host by its silence, which nobody without the key can fill (_heartbeat)
                    beat += 1
                    who = f"agent{spec.node_rank}"
                    ctl.put(beat_key(self.signer, who, os.getpid(), beat), beat)
                    ctl.put(f"agent_hb/{spec.node_rank}", {"pid": os.getpid(), "seq": beat})
                    if beat > HEARTBEAT_KEEP:
                        ctl.delete(beat_key(self.signer, who, os.getpid(), beat - HEARTBEAT_KEEP))
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
        write_ranks_file(self.spec.runtime_root, {
            "role": "agent", "pid": os.getpid(), "updated": now(), "node_rank": self.spec.node_rank,
            "state": state, "error": error, "generation": (group or {}).get("generation"),
            "world_size": self.spec.world_size, "backend": self.spec.backend,
            "master": f"{self.spec.master_addr}:{self.spec.master_port}", "nnodes": self.spec.nnodes,
            "launcher": self.spec.launcher, "ranks": ranks})


def agent_main():
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    spec = GroupSpec.from_json(os.environ[GROUP_ENV])
    agent = Agent(spec, key_from_environment().decode())
    signal.signal(signal.SIGTERM, lambda *a: agent.stop.set())
    return agent.run()


if __name__ == "__main__":
    sys.exit(store_main(sys.argv[2:]) if sys.argv[1:2] == ["--store"] else agent_main())
