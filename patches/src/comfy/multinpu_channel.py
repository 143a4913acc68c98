"""The process group's control plane: its store (StoreHost, Control) and its command channel (ChannelServer, Link).
Design: docs/multinpu.md, "The process transport" (signed values, the command channel, the store's own process).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

import torch
import torch.distributed

from comfy.multinpu_wire import (GroupError, HEARTBEAT_INTERVAL, PARENT_ENV, POLL, Signer, _die_with_parent_signal,
                                 CHANNEL_PORT_OFFSET, die_with_parent, td, wait_or_kill)


# ---- the store -----------------------------------------------------------------------------------

STORE_PREFIX = "h3kit"               # the control keys' prefix in the store
STORE_START_TIMEOUT = 120.0         # seconds for the store's process to answer (it imports torch)


class StoreHost:
    """The group's TCPStore in a process of its own (`python -B -m comfy.multinpu_channel --store`) on a socket the
    driver binds to addr:port only and keeps: a store that dies is started again on it (start())."""

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
        argv = [sys.executable, "-B", "-m", "comfy.multinpu_channel", "--store", self.addr, str(self.port), str(fd),
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
            wait_or_kill(self.proc, 10.0)
        self.sock.close()


STORE_GROWTH_ENV = "H3KIT_STORE_GROWTH_LIMIT"  # MiB the store's process may grow by before it ends itself
STORE_EXIT = 76                      # the store's process ended itself: it grew past its limit


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store_main(argv) -> int:
    """The store's process: host the TCPStore on the socket the driver handed over until the driver is gone (its
    stdin ends), or it grew past H3KIT_STORE_GROWTH_LIMIT MiB (rather than the host's OOM killer choosing a worker)."""
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
            if (stop or threading.Event()).wait(0.5):
                return None


def _store_gone(e: BaseException) -> bool:
    return isinstance(e, (torch.distributed.DistNetworkError, ConnectionError))


class Control:
    """Signed reads and writes of the control keys (signed with the key's name), one call at a time per connection;
    a value that does not verify is dropped with a log line and reads as absent (peek, wait)."""

    def __init__(self, store, signer: Signer):
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
SEND_ENV = "H3KIT_SEND_TIMEOUT"
SEND_TIMEOUT = float(os.environ.get(SEND_ENV, "10"))  # docs/multinpu.md, "Bounded sends"
MAX_PENDING = 16                     # connections not yet authenticated per listener; a new one closes the oldest


class ChannelClosed(GroupError):
    """The other end of a channel connection went away."""


class SendTimeout(ChannelClosed):
    """A send moved no byte for SEND_TIMEOUT seconds: its peer stopped reading. The connection is closed."""


def send_bounded(sock, data: bytes, timeout: float):
    """sendall that fails with SendTimeout once `timeout` seconds pass without a byte taken by the peer. Each send is
    non-blocking (MSG_DONTWAIT), so another thread may keep reading the same socket in blocking mode."""
    view = memoryview(data)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    stalled_since = time.monotonic()
    while view:
        try:
            sent = sock.send(view, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent:
            view = view[sent:]
            stalled_since = time.monotonic()
            continue
        left = stalled_since + timeout - time.monotonic()
        if left <= 0:
            raise SendTimeout(f"MultiNPU: the channel's other end took no byte for {timeout:g} s "
                              f"({len(view)} of {len(data)} bytes not sent): it stopped reading")
        poller.poll(min(left, 1.0) * 1000)


def private_dir(path: str) -> str:
    """`path` as a folder only this user can enter (made 0700 when absent), else GroupError naming the fix."""
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
    """One authenticated connection of the command channel (docs/multinpu.md, "Frames")."""

    def __init__(self, sock, signer: Signer, nonce: bytes, mine: str, theirs: str):
        self.sock = sock
        self.signer = signer
        self.nonce = nonce
        self.mine, self.theirs = mine, theirs
        self.sent = self.received = 0
        self.remote = None      # the TCP peer's "host:port" (ChannelServer); None on the Unix socket
        self._send_lock = threading.Lock()

    def send(self, obj, timeout: float = None):
        """Send one message; SendTimeout when the peer takes no byte for `timeout` (SEND_TIMEOUT) seconds."""
        with self._send_lock:
            self.sent += 1
            body = self.signer.dumps((self.nonce, self.mine, self.sent, obj))
            try:
                send_bounded(self.sock, len(body).to_bytes(4, "big") + body, SEND_TIMEOUT if timeout is None else timeout)
            except SendTimeout:
                self.close()  # a frame cut short: nothing more can follow it on this connection
                raise

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


def connect_channel(address, signer: Signer, hello: dict, timeout: float = 30.0) -> Link:
    """A connection to the driver's channel at `address` (GroupSpec.channel_address) whose hello names the caller."""
    tcp = not isinstance(address, str)
    if tcp:
        where, fd = f"{address[0]}:{address[1]}", None
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        target = tuple(address)
    else:
        where = address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target, fd = _address(address)
    try:
        sock.settimeout(timeout)
        sock.connect(target)
        if tcp:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _recv_exact(sock, 32)
        sock.settimeout(None)
    except (OSError, ChannelClosed) as e:
        sock.close()
        raise GroupError(f"MultiNPU: cannot reach the driver's command channel {where}: {e}") from None
    finally:
        if fd is not None:
            os.close(fd)
    link = Link(sock, signer, nonce, "w", "d")
    link.send({"hello": hello})
    return link


def beat(address, signer: Signer, hello: dict, stop: threading.Event, each=None, news=None):
    """Beat {"seq": n, **news()} every HEARTBEAT_INTERVAL on a channel connection (made again after a failure) until
    `stop` is set, n counting up for the life of this process; each() after every beat."""
    link, seq, down = None, 0, None
    while not stop.wait(HEARTBEAT_INTERVAL):
        seq += 1
        try:
            if link is None:
                link = connect_channel(address, signer, hello, timeout=5.0)
                if down is not None:
                    logging.info(f"MultiNPU: {hello.get('role')} of pid {hello.get('pid')}: beating again")
                    down = None
            link.send({"seq": seq, **(news() if news is not None else {})})
        except (OSError, GroupError) as e:
            if down is None:  # logged once per outage
                down = e
                logging.warning(f"MultiNPU: {hello.get('role')} of pid {hello.get('pid')}: a beat did not reach the "
                                f"driver ({e}); trying again every {HEARTBEAT_INTERVAL:g} s")
            if link is not None:
                link.close()
                link = None
        if each is not None:
            each()
    if link is not None:
        link.close()


class ChannelServer:
    """The driver's end of the command channel (docs/multinpu.md, "Handshake"): a Unix socket, and with listen_tcp()
    a TCP listener. on_link(link, hello) takes each accepted connection on its own thread."""

    def __init__(self, folder: str, signer: Signer, on_link):
        self.folder = private_dir(folder)
        self.path = os.path.join(folder, CHANNEL_SOCKET)
        self.signer = signer
        self.on_link = on_link
        self.dropped = 0
        self.tcp = None                  # the TCP listener's socket (listen_tcp)
        self._stop = threading.Event()
        self._lock = threading.Lock()
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
        self._listen(self.sock, tcp=False)

    def listen_tcp(self, addr: str, port: int) -> int:
        """Also take connections on addr:port over TCP (the other hosts'); the port it got."""
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as e:
            sock.close()
            raise GroupError(f"MultiNPU: the command channel cannot listen on {addr}:{port} for the other hosts: {e}. "
                             f"Fix: free that port (master port + {CHANNEL_PORT_OFFSET}) on this host, or choose "
                             "another --master-port") from None
        sock.listen(64)
        self.tcp = sock
        self._listen(sock, tcp=True)
        return sock.getsockname()[1]

    def _listen(self, sock, tcp: bool):
        pending = collections.OrderedDict()  # one per listener: connection -> "evicted" flag, oldest first
        threading.Thread(target=self._accept, args=(sock, pending, tcp), daemon=True,
                         name=f"multinpu-channel-{'tcp' if tcp else 'unix'}").start()

    def _accept(self, sock, pending, tcp: bool):
        while not self._stop.is_set():
            try:
                conn, addr = sock.accept()
            except OSError:
                return
            remote = f"{addr[0]}:{addr[1]}" if tcp else None
            with self._lock:
                checking = [c for c, evicted in pending.items() if not evicted]  # oldest first
                if len(checking) >= MAX_PENDING:
                    # the oldest gives way, not the newest: a client holding MAX_PENDING connections without a
                    # hello would otherwise keep every worker out (a real one says its hello at once). One already
                    # closed for a newer one stays listed until its thread drops it: never the oldest twice
                    oldest = checking[0]
                    pending[oldest] = True
                    try:
                        oldest.shutdown(socket.SHUT_RDWR)  # its handshake thread drops it
                    except OSError:
                        pass
                pending[conn] = False
            threading.Thread(target=self._handshake, args=(conn, pending, remote), name="multinpu-channel-link",
                             daemon=True).start()

    def _drop(self, conn, why: str, peer=None):
        self.dropped += 1
        source = f" from {peer}" if isinstance(peer, str) else f" from pid {peer}" if peer else ""
        logging.warning(f"MultiNPU: command channel: dropped a connection{source}: {why}")
        try:
            conn.close()
        except OSError:
            pass

    def _handshake(self, conn, pending, remote):
        """Check one connection's hello (remote: the TCP peer; None on the Unix socket); on_link gets it if it passes."""
        peer = remote
        try:
            try:
                if remote is None:
                    peer, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                       struct.calcsize("3i")))
                    if uid != os.getuid():
                        return self._drop(conn, f"uid {uid} is not this service's user", peer)
                else:
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(HANDSHAKE_TIMEOUT)
                nonce = os.urandom(32)
                conn.sendall(nonce)
                link = Link(conn, self.signer, nonce, "d", "w")
                link.remote = remote
                data = recv_frame(conn, HELLO_LIMIT)
                try:
                    hello = link.open(data)["hello"]
                except Exception as e:
                    return self._drop(conn, f"its first frame ({len(data)} bytes) is "
                                      f"{e if isinstance(e, GroupError) else 'not signed by this service'}", peer)
                if not isinstance(hello, dict) or not isinstance(hello.get("pid"), int):
                    return self._drop(conn, f"its hello names no pid: {hello!r:.200}", peer)
                if remote is None and hello["pid"] != peer:
                    return self._drop(conn, f"its hello names pid {hello['pid']}", peer)
                conn.settimeout(None)
            except (OSError, GroupError) as e:
                if pending.get(conn):
                    return self._drop(conn, f"the oldest of {MAX_PENDING} connections being checked, closed for "
                                      "a newer one", peer)
                return self._drop(conn, str(e) or type(e).__name__, peer)
        finally:
            with self._lock:
                pending.pop(conn, None)
        who = f"pid {hello['pid']}" + (f" at {remote}" if remote else "")
        try:
            self.on_link(link, hello)
        except (ChannelClosed, OSError):  # the worker left, or the driver closed the connection
            pass
        except Exception as e:
            logging.warning(f"MultiNPU: command channel: the connection of {who} ended: {e}")
        finally:
            link.close()

    def close(self):
        self._stop.set()
        for sock in (self.sock, self.tcp):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(): the port is free once close returns
            except OSError:
                pass
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(store_main(sys.argv[2:]) if sys.argv[1:2] == ["--store"] else 2)
