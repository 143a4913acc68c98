"""The ComfyUI page through the front, in a real headless browser (Debian's chromium, driven over the DevTools
protocol with websocket-client), on the real patched server with the tiny H3 checkpoints (npu_count 1): the page
loads through the front's proxy, the demo workflow is queued from the page (POST /prompt to the front, which
dispatches it), the /ws events come back mapped to the job's id, and the page shows the video the front
published (a <video> playing /view?...subfolder=h3front/<job>/...). A screenshot is left in the test's folder."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.support import requires
from tests.support.service_helpers import free_port

for _m in ("aiohttp", "sqlalchemy", "prometheus_client"):
    requires.module(_m, "the front extra (pip install 'h3kit[front]'; toolkit/requirements/test.txt lists it)",
                    allow_module_level=True)

from tests.support import av_pipeline, comfy_server  # noqa: E402
from tests.support.front_helpers import Front, http, wait_for  # noqa: E402

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
BAND = (8700, 8799)
DEMO = "workflows/api/demo_t2va_tiny.json"


class DevTools:
    """The smallest DevTools-protocol client: one page target, commands answered in order."""

    def __init__(self, port: int):
        import websocket

        targets = wait_for("chromium's DevTools", lambda: _pages(port), timeout=60)
        self.ws = websocket.create_connection(targets[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression[:200]}: {json.dumps(res['exceptionDetails'])[:2000]}")
        return res.get("result", {}).get("value")


def _pages(port: int):
    try:
        status, targets = http("GET", f"http://127.0.0.1:{port}/json/list", timeout=2)
    except OSError:
        return None
    return [t for t in targets or [] if t.get("type") == "page"] if status == 200 else None


VIDEOS_JS = ("JSON.stringify([...document.querySelectorAll('video')].map(v => ({src: v.currentSrc || v.src, "
             "ready: v.readyState, w: v.videoWidth})))")


def test_the_comfyui_page_through_the_front_queues_the_demo_and_shows_its_video(installed_tree, comfy_python,
                                                                               tiny_av_models, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        requires.skip("no chromium: apt-get install chromium (Debian's package; .ci/run installs it)")
    workdir = tmp_path / "server"
    server = comfy_server.Server(installed_tree, workdir, comfy_python, free_port(*BAND))
    av_pipeline.install_models(server.models, tiny_av_models)
    procs, browser = [], None
    try:
        server.start(timeout=300)
        front = Front(tmp_path / "front", free_port(*BAND), [server.url])
        procs.append(front)
        browser = _chromium(chromium, free_port(*BAND), tmp_path)
        page = DevTools(browser.port)
        _open_page(page, front.url)
        prompt = json.loads((comfy_server.SUPPORT.parents[1] / DEMO).read_text())
        page.js("window.__h3front = []; for (const k of ['executed', 'execution_success']) "
                "window.app.api.addEventListener(k, e => window.__h3front.push([k, e.detail])); 1")
        queued = page.js("(async () => { await window.app.loadApiJson(" + json.dumps(prompt) + ", 'demo.json'); "
                         "return String(await window.app.queuePrompt(0, 1)); })()")
        assert queued == "true", queued
        entry = wait_for("the demo job done on the front", lambda: _done(front), timeout=600, every=1)
        assert entry["h3front"]["state"] == "done", entry
        job_id = entry["prompt"][1]
        events = wait_for("the page's execution_success", lambda: _events(page, "execution_success"), timeout=60)
        assert [e["prompt_id"] for e in events] == [job_id]          # /ws relayed, the prompt id mapped back
        executed = _events(page, "executed")
        assert any(e["node"] == "15" and e["output"]["images"][0]["subfolder"].startswith(f"h3front/{job_id}/")
                   for e in executed), executed
        page.call("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape", windowsVirtualKeyCode=27)
        page.js("(() => { const n = window.app.graph.getNodeById(15); window.app.canvas.centerOnNode(n); "
                "window.app.canvas.setDirty(true, true); return 1; })()")   # SaveVideo: its preview is drawn in view
        videos = wait_for("the page showing the published video", lambda: _shown(page), timeout=120, every=0.5)
        shot = page.call("Page.captureScreenshot", format="png")["data"]
        (tmp_path / "front-page.png").write_bytes(__import__("base64").b64decode(shot))
        assert any(f"h3front%2F{job_id}%2F" in v["src"] and "/api/view?" in v["src"] and
                   v["src"].startswith(front.url) and v["w"] > 0 for v in videos), videos
    finally:
        if browser is not None:
            browser.stop()
        for p in procs:
            p.stop()
        server.stop()


def _chromium(chromium: str, port: int, tmp_path):
    from tests.support.front_helpers import Proc

    p = Proc([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--mute-audio", "--autoplay-policy=no-user-gesture-required", f"--remote-debugging-port={port}",
              "--remote-allow-origins=*", f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1600,1000",
              "about:blank"], tmp_path / "chromium.log")
    p.port = port
    return p


def _open_page(page: DevTools, url: str) -> None:
    page.call("Page.enable")
    page.call("Page.navigate", url=url)
    wait_for("the ComfyUI app loaded through the front",
             lambda: page.js("!!(window.app && window.app.graph && window.app.api && "
                             "document.querySelector('canvas'))"), timeout=180, every=0.5)


def _done(front: Front):
    status, hist = front.call("GET", "/history")
    return next(iter(hist.values()), None) if status == 200 and hist else None


def _shown(page: DevTools):
    """The page's <video> elements that play an output the front published and have loaded it (its size known)."""
    videos = json.loads(page.js(VIDEOS_JS) or "[]")
    return [v for v in videos if "h3front" in v["src"] and v["ready"] >= 1] or None


def _events(page: DevTools, kind: str) -> list:
    return [d for k, d in json.loads(page.js("JSON.stringify(window.__h3front)") or "[]") if k == kind]
