"""Processes and HTTP for the front's tests and its benchmark (test support, not shipped): stand-in servers
(tests/support/front_standin.py), `h3kit front` processes, and a small JSON client with a bearer token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TOOLKIT = SUPPORT.parents[1] / "toolkit"


def http(method: str, url: str, body=None, token: str | None = None, timeout: float = 30, raw: bool = False,
         data: bytes | None = None, content_type: str = "application/json"):
    """(status, parsed JSON or bytes). Never raises for an HTTP status."""
    if body is not None:
        data = json.dumps(body).encode()
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    if raw:
        return status, payload
    try:
        return status, json.loads(payload) if payload else None
    except ValueError:
        return status, payload


def wait_for(what: str, check, timeout: float = 120, every: float = 0.1):
    """Poll `check()` until it returns something truthy; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


class Proc:
    """A child in its own session, stopped (its group) on stop(); kill9() is the test's SIGKILL."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None, cwd: str | None = None):
        self.argv, self.log_path = argv, Path(log)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.log.close()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_up(self, what: str, url: str, timeout: float) -> None:
        """Until GET `url` answers 200; an exit meanwhile fails at once with the end of the log."""
        def up() -> bool:
            if not self.alive():
                raise AssertionError(f"{what} exited:\n{self.text()[-3000:]}")
            try:
                return http("GET", url, timeout=2)[0] == 200
            except OSError:
                return False
        wait_for(what, up, timeout=timeout)


class Standin(Proc):
    def __init__(self, home: Path, port: int, devices: int = 1, run_seconds: float = 0.5):
        self.home, self.port, self.url = Path(home), port, f"http://127.0.0.1:{port}"
        self.home.mkdir(parents=True, exist_ok=True)
        super().__init__([sys.executable, str(SUPPORT / "front_standin.py"), "--port", str(port), "--devices",
                          str(devices), "--home", str(home), "--run-seconds", str(run_seconds)],
                         self.home / "standin.log")
        self.wait_up(f"stand-in on {port}", self.url + "/system_stats", timeout=60)

    def runs(self) -> list[dict]:
        path = self.home / "runs.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class Front(Proc):
    def __init__(self, data_dir: Path, port: int, servers: list[str], *, token: str | None = None,
                 extra: list[str] = (), db: str | None = None, log_name: str = "front.log"):
        self.data_dir, self.port, self.token = Path(data_dir), port, token
        self.url = f"http://127.0.0.1:{port}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "h3kit", "front", "--port", str(port), "--data-dir", str(data_dir),
                *[a for s in servers for a in ("--server", s)], *extra]
        if db:
            argv += ["--db", db]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOOLKIT), os.environ.get("PYTHONPATH", "")]))
        super().__init__(argv, self.data_dir / log_name, env=env)
        self.wait_up(f"front on {port}", self.url + "/healthz", timeout=90)

    def call(self, method: str, path: str, body=None, **kw):
        kw.setdefault("token", self.token)
        return http(method, self.url + path, body, **kw)

    def submit(self, prompt: dict, client_id: str | None = None, token: str | None = None) -> str:
        status, answer = self.call("POST", "/prompt", {"prompt": prompt, "client_id": client_id or uuid.uuid4().hex},
                                   **({"token": token} if token else {}))
        assert status == 200, (status, answer)
        return answer["prompt_id"]

    def history(self, job_id: str, token: str | None = None) -> dict | None:
        status, hist = self.call("GET", f"/history/{job_id}", **({"token": token} if token else {}))
        assert status == 200, (status, hist)
        return hist.get(job_id)

    def wait_done(self, job_ids, timeout: float = 120, token: str | None = None) -> dict:
        out = {}

        def all_done():
            for j in job_ids:
                if j not in out:
                    entry = self.history(j, token)
                    if entry:
                        out[j] = entry
            return len(out) == len(job_ids)
        wait_for(f"jobs {list(job_ids)} done", all_done, timeout=timeout, every=0.2)
        return out

    def metrics(self) -> str:
        status, body = self.call("GET", "/metrics", raw=True)
        assert status == 200, status
        return body.decode()


def starts(*servers) -> dict:
    """{tag: [port, ...]} of every prompt start on these stand-in servers."""
    out: dict = {}
    for s in servers:
        for r in s.runs():
            if r["event"] == "start":
                out.setdefault(r["prompt"]["1"]["inputs"]["tag"], []).append(r["port"])
    return out


def sleep_prompt(seconds: float, tag: str = "", npu_count=None) -> dict:
    """A prompt the stand-in runs for `seconds`; with npu_count, a MultiNPUParallelConfig node asking for it."""
    prompt = {"1": {"class_type": "StandinSleep", "inputs": {"seconds": seconds, "tag": tag}}}
    if npu_count is not None:
        prompt["2"] = {"class_type": "MultiNPUParallelConfig", "inputs": {"npu_count": npu_count}}
    return prompt


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return None
