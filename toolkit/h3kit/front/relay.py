"""The /ws events of a client's prompts, relayed from the server that runs them.

The front holds one websocket per server (ws://server/ws?clientId=<the front's id>) and submits every prompt
with that client id, so the server sends it the events of the prompts it dispatched. Each event that names a
prompt id is mapped back: the server's attempt id becomes the job id the client knows, output file entries
point at the front's /view (subfolder h3front/<job>/<attempt>/...), and the event goes to the websockets of
the job's client id only. Binary frames (previews) go to the client of the prompt the server runs at that
moment. Clients also get the front's own "status" event (its queue length) as ComfyUI's page expects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
import weakref

from h3kit.front.dispatch import rewrite_outputs

log = logging.getLogger("h3kit.front")


class Relay:
    def __init__(self):
        self.client_id = "h3front-" + uuid.uuid4().hex
        self.clients: dict[str, weakref.WeakSet] = {}       # client id -> its websockets
        self.attempts: dict[str, tuple[str, str, str]] = {}  # attempt id -> (job id, client id, user)
        self.current: dict[str, str] = {}                   # server url -> attempt it runs (from its events)
        self.tasks: dict[str, asyncio.Task] = {}
        self.queue_remaining = 0
        self.on_end = lambda: None                          # called when a server reports a prompt's end

    # --------------------------------------------------------------------------------- client side

    def add_client(self, user: str, client_id: str, ws) -> None:
        """A client's websocket; it gets the events of that user's prompts sent with that client id only."""
        self.clients.setdefault(f"{user}\0{client_id}", weakref.WeakSet()).add(ws)

    def remove_client(self, user: str, client_id: str, ws) -> None:
        self.clients.get(f"{user}\0{client_id}", weakref.WeakSet()).discard(ws)

    def status_event(self, client_id: str | None = None) -> dict:
        data = {"status": {"exec_info": {"queue_remaining": self.queue_remaining}}}
        if client_id:
            data["sid"] = client_id
        return {"type": "status", "data": data}

    async def broadcast_status(self, remaining: int) -> None:
        if remaining == self.queue_remaining:
            return
        self.queue_remaining = remaining
        text = json.dumps(self.status_event())
        for sockets in list(self.clients.values()):
            for ws in list(sockets):
                await _send(ws, text)

    def watch(self, job) -> None:
        client = (job.extra or {}).get("client_id") or ""
        self.attempts[job.server_prompt_id] = (job.id, f"{job.user}\0{client}", job.user)

    def forget(self, attempt: str) -> None:
        # kept a little: the last events of a prompt may arrive after its history entry
        asyncio.get_running_loop().call_later(30, self.attempts.pop, attempt, None)

    def front_error(self, job, message: str) -> None:
        """An execution_error the front itself reports (the job failed for good, the server refused it)."""
        client = f"{job.user}\0{(job.extra or {}).get('client_id') or ''}"
        event = {"type": "execution_error", "data": {
            "prompt_id": job.id, "node_id": None, "node_type": None, "executed": [],
            "exception_type": "h3kit.front", "exception_message": message, "traceback": [],
            "current_inputs": {}, "current_outputs": {}, "timestamp": 0}}
        asyncio.ensure_future(self._to_client(client, json.dumps(event)))

    async def _to_client(self, client_id: str, payload) -> None:
        for ws in list(self.clients.get(client_id, ())):
            await _send(ws, payload)

    # --------------------------------------------------------------------------------- server side

    def follow_servers(self, session, urls) -> None:
        for url in urls:
            task = self.tasks.get(url)
            if task is None or task.done():
                self.tasks[url] = asyncio.ensure_future(self._server_loop(session, url))

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    async def _server_loop(self, session, url: str) -> None:
        ws_url = url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}"
        try:
            async with session.ws_connect(ws_url, heartbeat=20, max_msg_size=0) as ws:
                async for msg in ws:
                    await self._on_server_message(url, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("front: /ws of %s: %s", url, e)
        await asyncio.sleep(1.0)  # follow_servers reconnects on the next turn

    async def _on_server_message(self, url: str, msg) -> None:
        import aiohttp

        if msg.type == aiohttp.WSMsgType.BINARY:
            attempt = self.current.get(url)
            hit = self.attempts.get(attempt) if attempt else None
            if hit:
                await self._to_client(hit[1], msg.data)
            return
        if msg.type != aiohttp.WSMsgType.TEXT:
            return
        try:
            event = json.loads(msg.data)
        except ValueError:
            return
        if _is_end(event):
            self.on_end()
        mapped = self.map_event(url, event)
        if mapped is not None:
            await self._to_client(mapped[0], json.dumps(mapped[1]))

    def map_event(self, url: str, event: dict):
        """(client id, event as the client sees it) for an event of a prompt this front dispatched, else None."""
        data = event.get("data") if isinstance(event, dict) else None
        if not isinstance(data, dict) or "prompt_id" not in data:
            return None
        attempt = data["prompt_id"]
        hit = self.attempts.get(attempt)
        if hit is None:
            return None
        job_id, client, _user = hit
        kind = event.get("type")
        if kind in ("execution_start", "executing", "progress", "progress_state"):
            self.current[url] = attempt
        data = dict(data, prompt_id=job_id)
        if kind == "executed" and isinstance(data.get("output"), dict):
            data["output"] = rewrite_outputs({"n": data["output"]}, job_id, attempt)["n"]
        return client, {"type": kind, "data": data}


def _is_end(event) -> bool:
    kind = event.get("type") if isinstance(event, dict) else None
    data = event.get("data") if isinstance(event, dict) else None
    return kind in ("execution_success", "execution_error", "execution_interrupted") or (
        kind == "executing" and isinstance(data, dict) and data.get("node") is None and "prompt_id" in data)


async def _send(ws, payload) -> None:
    try:
        if isinstance(payload, (bytes, bytearray)):
            await ws.send_bytes(payload)
        else:
            await ws.send_str(payload)
    except Exception:
        pass
