"""h3kit's one HTTP client, for the ComfyUI endpoints the commands read (H3_FACTS section 4).

Standard library only (h3kit does not depend on requests): `h3kit start` polls every fraction of a second,
and `check-workflow` must start light. Proxies from the environment are ignored: the server is on this
machine (or one the user names), and an http_proxy setting must not route h3kit's requests elsewhere.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from h3kit.errors import H3kitError

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# Signatures of an out-of-memory error in an execution_error (exception_type / exception_message).
OOM_TYPES = ("OutOfMemoryError",)
OOM_MESSAGES = ("out of memory", "can't allocate memory")


class HttpError(H3kitError):
    """The server did not answer, or answered with an error status or a body that is not JSON.

    `status` is the HTTP status when there was one; `body` the decoded JSON of an error answer (ComfyUI's
    400 from POST /prompt carries the validation errors per node there), else None.
    """

    code = "server_http"

    def __init__(self, message: str, status: int | None = None, body=None):
        super().__init__(message, hint="is the server running? h3kit status shows it and its log")
        self.status = status
        self.body = body


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def request_json(url: str, *, method: str = "GET", body=None, timeout: float = 3.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        try:
            body = json.loads(e.read() or b"null")
        except (ValueError, OSError, http.client.HTTPException):
            body = None
        raise HttpError(f"{method} {url}: HTTP {e.code}", status=e.code, body=body) from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        # HTTPException: a server that dies mid-answer (IncompleteRead, RemoteDisconnected is an OSError)
        reason = getattr(e, "reason", e)
        raise HttpError(f"{method} {url}: {reason}") from None
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        raise HttpError(f"{method} {url}: the answer is not JSON") from None


@dataclass
class Health:
    ok: bool
    reason: str
    stats: dict | None = None

    @property
    def devices(self) -> list[dict]:
        return device_summary(self.stats)


def device_summary(stats: dict | None) -> list[dict]:
    """The /system_stats device entries, reduced to what `status` shows."""
    out = []
    for d in (stats or {}).get("devices") or []:
        out.append({"name": d.get("name"), "type": d.get("type"), "index": d.get("index"),
                    "vram_total": d.get("vram_total"), "vram_free": d.get("vram_free")})
    return out


def check_health(url: str, expected_devices: int | None = None, timeout: float = 2.0) -> Health:
    """GET /system_stats; healthy when it answers and, if `expected_devices` is given, lists that many
    devices. A wrong device count is reported with ok False and the stats attached."""
    try:
        stats = request_json(f"{url}/system_stats", timeout=timeout)
    except HttpError as e:
        return Health(False, str(e))
    if not isinstance(stats, dict) or not isinstance(stats.get("devices"), list):
        return Health(False, "/system_stats has no device list")
    if expected_devices is not None and len(stats["devices"]) != expected_devices:
        names = ", ".join(str(d.get("name")) for d in stats["devices"]) or "none"
        return Health(False, f"/system_stats lists {len(stats['devices'])} device(s) ({names}), "
                             f"expected {expected_devices}", stats)
    return Health(True, "healthy", stats)


def queue_counts(url: str, timeout: float = 3.0) -> tuple[int, int]:
    """(running, pending) prompts from GET /queue. Raises HttpError."""
    q = request_json(f"{url}/queue", timeout=timeout)
    if not isinstance(q, dict):
        raise HttpError(f"GET {url}/queue: unexpected answer")
    return len(q.get("queue_running") or []), len(q.get("queue_pending") or [])


def free_memory(url: str, timeout: float = 5.0) -> None:
    """POST /free asking the server to unload models and free cached memory. Raises HttpError."""
    request_json(f"{url}/free", method="POST", body={"unload_models": True, "free_memory": True},
                 timeout=timeout)


def is_oom_error(data: dict) -> bool:
    etype = str(data.get("exception_type") or "")
    message = str(data.get("exception_message") or "").lower()
    return any(t in etype for t in OOM_TYPES) or any(m in message for m in OOM_MESSAGES)


def history_errors(url: str, max_items: int = 64, timeout: float = 3.0) -> dict[str, dict]:
    """prompt_id -> the execution_error data of each recent prompt that failed. Raises HttpError."""
    history = request_json(f"{url}/history?max_items={max_items}", timeout=timeout)
    out = {}
    for prompt_id, entry in (history or {}).items():
        status = (entry or {}).get("status") or {}
        for message in status.get("messages") or []:
            if isinstance(message, (list, tuple)) and len(message) == 2 and message[0] == "execution_error":
                out[prompt_id] = message[1] if isinstance(message[1], dict) else {}
    return out


def cancel_prompt(url: str, prompt_id: str, timeout: float = 5.0) -> None:
    """Take `prompt_id` out of the queue and interrupt it if it runs (never another prompt)."""
    request_json(url + "/queue", method="POST", body={"delete": [prompt_id]}, timeout=timeout)
    request_json(url + "/interrupt", method="POST", body={"prompt_id": prompt_id}, timeout=timeout)
