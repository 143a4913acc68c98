"""comfy/multinpu_channel.py's framing and handshake on their own, in one process (no group, no worker): the
checks the command channel claims (frames signed per connection, direction and sequence; at most MAX_PENDING
connections being checked per listener, the oldest giving way). Seconds to run, so tools/mutate.py runs them
for every mutant of the channel. The channel with real workers is tested in test_multinpu_process.py."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import requires

requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)  # the channel module imports it

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_channel as channel  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_wire as wire  # noqa: E402


def raw(sock, signer, nonce, direction, seq, obj):
    """Put one frame on `sock` as the peer would, with the fields chosen by the test."""
    body = signer.dumps((nonce, direction, seq, obj))
    sock.sendall(len(body).to_bytes(4, "big") + body)


def settled(predicate, timeout=30.0):
    """Wait for what another thread does next; fail when it does not come."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the channel's threads did not get there"
        time.sleep(0.01)


def dropped(caplog):
    return [r.getMessage() for r in caplog.records if "dropped a channel frame" in r.getMessage()]


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    signer = wire.Signer(wire.new_key().encode())
    nonce = os.urandom(32)
    yield a, b, signer, nonce, channel.Link(a, signer, nonce, "w", "d"), channel.Link(b, signer, nonce, "d", "w")
    a.close()
    b.close()


def test_channel_frames_replayed_reordered_or_reflected_are_dropped(pair, caplog):
    """On one connection: a frame that skips ahead, frames sent out of order, a frame sent again (a replay), one
    sent back the way it came, garbage and one signed with another key are dropped with a log line naming why;
    the frames in order still arrive, each once."""
    a, b, signer, nonce, worker, driver = pair
    caplog.set_level(logging.WARNING)
    worker.send({"n": 1})
    assert driver.recv() == {"n": 1}
    # skipped ahead: 3 before 2. Dropped; 2 is the next taken, then 3 sent again in its place
    raw(a, signer, nonce, "w", 3, {"n": 3})
    raw(a, signer, nonce, "w", 2, {"n": 2})
    assert driver.recv() == {"n": 2}
    assert dropped(caplog) == ["MultiNPU: dropped a channel frame ({} bytes): MultiNPU: a channel frame out of order "
                               "(sequence 3 from the worker, expected 2): a replay".format(
                                   len(signer.dumps((nonce, "w", 3, {"n": 3}))))]
    raw(a, signer, nonce, "w", 2, {"n": 2})           # reordered: 2 again after 2 (an old frame)
    raw(a, signer, nonce, "w", 1, {"n": 1})           # replayed: the first frame again
    raw(a, signer, nonce, "w", 4, {"n": 4})           # skips 3
    raw(a, signer, nonce, "d", 3, {"name": "end"})    # as if the driver had sent it: reflected
    raw(a, signer, os.urandom(32), "w", 3, {"n": 3})  # another connection's
    a.sendall(b"\x00\x00\x00\x05junk!")
    raw(a, wire.Signer(wire.new_key().encode()), nonce, "w", 3, {"n": 9})  # another key's
    raw(a, signer, nonce, "w", 3, {"n": 3})
    assert driver.recv() == {"n": 3}
    why = dropped(caplog)[1:]
    assert len(why) == 7, why
    assert "sequence 2 from the worker, expected 3" in why[0] and "sequence 1 from the worker, expected 3" in why[1]
    assert "sequence 4 from the worker, expected 3" in why[2] and "sequence 3 from the driver, expected 3" in why[3]
    assert "signed for another connection: a replay" in why[4]
    assert all("is not signed with this service's key" in w for w in why[5:]), why
    worker.sent = 3  # the raw frames above were the worker's 2 and 3
    worker.send({"n": 4})
    assert driver.recv() == {"n": 4} and driver.received == 4
    # the other direction has its own count: the driver's first frame is 1
    driver.send({"name": "go"})
    assert worker.recv() == {"name": "go"} and worker.received == 1


