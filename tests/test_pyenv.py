"""The interpreter check: Python range and the torch / torch-npu pairing, judged from package metadata."""

import json
import sys

import pytest

from h3kit import pyenv
from tests.conftest import MANIFEST


def judge(**info):
    base = {"python": [3, 11, 7], "executable": "/x/python", "torch": "2.14.1", "torch_npu": None,
            "torchaudio": "2.11.1", "torchvision": "0.29.1"}
    base.update(info)
    return pyenv.evaluate("/x/python", base, MANIFEST)


def test_cpu_environment_is_fine():
    rep = judge()
    assert rep.errors == [] and rep.warnings == []


def test_tested_npu_pair_is_fine():
    rep = judge(torch="2.14.0", torch_npu="2.14.0")
    assert rep.errors == [] and rep.warnings == []


@pytest.mark.parametrize("torch, npu, fragment", [
    ("2.14.1", "2.14.0", "torch-npu 2.14.0 needs torch 2.14.0.*"),
    ("2.13.0", "2.14.0.post2", "needs torch 2.14.0.*"),
    ("2.14.0+cu130", "2.14.0", "cu130 build"),
])
def test_npu_mismatch_is_an_error_naming_the_fix(torch, npu, fragment):
    rep = judge(torch=torch, torch_npu=npu)
    assert any(fragment in e for e in rep.errors), rep.errors


def test_untested_but_consistent_pair_warns():
    rep = judge(torch="2.13.0", torch_npu="2.13.0")
    assert rep.errors == [] and "not a tested pairing" in rep.warnings[0]


@pytest.mark.parametrize("version", [[3, 9, 18], [3, 14, 0]])
def test_python_outside_range(version):
    assert "outside the supported range" in judge(python=version).errors[0]


def test_missing_torch_warns_but_does_not_block():
    rep = judge(torch=None, torchaudio=None)
    assert rep.errors == [] and "torch is not installed" in rep.warnings[0]


def test_probe_reads_a_real_interpreter_without_importing_torch():
    info = pyenv.probe(sys.executable)
    assert info["python"][:2] == list(sys.version_info[:2])


def test_install_refuses_a_mismatched_interpreter(tmp_path, runner):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho '" + json.dumps({
        "python": [3, 11, 7], "executable": str(fake), "torch": "2.14.1", "torch_npu": "2.14.0",
        "torchaudio": None, "torchvision": None}) + "'\n")
    fake.chmod(0o755)
    from h3kit.cli import main
    r = runner.invoke(main, ["install", "--comfy-home", str(tmp_path / "home"), "--python", str(fake)])
    assert r.exit_code == 1
    assert "torch-npu 2.14.0 needs torch 2.14.0.*" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "home").exists()
