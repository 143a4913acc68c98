"""What an operator trying h3kit for the first time ran into (issue 23), one test each: an interpreter without
torch refused before anything starts, naming `h3kit doctor`; one code for "not a ComfyUI tree"; a second start
with other settings names only what differs, and no "starting" line precedes a refusal; `logs` honours
NO_COLOR on a terminal. Stand-in servers only: no torch, no upstream."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import jsondoc
from tests.support.service_helpers import StandinHome, free_port, h3kit, kill_started_under

from h3kit.cli import main
from h3kit.runtime import parity


@pytest.fixture
def home(tmp_path):
    h = StandinHome(tmp_path / "comfy", free_port(8410, 8469))
    yield h
    kill_started_under(h.path)


def no_torch_python(tmp_path):
    """An interpreter that sees no site-packages (python -S): no torch, whatever this environment has."""
    path = tmp_path / "python-without-torch"
    path.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    path.chmod(0o755)
    return path


def test_start_with_an_interpreter_without_torch_is_refused_before_anything_starts(home, tmp_path):
    (home.path / "comfy" / "model_management.py").write_text("import torch\n")  # a ComfyUI that needs torch
    py = no_torch_python(tmp_path)
    r = home.start("--python", py, "--json")
    err = jsondoc.error(r.stdout, r.returncode)
    assert r.returncode == 1 and err["code"] == "python_env", r.stderr
    assert f"{py} has no torch installed: ComfyUI cannot run with it" in err["message"]
    assert f"h3kit doctor --comfy-home {home.path.resolve()} --python {py}" in err["fix"]
    assert "starting" not in r.stderr and home.record() is None and not home.boots()


def test_parity_with_an_interpreter_without_torch_names_doctor(tmp_path):
    tree = tmp_path / "ComfyUI"
    for rel in ("main.py", "comfy/model_management.py") + parity.PATCHED_FILES:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("")
    py = no_torch_python(tmp_path)
    r = h3kit("parity", "--comfy-home", tree, "--python", py, "--device-type", "cpu", "--npu-count", "2", "--json",
              timeout=120)
    err = jsondoc.error(r.stdout, r.returncode)
    assert r.returncode == 1 and err["code"] == "python_env" and "has no torch" in err["message"], r.stderr
    assert "h3kit doctor" in err["fix"]


@pytest.mark.parametrize("args", [
    ["verify"], ["revert"], ["patches", "status"], ["start", "--devices", "0", "--device-type", "cpu"],
    ["parity", "--device-type", "cpu", "--npu-count", "2"], ["calibrate", "--device-type", "cpu", "--npu-count", "2"],
    ["check-workflow", "WF"],
])
def test_not_a_comfyui_tree_is_one_code_and_exit_status(runner, tmp_path, args):
    empty = tmp_path / "empty"
    empty.mkdir()
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps({"1": {"class_type": "EmptyImage", "inputs": {}}}))
    argv = [str(wf) if a == "WF" else a for a in args] + ["--comfy-home", str(empty), "--json"]
    r = runner.invoke(main, argv)
    err = jsondoc.error(r.stdout, r.exit_code)
    assert r.exit_code == 2 and err["code"] == "no_comfy_tree", (args, r.output)
    assert f"{empty} is not a ComfyUI tree (" in err["message"]


def test_a_second_start_with_other_settings_names_only_what_differs(home):
    assert home.start(devices="0").returncode == 0
    r = home.start("--json", devices="0,1")
    err = jsondoc.error(r.stdout, r.returncode)
    assert r.returncode == 1 and err["code"] == "already_running_other_settings"
    assert err["details"]["differ"] == {"devices": {"running": [0], "requested": [0, 1]}}
    assert "runs with other settings: devices [0], not the requested [0, 1]" in err["message"]
    assert "extra_args" not in err["message"] and "starting" not in r.stderr
    same = home.start(devices="0")
    assert same.returncode == 0 and "already running" in same.stdout


def test_logs_honours_no_color_on_a_terminal(home, runner, monkeypatch):
    assert home.start().returncode == 0
    home.report_oom()
    args = ["logs", "--comfy-home", str(home.path), "--runtime-root", str(home.root)]
    from tests.support.service_helpers import wait_for
    wait_for(lambda: "Got an OOM" in runner.invoke(main, args).output, 10, "the OOM lines in the log")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\x1b[31m" in runner.invoke(main, args, color=True).output  # a terminal keeps ComfyUI's colours
    for errors in ([], ["--errors"]):
        monkeypatch.setenv("NO_COLOR", "1")
        out = runner.invoke(main, args + errors, color=True).output
        assert "\x1b[" not in out and "[ERROR]" in out
