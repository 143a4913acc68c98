"""The first hour of a new user (issue 31): every fix names the command, bad input exits 2 with its code, a
setting that came from the environment says so. One test per numbered item of the issue."""

from __future__ import annotations

import json

import pytest

from h3kit.cli import main
from tests.conftest import MANIFEST
from tests.support import jsondoc
from tests.test_doctor import CPU_HOST, GOOD_NPU, answer, doctor_json, findings, host  # noqa: F401 (fixture)

PAIRING = MANIFEST["torch"]


# ---- item 1 and 2: doctor names the versions and the install line; no torch on cpu is a FAIL ---------------------

def test_doctor_on_cpu_without_torch_fails_naming_the_versions_and_the_command(host, runner):
    py = host.fake_python(dict(CPU_HOST, torch=None, torchaudio=None, torchvision=None, torch_import=None))
    code, rep = doctor_json(runner, "--device-type", "cpu", "--python", py)
    assert code == 1 and rep["ok"] is False
    (torch,) = findings(rep, "torch", "error")
    cpu = PAIRING["cpu"]
    assert f"torch is not installed in {py}" in torch["message"]
    assert f"torch {cpu['torch']}, torchvision {cpu['torchvision']} and torchaudio {cpu['torchaudio']}" in torch["message"]
    assert torch["fix"] == (f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']} "
                            f"--index-url https://download.pytorch.org/whl/cpu && {py} -m pip install --no-deps "
                            f"torchaudio=={cpu['torchaudio']}")
    r = runner.invoke(main, ["doctor", "--device-type", "cpu", "--python", py])
    assert r.exit_code == 1 and "not ready" in r.output and f"fix: {torch['fix']}" in r.output


def test_doctor_on_npu_without_torch_names_torch_npu_and_cann(host, runner):
    py = host.fake_python(answer(torch=None, torch_npu=None, torchaudio=None, torch_import=None, torch_npu_import=None))
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", py)
    npu = PAIRING["npu"][0]
    (torch,) = findings(rep, "torch", "error")
    assert code == 1 and f"torch-npu {npu['torch_npu']}" in torch["message"] and f"CANN {npu['cann']}" in torch["message"]
    assert f"{py} -m pip install torch=={npu['torch']} --index-url https://download.pytorch.org/whl/cpu" in torch["fix"]
    assert f"{py} -m pip install torch-npu=={npu['torch_npu']}" in torch["fix"]
    assert f"install CANN {npu['cann']}" in torch["fix"] and "set_env.sh" in torch["fix"]


def test_doctor_names_the_command_for_a_missing_torch_npu_and_a_wrong_pairing(host, runner):
    npu = PAIRING["npu"][0]
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(answer(torch_npu=None)))
    fixes = [f["fix"] for f in findings(rep, "torch", "error")]
    assert code == 1 and fixes and all(f"torch-npu=={npu['torch_npu']}" in f for f in fixes), fixes
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(answer(torch="2.13.0")))
    fixes = [f["fix"] for f in findings(rep, "torch", "error")]
    assert code == 1 and fixes and all(f"torch=={npu['torch']}" in f for f in fixes), fixes


def test_doctor_without_torchaudio_is_a_fail_with_its_command(host, runner):
    code, rep = doctor_json(runner, "--device-type", "cpu", "--python", host.fake_python(dict(CPU_HOST, torchaudio=None)))
    (audio,) = findings(rep, "torch", "error")
    assert code == 1 and "torchaudio is not installed" in audio["message"]
    assert audio["fix"].endswith(f"-m pip install --no-deps torchaudio=={PAIRING['cpu']['torchaudio']}")


# ---- item 3: demo refuses an interpreter without ComfyUI's requirements up front, and leaves no lock ------------

def no_site_python(tmp_path):
    from tests.test_operator_papercuts import no_torch_python
    return no_torch_python(tmp_path)


@pytest.mark.parametrize("existing", [False, True])
def test_demo_refuses_an_interpreter_without_the_requirements_before_creating_anything(tmp_path, existing):
    from tests.support.service_helpers import h3kit
    home = tmp_path / "demo-home"
    if existing:
        home.mkdir()
    py = no_site_python(tmp_path)
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "1", "--python", py, "--json",
              timeout=120)
    err = jsondoc.error(r.stdout, r.returncode)
    assert r.returncode == 1 and err["code"] == "python_env", r.stderr
    assert f"{py} lacks torch, torchaudio, safetensors" in err["message"]
    assert f"{py} -m pip install torch=={MANIFEST['torch']['cpu']['torch']}" in err["fix"]
    assert "install" not in [line.split(":")[0] for line in r.stderr.splitlines()]  # no stage began
    assert not (home / ".h3kit").exists() and home.exists() == existing


def test_a_demo_that_fails_after_taking_the_lock_leaves_no_lock_behind(tmp_path):
    from tests.support.service_helpers import h3kit
    home = tmp_path / "fresh"
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "1",
              "--source", tmp_path / "no-such-mirror", "--json", timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert not (home / ".h3kit" / "h3kit.lock").exists() and not home.exists(), list(home.rglob("*"))


# ---- item 5: plan --tiers has H3's canvas by default; without --tiers every missing option is named -------------

