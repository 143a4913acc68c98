"""Helpers for the service tests: run the CLI, pick a port, read the record, clean up what a test started."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


# The one port allocator of the suite. A port is reserved before it is handed out: by an exclusive lock
# (flock) on PORT_LOCKS/<port>, which every test process of this user takes the same way (make test's xdist
# workers, its torch-free runs on other Pythons, another checkout's run on the same machine), and checked free by
# binding it. A reservation made while a test runs (its body or a function-scoped fixture) ends after the test's
# teardown; one made by a module- or session-scoped fixture is held until the process ends, so a server restarted
# by a later test of its module never finds its port taken by another run. A lock dies with its process. Every
# band lies below the kernel's ephemeral range (ip_local_port_range), where the ports of outgoing connections
# come from. (The old per-run and per-worker offsets are gone: PORT_OFFSET is 0, kept for the callers that
# subtract it.)
PORT_OFFSET = 0
PORT_LOCKS = Path(os.environ.get("H3KIT_TEST_PORT_LOCKS") or
                  os.path.join(tempfile.gettempdir(), f"h3kit-test-ports-{os.getuid()}"))
FIXTURE_SCOPES: list[str] = []      # the scopes of the fixtures being set up (tests/conftest.py keeps it)
_held: dict[int, tuple[int, bool]] = {}   # port -> (its lock's descriptor, held until the process ends)


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _lock(port: int) -> int | None:
    PORT_LOCKS.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per open file: a second reservation here fails too
        return fd
    except OSError:
        os.close(fd)
        return None


def free_port(lo: int, hi: int, exclude=(), span: int = 1) -> int:
    """A port p in [lo, hi] such that p .. p + span - 1 are each reserved for this test (see above) and free to
    bind, other than `exclude`; RuntimeError when the band has none. The band must lie below the ephemeral range."""
    first_ephemeral = ephemeral_range()[0]
    if hi + span - 1 >= first_ephemeral:
        raise ValueError(f"port band {lo}-{hi} reaches the kernel's ephemeral range (from {first_ephemeral}): "
                         "outgoing connections take ports there; choose a band below it")
    long = any(scope != "function" for scope in FIXTURE_SCOPES)
    for port in range(lo, hi + 1):
        wanted = range(port, port + span)
        if any(p in exclude for p in wanted):
            continue
        got = []
        for p in wanted:
            fd = _lock(p)
            if fd is None:
                break
            got.append((p, fd))
            if not _bindable(p):
                break
        else:
            for p, fd in got:
                _held[p] = (fd, long)
            return port
        for p, fd in got:
            os.close(fd)
    raise RuntimeError(f"no {span} free port(s) in a row in {lo}-{hi} (reserved by other tests, or in use)")


def release_test_ports() -> None:
    """End the reservations made for the test that just ended (tests/conftest.py, after its teardown)."""
    for port, (fd, long) in list(_held.items()):
        if not long:
            del _held[port]
            os.close(fd)


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


def prompt_after(url: str, timeout: float = 120) -> dict:
    """Queue a prompt of two core nodes (PrimitiveInt -> PreviewAny) on the ComfyUI at `url` and wait for its
    history entry; the entry. The event a test waits on after POST /free: ComfyUI's prompt worker acts on the
    free's flags after the prompt it is running (or at once when idle), in the same loop that then takes the
    next prompt, so once this prompt is done the free has taken effect for every prompt queued after it."""
    import uuid
    prompt = {"1": {"class_type": "PrimitiveInt", "inputs": {"value": uuid.uuid4().int % 10**9}},
              "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
    pid = http_json(f"{url}/prompt", {"prompt": prompt})["prompt_id"]
    seen = None

    def done():
        nonlocal seen
        seen = (http_json(f"{url}/history/{pid}") or {}).get(pid)
        return seen if seen and (seen.get("status") or {}).get("completed") is not None else None
    try:
        entry = wait_for(done, timeout, f"prompt {pid} (queued after the free) to finish")
    except AssertionError as e:
        raise AssertionError(f"{e}; its history entry: {json.dumps(seen)[:2000]}") from None
    assert entry["status"].get("status_str") == "success", json.dumps(entry["status"])[:2000]
    return entry


def submit_until_sampling(port: int, prompt: dict, timeout: float = 120, step: int = 1) -> str:
    """Queue `prompt` on the ComfyUI at 127.0.0.1:`port` and return its id once the server reported (on /ws, the
    sampler's `progress` message) that `step` sampling steps are done: the stage a kill or an interrupt test means
    to hit, whatever the host's speed (a fixed sleep after the prompt appeared in the queue hit the loading on a
    loaded host and the end on a fast one). Fails with the messages it saw when the prompt ends or the time
    passes first."""
    import uuid
    from h3kit import comfyws
    client = uuid.uuid4().hex
    ws = comfyws.WebSocket("127.0.0.1", port, client, timeout=30)
    seen = []
    try:
        pid = http_json(f"http://127.0.0.1:{port}/prompt", {"prompt": prompt, "client_id": client})["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = ws.recv_json(max(0.1, deadline - time.monotonic()))
            if m is None:
                break
            data = m.get("data") if isinstance(m.get("data"), dict) else {}
            if data.get("prompt_id") not in (None, pid):
                continue
            seen.append(m.get("type"))
            if m.get("type") == "progress" and isinstance(data.get("value"), int) and data["value"] >= step:
                return pid
            if m.get("type") in ("execution_success", "execution_error", "execution_interrupted"):
                raise AssertionError(f"prompt {pid} ended ({m['type']}) before sampling step {step}: {seen[-40:]}")
        raise AssertionError(f"prompt {pid}: no sampling step {step} within {timeout} s; messages seen: {seen[-40:]}")
    finally:
        ws.close()


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


def copy_tree(src: Path, dest: Path) -> Path:
    """A ComfyUI tree of a test's own: `src` copied to `dest` without its git folder, links kept as links."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    return dest


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

    def history_reads(self) -> int:
        """How often GET /history was answered (watch reads it every tick)."""
        path = self.path / "standin-history-reads"
        return len(path.read_text()) if path.exists() else 0

    def report_oom(self, log: bool = True, history: bool = False) -> None:
        http_json(f"{self.url}/standin/oom", {"log": log, "history": history})
