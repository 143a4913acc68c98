"""The front's settings and its aiohttp application: auth middleware, the ComfyUI API (comfyapi.py), the job
API (/v1/videos), /metrics, /front/status, and the proxy that passes the page's other requests to a server."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import shutil
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web

from h3kit.front import FrontError, auth, videos
from h3kit.front import store as st
from h3kit.front.comfyapi import HOP_HEADERS, REQUEST_ONLY, ComfyApi
from h3kit.front.dispatch import Dispatcher, Timing
from h3kit.front.jobsapi import JobsApi
from h3kit.front.metrics import Metrics
from h3kit.front.relay import Relay
from h3kit.front.servers import Pool

log = logging.getLogger("h3kit.front")
OPEN_PATHS = ("/healthz",)
# the page's writes the front passes to a server (a user's settings and saved workflows; kept on that server)
WRITABLE = ("/api/userdata", "/userdata", "/api/settings", "/settings", "/api/users", "/users")   # answered without a token: a load balancer's liveness probe (no data in it)


@dataclass
class Settings:
    host: str = "127.0.0.1"
    port: int = 8188
    data_dir: Path = Path(".")
    db_url: str | None = None             # default: sqlite:///<data_dir>/front.db
    servers: list = field(default_factory=list)
    comfy_home: str | None = None
    runtime_root: str | None = None
    tokens: dict | None = None            # {token: user}
    timing: Timing = field(default_factory=Timing)
    video_workflows: dict = field(default_factory=dict)

    @property
    def database(self) -> str:
        return self.db_url or f"sqlite:///{Path(self.data_dir).resolve() / 'front.db'}"


class Front:
    """Everything one front process holds."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.data_dir = Path(settings.data_dir)
        self.inputs_dir, self.outputs_dir = self.data_dir / "inputs", self.data_dir / "outputs"
        for d in (self.inputs_dir, self.outputs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.store = st.Store(settings.database)
        self.pool = Pool(settings.servers, comfy_home=settings.comfy_home, runtime_root=settings.runtime_root)
        self.relay = Relay()
        self.metrics = Metrics(self.store, self.pool)
        self.dispatcher = Dispatcher(self.store, self.pool, self.data_dir, timing=settings.timing,
                                     metrics=self.metrics, relay=self.relay)
        self.workflows = videos.load_workflows(settings.video_workflows)
        self.session: ClientSession | None = None

    # ------------------------------------------------------------------------------------------ proxy

    def pick_server(self) -> str | None:
        up = [s for s in self.pool.servers.values() if s.healthy]
        up.sort(key=lambda s: s.queue)
        return up[0].url if up else None

    async def proxy(self, request: web.Request, *, server: str | None = None, path: str | None = None,
                    query=None) -> web.StreamResponse:
        """Pass the request to `server` (default: a healthy one), without the client's credentials."""
        url = server or self.pick_server()
        if url is None:
            return web.json_response({"error": {"type": "h3kit_front", "message": "no server is up"}}, status=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS | REQUEST_ONLY}
        body = await request.read() if request.can_read_body else None
        try:
            async with self.session.request(request.method, url + (path or request.path),
                                            params=query if query is not None else request.query,
                                            headers=headers, data=body, allow_redirects=False,
                                            timeout=ClientTimeout(total=600)) as r:
                out = web.StreamResponse(status=r.status, headers={
                    k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}})
                await out.prepare(request)
                async for chunk in r.content.iter_chunked(1 << 16):
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (OSError, asyncio.TimeoutError) as e:
            return web.json_response({"error": {"type": "h3kit_front", "message": f"{url}: {e}"}}, status=502)

    # ------------------------------------------------------------------------------------------ /v1

    def v1_routes(self) -> list:
        return [web.post("/v1/videos", self.create_video), web.get("/v1/videos", self.list_videos),
                web.get("/v1/videos/{id}", self.get_video), web.delete("/v1/videos/{id}", self.delete_video),
                web.get("/v1/videos/{id}/content", self.video_content)]

    async def create_video(self, request: web.Request) -> web.Response:
        try:
            req, image, ext = await _video_request(request)
            prompt, params, npu_count = videos.build_job(self.workflows, req, image, ext, self.inputs_dir)
        except videos.BadRequest as e:
            return web.json_response(e.body(), status=400)
        job = await asyncio.to_thread(self.store.add, kind="video", user=request["user"], prompt=prompt,
                                      extra={"video": params, "client_id": None}, npu_count=npu_count,
                                      job_id="video_" + st.uuid.uuid4().hex)
        self.dispatcher.poke()
        return web.json_response(videos.video_object(job, await asyncio.to_thread(self.store.position, job)))

    async def _own_video(self, request: web.Request):
        job = await asyncio.to_thread(self.store.get, request.match_info["id"])
        if job is None or job.kind != "video" or job.user != request["user"]:
            raise web.HTTPNotFound(text=json.dumps({"error": {"message": "no such video",
                                                              "type": "invalid_request_error"}}),
                                   content_type="application/json")
        return job

    async def get_video(self, request: web.Request) -> web.Response:
        job = await self._own_video(request)
        pos = await asyncio.to_thread(self.store.position, job) if job.state == st.QUEUED else None
        return web.json_response(videos.video_object(job, pos))

    async def list_videos(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(int(request.query.get("limit", 100)), 1000))
        except ValueError:
            return web.json_response(videos.BadRequest("limit must be an integer", "limit").body(), status=400)
        jobs = await asyncio.to_thread(self.store.list, user=request["user"], kind="video", limit=limit,
                                       newest_first=request.query.get("order", "desc") != "asc")
        return web.json_response({"object": "list", "data": [videos.video_object(j) for j in jobs],
                                  "has_more": len(jobs) == limit})

    async def delete_video(self, request: web.Request) -> web.Response:
        job = await self._own_video(request)
        job = await asyncio.to_thread(self.store.cancel, job.id)
        if job.state in st.FINAL:
            await asyncio.to_thread(self.store.delete, job.id)
            shutil.rmtree(self.outputs_dir / job.id, ignore_errors=True)
            return web.json_response({"id": job.id, "object": "video.deleted", "deleted": True})
        return web.json_response(dict(videos.video_object(job), deleted=False), status=202)

    async def video_content(self, request: web.Request) -> web.StreamResponse:
        job = await self._own_video(request)
        path = videos.content_file(job, self.outputs_dir) if job.state == st.DONE else None
        if path is None:
            return web.json_response({"error": {"message": f"video {job.id} is {videos.STATUS[job.state]}, "
                                                 "not completed", "type": "invalid_request_error"}}, status=409)
        return web.FileResponse(path, headers={"Content-Disposition": f'attachment; filename="{job.id}{path.suffix}"'})

    # ------------------------------------------------------------------------------------------ misc

    async def metrics_route(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(self.metrics.render)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def status_route(self, request: web.Request) -> web.Response:
        counts = await asyncio.to_thread(self.store.counts)
        return web.json_response({"jobs": counts, "servers": [s.to_dict() for s in self.pool.servers.values()],
                                  "owner": self.dispatcher.owner, "database": _redacted(self.settings.database)})

    async def catch_all(self, request: web.Request) -> web.StreamResponse:
        """The page's other requests go to a server: reads, and writes of the user's settings and saved workflows
        only (anything else, /free say, would act on a server under the queue's feet)."""
        if request.method not in ("GET", "HEAD") and not request.path.startswith(WRITABLE):
            return web.json_response({"error": {"type": "h3kit_front", "message": f"{request.method} "
                                                f"{request.path} is not passed to the servers by the front"}},
                                     status=405)
        return await self.proxy(request)


async def _video_request(request: web.Request) -> tuple[dict, bytes | None, str]:
    if request.content_type.startswith("multipart/"):
        form = await request.post()
        req = {k: v for k, v in form.items() if isinstance(v, str)}
        ref = form.get("input_reference")
        if ref is not None and hasattr(ref, "file"):
            ext = (Path(ref.filename or "x.png").suffix.lstrip(".") or "png").lower()[:5]
            return req, ref.file.read(), ext
        return req, None, "png"
    try:
        req = await request.json()
    except ValueError:
        raise videos.BadRequest("the body is neither JSON nor a multipart form") from None
    if not isinstance(req, dict):
        raise videos.BadRequest("the body must be a JSON object")
    if req.get("input_reference"):
        image, ext = videos.decode_data_url(req["input_reference"])
        return req, image, ext
    return req, None, "png"


def _redacted(url: str) -> str:
    import re

    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def foreign_origin(request: web.Request) -> str | None:
    """A browser's request from another site (its Origin is not the front's own address), as ComfyUI refuses
    them: without it a web page open in a team member's browser could queue work on the front at 127.0.0.1."""
    from urllib.parse import urlsplit

    origin = request.headers.get("Origin")
    if not origin:
        return None
    return None if urlsplit(origin).netloc.lower() == (request.host or "").lower() else origin


@web.middleware
async def auth_middleware(request: web.Request, handler):
    tokens = request.app["tokens"]
    if request.path in OPEN_PATHS:
        return web.json_response({"ok": True})
    origin = foreign_origin(request)
    if origin is not None:
        return web.json_response({"error": {"type": "forbidden", "message": f"a request from {origin[:200]} is "
                                            f"not from this front's own page ({request.host})"}}, status=403)
    user = auth.user_of(request.headers, request.cookies, request.query, tokens)
    if user is None:
        return web.json_response({"error": {"type": "unauthorized", "message": "a valid bearer token is needed "
                                            "(Authorization: Bearer TOKEN; in a browser open /?token=TOKEN once)"}},
                                 status=401, headers={"WWW-Authenticate": 'Bearer realm="h3kit front"'})
    request["user"] = user
    if tokens and "token" in request.query and request.method == "GET" and request.path == "/":
        resp = web.HTTPFound("/")
        resp.set_cookie(auth.COOKIE, request.query["token"], httponly=True, samesite="Strict",
                        secure=request.headers.get("X-Forwarded-Proto") == "https")
        raise resp
    return await handler(request)


def build_app(front: Front) -> web.Application:
    app = web.Application(middlewares=[auth_middleware], client_max_size=64 << 20)
    app["tokens"] = front.settings.tokens
    api = ComfyApi(front)
    app.add_routes(api.routes() + JobsApi(front).routes() + front.v1_routes())
    app.add_routes([web.get("/metrics", front.metrics_route), web.get("/front/status", front.status_route)])
    app.router.add_route("*", "/{tail:.*}", front.catch_all)
    app.on_startup.append(lambda _app: _start(front))
    app.on_cleanup.append(lambda _app: _stop(front))
    return app


async def _start(front: Front) -> None:
    front.session = ClientSession(timeout=ClientTimeout(total=30), auto_decompress=True)
    front.relay.on_end = lambda: _poke_soon(front)
    front.dispatcher_task = asyncio.ensure_future(_loop(front))


def _poke_soon(front: Front) -> None:
    """A server reported a prompt's end: its history entry is filed just after, so look now and shortly after."""
    loop = asyncio.get_running_loop()
    for delay in (0.0, 0.05, 0.2):
        loop.call_later(delay, front.dispatcher.poke)


async def _loop(front: Front) -> None:
    async def relay_servers():
        while True:
            front.relay.follow_servers(front.session, [s.url for s in front.pool.servers.values() if s.healthy])
            counts = await asyncio.to_thread(front.store.counts)
            await front.relay.broadcast_status(counts[st.QUEUED] + counts[st.RUNNING])
            await asyncio.sleep(front.settings.timing.tick)

    await asyncio.gather(front.dispatcher.run(front.session), relay_servers())


async def _stop(front: Front) -> None:
    front.dispatcher.stop()
    front.dispatcher_task.cancel()
    front.relay.close()
    await front.session.close()
    front.store.close()


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise FrontError(f"port {port} on {host} is in use", code="port_in_use",
                             hint="choose another --port (h3kit never takes a port by force)") from None
        raise FrontError(f"cannot listen on {host}:{port}: {e.strerror}", hint="check --host") from None
    sock.listen(128)
    return sock


def run(settings: Settings) -> None:
    auth.check_bind(settings.host, settings.tokens)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    front = Front(settings)
    sock = bind(settings.host, settings.port)
    url = f"http://{settings.host}:{sock.getsockname()[1]}"
    print(f"h3kit front: listening on {url} (database {_redacted(settings.database)}, "
          f"data {front.data_dir}, {'tokens' if settings.tokens else 'no tokens: loopback only'})",
          file=sys.stderr, flush=True)
    web.run_app(build_app(front), sock=sock, print=None, handle_signals=True, access_log=None,
                shutdown_timeout=5.0)
