"""Inputs an adversarial operator tries: each must end in h3kit's error shape with a clear code and a
non-zero exit (never 3, never a hang), and change nothing.

Install cases run on the fake upstream (tests/support/fakekit.py), service cases on the stand-in server.
Read-only folders: as root, the command runs without the capabilities that bypass file permissions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fakekit import git, kit, refreshed, snapshot, upstream  # noqa: F401
from tests.support.service_helpers import StandinHome, free_port, h3kit, kill_started_under, pid_running
from tests.support import jsondoc, requires

LONG_ID = "7" * 4400


def unprivileged(cmd: list[str]) -> list[str]:
    """`cmd` as a user for whom read-only means read-only (root ignores file permissions)."""
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    if not setpriv:
        requires.skip("running as root without setpriv (util-linux): cannot make a folder read-only for h3kit")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner,-linux_immutable", "--", *cmd]


def run_ro(*args, env=None):
    return subprocess.run(unprivileged([sys.executable, "-m", "h3kit", *map(str, args)]), capture_output=True,
                          text=True, timeout=120, env=env)


def read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)


def writable(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        if not p.is_symlink():
            p.chmod(p.stat().st_mode | stat.S_IWUSR)


def assert_h3kit_error(r, code: str, exit_code: int = 2):
    assert r.returncode == exit_code, (r.returncode, r.stdout, r.stderr)
    assert f"h3kit: error [{code}]" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    assert len(r.stderr) < 2000  # nothing echoed whole


# --------------------------------------------------------------------------------------------- workflow files


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory"])
def test_check_workflow_refuses_what_is_not_a_regular_file(tmp_path, kind):
    path = {"/dev/zero": "/dev/zero", "fifo": tmp_path / "wf.json", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)  # no writer: a plain open would block forever
    r = h3kit("check-workflow", path, "--json", timeout=20)
    assert r.returncode == 2
    finding = jsondoc.data(r.stdout, r.returncode)["findings"][0]
    assert finding["code"] == "H3001"
    assert ("not a regular file" if kind != "directory" else "is a directory") in finding["message"]
    if kind == "/dev/zero":
        b = h3kit("bench", "/dev/zero", "--comfy-home", tmp_path / "x", timeout=20)
        assert_h3kit_error(b, "bad_workflow")


# --------------------------------------------------------------------------------------------- device lists


@pytest.mark.parametrize("devices", [LONG_ID, "0," + LONG_ID, ",".join(["0"] * 5000), ",".join(map(str, range(5000)))])
def test_device_lists_past_int_limits_and_huge_lists(tmp_path, devices):
    wf = Path(__file__).resolve().parents[1] / "workflows" / "api" / "demo_t2va_tiny.json"
    r = h3kit("check-workflow", wf, "--devices", devices, timeout=30)
    assert_h3kit_error(r, "bad_device_list")
    r = h3kit("check-workflow", wf, timeout=30, env=dict(os.environ, ASCEND_RT_VISIBLE_DEVICES=devices))
    assert_h3kit_error(r, "bad_device_list")
    r = h3kit("start", "--comfy-home", tmp_path, "--devices", devices, "--device-type", "cpu", timeout=30)
    assert_h3kit_error(r, "bad_device_list")
    assert not (tmp_path / ".h3kit").exists()


# --------------------------------------------------------------------------------------------- folders


@pytest.mark.parametrize("command", ["install", "verify", "revert", "start", "stop", "status", "logs", "demo"])
def test_a_comfy_home_that_is_a_file_is_bad_input(tmp_path, command):
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    extra = {"start": ["--devices", "0"]}.get(command, [])
    for home in (afile, afile / "sub"):
        r = h3kit(command, "--comfy-home", home, *extra, timeout=60)
        assert_h3kit_error(r, "not_a_folder")
        assert "--comfy-home" in r.stderr and afile.read_text() == "not a folder\n"


@pytest.mark.parametrize("command", ["start", "stop", "status", "logs", "restart", "watch"])
def test_a_runtime_root_that_is_a_file_is_bad_input(tmp_path, command):
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    extra = {"start": ["--devices", "0"]}.get(command, [])
    r = h3kit(command, "--comfy-home", tmp_path, "--runtime-root", afile, *extra, "--json"
              if command not in ("logs",) else "--errors", timeout=60)
    assert_h3kit_error(r, "not_a_folder")
    if command != "logs":
        assert jsondoc.error(r.stdout, r.returncode)["code"] == "not_a_folder"


def test_install_under_a_read_only_parent_fails_cleanly(refreshed, upstream, tmp_path):
    up, _ = upstream
    parent = tmp_path / "locked"
    parent.mkdir()
    read_only(parent)
    try:
        r = run_ro("install", "--comfy-home", parent / "home", "--source", up, "--python", sys.executable)
    finally:
        writable(parent)
    assert_h3kit_error(r, "write_failed", exit_code=1)
    assert "permission denied" in r.stderr and list(parent.iterdir()) == []


def test_a_no_op_reinstall_on_a_read_only_tree_writes_nothing(refreshed, upstream, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    args = ("install", "--comfy-home", home, "--source", up, "--python", sys.executable)
    assert h3kit(*args).returncode == 0
    before = snapshot(home)
    read_only(home)
    try:
        r = run_ro(*args)
        v = run_ro("verify", "--comfy-home", home)
    finally:
        writable(home)
    assert r.returncode == 0, r.stderr
    assert "Nothing to change" in r.stdout
    assert v.returncode == 0, v.stdout + v.stderr
    assert snapshot(home) == before  # state.json included: a no-op writes nothing


def test_a_read_only_runtime_root_refuses_start_and_stop(tmp_path):
    home = StandinHome(tmp_path / "comfy", free_port(8490, 8499))
    try:
        home.root.mkdir(parents=True)
        read_only(home.root)
        r = run_ro("start", "--comfy-home", home.path, "--devices", "0", "--device-type", "cpu", "--port", home.port)
        assert_h3kit_error(r, "runtime_root_not_writable", exit_code=1)
        assert home.boots() == []
        writable(home.root)
        assert home.start().returncode == 0
        pid = home.record()["pid"]
        read_only(home.root)
        r = run_ro("stop", "--comfy-home", home.path)
        assert_h3kit_error(r, "runtime_root_not_writable", exit_code=1)
        assert pid_running(pid)  # nothing signalled
        writable(home.root)
        assert home.run("stop").returncode == 0
    finally:
        writable(home.root)
        kill_started_under(home.path)


# --------------------------------------------------------------------------------------------- install --commit, verify


def test_another_commit_is_refused_without_force_then_marked(refreshed, upstream, tmp_path):
    from tests.support.fakekit import A_PY, commit_change

    up, pin = upstream
    later = commit_change(up, "comfy/a.py", A_PY.replace("line 18\n", "line eighteen\n"))
    home = tmp_path / "home"
    args = ("install", "--comfy-home", home, "--source", up, "--python", sys.executable)
    r = h3kit(*args, "--commit", later)
    assert_h3kit_error(r, "not_the_pin", exit_code=1)
    assert not home.exists()
    r = h3kit(*args, "--commit", later, "--force", "--json")
    assert r.returncode == 0, r.stderr
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["pin_verified"] is False and any("not the pin" in w for w in rep["warnings"])
    v = h3kit("verify", "--comfy-home", home, "--json")
    out = jsondoc.data(v.stdout, v.returncode)
    assert v.returncode == 0 and out["pin_verified"] is False, out  # verifiable against what was installed
    assert any("not the pin" in w for w in out["warnings"])
    r = h3kit(*args)
    assert r.returncode == 1 and "installed with --commit" in r.stderr and "--force" in r.stderr
    assert h3kit(*args, "--force").returncode == 0  # back to the verified pin
    v = h3kit("verify", "--comfy-home", home, "--json")
    assert v.returncode == 0 and jsondoc.data(v.stdout, v.returncode)["pin_verified"] is True


def test_verify_says_missing_for_a_deleted_patched_in_file(refreshed, upstream, tmp_path):
    up, _ = upstream
    home = tmp_path / "home"
    assert h3kit("install", "--comfy-home", home, "--source", up, "--python", sys.executable).returncode == 0
    (home / "comfy" / "new.py").unlink()
    (home / "nodes.py").unlink()
    v = h3kit("verify", "--comfy-home", home)
    assert v.returncode == 1
    assert "comfy/new.py is missing (the series adds it)" in v.stdout
    assert "nodes.py is missing (the series changes it)" in v.stdout


# --------------------------------------------------------------------------------------------- arguments after --


@pytest.fixture
def standin(tmp_path):
    h = StandinHome(tmp_path / "comfy", free_port(8490, 8499))
    yield h
    kill_started_under(h.path)


@pytest.mark.parametrize("extra, said", [
    (["--liste", "0.0.0.0"], "--liste (ComfyUI reads it as --listen) after -- would set the listen address"),
    (["--por", "8308"], "--por (ComfyUI reads it as --port) after -- would set the port"),
    (["--listen"], "--listen after -- would set the listen address"),
    (["--cuda-dev", "1"], "(ComfyUI reads it as --cuda-device) after -- would set the devices"),
    (["--direct"], "(ComfyUI reads it as --directml)"),
    (["--tls-key", "k.pem"], "plain HTTP"),
    (["--highvram"], "not allowed with argument --cpu"),
    (["--preview-method", "bogus"], "invalid choice: 'bogus'"),
    (["--nonsense"], "unrecognized arguments: --nonsense"),
    (["--preview-size", "big"], "invalid int value"),
])
def test_arguments_after_the_separator_follow_comfyuis_rules(standin, extra, said):
    r = standin.start(extra=extra)
    assert_h3kit_error(r, "bad_extra_args")
    assert said in r.stderr
    assert standin.boots() == [] and standin.record() is None


def test_cpu_after_the_separator_is_refused_on_an_accelerator(standin):
    r = standin.start(device_type="npu", extra=["--cpu"])
    assert_h3kit_error(r, "bad_extra_args")
    assert "device type" in r.stderr


def test_a_server_that_dies_parsing_its_arguments_says_why(standin):
    """A check only ComfyUI can make (the folder must exist) passes h3kit's and fails in the server: start,
    status and logs --errors all show argparse's line."""
    r = standin.start(extra=["--front-end-root", "/nonexistent/h3kit"])
    assert r.returncode == 1 and "server_exited" in r.stderr
    line = "main.py: error: argument --front-end-root: The path '/nonexistent/h3kit' does not exist."
    assert line in r.stderr
    st = standin.status()
    assert st["running"] is False and st["first_error"]["summary"] == line
    text = standin.run("status")
    assert f"first error (error, log line" in text.stdout and line in text.stdout
    errors = standin.run("logs", "--errors")
    assert errors.returncode == 0 and line in errors.stdout


