"""A stand-in for a ComfyUI server that runs prompts, for the front's tests (test support; NOT ComfyUI).

    python front_standin.py --port P --devices N --home DIR [--run-seconds S]

It speaks the part of ComfyUI's HTTP API the front uses, with ComfyUI's shapes: GET /system_stats (N devices),
GET /queue, POST /prompt (honours the body's prompt_id; a node of class StandinRefuse is refused with 400 and
node_errors), GET /history[/id], GET /view, POST /interrupt, POST /queue {delete}, POST /upload/image,
GET /object_info, GET / (a page), and /ws with ComfyUI's events (execution_start, executing, progress,
executed, execution_success) sent to the prompt's client id. One prompt runs at a time, for --run-seconds, or
for the `seconds` input of a node of class StandinSleep; it "writes" output/video/<prompt_id>.mp4 whose bytes
name the prompt id and the server's port, and reports it as SaveVideo does.

Everything it does is appended to DIR/runs.jsonl ({"event": "start"|"end"|"interrupted", "prompt_id", "port",
"prompt", "t"}), so a test can tell which server ran what, when, and how many times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path

from aiohttp import web


class Standin:
    def __init__(self, args):
        self.port, self.devices, self.run_seconds = args.port, args.devices, args.run_seconds
        self.home = Path(args.home)
        for d in ("output/video", "input"):
            (self.home / d).mkdir(parents=True, exist_ok=True)
        self.pending: list = []          # [number, prompt_id, prompt, extra_data, []]
        self.running: list = []
        self.history: dict = {}
        self.clients: dict = {}
        self.wake = asyncio.Event()
        self.interrupt_id = None
        self.number = 0

    def log(self, event: str, pid: str, prompt=None) -> None:
        with open(self.home / "runs.jsonl", "a") as f:
            f.write(json.dumps({"event": event, "prompt_id": pid, "port": self.port, "prompt": prompt,
                                "t": time.time()}) + "\n")

    async def send(self, client_id, kind, data) -> None:
        for ws in list(self.clients.get(client_id, ())):
            try:
                await ws.send_str(json.dumps({"type": kind, "data": data}))
            except Exception:
                pass

    async def worker(self) -> None:
        while True:
            while not self.pending:
                self.wake.clear()
                await self.wake.wait()
            item = self.pending.pop(0)
            self.running = [item]
            await self.run(item)
            self.running = []

    def seconds_of(self, prompt: dict) -> float:
        for node in prompt.values():
            if node.get("class_type") == "StandinSleep":
                return float(node["inputs"].get("seconds", self.run_seconds))
        return self.run_seconds

    async def run(self, item) -> None:
        _n, pid, prompt, extra, _ = item
        client = extra.get("client_id")
        self.log("start", pid, prompt)
        await self.send(client, "execution_start", {"prompt_id": pid, "timestamp": int(time.time() * 1000)})
        await self.send(client, "executing", {"node": "1", "display_node": "1", "prompt_id": pid})
        steps, total = 5, self.seconds_of(prompt)
        for i in range(steps):
            if self.interrupt_id in (pid, "*"):
                self.interrupt_id = None
                self.log("interrupted", pid)
                return self.finish(pid, item, "error", {}, [["execution_interrupted", {"prompt_id": pid}]])
            await asyncio.sleep(total / steps)
            await self.send(client, "progress", {"value": i + 1, "max": steps, "prompt_id": pid, "node": "1"})
        name = f"{pid}.mp4"
        (self.home / "output/video" / name).write_bytes(f"standin video {pid} from {self.port}\n".encode())
        out = {"images": [{"filename": name, "subfolder": "video", "type": "output"}], "animated": [True]}
        await self.send(client, "executed", {"node": "9", "display_node": "9", "output": out, "prompt_id": pid})
        await self.send(client, "execution_success", {"prompt_id": pid, "timestamp": int(time.time() * 1000)})
        self.finish(pid, item, "success", {"9": out}, [["execution_success", {"prompt_id": pid}]])
        self.log("end", pid)
        await self.send(client, "executing", {"node": None, "prompt_id": pid})

    def finish(self, pid, item, status, outputs, messages) -> None:
        self.history[pid] = {"prompt": item, "outputs": outputs, "meta": {},
                             "status": {"status_str": status, "completed": status == "success",
                                        "messages": messages}}

    # ------------------------------------------------------------------------------------------ routes

    async def post_prompt(self, request):
        body = await request.json()
        prompt = body.get("prompt") or {}
        if any(n.get("class_type") == "StandinRefuse" for n in prompt.values()):
            return web.json_response({"error": {"type": "prompt_outputs_failed_validation",
                                                "message": "Prompt outputs failed validation", "details": ""},
                                      "node_errors": {"1": {"errors": [{"message": "refused by the stand-in"}],
                                                            "class_type": "StandinRefuse"}}}, status=400)
        pid = body.get("prompt_id") or str(uuid.uuid4())
        self.number += 1
        extra = dict(body.get("extra_data") or {}, client_id=body.get("client_id"))
        self.pending.append([self.number, pid, prompt, extra, []])
        self.log("queued", pid, prompt)
        self.wake.set()
        return web.json_response({"prompt_id": pid, "number": self.number, "node_errors": {}})

    async def get_queue(self, request):
        return web.json_response({"queue_running": self.running, "queue_pending": self.pending})

    async def post_queue(self, request):
        body = await request.json()
        drop = set(body.get("delete") or [])
        self.pending = [p for p in self.pending if p[1] not in drop]
        for pid in drop:
            self.log("deleted", pid)
        return web.Response()

    async def interrupt(self, request):
        body = await request.json() if request.can_read_body else {}
        self.interrupt_id = body.get("prompt_id") or "*"
        return web.Response()

    async def get_history(self, request):
        pid = request.match_info.get("id")
        if pid:
            return web.json_response({pid: self.history[pid]} if pid in self.history else {})
        return web.json_response(self.history)

    async def view(self, request):
        q = request.query
        base = self.home / ("input" if q.get("type") == "input" else "output")
        path = base / q.get("subfolder", "") / q.get("filename", "")
        if not path.is_file():
            return web.Response(status=404)
        return web.FileResponse(path)

    async def upload(self, request):
        form = await request.post()
        image = form["image"]
        dest = self.home / "input" / str(form.get("subfolder") or "") / Path(image.filename).name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(image.file.read())
        return web.json_response({"name": dest.name, "subfolder": form.get("subfolder") or "", "type": "input"})

    async def system_stats(self, request):
        devices = [{"name": f"npu:{i} stand-in", "type": "npu", "index": i} for i in range(self.devices)]
        return web.json_response({"system": {"comfyui_version": "front-stand-in", "argv": [str(self.port)]},
                                  "devices": devices})

    async def object_info(self, request):
        return web.json_response({"StandinSleep": {"input": {"required": {"seconds": ["FLOAT", {}]}},
                                                   "output": [], "name": "StandinSleep"}})

    async def page(self, request):
        return web.Response(text=f"<html><body>front stand-in {self.port}</body></html>", content_type="text/html")

    async def ws(self, request):
        client = request.query.get("clientId") or uuid.uuid4().hex
        sock = web.WebSocketResponse()
        await sock.prepare(request)
        self.clients.setdefault(client, set()).add(sock)
        await sock.send_str(json.dumps({"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}},
                                                                   "sid": client}}))
        try:
            async for _ in sock:
                pass
        finally:
            self.clients[client].discard(sock)
        return sock


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--home", required=True)
    ap.add_argument("--run-seconds", type=float, default=0.5)
    args = ap.parse_args()
    s = Standin(args)
    app = web.Application()
    for prefix in ("", "/api"):
        app.add_routes([web.post(prefix + "/prompt", s.post_prompt), web.get(prefix + "/queue", s.get_queue),
                        web.post(prefix + "/queue", s.post_queue), web.post(prefix + "/interrupt", s.interrupt),
                        web.get(prefix + "/history", s.get_history), web.get(prefix + "/history/{id}", s.get_history),
                        web.get(prefix + "/view", s.view), web.post(prefix + "/upload/image", s.upload),
                        web.get(prefix + "/system_stats", s.system_stats),
                        web.get(prefix + "/object_info", s.object_info), web.get(prefix + "/ws", s.ws)])
    app.router.add_get("/", s.page)

    async def start_worker(_app):
        _app["worker"] = asyncio.ensure_future(s.worker())
    app.on_startup.append(start_worker)
    print(f"front stand-in on {args.port}, pid {os.getpid()}", flush=True)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None,
                shutdown_timeout=0.5)


if __name__ == "__main__":
    main()
