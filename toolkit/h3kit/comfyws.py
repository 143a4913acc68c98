"""Follow a prompt on ComfyUI's /ws: which node runs when, so stage times come from the server's own events.

The connection is websocket-client's (imported only here, when a prompt is followed): it verifies the
handshake, answers pings, reassembles fragmented messages, and keeps a frame that a timeout cut in half for
the next read, so a slow server never desynchronises the stream. Binary frames (latent previews) are skipped;
text messages are yielded as JSON. Proxies from the environment are ignored, as for h3kit's HTTP requests.
ComfyUI sends, per prompt: execution_start, execution_cached (nodes served from cache), executing {node}
as each node starts (node None at the end), progress {value, max, node} as a node advances (the sampler's
steps), executed, execution_success or execution_error / execution_interrupted.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field

from h3kit.errors import H3kitError


class WebSocketError(H3kitError):
    code = "websocket"


class WebSocket:
    """ws://host:port/ws?clientId=ID, opened at once; WebSocketError when it cannot be."""

    def __init__(self, host: str, port: int, client_id: str, timeout: float = 10.0):
        import websocket

        self._lib = websocket
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        url = f"ws://{where}/ws?clientId={client_id}"
        try:
            # the TCP connection is made here, directly: websocket-client would route it through an
            # http_proxy from the environment (its no-proxy option only applies to a proxy given explicitly)
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise WebSocketError(f"cannot connect to {url}: {e}", hint="is the server running? h3kit status shows it") from None
        try:
            self.ws = websocket.create_connection(url, timeout=timeout, socket=sock, skip_utf8_validation=True)
        except (websocket.WebSocketException, OSError) as e:
            sock.close()
            raise WebSocketError(f"cannot open {url}: {e}", hint="is the server running? h3kit status shows it") from None

    def recv_json(self, timeout: float) -> dict | None:
        """The next text message as JSON, or None when `timeout` passes without one."""
        deadline = time.monotonic() + timeout
        lib = self._lib
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.ws.settimeout(left)
            try:
                opcode, payload = self.ws.recv_data()
            except lib.WebSocketTimeoutException:
                return None
            except lib.WebSocketConnectionClosedException:
                raise WebSocketError("websocket closed by the server") from None
            except (lib.WebSocketException, OSError) as e:
                raise WebSocketError(f"the websocket broke: {e}") from None
            if opcode == lib.ABNF.OPCODE_CLOSE:
                raise WebSocketError("websocket closed by the server")
            if opcode != lib.ABNF.OPCODE_TEXT:
                continue  # previews and other binary frames are of no interest here
            try:
                message = json.loads(payload)
            except ValueError:
                continue
            if isinstance(message, dict):
                return message

    def close(self) -> None:
        try:
            self.ws.close(timeout=1)
        except (self._lib.WebSocketException, OSError):
            pass


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
