"""Helpers for the service tests: run the CLI, pick a port, read the record, clean up what a test started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from tests.support import jsondoc

SUPPORT = Path(__file__).resolve().parent
STANDIN = SUPPORT / "standin_server.py"
STANDIN_CLI_ARGS = SUPPORT / "standin_cli_args.py"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# make test runs the torch-free tests on other Pythons beside the main run, and the main run on pytest-xdist
# workers: each run (H3KIT_TEST_PORT_OFFSET, a multiple of 3000) and each worker of a run (gwN: N x 400) shifts
# every test's port band by its own offset, so tests in parallel never pick the same free port. The bands in
# use span 8320-8660 and 29500-29599: 400 apart they never overlap, up to 7 workers per run.
XDIST_PORT_STRIDE = 400


def _port_offset() -> int:
    offset = int(os.environ.get("H3KIT_TEST_PORT_OFFSET", "0"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        offset += XDIST_PORT_STRIDE * int(worker[2:])
    return offset


PORT_OFFSET = _port_offset()


def free_port(lo: int, hi: int, exclude=()) -> int:
    """The first port in [lo, hi] (shifted by PORT_OFFSET) nothing listens on, other than `exclude`
    (ports 8400-8499 belong to the service tests)."""
    for port in range(lo + PORT_OFFSET, hi + PORT_OFFSET + 1):
        if port in exclude:
            continue
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {lo + PORT_OFFSET}-{hi + PORT_OFFSET}")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def h3kit(*args, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def http_json(url: str, body=None, timeout: float = 5.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with _NO_PROXY.open(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def http_status(url: str, timeout: float = 3.0) -> int | None:
    try:
        with _NO_PROXY.open(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def wait_for(predicate, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def pid_running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_started_under(home: Path) -> None:
    """SIGKILL every process whose working directory is `home`: only servers this test started run there."""
    home = home.resolve()
    for p in psutil.process_iter(["pid", "cwd"]):
        try:
            if p.info["cwd"] and Path(p.info["cwd"]).resolve() == home and p.pid != os.getpid():
                p.send_signal(signal.SIGKILL)
                p.wait(5)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.TimeoutExpired):
            pass


class Home:
    """A ComfyUI home for one test, with its own runtime root and port."""

    def __init__(self, path: Path, port: int, runtime_root: Path | None = None):
        self.path = path
        self.port = port
        self.root = runtime_root or path / ".h3kit" / "run"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self, command: str, *args, timeout: float = 120, env: dict | None = None):
        return h3kit(command, "--comfy-home", self.path, "--runtime-root", self.root, *args,
                     timeout=timeout, env=env)

    def start(self, *args, devices: str = "0", device_type: str = "cpu", timeout: float = 60, extra=()):
        cmd = ["--devices", devices, "--device-type", device_type, "--port", self.port,
               "--timeout", timeout, *args]
        if extra:
            cmd += ["--", *extra]
        return self.run("start", *cmd, timeout=timeout + 60)

    def record(self) -> dict | None:
        path = self.root / "server.json"
        return json.loads(path.read_text()) if path.exists() else None

    def status(self) -> dict:
        r = self.run("status", "--json")
        assert r.returncode in (0, 1), r.stderr
        return jsondoc.data(r.stdout, r.returncode)


class StandinHome(Home):
    """A fake ComfyUI home whose main.py is the test stand-in server (tests/support/standin_server.py)."""

    def __init__(self, path: Path, port: int):
        (path / "comfy").mkdir(parents=True, exist_ok=True)
        shutil.copy(STANDIN, path / "main.py")
        shutil.copy(STANDIN_CLI_ARGS, path / "comfy" / "cli_args.py")
        super().__init__(path, port)

    def configure(self, **cfg) -> None:
        (self.path / "standin.json").write_text(json.dumps(cfg))

    def boots(self) -> list[dict]:
        path = self.path / "standin-boots.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []

    def frees(self) -> list[dict]:
        path = self.path / "standin-free.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []

    def report_oom(self, log: bool = True, history: bool = False) -> None:
        http_json(f"{self.url}/standin/oom", {"log": log, "history": history})
