"""h3kit.progress (a prompt's progress from ComfyUI's events) and h3kit.comfyws on websocket-client: a frame cut
by a timeout is read whole afterwards, a handshake that does not answer the key is refused, proxies ignored.

The real server's events reach these classes in test_demo.py (the demo's stderr shows the sampler's steps)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import socket
import threading
import time

import pytest

from h3kit import comfyws
from h3kit.progress import PromptProgress

CLASSES = {"10": "BasicScheduler", "11": "SamplerCustomAdvanced", "12": "VAEDecode"}
EVENTS = [("execution_start", {}), ("executing", {"node": "10"}), ("executing", {"node": "11"})] + \
    [("progress", {"value": v, "max": 20, "node": "11"}) for v in range(1, 21)] + \
    [("executing", {"node": "12"}), ("progress", {"value": 1, "max": 1, "node": "12"}), ("executing", {"node": None}),
     ("execution_success", {})]


def test_plain_lines_say_each_node_and_every_tenth_of_the_steps():
    lines = []
    shown = PromptProgress(CLASSES, lines.append, stream=io.StringIO(), tty=False)
    for kind, data in EVENTS:
        shown(kind, data)
    shown.close()
    steps = [ln for ln in lines if "SamplerCustomAdvanced: step" in ln]
    assert steps == [f"  SamplerCustomAdvanced: step {v}/20" for v in [1, *range(2, 21, 2)]]  # the first, then tenths
    assert "  running SamplerCustomAdvanced" in lines and "  VAEDecode: step 1/1" in lines
    assert lines.index("  running BasicScheduler") < lines.index("  running SamplerCustomAdvanced") < lines.index(steps[0])


def test_a_bar_on_a_terminal_redraws_in_place_and_ends_its_line():
    out, lines = io.StringIO(), []
    shown = PromptProgress(CLASSES, lines.append, stream=out, tty=True)
    for kind, data in EVENTS[:8]:
        shown(kind, data)
    text = out.getvalue()
    assert text.count("\r") == 5 and "\n" not in text and lines == []
    assert text.endswith("\r  SamplerCustomAdvanced [" + "#" * 7 + "-" * 23 + "]  5/20")
    for kind, data in EVENTS[8:]:
        shown(kind, data)
    shown.close()
    text = out.getvalue()
    assert "[" + "#" * 30 + "] 20/20\n" in text and text.endswith("\n") and text.count("\n") == 2


def test_progress_ignores_what_it_cannot_read():
    lines = []
    shown = PromptProgress(CLASSES, lines.append, tty=False)
    for data in ({"value": "x", "max": 3}, {"value": 1, "max": 0}, {"max": 2}, {"value": 9, "max": 3, "node": "11"}):
        shown("progress", data)
    assert lines == ["  SamplerCustomAdvanced: step 3/3"]  # the value past max is clamped, the rest skipped


class _TinyWsServer:
    """One websocket connection on 127.0.0.1, its frames written by the test (unmasked, as a server sends)."""

    def __init__(self, accept_key=True):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.accept_key = accept_key
        self.conn = None
        self.ready = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        conn, _ = self.sock.accept()
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(4096)
        key = next(ln.split(b":", 1)[1].strip() for ln in head.split(b"\r\n") if ln.lower().startswith(b"sec-websocket-key"))
        guid = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        accept = base64.b64encode(hashlib.sha1((key if self.accept_key else b"wrong") + guid).digest())
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        self.conn = conn
        self.ready.set()

    @staticmethod
    def frame(opcode: int, payload: bytes) -> bytes:
        assert len(payload) < 65536
        head = bytes([0x80 | opcode]) + (bytes([len(payload)]) if len(payload) < 126 else bytes([126]) + len(payload).to_bytes(2, "big"))
        return head + payload

    def close(self):
        for s in (self.conn, self.sock):
            if s is not None:
                s.close()


def test_a_frame_cut_by_a_timeout_is_read_whole_afterwards(monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # a proxy in the environment is not used
    server = _TinyWsServer()
    ws = comfyws.WebSocket("127.0.0.1", server.port, "c1", timeout=5)
    try:
        assert server.ready.wait(5)
        message = {"type": "progress", "data": {"value": 3, "max": 8, "pad": "x" * 300}}
        text = server.frame(0x1, json.dumps(message).encode())
        server.conn.sendall(server.frame(0x2, b"\x00preview") + server.frame(0x9, b"hi") + text[:150])
        assert ws.recv_json(0.3) is None  # half a frame, then silence past the timeout
        server.conn.settimeout(2)
        assert server.conn.recv(64)[0] == 0x8A  # the ping was answered with a pong meanwhile
        server.conn.sendall(text[150:])
        assert ws.recv_json(2) == message
        server.conn.sendall(server.frame(0x8, b"\x03\xe8"))
        with pytest.raises(comfyws.WebSocketError, match="closed by the server"):
            ws.recv_json(2)
    finally:
        ws.close()
        server.close()


def test_a_handshake_that_does_not_answer_the_key_is_refused():
    server = _TinyWsServer(accept_key=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(comfyws.WebSocketError, match="cannot open ws://127.0.0.1:[0-9]+/ws.*Invalid WebSocket Header"):
            comfyws.WebSocket("127.0.0.1", server.port, "c1", timeout=120)
        assert time.monotonic() - t0 < 60, "refused at the handshake, not after the timeout"
    finally:
        server.close()
