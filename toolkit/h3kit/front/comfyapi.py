"""ComfyUI's own HTTP API on the front, for the prompts it takes, and the ComfyUI page through it.

Every route answers at /x and at /api/x, as ComfyUI's do. The front's own routes: POST /prompt (queue a job,
answer its id), GET /prompt, GET and POST /queue, GET and POST /history[/id], GET /view, POST /interrupt,
POST /upload/image, GET /ws. Everything else the page asks for (the static frontend, /object_info,
/system_stats, /extensions, /api/userdata, ...) is passed to a healthy server as it is, without the client's
token or cookie. Each user sees and cancels only their own jobs.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from pathlib import Path

from aiohttp import web

from h3kit.front import store as st
from h3kit.front.dispatch import OUTPUT_PREFIX, safe_rel

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
HOP_HEADERS = {"host", "authorization", "cookie", "connection", "keep-alive", "transfer-encoding", "upgrade",
               "content-length", "accept-encoding", "proxy-authorization", "te", "trailer"}
# not passed to a server either: the front checked the origin itself (ComfyUI would refuse the front's own
# origin as foreign: its host is the server's, the origin the front's)
REQUEST_ONLY = {"origin", "referer"}


def error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": {"type": "h3kit_front", "message": message, **extra}}, status=status)


def npu_count_of(prompt: dict) -> int | None:
    """The npu_count the prompt's MultiNPUParallelConfig nodes ask for; None for "auto", a link or no node."""
    counts = set()
    for node in prompt.values():
        if isinstance(node, dict) and node.get("class_type") == "MultiNPUParallelConfig":
            v = (node.get("inputs") or {}).get("npu_count")
            if isinstance(v, int) and not isinstance(v, bool):
                counts.add(v)
            elif isinstance(v, str) and v.isdigit():
                counts.add(int(v))
    if len(counts) > 1:
        raise ValueError(f"the prompt's MultiNPUParallelConfig nodes ask for different npu_count values "
                         f"{sorted(counts)}: one prompt runs on one server")
    return counts.pop() if counts else None


def queue_item(job: st.Job, number: int) -> list:
    return [number, job.id, job.prompt, (job.extra or {}).get("extra_data") or {}, []]


def history_entry(job: st.Job, number: int) -> dict:
    status = job.status or {}
    if job.state != st.DONE and not status.get("messages"):
        status = {"status_str": "error", "completed": False, "messages": [["execution_error", {
            "prompt_id": job.id, "exception_type": "h3kit.front", "exception_message": job.error or job.state}]]}
    return {"prompt": queue_item(job, number), "outputs": job.outputs or {}, "status": status, "meta": {},
            "h3front": {"state": job.state, "server": job.server, "attempts": job.attempts, "error": job.error}}


