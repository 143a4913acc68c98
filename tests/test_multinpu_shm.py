"""The /dev/shm hand-off of the process runtime (comfy/multinpu_wire.py shm_*): a full tmpfs is a command's error,
never a signal, and what a killed server left there is removed at the next start.

The tmpfs is real and small: each test runs its program in a private mount namespace (`unshare -m`, which needs
root or CAP_SYS_ADMIN) with a tmpfs of a few MiB mounted on a temporary folder, and points the hand-off there with
H3KIT_SHM_DIR; nothing of the host's /dev/shm is touched. Without the privilege the tests skip with the reason
(a failure under H3KIT_REQUIRE_UPSTREAM=1, as in CI).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.module("torch", requires.NO_TORCH_REASON, allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "patches" / "src"
SUPPORT = ROOT / "tests" / "support"
sys.path.insert(0, str(SRC))
import comfy.multinpu_wire as wire  # noqa: E402  (namespace package: patches/src/comfy)

MIB = 1 << 20

# Writes one hand-off file as a driver does (its lock held, as GroupRuntime.start takes it), says so, and waits to be
# killed: argv = folder, token
HOLDER = """
import os, sys, time, torch
import comfy.multinpu_wire as wire
folder, token = sys.argv[1], sys.argv[2]
wire.shm_claim(token, folder)
wire.shm_write(os.path.join(folder, f"h3kit-{os.getpid()}-{token}-1-7-in"), [torch.ones(1000)])
print("written", flush=True)
time.sleep(600)
"""

# The driver of a 2-rank group on cpu/gloo whose hand-off folder (H3KIT_SHM_DIR) is a 16 MiB tmpfs: argv = out, folder
DRIVER = """
import json, os, signal, subprocess, sys, time
import torch
import comfy.multinpu_wire as wire
import comfy.multinpu_process as mp

out, folder, holder = sys.argv[1], sys.argv[2], sys.argv[3]
res = {"driver_pid": os.getpid()}