def test_plan_tiers_defaults_to_h3s_canvas(runner):
    r = runner.invoke(main, ["plan", "--tiers", "--json"])
    doc = jsondoc.data(r.stdout)
    assert r.exit_code == 0 and (doc["width"], doc["height"], doc["frames"]) == (1344, 768, 124), r.output
    given = jsondoc.data(runner.invoke(main, ["plan", "--tiers", "--width", "1344", "--height", "768", "--frames",
                                              "124", "--json"]).stdout)
    assert given == doc
    r = runner.invoke(main, ["plan", "--npu-count", "2", "--width", "1344"])
    assert r.exit_code == 2 and "Missing options --height, --frames" in r.output


# ---- item 11: status on a folder without a tree, install with an interpreter that is not one ---------------------

def test_status_on_a_folder_that_is_not_a_tree_is_no_comfy_tree(runner, tmp_path):
    for home in (tmp_path / "not" / "a" / "tree", tmp_path):
        r = runner.invoke(main, ["status", "--comfy-home", str(home), "--json"])
        err = jsondoc.error(r.stdout, r.exit_code)
        assert r.exit_code == 2 and err["code"] == "no_comfy_tree", r.output
        assert f"{home} is not a ComfyUI tree" in err["message"]


@pytest.mark.parametrize("python, code, status, fragment", [
    ("/nope/python", "bad_python", 2, "/nope/python cannot be run: No such file or directory"),
    ("/usr/bin/false", "python_env", 1, "exited with status 1 and printed nothing: it is not a Python interpreter"),
    ("/usr/bin/true", "python_env", 1, "it printed no report"),
])
def test_install_names_why_an_interpreter_cannot_be_used(runner, tmp_path, python, code, status, fragment):
    r = runner.invoke(main, ["install", "--comfy-home", str(tmp_path / "c"), "--python", python,
                             "--source", str(tmp_path / "mirror"), "--json"])
    err = jsondoc.error(r.stdout, r.exit_code)
    assert (r.exit_code, err["code"]) == (status, code) and fragment in err["message"], r.output
    assert "--python" in err["fix"] and not (tmp_path / "c").exists()


# ---- item 12: a device list taken from the environment says so -------------------------------------------------

@pytest.mark.parametrize("var", ["ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"])
def test_a_bad_device_list_from_the_environment_names_the_variable(runner, tmp_path, monkeypatch, var):
    for other in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "H3KIT_COMFY_HOME"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(var, "0-3")
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps({"1": {"class_type": "MultiNPUParallelConfig", "inputs": {"npu_count": 4}}}))
    r = runner.invoke(main, ["check-workflow", str(wf), "--json"])
    err = jsondoc.error(r.stdout, r.exit_code)
    assert r.exit_code == 2 and err["code"] == "bad_device_list", r.output
    assert err["message"].startswith(f"{var} in the environment: device list '0-3'")
    assert f"unset {var} and pass --devices" in err["fix"]


# ---- check-workflow: a diffusion-model wrapper node after MultiNPUParallelConfig (EasyCache) ---------------------

def _with_cache(node_type: str, after: bool) -> dict:
    from tests.support.check_workflow_helpers import deep, load_data
    prompt = deep(load_data("api_t2va.json"))
    inputs = {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": False}
    if after:  # MultiNPUParallelConfig -> cache -> guider and scheduler
        prompt["20"] = {"class_type": node_type, "inputs": {"model": ["6", 0], **inputs}}
        prompt["8"]["inputs"]["model"] = prompt["9"]["inputs"]["model"] = ["20", 0]
    else:  # LoRA -> cache -> MultiNPUParallelConfig
        prompt["20"] = {"class_type": node_type, "inputs": {"model": ["2", 0], **inputs}}
        prompt["6"]["inputs"]["model"] = ["20", 0]
    return prompt


def test_easycache_after_the_config_node_is_an_error_naming_the_fix_and_before_it_is_clean(tmp_path):
    from tests.support.check_workflow_helpers import check_doc, found, messages
    result = check_doc(tmp_path, _with_cache("EasyCache", after=True), devices="0,1,2,3")
    assert found(result) == [("H3111", "20")] and result.exit_code == 1
    (msg,) = messages(result, "H3111")
    assert "move EasyCache before MultiNPUParallelConfig" in msg
    assert found(check_doc(tmp_path, _with_cache("EasyCache", after=False), devices="0,1,2,3")) == []
    # LazyCache wraps predict_noise, outside the DiT forward: the runtime refuses it on neither side
    assert found(check_doc(tmp_path, _with_cache("LazyCache", after=True), devices="0,1,2,3")) == []
    # at npu_count 1 the node passes the model through, and EasyCache after it runs (benchmarks/step_cache.py)
    one = _with_cache("EasyCache", after=True)
    one["6"]["inputs"]["npu_count"] = 1
    assert found(check_doc(tmp_path, one, devices="0")) == []


def test_start_without_torch_names_the_install_line_itself(tmp_path):
    from tests.support.service_helpers import h3kit
    tree = tmp_path / "ComfyUI"
    (tree / "comfy").mkdir(parents=True)
    (tree / "main.py").write_text("")
    (tree / "comfy" / "model_management.py").write_text("import torch\n")  # a ComfyUI that needs torch
    py = no_site_python(tmp_path)
    r = h3kit("start", "--comfy-home", tree, "--devices", "0", "--device-type", "cpu", "--python", py, "--json",
              timeout=60)
    err = jsondoc.error(r.stdout, r.returncode)
    cpu = MANIFEST["torch"]["cpu"]
    assert r.returncode == 1 and err["code"] == "python_env", r.stderr
    assert err["fix"].startswith(f"{py} -m pip install torch=={cpu['torch']} torchvision=={cpu['torchvision']}")
    assert f"h3kit doctor --comfy-home {tree.resolve()} --python {py}" in err["fix"]