class ComfyApi:
    """The handlers; `front` is the app's state (store, pool, dispatcher, relay, data folders)."""

    def __init__(self, front):
        self.front = front

    def routes(self) -> list:
        out = []
        for prefix in ("", "/api"):
            out += [web.post(prefix + "/prompt", self.post_prompt), web.get(prefix + "/prompt", self.get_prompt),
                    web.get(prefix + "/queue", self.get_queue), web.post(prefix + "/queue", self.post_queue),
                    web.get(prefix + "/history", self.get_history),
                    web.get(prefix + "/history/{id}", self.get_history),
                    web.post(prefix + "/history", self.post_history), web.get(prefix + "/view", self.view),
                    web.post(prefix + "/interrupt", self.interrupt),
                    web.post(prefix + "/upload/image", self.upload_image), web.get(prefix + "/ws", self.ws)]
        return out

    async def _db(self, fn, *a, **kw):
        return await asyncio.to_thread(fn, *a, **kw)

    # ------------------------------------------------------------------------------------------ queue

    async def post_prompt(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, dict) or not prompt or not all(isinstance(n, dict) for n in prompt.values()):
            return web.json_response({"error": {"type": "invalid_prompt", "message": "no prompt: the body needs "
                                      "\"prompt\", an API-format graph", "details": ""}, "node_errors": {}}, status=400)
        try:
            npu_count = npu_count_of(prompt)
        except ValueError as e:
            return web.json_response({"error": {"type": "invalid_prompt", "message": str(e), "details": ""},
                                      "node_errors": {}}, status=400)
        job_id = body.get("prompt_id")
        if job_id is not None and (not isinstance(job_id, str) or not UUID.match(job_id)):
            return error(400, "prompt_id must be a lowercase UUID; omit it to let the front make one")
        extra = {"client_id": body.get("client_id") if isinstance(body.get("client_id"), str) else None,
                 "extra_data": body.get("extra_data") if isinstance(body.get("extra_data"), dict) else {}}
        if await self._db(self.front.store.get, job_id) if job_id else False:
            return error(400, f"prompt_id {job_id} is taken")
        job = await self._db(self.front.store.add, kind="comfy", user=request["user"], prompt=prompt, extra=extra,
                             npu_count=npu_count, job_id=job_id)
        self.front.dispatcher.poke()
        number = await self._db(self.front.store.position, job)
        return web.json_response({"prompt_id": job.id, "number": number, "node_errors": {}})

    async def get_prompt(self, request: web.Request) -> web.Response:
        counts = await self._db(self.front.store.counts)
        return web.json_response({"exec_info": {"queue_remaining": counts[st.QUEUED] + counts[st.RUNNING]}})

    async def get_queue(self, request: web.Request) -> web.Response:
        jobs = await self._db(self.front.store.list, user=request["user"], states=(st.QUEUED, st.RUNNING))
        running = [queue_item(j, i) for i, j in enumerate(jobs) if j.state == st.RUNNING]
        pending = [queue_item(j, i) for i, j in enumerate(jobs) if j.state == st.QUEUED]
        return web.json_response({"queue_running": running, "queue_pending": pending})

    async def post_queue(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        ids = body.get("delete") if isinstance(body.get("delete"), list) else []
        if body.get("clear"):
            ids += [j.id for j in await self._db(self.front.store.list, user=request["user"], states=(st.QUEUED,))]
        for job_id in ids:
            await self._cancel_own(request, str(job_id))
        return web.Response(status=200)

    async def interrupt(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if isinstance(body.get("prompt_id"), str):
            await self._cancel_own(request, body["prompt_id"])
        else:
            for job in await self._db(self.front.store.list, user=request["user"], states=(st.RUNNING,)):
                await self._cancel_own(request, job.id)
        return web.Response(status=200)

    async def _cancel_own(self, request: web.Request, job_id: str) -> None:
        job = await self._db(self.front.store.get, job_id)
        if job is not None and job.user == request["user"]:
            await self._db(self.front.store.cancel, job_id)

    async def get_history(self, request: web.Request) -> web.Response:
        job_id = request.match_info.get("id")
        if job_id:
            job = await self._db(self.front.store.get, job_id)
            jobs = [job] if job and job.user == request["user"] and job.state in st.FINAL else []
        else:
            try:
                limit = max(1, min(int(request.query.get("max_items", 10000)), 10000))
            except ValueError:
                return error(400, "max_items must be an integer")
            jobs = await self._db(self.front.store.list, user=request["user"], states=st.FINAL, limit=limit,
                                  newest_first=True)
        return web.json_response({j.id: history_entry(j, i) for i, j in enumerate(jobs)})

    async def post_history(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        ids = body.get("delete") if isinstance(body.get("delete"), list) else []
        if body.get("clear"):
            ids += [j.id for j in await self._db(self.front.store.list, user=request["user"], states=st.FINAL)]
        for job_id in ids:
            job = await self._db(self.front.store.get, str(job_id))
            if job is not None and job.user == request["user"] and job.state in st.FINAL:
                await self._db(self.front.store.delete, job.id)
                shutil.rmtree(self.front.outputs_dir / safe_rel(job.id), ignore_errors=True)
        return web.Response(status=200)

    # ------------------------------------------------------------------------------------------ files

    async def view(self, request: web.Request) -> web.StreamResponse:
        q = request.query
        filename, sub, kind = q.get("filename", ""), q.get("subfolder", ""), q.get("type", "output")
        try:
            rel = safe_rel(sub, filename)
        except ValueError:
            return error(400, "bad filename or subfolder")
        if sub.startswith(OUTPUT_PREFIX + "/"):
            return await self._view_job(request, sub, filename)
        if kind == "input" and (self.front.inputs_dir / rel).is_file():
            return web.FileResponse(self.front.inputs_dir / rel)
        return await self.front.proxy(request)

    async def _view_job(self, request: web.Request, sub: str, filename: str) -> web.StreamResponse:
        parts = sub.split("/", 3)
        if len(parts) < 3:
            return error(404, "no such output")
        job = await self._db(self.front.store.get, parts[1])
        if job is None or job.user != request["user"]:
            return error(404, "no such output")
        local = self.front.outputs_dir / safe_rel(*parts[1:], filename)
        if local.is_file():
            return web.FileResponse(local)
        if job.server and parts[2] == job.server_prompt_id:  # not published yet: the server that runs it has it
            query = dict(request.query, subfolder=parts[3] if len(parts) > 3 else "")
            return await self.front.proxy(request, server=job.server, path="/view", query=query)
        return error(404, "no such output")

    async def upload_image(self, request: web.Request) -> web.Response:
        form = await request.post()
        image = form.get("image")
        if image is None or not hasattr(image, "file"):
            return error(400, "the form needs an \"image\" file")
        sub = str(form.get("subfolder") or "")
        name = Path(image.filename or "image.png").name
        try:
            rel = safe_rel(sub, name)
        except ValueError:
            return error(400, "bad subfolder")
        dest = self.front.inputs_dir / rel
        if dest.exists() and str(form.get("overwrite", "")).lower() not in ("true", "1"):
            stem, suffix, i = dest.stem, dest.suffix, 1
            while dest.exists():
                dest, i = dest.with_name(f"{stem} ({i}){suffix}"), i + 1
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(image.file.read())
        return web.json_response({"name": dest.name, "subfolder": sub, "type": "input"})

    # ------------------------------------------------------------------------------------------ events

    async def ws(self, request: web.Request) -> web.WebSocketResponse:
        client_id = request.query.get("clientId") or uuid.uuid4().hex
        sock = web.WebSocketResponse(heartbeat=30)
        await sock.prepare(request)
        relay = self.front.relay
        relay.add_client(request["user"], client_id, sock)
        try:
            await sock.send_str(json.dumps(relay.status_event(client_id)))
            async for _msg in sock:
                pass
        finally:
            relay.remove_client(request["user"], client_id, sock)
        return sock


async def _json_or_empty(request: web.Request) -> dict:
    try:
        body = await request.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
