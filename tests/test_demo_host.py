"""`make demo` on an NPU host builds nothing it cannot use: with the host faked as doctor's tests fake it (an
`npu-smi` on PATH), the Makefile says what to run instead before ensure-venv builds anything (exit 2), runs
the demo with COMFY_PYTHON when one is given (building nothing), and builds the CPU environment only for
DEVICE_TYPE=cpu (h3kit.demohost). The make runs stop before any build: seconds, no environment made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from h3kit import demohost
from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def npu_host(tmp_path, monkeypatch):
    """PATH with an npu-smi in front (detect_device_type's cheap test), and an empty h3kit cache."""
    if shutil.which("make") is None:
        requires.skip("make is not installed (apt-get install make): the README's make demo needs it")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "npu-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return {"PATH": os.environ["PATH"], "H3KIT_CACHE": str(tmp_path / "cache"),
            "H3KIT_BOOTSTRAP_PYTHON": sys.executable}


def make_demo(env: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(ROOT), "demo", f"COMFY_HOME={tmp_path / 'comfy'}", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_make_demo_on_an_npu_host_says_what_to_run_and_builds_nothing(npu_host, tmp_path):
    r = make_demo(npu_host, tmp_path)
    assert r.returncode == 2, r.stderr
    assert "this host has npu devices" in r.stderr and "nothing was built" in r.stderr
    assert "make demo COMFY_PYTHON=" in r.stderr and "make demo DEVICE_TYPE=cpu" in r.stderr
    assert not (tmp_path / "cache").exists() and not (tmp_path / "comfy").exists()  # ensure-venv never ran


def test_make_demo_with_an_npu_interpreter_runs_it_and_builds_nothing(npu_host, tmp_path):
    """COMFY_PYTHON given: the demo runs with it (here a stand-in that records its arguments)."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python-cann"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\nexit 0\n")
    fake.chmod(0o755)
    r = make_demo(npu_host, tmp_path, f"COMFY_PYTHON={fake}", "NPU_COUNT=4")
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == "-c import h3kit, click"  # the check that h3kit is installed there
    assert lines[1] == (f"-m h3kit demo --comfy-home {tmp_path / 'comfy'} --python {fake} --device-type auto "
                        "--npu-count 4")
    assert not (tmp_path / "cache").exists()


def test_the_plan_per_host_and_setting(npu_host, tmp_path):
    assert demohost.plan("cpu", None) == ("cpu", None)  # the CPU simulation on the NPU host
    what, message = demohost.plan("auto", None)
    assert what == "refuse" and "no torch-npu, no CANN" in message
    what, message = demohost.plan("auto", str(tmp_path / "missing-python"))
    assert what == "refuse" and "cannot run" in message
    no_h3kit = tmp_path / "bare-python"
    no_h3kit.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named h3kit' >&2\nexit 1\n")
    no_h3kit.chmod(0o755)
    what, message = demohost.plan("npu", str(no_h3kit))
    assert what == "refuse" and "cannot import h3kit (ModuleNotFoundError: No module named h3kit)" in message
    assert demohost.main(["tpu"]) == 2