def test_a_frame_past_the_limit_is_refused_unread(pair):
    a, b, signer, nonce, worker, driver = pair
    b.sendall((10 << 20).to_bytes(4, "big"))
    with pytest.raises(wire.GroupError, match="a frame of 10485760 bytes \\(the limit is 4096\\)"):
        worker.recv(limit=4096)
    body = signer.dumps((nonce, "d", 1, {"x": "y" * 100}))
    b.sendall(len(body).to_bytes(4, "big") + body)
    assert worker.recv(limit=len(body)) == {"x": "y" * 100}  # exactly the limit is taken


def test_a_closed_peer_ends_a_read_with_channel_closed(pair):
    a, b, signer, nonce, worker, driver = pair
    b.sendall(b"\x00\x00")  # half a length prefix, then the end
    b.shutdown(socket.SHUT_WR)
    with pytest.raises(channel.ChannelClosed):
        worker.recv()


def test_silent_connections_beyond_max_pending_close_the_oldest_at_once(tmp_path, monkeypatch):
    """A client that opens connections and says nothing: each listener checks at most MAX_PENDING at a time,
    and a new one closes the oldest at once, not at the handshake timeout (set far beyond this test's waits
    here, so only the eviction can close them); the newer ones stay open, and a real worker still gets in."""
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT", 600.0)
    signer = wire.Signer(wire.new_key().encode())
    got, arrived = [], threading.Event()

    def on_link(link, hello):
        got.append((hello, link.recv()))
        arrived.set()
    server = channel.ChannelServer(str(tmp_path / channel.CHANNEL_DIR), signer, on_link)
    silent = []
    try:
        port = server.listen_tcp("127.0.0.1", 0)
        extra = 3
        for _ in range(channel.MAX_PENDING + extra):
            c = socket.create_connection(("127.0.0.1", port), timeout=60)
            channel._recv_exact(c, 32)  # its nonce: the server accepted it (and evicted any oldest) before
            silent.append(c)
        for c in silent[:extra]:
            c.settimeout(10)  # closed before the newer one's nonce was sent: its end is there already
            assert c.recv(1) == b"", "an oldest silent connection was closed for a newer one"
        for c in silent[extra:]:
            c.setblocking(False)
            with pytest.raises(BlockingIOError):  # open, nothing said
                c.recv(1)
        settled(lambda: server.dropped >= extra)  # each evicted one's thread counts it as it drops it
        assert server.dropped == extra
        hello = {"role": "agent", "node": 1, "pid": 424242}
        late = channel.connect_channel(("127.0.0.1", port), signer, hello, timeout=60)
        late.send({"seq": 7})
        assert arrived.wait(60), "the worker's connection was not taken"
        assert got == [(hello, {"seq": 7})]
        settled(lambda: server.dropped >= extra + 1)
        assert server.dropped == extra + 1  # the worker's connection evicted one more silent one
        late.close()
    finally:
        for c in silent:
            c.close()
        server.close()


def test_the_unix_socket_is_private_and_takes_only_the_process_its_hello_names(tmp_path, caplog):
    """The socket (0600, in a 0700 folder) takes a hello signed with the key whose pid is the socket's peer;
    a hello naming another pid and one signed with another key are dropped with a log line naming why, and the
    connection is closed. A connection whose on_link raises ends with a log line naming its pid."""
    caplog.set_level(logging.WARNING)
    signer = wire.Signer(wire.new_key().encode())
    got, arrived = [], threading.Event()

    def on_link(link, hello):
        got.append((hello, link.remote, link.recv()))
        arrived.set()
        if hello.get("role") == "raises":
            raise ValueError("boom")
    server = channel.ChannelServer(str(tmp_path / channel.CHANNEL_DIR), signer, on_link)
    try:
        assert os.stat(server.path).st_mode & 0o777 == 0o600
        assert os.stat(server.folder).st_mode & 0o777 == 0o700
        me = {"role": "beat", "rank": 0, "pid": os.getpid()}
        link = channel.connect_channel(server.path, signer, me, timeout=30)
        link.send({"seq": 1})
        assert arrived.wait(30) and got == [(me, None, {"seq": 1})]
        link.close()
        for hello, key, why in (({"role": "beat", "rank": 1, "pid": os.getpid() + 1}, signer,
                                 f"its hello names pid {os.getpid() + 1}"),
                                ({"role": "beat", "rank": 1, "pid": str(os.getpid())}, signer,
                                 "its hello names no pid"),
                                (me, wire.Signer(wire.new_key().encode()), "is not signed with this service's key")):
            before = server.dropped
            other = channel.connect_channel(server.path, key, hello, timeout=30)
            other.sock.settimeout(30)
            assert other.sock.recv(1) == b"", "the connection was closed"
            settled(lambda: server.dropped == before + 1)
            assert any(f"dropped a connection from pid {os.getpid()}: " in m and why in m for m in
                       (r.getMessage() for r in caplog.records)), [r.getMessage() for r in caplog.records]
            other.close()
        arrived.clear()
        raising = {"role": "raises", "pid": os.getpid()}
        link = channel.connect_channel(server.path, signer, raising, timeout=30)
        link.send({"seq": 2})
        assert arrived.wait(30)
        settled(lambda: any(f"the connection of pid {os.getpid()} ended: boom" in r.getMessage()
                            for r in caplog.records))
        link.sock.settimeout(30)
        assert link.sock.recv(1) == b"", "the server closes a connection whose on_link ended"
        link.close()
    finally:
        server.close()
    assert not os.path.exists(server.path)


