"""The interpreter check: Python range and the torch / torch-npu pairing, judged from package metadata."""

import json
import subprocess
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


def test_cuda_torch_beside_torch_npu_is_found_by_what_it_is_not_by_its_tag():
    """PyPI's default x86_64 torch is a CUDA build whose metadata version has no +cu tag: torch/version.py
    and the shipped libtorch_cuda libraries say what it is."""
    build = {"cuda": "12.8", "hip": None, "libs": ["libc10_cuda.so", "libtorch_cuda.so"]}
    rep = judge(torch="2.14.0", torch_npu="2.14.0", torch_build=build)
    assert any("CUDA 12.8 build" in e and "torch.version.cuda = 12.8" in e and "libc10_cuda.so present" in e
               for e in rep.errors), rep.errors
    assert judge(torch="2.14.0", torch_npu="2.14.0", torch_build={"cuda": None, "hip": None, "libs": []}).errors == []
    rocm = judge(torch="2.14.0", torch_npu="2.14.0", torch_build={"cuda": None, "hip": "6.4", "libs": []})
    assert any("ROCm 6.4 build" in e for e in rocm.errors)
    # the same CUDA build without torch-npu is fine for ComfyUI (this machine's own environment is one)
    assert judge(torch_build=build).errors == []


def test_probe_reads_the_torch_build_from_its_files(tmp_path):
    """envprobe's torch_build on a fake site-packages: version.py assignments, the libraries, no import."""
    site = tmp_path / "site"
    (site / "torch" / "lib").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise SystemExit('torch must not be imported by the probe')\n")
    (site / "torch" / "version.py").write_text("from typing import Optional\n__version__ = '2.14.0'\n"
                                               "cuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n")
    (site / "torch" / "lib" / "libtorch_cuda.so").write_bytes(b"")
    (site / "torch" / "lib" / "libtorch_cpu.so").write_bytes(b"")
    code = f"import sys; sys.path.insert(0, {str(site)!r}); sys.argv = ['x']; exec(open({str(pyenv.PROBE)!r}).read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    build = json.loads(out)["torch_build"]
    assert build["cuda"] == "12.8" and build["hip"] is None and build["libs"] == ["libtorch_cuda.so"]


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


@pytest.mark.parametrize("python, ok", [([3, 10, 0], True), ([3, 13, 9], True), ([3, 9, 18], False),
                                        ([3, 14, 0], False), ([4, 0, 0], False)])
def test_python_range_through_packaging(python, ok):
    assert (judge(python=python).errors == []) is ok


def test_package_drift_names_changes_additions_and_removals():
    recorded = ["torch==2.14.1", "Pillow==13.0.0", "comfy_kitchen==0.2.30", "gone==1"]
    now = ["torch==2.14.0", "pillow==13.0.0", "comfy-kitchen==0.2.30", "new-one==0.1"]
    assert pyenv.package_drift(recorded, now) == {"changed": ["torch 2.14.1 -> 2.14.0"], "added": ["new-one==0.1"],
                                                  "removed": ["gone==1"]}
    assert pyenv.package_drift(now, now) == {"changed": [], "added": [], "removed": []}


def test_probe_lists_the_interpreters_packages():
    rep = pyenv.check(sys.executable, MANIFEST, packages=True)
    names = {p.split("==")[0].lower() for p in rep.packages}
    assert {"click", "psutil", "pyyaml", "websocket-client", "packaging"} <= names
    assert rep.packages == sorted(rep.packages, key=lambda p: p.split("==")[0].lower().replace("_", "-"))
    assert "packages" not in rep.to_dict()["info"]  # the report install prints stays short
