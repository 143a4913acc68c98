"""The probe set: what an adversarial operator throws at h3kit, run as real commands, counted.

Hostile workflow files, device lists, service records, command-line arguments, and install/revert
SIGKILLed at random moments. Every probe runs `python -m h3kit` in a subprocess with a deadline and is
judged on four counts, which must all be zero: exit code 3 (an internal error), hangs (the deadline
passed), tracebacks on either stream, and leftovers (temporary files or folders, servers still running, a
foreign process signalled). The summary line is printed and is the assertion message.

Install and revert run on the fake upstream (tests/support/fakekit.py); service probes on the stand-in
(tests/support/standin_server.py). The random kills use a fixed seed (PROBE_SEED to vary it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from tests.support.fakekit import git, kit, refreshed, upstream  # noqa: F401
from tests.support.service_helpers import StandinHome, free_port, kill_started_under

DEADLINE = 30.0
TEMP_MARKERS = (".h3kit-tmp", ".h3kit-restore", "h3kit-clone-", "h3kit-scratch-", ".init")
SEED = int(os.environ.get("PROBE_SEED", "12"))


@dataclass
class Tally:
    runs: int = 0
    exit3: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.runs} probes: {len(self.exit3)} exit-3, {len(self.hangs)} hangs, "
                f"{len(self.tracebacks)} tracebacks, {len(self.leftovers)} leftovers, "
                f"{len(self.unexpected)} unexpected outcomes"
                + "".join(f"\n  {k}: {v[:5]}" for k, v in (("exit3", self.exit3), ("hangs", self.hangs),
                                                            ("tracebacks", self.tracebacks),
                                                            ("leftovers", self.leftovers),
                                                            ("unexpected", self.unexpected)) if v))

    def clean(self) -> bool:
        return not (self.exit3 or self.hangs or self.tracebacks or self.leftovers or self.unexpected)


class Prober:
    def __init__(self, tmp_path: Path, env: dict):
        self.tally = Tally()
        self.env = env
        self.tmp = tmp_path

    def run(self, name: str, *args, env: dict | None = None, expect: tuple[int, ...] | None = None,
            stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess | None:
        self.tally.runs += 1
        try:
            r = subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True,
                               timeout=DEADLINE, env=env or self.env, stdin=stdin)
        except subprocess.TimeoutExpired:
            self.tally.hangs.append(name)
            return None
        if r.returncode == 3 or "internal error" in r.stderr:
            self.tally.exit3.append(f"{name}: {r.stderr.strip()[-200:]}")
        if "Traceback" in r.stdout or "Traceback (most recent call last)" in r.stderr.replace(
                "| Traceback", ""):  # a server log quoted after '|' is the server's, not h3kit's
            self.tally.tracebacks.append(name)
        if expect is not None and r.returncode not in expect:
            self.tally.unexpected.append(f"{name}: exit {r.returncode}, expected {expect}: {r.stderr.strip()[-200:]}")
        return r

    def check_leftovers(self, *bases: Path, label: str = "") -> None:
        for base in bases:
            if not base.exists():
                continue
            for p in base.rglob("*"):
                if ".git" in p.relative_to(base).parts:
                    continue
                if any(m in p.name for m in TEMP_MARKERS) or p.parent.name == "journal":
                    self.tally.leftovers.append(f"{label}{p}")


@pytest.fixture
def prober(refreshed, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return Prober(tmp_path, dict(os.environ, TMPDIR=str(tmpdir), H3KIT_LOCK_WAIT="2"))


def test_probe_set(prober, tmp_path, upstream):
    t0 = time.monotonic()
    up, _ = upstream
    _workflow_files(prober, tmp_path)
    _device_lists(prober, tmp_path)
    _records_and_arguments(prober, tmp_path)
    _random_kills(prober, tmp_path, up)
    prober.check_leftovers(Path(prober.env["TMPDIR"]), label="tmp: ")
    seconds = time.monotonic() - t0
    summary = prober.tally.summary() + f" in {seconds:.0f} s"
    print("\n" + summary)
    assert prober.tally.clean(), summary  # the time is reported, not judged: each step bounds its own hang


# --------------------------------------------------------------------------------------------- workflow files


def _workflow_files(p: Prober, tmp: Path) -> None:
    d = tmp / "wf"
    d.mkdir()
    files = {
        "dev-zero": "/dev/zero", "dev-null": "/dev/null", "directory": d, "missing": d / "nope.json",
        "self-loop": d / "loop.json",
    }
    os.mkfifo(d / "fifo.json")
    files["fifo"] = d / "fifo.json"
    os.symlink(d / "loop.json", d / "loop.json")
    for name, data in {"garbage": os.urandom(4096), "empty": b"", "deep": b"[" * 200000, "big-int": b"1" * 5000,
                       "not-utf8": b"\xff\xfe{}", "nodes-str": b'{"nodes": "x"}', "prompt-5": b'{"prompt": 5}',
                       "bom": b"\xef\xbb\xbf{}", "nan": b'{"1": {"class_type": "X", "inputs": {"a": NaN}}}',
                       "links-junk": json.dumps({"nodes": [{"id": "x", "type": 5, "inputs": "no"}],
                                                 "links": [[1, 2, 3]]}).encode()}.items():
        (d / f"{name}.json").write_bytes(data)
        files[name] = d / f"{name}.json"
    sparse = d / "sparse.json"
    with open(sparse, "wb") as f:
        f.truncate(65 * 2 ** 20)  # over the cap, without writing 65 MB
    files["sparse-65mb"] = sparse
    for name, path in files.items():
        p.run(f"check-workflow {name}", "check-workflow", path, "--json", expect=(0, 1, 2))
    p.run("check-workflow all at once", "check-workflow", *files.values(), expect=(2,))
    p.run("bench /dev/zero", "bench", "/dev/zero", "--comfy-home", tmp / "nohome", expect=(2,))
    p.run("check-workflow runtime-root /dev/null", "check-workflow", files["empty"], "--comfy-home", tmp,
          "--runtime-root", "/dev/null", expect=(2,))


# --------------------------------------------------------------------------------------------- device lists


DEVICE_LISTS = ["", ",", "0,", "-1", "\u0663", "0 ,1", "0,1,2,3,4", "18446744073709551616", "0x1",
                "7" * 4400, "0," + "1" * 4301, ",".join(["0"] * 5000)]


def _device_lists(p: Prober, tmp: Path) -> None:
    wf = Path(__file__).resolve().parents[1] / "workflows" / "api" / "demo_t2va_tiny.json"
    home = tmp / "devhome"
    home.mkdir()
    (home / "main.py").write_text("raise SystemExit('not to be run')\n")
    for i, devices in enumerate(DEVICE_LISTS):
        r = p.run(f"check-workflow --devices #{i}", "check-workflow", wf, "--devices", devices, expect=(0, 1, 2))
        if r is not None and len(r.stderr) > 2000:
            p.tally.unexpected.append(f"device list #{i} echoed {len(r.stderr)} characters")
        p.run(f"ASCEND_RT_VISIBLE_DEVICES #{i}", "check-workflow", wf, expect=(0, 1, 2),
              env=dict(p.env, ASCEND_RT_VISIBLE_DEVICES=devices))
        p.run(f"start --devices #{i}", "start", "--comfy-home", home, "--devices", devices, "--device-type", "cpu",
              "--port", "1", expect=(2,))
    if (home / ".h3kit").exists():
        p.tally.leftovers.append("start with a bad device list created .h3kit/")


# --------------------------------------------------------------------------------------------- records and arguments


def _records_and_arguments(p: Prober, tmp: Path) -> None:
    home = StandinHome(tmp / "svc", free_port(8490, 8499))
    foreign = subprocess.Popen(["sleep", "300"])
    try:
        _records(p, home, psutil.Process(foreign.pid))
        _arguments(p, home)
        if foreign.poll() is not None:
            p.tally.unexpected.append("a foreign process named by a record was signalled")
    finally:
        foreign.kill()
        foreign.wait()
        for proc in psutil.process_iter(["cwd"]):
            if proc.info["cwd"] and Path(proc.info["cwd"]) == home.path.resolve():
                p.tally.leftovers.append(f"a server left running: pid {proc.pid}")
        kill_started_under(home.path)


def _records(p: Prober, home: StandinHome, foreign: psutil.Process) -> None:
    root = home.root
    (root / "logs").mkdir(parents=True)
    os.mkfifo(root / "logs" / "comfyui-fifo.log")
    os.symlink("/dev/zero", root / "logs" / "comfyui-zero.log")
    base = {"pid": foreign.pid, "create_time": foreign.create_time(), "cmdline": foreign.cmdline(),
            "port": home.port, "listen": "127.0.0.1", "device_type": "cpu", "devices": [0], "python": sys.executable,
            "comfy_home": str(home.path), "log": str(root / "logs" / "comfyui-1.log"), "extra_args": []}
    good_cmd = [sys.executable, "-B", "main.py", "--listen", "127.0.0.1", "--port", str(home.port), "--cpu"]
    records = {
        "not-json": "{", "list": "[]", "null": "null", "deep": "[" * 100000, "huge-int": '{"pid": ' + "9" * 5000 + "}",
        "sleep": base, "pid-0": dict(base, pid=0, cmdline=good_cmd), "pid-1": dict(base, pid=1, cmdline=good_cmd),
        "pid-self": dict(base, pid=os.getpid(), cmdline=good_cmd),
        "devices-unordered": dict(base, devices=[1, 0, 7], cmdline=good_cmd),
        "extra-foo": dict(base, extra_args=["--foo"], cmdline=good_cmd + ["--foo"]),
        "extra-liste": dict(base, extra_args=["--liste", "0.0.0.0"], cmdline=good_cmd + ["--liste", "0.0.0.0"]),
        "log-fifo": dict(base, cmdline=good_cmd, log=str(root / "logs" / "comfyui-fifo.log")),
        "log-dev-zero": dict(base, cmdline=good_cmd, log=str(root / "logs" / "comfyui-zero.log")),
        "log-passwd": dict(base, cmdline=good_cmd, log="/etc/passwd"),
        "listen-name": dict(base, listen="localhost"), "unknown-field": dict(base, evil=1),
        "other-tree": dict(base, cmdline=good_cmd, comfy_home="/"),
        "stale": dict(base, pid=2 ** 22, cmdline=good_cmd),
    }
    for name, rec in records.items():
        (root / "server.json").write_text(rec if isinstance(rec, str) else json.dumps(rec))
        every = name in ("sleep", "deep", "log-fifo", "log-dev-zero", "other-tree", "extra-liste")
        for command in ("status", "stop", "restart") + (("logs", "watch") if every else ()):
            extra = {"watch": ["--max-seconds", "0.5", "--interval", "0.1"], "restart": ["--timeout", "5"]}
            if name == "stale" and command == "restart":
                continue  # a valid stale record: restart would rightly start a server
            expect = (0, 1) if name in ("stale", "pid-self") else (1,)  # valid, stale: never acted on
            p.run(f"{command} with record {name}", command, "--comfy-home", home.path, *extra.get(command, []),
                  expect=expect)
    for link in ("comfyui-fifo.log", "comfyui-zero.log"):  # `latest` pointing at them, with no record
        (root / "server.json").unlink(missing_ok=True)
        latest = root / "logs" / "latest"
        latest.unlink(missing_ok=True)
        latest.symlink_to(link)
        p.run(f"logs via latest -> {link}", "logs", "--comfy-home", home.path, expect=(1,))
        p.run(f"status via latest -> {link}", "status", "--comfy-home", home.path, expect=(1,))


def _arguments(p: Prober, home: StandinHome) -> None:
    (home.root / "server.json").unlink(missing_ok=True)
    start = ["start", "--comfy-home", home.path, "--devices", "0", "--device-type", "cpu", "--port", home.port]
    for extra in (["--liste", "0.0.0.0"], ["--por", "8308"], ["--listen"], ["--port=1"], ["--cuda-d", "0"],
                  ["--", "--listen", "0.0.0.0"], ["-h"], ["--he"], ["x" * 100000], ["--verbose"] * 300,
                  ["--preview-method"], ["--highvram"], ["--cpu", "--highvram"], ["\u00e9\u00e8"], ["--directml=1"]):
        p.run(f"start -- {' '.join(extra)[:30]}", *start, "--", *extra, expect=(2,))
    for name, args in {"port 0": ["--port", "0"], "port 65536": ["--port", "65536"],
                       "listen 999.0.0.1": ["--listen", "999.0.0.1"], "listen empty": ["--listen", ""],
                       "listen TEST-NET": ["--listen", "192.0.2.7"], "timeout nan": ["--timeout", "nan"],
                       "timeout inf": ["--timeout", "inf"], "python /dev/zero": ["--python", "/dev/zero"],
                       "python missing": ["--python", "/nonexistent/python"], "type tpu": ["--device-type", "tpu"]
                       }.items():
        p.run(f"start {name}", *start, *args, expect=(2,))
    p.run("stop --grace nan", "stop", "--comfy-home", home.path, "--grace", "nan", expect=(2,))
    p.run("watch --interval nan", "watch", "--comfy-home", home.path, "--interval", "nan", expect=(2,))
    if home.boots():
        p.tally.unexpected.append(f"a refused start ran the server: {home.boots()[:1]}")
    for name, args in {"commit option": ["--commit", "--upload-pack=x"], "commit junk": ["--commit", "zz"],
                       "source option": ["--source", "-uevil"], "home /dev/null": ["--comfy-home", "/dev/null"],
                       "home under a file": ["--comfy-home", "/etc/passwd/x"]}.items():
        args = args if "--comfy-home" in args else ["--comfy-home", home.path.parent / "fresh", *args]
        p.run(f"install {name}", "install", *args, "--python", sys.executable, expect=(1, 2))
    if (home.path.parent / "fresh").exists():
        p.tally.leftovers.append("a refused install left its folder")


# --------------------------------------------------------------------------------------------- random kills


KILL_POINTS = {"install": ["clone-made", "clone-moving:1", "clone-moving:2", "clone-moved", "journal-blobs",
                           "journal-written", "tmp-written:2", "file-written:1", "file-written:6", "files-written"],
               "revert": ["journal-written", "tmp-written:1", "file-written:3", "file-written:8", "files-written"]}


def _random_kills(p: Prober, tmp: Path, up: Path) -> None:
    """install (fresh) and revert (of an installed tree) SIGKILLed at random: half after a random delay
    within the time a whole run takes here (start-up, clone, scratch checks), half at a random named point
    of the write itself (a window of milliseconds a delay rarely hits)."""
    rng = random.Random(SEED)
    base = ["--source", up, "--python", sys.executable]
    t0 = time.monotonic()
    p.run("kills: a whole install, for its duration", "install", "--comfy-home", tmp / "calibrate", *base, expect=(0,))
    whole = time.monotonic() - t0
    for i in range(10):
        home = tmp / f"kill{i}"
        op = ("install", "revert")[i % 2]
        if op == "revert":
            p.run(f"kill #{i}: install first", "install", "--comfy-home", home, *base, expect=(0,))
            argv = ["revert", "--comfy-home", home]
        else:
            argv = ["install", "--comfy-home", home, *base]
        env, how = p.env, None
        if (i // 2) % 2:
            how = rng.choice(KILL_POINTS[op])
            env = dict(p.env, H3KIT_TEST_KILL_AT=how)
        proc = subprocess.Popen([sys.executable, "-m", "h3kit", *map(str, argv)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if how is None:
            delay = rng.uniform(0.05, 1.0) * whole
            how = f"after {delay:.2f} s"
            try:
                proc.wait(delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        proc.wait()
        p.tally.runs += 1
        label = f"kill #{i} ({op} {how})"
        p.run(f"{label}: plain install", "install", "--comfy-home", home, *base, expect=(0,))
        p.run(f"{label}: verify", "verify", "--comfy-home", home, expect=(0,))
        p.check_leftovers(home, label=f"{label}: ")
        for clone in tmp.glob(f".kill{i}.h3kit-clone-*"):
            p.tally.leftovers.append(f"{label}: {clone}")