def _open_sockets():
    """The inodes of the sockets this process holds open, read from /proc/self/fd. Inodes, not fd numbers: another
    test's thread in this xdist worker may close an fd while this test runs and the server's socket reuse its number."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between listdir and readlink
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def test_close_frees_the_sockets_and_the_port(tmp_path):
    server = channel.ChannelServer(str(tmp_path / channel.CHANNEL_DIR), wire.Signer(b"k" * 64), lambda link, h: None)
    port = server.listen_tcp("127.0.0.1", 0)
    mine = {os.fstat(server.sock.fileno()).st_ino, os.fstat(server.tcp.fileno()).st_ino}
    assert len(mine) == 2 and mine <= _open_sockets()
    server.close()
    settled(lambda: not (mine & _open_sockets()))
    with socket.socket() as s:  # free again at once, without SO_REUSEADDR's help for a listener still there
        s.bind(("127.0.0.1", port))


def test_the_tcp_listener_takes_the_port_asked_for_again_after_a_closed_server(tmp_path):
    """listen_tcp binds the master port + 1 it is given (not any port), and a channel started again on it (a
    restarted driver) gets it while the last server's closed connections are still in TIME_WAIT."""
    from tests.support.service_helpers import free_port
    port = free_port(21100, 21199)
    signer = wire.Signer(wire.new_key().encode())
    for i in range(2):
        server = channel.ChannelServer(str(tmp_path / f"c{i}"), signer, lambda link, hello: None)
        try:
            assert server.listen_tcp("127.0.0.1", port) == port
            before = server.dropped
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:  # dropped: the server closes first
                channel._recv_exact(c, 32)
                c.sendall(b"\x00\x00\x00\x05junk!")
                c.settimeout(30)
                assert c.recv(1) == b""
            settled(lambda: server.dropped == before + 1)
        finally:
            server.close()


def test_a_socket_left_by_a_killed_server_is_replaced_one_that_answers_is_refused(tmp_path):
    folder = str(tmp_path / channel.CHANNEL_DIR)
    signer = wire.Signer(b"k" * 64)
    first = channel.ChannelServer(folder, signer, lambda link, h: None)
    try:
        with pytest.raises(wire.GroupError, match="another server's command channel answers at .*Fix: stop that"):
            channel.ChannelServer(folder, signer, lambda link, h: None)
        assert os.path.exists(first.path)  # the live server's socket stays
    finally:
        first.close()
    # a server killed without closing leaves its socket file behind, with nobody listening
    address, fd = channel._address(first.path)  # a long tmp path is reached through its folder's descriptor
    try:
        if not os.path.exists(first.path):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
                stale.bind(address)
        assert os.path.exists(first.path)
        second = channel.ChannelServer(folder, signer, lambda link, h: None)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(address)  # the new server listens there
        finally:
            second.close()
    finally:
        if fd is not None:
            os.close(fd)