def holder_process(token):
    p = subprocess.Popen([sys.executable, "-c", holder, folder, token], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "written"
    return p

def attempt(fn):
    t0 = time.monotonic()
    try:
        return {"ok": True, "value": fn(), "seconds": time.monotonic() - t0}
    except Exception as e:
        return {"ok": False, "type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}

def echo(mib):
    sent = torch.arange(mib << 18, dtype=torch.float32)
    got = rt.run("echo", {"tensors": [sent], "note": "x"})
    return bool(got["same"] and torch.equal(got["tensors"][0], sent))

def big(mib):
    got = rt.run("big", {"mib": mib})
    return bool(got.numel() == mib << 18 and (got == 1.5).all())

def state():
    return {"members": {str(r): p for r, p in rt.members.items()}, "generation": rt.generation, "state": rt.state}

live = holder_process("bbbbbbbbbbbb")    # a live server's file: it must stay
killed = holder_process("aaaaaaaaaaaa")  # a server killed -9 mid-command: its input file stays behind
killed.kill()
killed.wait()
res["killed_pid"], res["live_pid"] = killed.pid, live.pid
res["before_start"] = sorted(os.listdir(folder))
spec = wire.GroupSpec(local_size=2, device_type="cpu", timeout=30, join_timeout=120,
                      worker_module="process_group_worker")
rt = mp.start_runtime(spec, os.environ[wire.KEY_ENV])
res["after_start"] = sorted(os.listdir(folder))
try:
    mp.wait_ready(rt, 150)
    res["warm"] = attempt(lambda: echo(1))
    res["ready"] = state()
    # another program fills the tmpfs (all but 1 MiB): the next command's 4 MiB of inputs do not fit
    st = os.statvfs(folder)
    filler = os.path.join(folder, "filler")
    with open(filler, "wb") as f:
        f.write(b"\\1" * (st.f_bavail * st.f_frsize - (1 << 20)))
    t_full = time.monotonic()
    res["inputs_full"] = attempt(lambda: echo(4))
    res["seconds_full_to_error"] = time.monotonic() - t_full
    res["result_full"] = attempt(lambda: big(4))   # small inputs, a 4 MiB result: rank 0's write fails
    res["while_full"] = state()
    os.unlink(filler)
    t_room = time.monotonic()
    res["inputs_after"] = attempt(lambda: echo(4))
    res["seconds_room_to_success"] = time.monotonic() - t_room
    res["result_after"] = attempt(lambda: big(4))
    res["after"] = state()
    res["left"] = sorted(os.listdir(folder))
finally:
    mp.stop_runtime()
    res["after_stop"] = sorted(os.listdir(folder))
    live.kill()
    live.wait()
    with open(out, "w") as f:
        json.dump(res, f, indent=2)
    sys.stdout.flush()
    os._exit(0)
"""


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(SUPPORT)]), **extra)
    env.setdefault(wire.KEY_ENV, wire.new_key())
    return env


def in_small_tmpfs(folder: Path, mib: int, argv: list, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """argv run in a private mount namespace where `folder` is a tmpfs of `mib` MiB (gone with the namespace)."""
    if shutil.which("unshare") is None:
        requires.skip_or_fail("needs unshare (util-linux) to mount a small tmpfs in a private mount namespace")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o size=1m h3kit-test "{folder}"'],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        requires.skip_or_fail("needs root or CAP_SYS_ADMIN to mount a small tmpfs in a private mount namespace "
                              f"(`unshare -m mount -t tmpfs ...`: {probe.stderr.strip()})")
    script = f'mount -t tmpfs -o size={mib}m h3kit-test "$0" && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, str(folder), *argv], timeout=timeout,
                          capture_output=True, text=True, **kwargs)


def test_a_full_tmpfs_is_an_error_not_sigbus(tmp_path):
    """shm_write into a 1 MiB tmpfs: 4 MiB fail with SharedMemoryFull naming the folder, the size, what was free and
    the fix, and leave no file; a small write then works. (Before: the process died of SIGBUS, exit 135.)"""
    folder = tmp_path / "shm"
    folder.mkdir()
    code = """
import os, sys, torch
import comfy.multinpu_wire as wire
folder = sys.argv[1]
try:
    wire.shm_write(os.path.join(folder, "h3kit-1-abc-1-1-in"), [torch.ones(1 << 20)], "the inputs of dit_forward")
    print("NO ERROR")
except wire.SharedMemoryFull as e:
    print("ERROR", e)
print("LEFT", sorted(os.listdir(folder)))
print("SMALL", wire.shm_write(os.path.join(folder, "h3kit-1-abc-1-2-in"), [torch.ones(1000)])[1])
"""
    proc = in_small_tmpfs(folder, 1, [sys.executable, "-c", code, str(folder)], 120, env=_env())
    assert proc.returncode == 0, f"exit {proc.returncode} (135: SIGBUS): {proc.stdout}{proc.stderr}"
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    message = lines["ERROR"]
    assert "shared memory is full" in message and "the inputs of dit_forward" in message
    assert "4.2 MB" in message and f"in {folder}" in message, message        # 4 MiB = 4.19 MB needed, where
    assert "free of 1.0 MB" in message, message                               # what was free, of how much
    assert "--shm-size" in message and "mount -o remount,size=" in message, message  # the fix
    assert lines["LEFT"] == "[]", "the failed write leaves no file"
    assert lines["SMALL"] == "4032"


def test_shm_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(wire.SHM_DIR_ENV, str(tmp_path))
    assert wire.shm_dir() == str(tmp_path)
    monkeypatch.delenv(wire.SHM_DIR_ENV)
    assert wire.shm_dir() == ("/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp"))


def _holder(folder: Path, token: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), token], stdout=subprocess.PIPE, text=True,
                         env=_env())
    assert p.stdout.readline().strip() == "written"
    return p


def test_sweep_removes_what_dead_drivers_left_and_keeps_live_ones(tmp_path):
    """A driver killed -9 after writing its hand-off: its files go; a live driver's stay (its lock is held), and so
    do another user's files and a file whose pid is alive and older than it; a file whose pid was reused by a
    process that started after it was written goes."""
    folder = tmp_path / "shm"
    folder.mkdir()
    killed = _holder(folder, "aaaaaaaaaaaa")
    live = _holder(folder, "bbbbbbbbbbbb")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        killed_files = sorted(n for n in os.listdir(folder) if f"{killed.pid}-aaaaaaaaaaaa" in n)
        assert killed_files == [f"h3kit-{killed.pid}-aaaaaaaaaaaa-1-7-in", f"h3kit-lock-{killed.pid}-aaaaaaaaaaaa"]
        live_files = sorted(n for n in os.listdir(folder) if f"{live.pid}-bbbbbbbbbbbb" in n)
        assert len(live_files) == 2
        # a server of an older h3kit (no lock file) that died: its pid is gone
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout.strip()
        (folder / f"h3kit-{dead}-cccccccccccc-3-4-out").write_bytes(b"x")
        # pid 1 is alive, but started long after this file was written: a reused pid, the file is a leftover
        reused = folder / "h3kit-1-dddddddddddd-1-1-in"
        reused.write_bytes(b"x")
        os.utime(reused, (946684800, 946684800))  # 2000-01-01
        # pid 1 alive and older than the file: it may be its owner (no lock to ask): kept
        (folder / "h3kit-1-eeeeeeeeeeee-1-1-in").write_bytes(b"x")
        # another user's file is never touched; a name of another program neither
        other = folder / f"h3kit-{dead}-ffffffffffff-1-1-in"
        other.write_bytes(b"x")
        if os.geteuid() == 0:
            os.chown(other, 65534, 65534)
        (folder / "h3kit-notes.txt").write_bytes(b"x")

        removed = wire.shm_sweep(str(folder))

        left = sorted(os.listdir(folder))
        assert sorted(removed) == sorted(killed_files + [f"h3kit-{dead}-cccccccccccc-3-4-out", reused.name]
                                         + ([] if os.geteuid() == 0 else [other.name]))
        assert set(live_files) <= set(left), "a live driver's files stay"
        assert "h3kit-1-eeeeeeeeeeee-1-1-in" in left and "h3kit-notes.txt" in left
        if os.geteuid() == 0:
            assert other.name in left, "another user's file stays"
    finally:
        for p in (killed, live):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_live_driver_in_another_pid_namespace_keeps_its_files(tmp_path):
    """A driver in another pid namespace (a container sharing /dev/shm) names its files with a pid that means
    nothing here: its held lock alone keeps them. The files are aged so that the pid check alone would remove
    them (pid 1 here started after they were written)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    probe = subprocess.run(["unshare", "-p", "-f", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        requires.skip_or_fail(f"needs root or CAP_SYS_ADMIN for a pid namespace (`unshare -p`): {probe.stderr.strip()}")
    p = subprocess.Popen(["unshare", "-p", "-f", "--kill-child", sys.executable, "-c", HOLDER, str(folder), "abcdefabcdef"],
                         stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert p.stdout.readline().strip() == "written"
        names = sorted(os.listdir(folder))
        assert names == ["h3kit-1-abcdefabcdef-1-7-in", "h3kit-lock-1-abcdefabcdef"], names
        for name in names:
            os.utime(folder / name, (946684800, 946684800))
        assert wire.shm_sweep(str(folder)) == [] and sorted(os.listdir(folder)) == names
    finally:
        p.kill()  # unshare's child (pid 1 of the namespace) gets SIGKILL with it
        p.wait()
    removed, deadline = [], time.monotonic() + 30
    while not removed and time.monotonic() < deadline:  # until the kernel has reaped the holder (its lock goes)
        removed = wire.shm_sweep(str(folder))
        time.sleep(0.1)
    assert sorted(removed) == names, "once it is gone, its files go"


def test_a_driver_removes_its_lock_at_shutdown(tmp_path):
    claim = wire.shm_claim("0123456789ab", str(tmp_path))
    name = f"h3kit-lock-{os.getpid()}-0123456789ab"
    assert os.listdir(tmp_path) == [name]
    assert wire.shm_sweep(str(tmp_path)) == [] and os.listdir(tmp_path) == [name], "its own lock is never swept"
    wire.shm_release(claim)
    assert os.listdir(tmp_path) == []


# also under the twin of the accelerator's clock (H3KIT_EMULATE_ASYNC_DEVICE=1, comfy/multinpu_clock.py)
@pytest.mark.parametrize("clock", ["gloo", "twin"])
def test_a_full_dev_shm_fails_one_command_and_the_group_lives_on(tmp_path, clock):
    """A 2-rank group on cpu/gloo whose hand-off folder is a 16 MiB tmpfs. Before the start, a driver killed -9
    left a hand-off file there (gone after the start) and a live one has its file (kept). Filled by another
    program, the next command's inputs fail within seconds with the message, and a command whose result does not
    fit fails too; the driver and both workers live on (same pids, same generation); once space returns the next
    commands succeed. (Before: the driver died of SIGBUS, no result.)"""
    folder = tmp_path / "shm"
    folder.mkdir()
    out = tmp_path / "result.json"
    env = _env(**({"H3KIT_EMULATE_ASYNC_DEVICE": "1"} if clock == "twin" else {}))
    env[wire.SHM_DIR_ENV] = str(folder)
    proc = in_small_tmpfs(folder, 16, [sys.executable, "-c", DRIVER, str(out), str(folder), HOLDER], 400, env=env)
    (tmp_path / "driver.log").write_text(proc.stdout + proc.stderr)
    assert out.exists(), f"the driver died (exit {proc.returncode}; 135 or -7: SIGBUS): {proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    killed, live = res["killed_pid"], res["live_pid"]
    assert any(str(killed) in n for n in res["before_start"]) and any(str(live) in n for n in res["before_start"])
    assert not any(str(killed) in n for n in res["after_start"]), "a killed driver's leftovers are gone at the start"
    assert sum(str(live) in n for n in res["after_start"]) == 2, "a live driver's hand-off and lock stay"
    assert res["warm"]["ok"] and res["warm"]["value"] is True, res["warm"]

    full = res["inputs_full"]
    assert not full["ok"] and full["type"] == "SharedMemoryFull", full
    message = full["message"]
    assert "shared memory is full" in message and "the inputs of echo" in message and "4.2 MB" in message, message
    assert f"in {folder}" in message and "free of 16.8 MB" in message and "--shm-size" in message, message
    assert full["seconds"] < 30, "the error comes at once, not after a timeout"
    result = res["result_full"]
    assert not result["ok"] and result["type"] == "SharedMemoryFull", result
    assert "the result of big" in result["message"], result

    assert res["while_full"] == res["ready"], "the same workers, the same generation, still ready"
    assert res["inputs_after"] == {**res["inputs_after"], "ok": True, "value": True}, res["inputs_after"]
    assert res["result_after"]["ok"] and res["result_after"]["value"] is True, res["result_after"]
    assert res["after"] == res["ready"], "no worker was replaced"
    mine = [n for n in res["left"] if n.startswith(f"h3kit-{res['driver_pid']}-")]
    assert mine == [], "every hand-off file of the driver is removed"
    assert f"h3kit-lock-{res['driver_pid']}-" not in " ".join(res["after_stop"]), "its lock goes at shutdown"
    print(f"full /dev/shm -> error {res['seconds_full_to_error']:.2f} s; space back -> success "
          f"{res['seconds_room_to_success']:.2f} s")


BOOT = 300
PROMPT = 300


def _h3kit(*args, env=None, timeout=BOOT + 60):
    proc = subprocess.run([sys.executable, "-m", "h3kit", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    return proc


@pytest.mark.upstream
@pytest.mark.slow
def test_a_full_dev_shm_costs_one_prompt_of_the_real_server(tiny_tree, comfy_python, tmp_path):
    """`h3kit start --transport process` on 2 CPU ranks with the tiny H3 checkpoints, the hand-off folder a 16 MiB
    tmpfs (H3KIT_SHM_DIR). Filled by another program after a warm prompt, the next prompt errors with the message
    within seconds; the server and both workers live on (same pids); once space returns the next prompt runs.
    (Before: the server died of SIGBUS, the prompt never answered, the next was refused.) Then the server is killed
    -9 mid-prompt: its input file stays until the next `h3kit start`, which removes it, and a prompt runs."""
    from h3kit import demo
    from tests.support.service_helpers import copy_tree, free_port, http_json, pid_running, wait_for

    home = copy_tree(tiny_tree, tmp_path / "ComfyUI")
    folder = tmp_path / "shm"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "h3kit-test", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        requires.skip_or_fail(f"needs root to mount a small tmpfs: {mounted.stderr.strip()}")
    port = free_port(8640, 8659)
    hold = tmp_path / "hold"
    env = dict(os.environ, **{wire.SHM_DIR_ENV: str(folder), "H3KIT_MULTINPU_FAULT": f"dit_forward:hold:{hold}"})
    base = ["--comfy-home", home]
    start_args = [*base, "--devices", "0,1", "--device-type", "cpu", "--transport", "process", "--python",
                  comfy_python, "--port", port, "--timeout", BOOT, "--json"]
    try:
        started = _h3kit("start", *start_args, env=env)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]

        def status():
            r = _h3kit("status", *base, "--json", timeout=60)
            return json.loads(r.stdout)["data"]

        def ranks():
            return {r["rank"]: r["pid"] for r in json.loads((home / ".h3kit" / "run" / "ranks.json").read_text())["ranks"]}

        def submit(tag):
            p = demo.demo_prompt(2, tag)
            for node in p.values():
                if node["class_type"] == "RandomNoise":
                    node["inputs"]["noise_seed"] = int.from_bytes(os.urandom(4), "little")  # nothing from the cache
            return http_json(f"http://127.0.0.1:{port}/prompt", {"prompt": p})["prompt_id"]

        def run_prompt(tag):
            pid = submit(tag)

            def done():
                entry = http_json(f"http://127.0.0.1:{port}/history/{pid}").get(pid)
                return entry if entry and entry["status"].get("completed") is not None else None
            return wait_for(done, PROMPT, f"prompt {pid}", step=0.05)["status"]

        assert run_prompt("warm")["status_str"] == "success"
        server, workers = status()["pid"], ranks()
        # another program fills the tmpfs to the last byte
        with open(folder / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\1" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        t0 = time.monotonic()
        full = run_prompt("full")
        to_error = time.monotonic() - t0
        errors = [m[1] for m in full["messages"] if m[0] == "execution_error"]
        assert full["status_str"] == "error" and errors, full
        assert errors[0]["exception_type"].endswith("SharedMemoryFull"), errors[0]
        message = errors[0]["exception_message"]
        assert "shared memory is full" in message and f"in {folder}" in message and "--shm-size" in message, message
        assert to_error < 60, f"{to_error:.1f} s"
        os.unlink(folder / "filler")
        t1 = time.monotonic()
        after = run_prompt("after")
        to_success = time.monotonic() - t1
        assert after["status_str"] == "success", after
        assert status()["pid"] == server and ranks() == workers, "the server and its workers live on"
        print(f"service: full /dev/shm -> prompt error {to_error:.2f} s; space back -> next prompt ok {to_success:.2f} s")

        # killed -9 mid-prompt (its workers hold the DiT forward while `hold` exists), the server leaves its input
        # file behind; the next start removes it
        hold.touch()
        submit("killed")
        mine = lambda: [n for n in os.listdir(folder) if n.startswith((f"h3kit-{server}-", f"h3kit-lock-{server}-"))]  # noqa: E731
        wait_for(lambda: any(n.endswith("-in") for n in mine()), PROMPT, "the held prompt's input file")
        os.kill(server, signal.SIGKILL)
        # one read of the process (pid_running: gone, or a zombie): pid_exists and then Process() raced its reaping,
        # which between the two raised NoSuchProcess out of the wait
        wait_for(lambda: not pid_running(server), 60, "the killed server to end")
        hold.unlink()
        left = mine()
        assert any(n.endswith("-in") for n in left), left
        started = _h3kit("start", *start_args, env=env)
        assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-3000:]
        assert mine() == [], f"a killed server's files survived the next start: {mine()}"
        assert run_prompt("restarted")["status_str"] == "success"
    finally:
        _h3kit("stop", *base, "--json", timeout=120)
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
