"""Follow a prompt on ComfyUI's /ws: which node runs when, so stage times come from the server's own events.

A minimal RFC 6455 client on the standard library (the toolkit's dependencies stay click, GitPython, psutil,
requests, PyYAML): it connects to ws://host:port/ws?clientId=ID, answers pings, skips binary frames (latent
previews) and yields the JSON text messages. ComfyUI sends, per prompt: execution_start, execution_cached
(nodes served from cache), executing {node} as each node starts (node None at the end), executed,
progress, execution_success or execution_error / execution_interrupted.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from dataclasses import dataclass, field

from h3kit.errors import H3kitError


class WebSocketError(H3kitError):
    code = "websocket"


class WebSocket:
    def __init__(self, host: str, port: int, client_id: str, timeout: float = 10.0):
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise WebSocketError(f"cannot connect to ws://{host}:{port}/ws: {e}",
                                 hint="is the server running? h3kit status shows it") from None
        key = base64.b64encode(os.urandom(16)).decode()
        request = (f"GET /ws?clientId={client_id} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise WebSocketError("connection closed during the websocket handshake")
            head += chunk
        status, _, rest = head.partition(b"\r\n\r\n")
        first_line = status.split(b"\r\n", 1)[0]
        if b" 101 " not in first_line:
            raise WebSocketError(f"websocket handshake refused: {first_line.decode(errors='replace')}")
        self._buf = rest

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise WebSocketError("websocket closed by the server")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def _send(self, opcode: int, payload: bytes = b"") -> None:
        mask = os.urandom(4)
        header = bytes([0x80 | opcode])
        n = len(payload)
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 65536:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        self.sock.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv_json(self, timeout: float) -> dict | None:
        """The next text message as JSON, or None when `timeout` passes without one."""
        deadline = time.monotonic() + timeout
        message = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                b1, b2 = self._read(2)
            except socket.timeout:
                return None
            except OSError as e:
                raise WebSocketError(f"the websocket broke: {e}") from None
            opcode, length = b1 & 0x0F, b2 & 0x7F
            if length == 126:
                length = struct.unpack(">H", self._read(2))[0]
            elif length == 127:
                length = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b2 & 0x80 else None
            payload = self._read(length)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            if opcode == 0x8:
                raise WebSocketError("websocket closed by the server")
            if opcode == 0x9:
                self._send(0xA, payload)
                continue
            if opcode in (0x1, 0x0):
                message += payload
                if b1 & 0x80 and message:
                    try:
                        return json.loads(message)
                    except ValueError:
                        message = b""
                continue
            # binary frames (previews) and pongs are of no interest here

    def close(self) -> None:
        try:
            self._send(0x8)
        except OSError:
            pass
        self.sock.close()


@dataclass
class NodeTiming:
    node: str
    class_type: str
    started: float
    finished: float | None = None

    @property
    def seconds(self) -> float:
        return (self.finished or self.started) - self.started


@dataclass
class PromptTrace:
    prompt_id: str
    submitted: float
    started: float | None = None
    finished: float | None = None
    cached: list[str] = field(default_factory=list)
    nodes: list[NodeTiming] = field(default_factory=list)
    error: dict | None = None
    status: str = "running"

    def to_dict(self) -> dict:
        return {"prompt_id": self.prompt_id, "status": self.status, "error": self.error,
                "end_to_end_s": (self.finished - self.submitted) if self.finished else None,
                "cached": self.cached,
                "nodes": [{"node": n.node, "class_type": n.class_type, "seconds": round(n.seconds, 4)}
                          for n in self.nodes]}


def follow(ws: WebSocket, prompt_id: str, classes: dict[str, str], submitted: float, timeout: float,
           on_event=None) -> PromptTrace:
    """Read events until `prompt_id` finishes (or fails); times are this client's clock when events arrive."""
    trace = PromptTrace(prompt_id, submitted)
    deadline = time.monotonic() + timeout
    while trace.status == "running":
        left = deadline - time.monotonic()
        if left <= 0:
            trace.status = "timeout"
            break
        msg = ws.recv_json(min(left, 5.0))
        now = time.monotonic()
        if msg is None:
            continue
        kind, data = msg.get("type"), msg.get("data") or {}
        if data.get("prompt_id") not in (None, prompt_id):
            continue
        if on_event:
            on_event(kind, data)
        if kind == "execution_start":
            trace.started = now
        elif kind == "execution_cached":
            trace.cached = [str(n) for n in data.get("nodes", [])]
        elif kind == "executing":
            if trace.nodes and trace.nodes[-1].finished is None:
                trace.nodes[-1].finished = now
            node = data.get("node")
            if node is not None:
                trace.nodes.append(NodeTiming(str(node), classes.get(str(node), "?"), now))
        elif kind == "execution_success":
            trace.finished, trace.status = now, "success"
        elif kind in ("execution_error", "execution_interrupted"):
            trace.finished, trace.status, trace.error = now, kind.replace("execution_", ""), data
    if trace.nodes and trace.nodes[-1].finished is None:
        trace.nodes[-1].finished = trace.finished or time.monotonic()
    return trace
