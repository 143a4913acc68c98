"""The servers a front dispatches to, and what it knows of each from their HTTP API alone.

A server comes from a --server URL or from the service record of a ComfyUI tree (--comfy-home, read-only,
re-read every few seconds so that a server started later joins). Each poll reads GET /system_stats (its device
count: the `devices` list) and GET /queue (idle: nothing running or pending). States:

- up:   /system_stats answered 200 at the last poll;
- down: it refused the connection or answered an error (a server killed, stopped or restarting);
- hung: it accepted the connection but did not answer within the poll timeout.

`since` is when the server entered its state (monotonic), so the dispatcher can give a dead or hung server a
grace period before it moves that server's jobs elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("h3kit.front")
UP, DOWN, HUNG = "up", "down", "hung"
SERVER_STATES = (UP, DOWN, HUNG)


@dataclass
class Server:
    url: str                       # http://host:port, no trailing slash
    source: str                    # "url" or the tree's runtime root
    state: str = DOWN
    since: float = field(default_factory=time.monotonic)
    devices: int | None = None     # len(/system_stats devices)
    queue: int = 0                 # running + pending on the server itself (any client)
    running_ids: set = field(default_factory=set)
    pending_ids: set = field(default_factory=set)
    polled: bool = False
    fresh: bool = False            # its last poll ended within this turn (a slow one goes on in the background)
    error: str = ""

    def set_state(self, state: str, error: str = "") -> None:
        if state != self.state:
            if self.polled or state != DOWN:
                log.warning("front: server %s is %s%s", self.url, state, f" ({error})" if error else "")
            self.state, self.since = state, time.monotonic()
        self.error = error

    @property
    def healthy(self) -> bool:
        return self.state == UP

    def to_dict(self) -> dict:
        return {"url": self.url, "source": self.source, "state": self.state, "devices": self.devices,
                "queue": self.queue, "error": self.error or None,
                "state_for_s": round(time.monotonic() - self.since, 1)}


def normalize_url(url: str) -> str:
    from h3kit.front import FrontUsageError

    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        if ":" not in url:
            raise FrontUsageError(f"--server {url!r} is not a URL", hint="give http://HOST:PORT")
        url = "http://" + url
    return url


def tree_server_urls(comfy_home: str | None, runtime_root: str | None) -> list[str]:
    """The URLs of the tree's recorded servers, read-only: the record of the runtime root R and those of
    R/servers/<port>/ (several servers of one tree, h3kit.service.servers' layout). A broken record is skipped
    (the tree's own `h3kit status` reports it)."""
    if not comfy_home and not runtime_root:
        return []
    from h3kit.service import records

    root = Path(records.runtime_root(comfy_home, runtime_root))
    extra = root / "servers"
    roots = [root] + (sorted((p for p in extra.iterdir() if p.name.isdigit() and p.is_dir()),
                             key=lambda p: int(p.name)) if extra.is_dir() else [])
    urls = []
    for r in roots:
        try:
            rec = records.read_record(r, comfy_home)
        except records.ServiceError:
            continue
        if rec is not None and rec.url not in urls:
            urls.append(rec.url)
    return urls


class Pool:
    """The servers, polled together. The dispatcher reads `servers`; `poll` refreshes them."""

    def __init__(self, urls: list[str], *, comfy_home: str | None = None, runtime_root: str | None = None,
                 timeout: float = 5.0):
        self.fixed = [normalize_url(u) for u in urls]
        self.comfy_home, self.runtime_root = comfy_home, runtime_root
        self.timeout = timeout
        self.servers: dict[str, Server] = {u: Server(u, "url") for u in self.fixed}
        self._discovered = 0.0
        self._inflight: dict[str, asyncio.Future] = {}

    def discover(self) -> None:
        if time.monotonic() - self._discovered < 5.0:
            return
        self._discovered = time.monotonic()
        source = str(self.runtime_root or self.comfy_home or "")
        for url in tree_server_urls(self.comfy_home, self.runtime_root):
            url = normalize_url(url)
            self.servers.setdefault(url, Server(url, source))

    async def poll(self, session, wait: float = 1.0) -> None:
        """Poll every server, waiting at most `wait` seconds: a server slower than that (hung, say) goes on being
        polled in the background, is not `fresh` this turn, and holds up no other server."""
        self.discover()
        for s in list(self.servers.values()):
            task = self._inflight.get(s.url)
            if task is None or task.done():
                self._inflight[s.url] = asyncio.ensure_future(self._poll_one(session, s))
        tasks = [self._inflight[u] for u in self.servers]
        await asyncio.wait(tasks, timeout=wait)
        for s in self.servers.values():
            s.fresh = self._inflight[s.url].done()

    async def _poll_one(self, session, s: Server) -> None:
        import aiohttp

        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout)
            async with session.get(s.url + "/system_stats", timeout=timeout) as r:
                if r.status != 200:
                    return s.set_state(DOWN, f"/system_stats answered {r.status}")
                stats = await r.json(content_type=None)
            async with session.get(s.url + "/queue", timeout=timeout) as r:
                queue = await r.json(content_type=None) if r.status == 200 else {}
        except asyncio.TimeoutError:
            return s.set_state(HUNG, f"no answer within {self.timeout:g} s")
        except (aiohttp.ClientError, OSError, ValueError) as e:
            return s.set_state(DOWN, f"{type(e).__name__}: {e}"[:300])
        finally:
            s.polled = True
        devices = stats.get("devices") if isinstance(stats, dict) else None
        s.devices = len(devices) if isinstance(devices, list) else None
        s.running_ids = {item[1] for item in queue.get("queue_running", []) if _is_item(item)}
        s.pending_ids = {item[1] for item in queue.get("queue_pending", []) if _is_item(item)}
        s.queue = len(s.running_ids) + len(s.pending_ids)
        s.set_state(UP)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(SERVER_STATES, 0)
        for s in self.servers.values():
            out[s.state] += 1
        return out


def _is_item(item) -> bool:
    return isinstance(item, list) and len(item) > 1 and isinstance(item[1], str)
