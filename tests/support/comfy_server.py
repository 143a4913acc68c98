"""Boot a ComfyUI tree for a test, isolated from every other test (test support, not shipped).

Models, outputs, inputs, user files and the database live in the test's own folder; only code comes from
the tree. The server is always stopped (its process group) when the context exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent

from tests.support.service_helpers import free_port  # noqa: E402  (one port finder for all tests)


def http(method: str, url: str, body=None, timeout=10):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if raw else None


class Server:
    def __init__(self, tree: Path, workdir: Path, python: str, port: int, count_loads=False, env=None,
                 extra_args=()):
        self.tree, self.workdir, self.python, self.port = Path(tree), Path(workdir), python, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = self.workdir / "server.log"
        dirs = {d: self.workdir / d for d in ("models", "output", "input", "user", "temp")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        self.models = dirs["models"]
        self.output = dirs["output"]
        entry = [str(SUPPORT / "count_loads.py"), "main.py"] if count_loads else ["main.py"]
        self.cmd = [python, "-B", *entry, "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                    "--models-directory", str(dirs["models"]), "--output-directory", str(dirs["output"]),
                    "--input-directory", str(dirs["input"]), "--user-directory", str(dirs["user"]),
                    "--temp-directory", str(dirs["temp"]), "--database-url", "sqlite:///:memory:",
                    *extra_args]
        self.env = dict(os.environ, **(env or {}))
        self.proc = None

    def start(self, timeout=120):
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=self.tree, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.log_text()[-3000:]}")
            try:
                stats = http("GET", self.url + "/system_stats", timeout=2)
            except OSError:
                time.sleep(0.3)
                continue
            # the answer must come from this server: another run's server may hold the port (ours then exits
            # on its failed bind, which the poll above reports)
            if str(self.output) in (stats.get("system") or {}).get("argv", []):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"server not healthy in {timeout} s:\n{self.log_text()[-3000:]}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        if self.proc:
            self.log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, text: str, since: int = 0, timeout: float = 120) -> str:
        """Wait until `text` appears in the server's log after character `since`; the log from there. Fails with
        what the log says when it does not come (or the server exits), never goes on without it."""
        deadline = time.monotonic() + timeout
        while True:
            log = self.log_text()[since:]
            if text in log:
                return log
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}) before logging {text!r}:\n"
                                     f"{log[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} in the server log within {timeout} s; it says:\n{log[-3000:]}")
            time.sleep(0.1)

    def run_prompt(self, prompt: dict, timeout=120) -> dict:
        pid = http("POST", self.url + "/prompt", {"prompt": prompt})["prompt_id"]
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = http("GET", f"{self.url}/history/{pid}")
            if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
                entry = hist[pid]
                if entry["status"].get("status_str") != "success":
                    raise RuntimeError(f"prompt failed: {json.dumps(entry['status'])[:2000]}")
                return entry
            time.sleep(0.1)
        raise RuntimeError(f"prompt {pid} did not finish in {timeout} s:\n{self.log_text()[-2000:]}")


@contextlib.contextmanager
def running(tree, workdir, python, port_range=(8300, 8399), **kw):
    srv = Server(tree, workdir, python, free_port(port_range[0], port_range[1] - 1), **kw)
    try:
        yield srv.start()
    finally:
        srv.stop()


def write_tiny_dits(python: str, tree: Path, paths: list[Path], seed: int = 1) -> None:
    """Tiny random H3 DiT checkpoints, seeds seed, seed+1, ... (one interpreter start for all)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(SUPPORT.parents[1] / "toolkit")]))
    subprocess.run([python, "-m", "h3kit.tiny_models", "dit", *map(str, paths), "--seed", str(seed)], cwd=tree,
                   env=env, check=True, capture_output=True, timeout=300)


if __name__ == "__main__":
    sys.exit("test support module: import it")