def test_restart_revalidates_the_recorded_settings(standin):
    assert standin.start().returncode == 0
    rec = standin.record()
    standin.run("stop")
    rec["devices"] = [1, 0, 7]
    standin.root.mkdir(parents=True, exist_ok=True)
    (standin.root / "server.json").write_text(json.dumps(rec))
    r = standin.run("restart")
    assert_h3kit_error(r, "bad_record", exit_code=1)
    assert "comes after" in r.stderr and len(standin.boots()) == 1


def test_sigterm_during_start_stops_the_server_it_was_starting(standin):
    standin.configure(boot_delay=30)
    proc = subprocess.Popen([sys.executable, "-m", "h3kit", "start", "--comfy-home", str(standin.path), "--devices",
                             "0", "--device-type", "cpu", "--port", str(standin.port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        from tests.support.service_helpers import wait_for
        wait_for(lambda: standin.boots(), 30, "the server to be launched")
        proc.send_signal(signal.SIGTERM)
        _, errs = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143 and "terminated (SIGTERM)" in errs
    assert not pid_running(standin.boots()[0]["pid"])


def test_the_pins_own_options_are_read(comfy_source, tmp_path):
    """Every option h3kit keeps for itself exists in the pinned comfy/cli_args.py (an upstream rename would
    otherwise slip past the check), and the replica resolves prefixes as the pin's parser does."""
    from h3kit import comfyargs
    from tests.conftest import PIN

    bare = (Path(comfy_source) / "objects").is_dir()
    text = subprocess.run(["git", "--git-dir" if bare else "-C", comfy_source, "show", f"{PIN}:comfy/cli_args.py"],
                          capture_output=True, text=True, check=True).stdout
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "cli_args.py").write_text(text)
    parser = comfyargs.load_rules(tmp_path)
    dests = {a.dest for a in parser._actions}
    assert set(comfyargs.OWNED) <= dests, set(comfyargs.OWNED) - dests
    assert len(dests) > 90
    own = ["--listen", "127.0.0.1", "--port", "8189"]
    assert comfyargs.check(tmp_path, ["--preview-method", "auto", "--fast", "--verbose"], own, "npu")
    for extra in (["--liste", "0.0.0.0"], ["--por", "1"], ["--default-dev", "1"], ["--direct"], ["--cpu"],
                  ["--fp"], ["--cache-ram", "x"], ["--preview-method", "nope"]):
        with pytest.raises(comfyargs.ExtraArgsError):
            comfyargs.check(tmp_path, extra, own, "npu")
