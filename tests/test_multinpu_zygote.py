"""comfy/multinpu_zygote.py: workers forked from one process that imported torch once (the fork server), as the
launcher starts them on the CPU by default. A forked worker must be what `python -B -m MODULE` would have started:
its own environment, folder, arguments and `__main__`, its exit code (or signal) as Popen tells it, a child that
dies with its launcher; and it must find the fork server's imports already done (the point of it). The process
group's tests (test_multinpu_process*.py) run their workers this way; test_multinpu_launch_units.py runs a rank
both ways."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "patches" / "src"))
import comfy.multinpu_launch as launch  # noqa: E402  (namespace package: patches/src/comfy)
import comfy.multinpu_wire as wire  # noqa: E402
import comfy.multinpu_zygote as zygote  # noqa: E402

# what a forked worker tells of itself: run as `python -m probe_worker EXIT OUT`
PROBE = textwrap.dedent("""
    import json, os, sys
    out = {"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "rank": os.environ.get("H3KIT_RANK"),
           "server_only": os.environ.get("ONLY_IN_THE_SERVER"), "parent": os.environ.get("H3KIT_PARENT_PID"),
           "ppid": os.getppid(), "marked_in": sys.modules["preload_mark"].PID if "preload_mark" in sys.modules else None}
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
    how = sys.argv[1]
    if how == "sleep":
        import time
        time.sleep(120)
    if how == "raise":
        raise RuntimeError("the worker's own error")
    sys.exit(int(how))
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("zygote")
    (home / "probe_worker.py").write_text(PROBE)
    (home / "preload_mark.py").write_text("import os\nPID = os.getpid()\n")
    env = dict(os.environ, ONLY_IN_THE_SERVER="1", PYTHONPATH=str(home))
    s = zygote.ForkServer(("torch", "preload_mark"), env, str(home))
    yield s, home
    s.close()


def run(server, how, tmp_path, **env):
    s, home = server
    out = tmp_path / f"probe-{how}.json"
    proc = s.fork("probe_worker", [how, out], dict(os.environ, **env), str(tmp_path))
    return proc, out


def test_a_forked_worker_is_its_module_run_as_main_in_its_own_environment(server, tmp_path):
    import json
    proc, out = run(server, "0", tmp_path, H3KIT_RANK="3")
    assert proc.wait(60) == 0
    seen = json.loads(out.read_text())
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["0", str(out)]
    assert seen["argv"][0].endswith("probe_worker.py")  # as `python -m` sets it
    assert seen["cwd"] == str(tmp_path) and seen["rank"] == "3"
    assert seen["server_only"] is None  # the request's environment, not the fork server's
    # its parent is the fork server (which dies with the launcher), and the module was imported there, once
    assert seen["ppid"] == server[0].proc.pid and seen["parent"] == str(server[0].proc.pid)
    assert seen["marked_in"] == server[0].proc.pid


@pytest.mark.parametrize("how,code", [("3", 3), ("raise", 1)])
def test_an_exit_code_reaches_the_launcher_as_popen_tells_it(server, tmp_path, how, code):
    proc, _ = run(server, how, tmp_path)
    assert proc.wait(60) == code and proc.poll() == code


def test_a_signal_ends_it_as_popen_tells_it_and_wait_is_bounded(server, tmp_path):
    proc, out = run(server, "sleep", tmp_path)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.3)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(60) == -signal.SIGKILL
    proc.kill()  # a second kill of a worker reported ended signals nothing


def test_workers_end_with_their_fork_server_which_ends_with_its_launcher(tmp_path):
    (tmp_path / "probe_worker.py").write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), H3KIT_PARENT_PID=str(os.getpid()))
    s = zygote.ForkServer(("torch",), env, str(tmp_path))
    proc = s.fork("probe_worker", ["sleep", tmp_path / "o.json"], dict(os.environ), str(tmp_path))
    deadline = time.monotonic() + 60
    while not (tmp_path / "o.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    s.close()  # the launcher's end: the fork server exits, the worker gets its death signal
    assert s.proc.returncode == 0
    assert proc.wait(60) == -signal.SIGTERM


def test_the_start_is_fork_on_the_cpu_exec_on_accelerators_and_a_typo_is_refused(monkeypatch):
    monkeypatch.delenv(zygote.WORKER_START_ENV, raising=False)
    assert zygote.worker_start(wire.GroupSpec(device_type="cpu")) == "fork"
    assert zygote.worker_start(wire.GroupSpec(device_type="npu")) == "exec"
    assert zygote.worker_start(wire.GroupSpec(device_type="cuda")) == "exec"
    monkeypatch.setenv(zygote.WORKER_START_ENV, "fork")
    assert zygote.worker_start(wire.GroupSpec(device_type="npu")) == "fork"
    monkeypatch.setenv(zygote.WORKER_START_ENV, "spawn")
    with pytest.raises(wire.GroupError, match="H3KIT_WORKER_START='spawn' is not one of fork, exec"):
        zygote.worker_start(wire.GroupSpec(device_type="cpu"))
    # what the fork server imports for ComfyUI's worker touches no device: comfy.model_management is the worker's
    assert not any("model_management" in m for m in zygote.preload(wire.GroupSpec()))
