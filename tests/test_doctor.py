"""`h3kit doctor` against crafted environments.

The ComfyUI interpreter is stood in for by small scripts that print a crafted probe answer (what
toolkit/h3kit/envprobe.py --deep prints on an NPU or GPU host) and record the environment they were
started with; `npu-smi` and `nvidia-smi` by scripts on PATH printing the answers in tests/data/smi/
(hand-written to the tools' formats, not captured on hardware). One test runs the real probe in the real
interpreter, and the tree tests use a real installed tree.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest

from h3kit import doctor, smi
from h3kit.cli import main
from h3kit.runtime import costmodel
from tests.conftest import MANIFEST, ROOT
from tests.support import jsondoc
from tests.support.hub_standin import manifest_with_figures

SMI_DATA = ROOT / "tests" / "data" / "smi"
GIB = 1024 ** 3
GOOD_NPU = {
    "python": [3, 11, 7], "executable": "/opt/h3/bin/python3.11", "torch": "2.14.0", "torch_npu": "2.14.0",
    "torchaudio": "2.14.0", "torchvision": "0.29.0", "comfy_kitchen": "0.2.30", "prometheus_client": "0.26.0",
    "torch_build": {"path": "/opt/h3/lib/python3.11/site-packages/torch", "cuda": None, "hip": None, "libs": []},
    "env": {},
    "cann": {"home": "/usr/local/Ascend/ascend-toolkit/latest", "version": "9.2.0",
             "file": "/usr/local/Ascend/ascend-toolkit/latest/aarch64-linux/ascend_toolkit_install.info",
             "searched": ["/usr/local/Ascend/ascend-toolkit/latest"]},
    "torch_import": {"ok": True, "version": "2.14.0", "cuda": None, "hip": None, "debug": False},
    "torch_npu_import": {"ok": True, "version": "2.14.0"},
    "devices": {"kind": "npu", "count": 4,
                "list": [{"index": i, "name": "Ascend910B3", "free": 61 * GIB, "total": 64 * GIB} for i in range(4)]},
}


def answer(**changes):
    out = copy.deepcopy(GOOD_NPU)
    for key, value in changes.items():
        out[key] = value
    return out


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A host to craft: fake_python(answer) writes the interpreter, tool(name, text|None, rc) the driver tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for var in ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "H3KIT_COMFY_HOME"):
        monkeypatch.delenv(var, raising=False)

    class Host:
        env_file = tmp_path / "probe-env.json"

        def fake_python(self, probe_answer):
            path = tmp_path / "python"
            path.write_text("#!/bin/sh\n"
                            f"{shlex.quote(sys.executable)} -c 'import json, os, sys; "
                            f"json.dump(dict(os.environ, ARGV=\" \".join(sys.argv[1:])), open(sys.argv[1], \"w\"))' "
                            f"{shlex.quote(str(self.env_file))} \"$@\"\n"
                            f"cat <<'EOF'\n{json.dumps(probe_answer)}\nEOF\n")
            path.chmod(0o755)
            return str(path)

        def tool(self, name, text=None, rc=0):
            path = bin_dir / name
            body = f"cat <<'EOF'\n{text}\nEOF\n" if text is not None else ""
            path.write_text(f"#!/bin/sh\n{body}exit {rc}\n")
            path.chmod(0o755)

        def probe_env(self):
            return json.loads(self.env_file.read_text())

    return Host()


def doctor_json(runner, *args):
    r = runner.invoke(main, ["doctor", "--json", *args])
    assert "Traceback" not in r.output, r.output
    doc = jsondoc.document(r.stdout, r.exit_code)
    return r.exit_code, {"ok": doc["ok"], **doc["data"]}


def findings(report, check, severity=None):
    return [f for f in report["findings"] if f["check"] == check and (severity is None or f["severity"] == severity)]


def only_message(report, check, severity):
    got = findings(report, check, severity)
    assert len(got) == 1, report["findings"]
    return got[0]["message"]


CPU_HOST = dict(copy.deepcopy(GOOD_NPU), torch_npu=None, cann=None, torch_npu_import=None,
                devices={"kind": "cpu", "count": 0, "list": []})
NPU_SMI = (SMI_DATA / "npu-smi-info-4x910b.txt").read_text()


def test_a_good_npu_host_is_ready_and_exposes_the_devices_as_start_does(host, runner):
    host.tool("npu-smi", NPU_SMI.replace("Warning", "OK     "))
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1,2,3", "--python", host.fake_python(GOOD_NPU))
    assert code == 0 and rep["ok"] and rep["errors"] == 0, rep["findings"]
    assert "listed for torch-npu 2.14.0" in only_message(rep, "cann", "ok")
    assert "npu-smi 25.2.0: 4 device(s) (910B3)" in only_message(rep, "driver", "ok")
    assert "torch sees 4 npu device(s) with ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in only_message(rep, "devices", "ok")
    # 61 GiB free: BF16 (66.3 GB of weights) does not fit one card, INT8 does; a warning, not an error
    assert "INT8 weights fit" in only_message(rep, "memory", "warning")
    env = host.probe_env()
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3" and env["ARGV"].endswith("--deep --device-type npu")


def test_missing_cann(host, runner):
    probe = answer(cann={"home": None, "file": None, "version": None, "searched": ["/usr/local/Ascend/ascend-toolkit/latest"]},
                   torch_npu_import={"ok": False, "error": "ImportError: libhccl.so: cannot open shared object file"},
                   devices={"kind": "npu", "count": 0, "list": [], "error": "torch.npu.is_available() is False"})
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(probe))
    assert code == 1
    errors = findings(rep, "cann", "error")
    assert any("CANN not found (looked in /usr/local/Ascend/ascend-toolkit/latest)" in f["message"]
               and "needs CANN 9.2.0 (9.1.x compatible)" in f["message"] and "set_env.sh" in f["fix"] for f in errors)
    assert any("libhccl.so" in f["message"] for f in errors)
    assert "torch sees no npu device" in only_message(rep, "devices", "error")


def test_cuda_torch_beside_torch_npu_is_found_by_its_build_not_its_tag(host, runner):
    probe = answer(torch_build={"path": "/x/torch", "cuda": "12.8", "hip": None, "libs": ["libtorch_cuda.so"]})
    assert "+" not in probe["torch"]
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(probe))
    assert code == 1
    message = only_message(rep, "torch", "error")
    assert "CUDA 12.8 build (torch.version.cuda = 12.8, libtorch_cuda.so present)" in message
    assert "torch-npu 2.14.0 needs the CPU build" in message


@pytest.mark.parametrize("changes, check, fragment", [
    ({"torch": "2.14.1"}, "torch", "torch-npu 2.14.0 needs torch 2.14.0.*"),
    ({"cann": dict(GOOD_NPU["cann"], version="8.5.0")}, "cann", "CANN 8.5.0 (from "),
    ({"torch_npu": None}, "torch", "torch-npu is not installed"),
])
def test_a_wrong_pairing_is_an_error(host, runner, changes, check, fragment):
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(answer(**changes)))
    assert code == 1
    assert any(fragment in f["message"] for f in findings(rep, check, "error")), rep["findings"]


def test_cann_91_is_compatible_with_torch_npu_2140(host, runner):
    code, rep = doctor_json(runner, "--device-type", "npu", "--python",
                            host.fake_python(answer(cann=dict(GOOD_NPU["cann"], version="9.1.3"))))
    assert "CANN 9.1.3" in only_message(rep, "cann", "ok") and "compatible" in only_message(rep, "cann", "ok")


def test_fewer_devices_than_asked(host, runner):
    probe = answer(devices={"kind": "npu", "count": 2, "list": GOOD_NPU["devices"]["list"][:2]})
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1,2,3", "--python", host.fake_python(probe))
    assert code == 1
    assert "4 device(s) asked (--devices), but torch sees only 2 with ASCEND_RT_VISIBLE_DEVICES=0,1,2,3" in \
        only_message(rep, "devices", "error")


def test_the_driver_tool_is_read_against_the_devices(host, runner):
    two_cards = "\n".join(NPU_SMI.splitlines()[:12] + NPU_SMI.splitlines()[-5:])
    host.tool("npu-smi", two_cards)
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1,2,3", "--python", host.fake_python(GOOD_NPU))
    assert code == 1
    assert "device id(s) 2, 3 do not exist: npu-smi lists 2 device(s)" in only_message(rep, "devices", "error")
    host.tool("npu-smi", NPU_SMI)  # card 2 reports health Warning
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1,2,3", "--python", host.fake_python(GOOD_NPU))
    assert "device 2 (910B3) reports health Warning" in only_message(rep, "driver", "warning")
    host.tool("npu-smi", "dcmi module initialize failed. ret is -8005", rc=1)
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(GOOD_NPU))
    assert code == 1 and "npu-smi exited with 1: dcmi module initialize failed" in only_message(rep, "driver", "error")


def test_no_driver_tool_is_a_warning_and_memory_falls_back_to_it(host, runner):
    probe = answer(devices={"kind": "npu", "count": 4, "list": [{"index": i, "name": "910B3"} for i in range(4)]})
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(probe))
    assert "npu-smi is not on PATH" in only_message(rep, "driver", "warning")
    assert "free device memory is unknown" in only_message(rep, "memory", "warning")
    host.tool("npu-smi", NPU_SMI)
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1", "--python", host.fake_python(probe))
    free = rep["facts"]["free_memory"]
    assert free == [(65536 - 3302) * smi.MIB, (65536 - 3299) * smi.MIB]  # HBM total - used of cards 0 and 1


def test_a_shell_variable_that_differs_from_devices_is_named(host, runner, monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    code, rep = doctor_json(runner, "--device-type", "npu", "--devices", "0,1", "--python", host.fake_python(GOOD_NPU))
    assert "this shell sets ASCEND_RT_VISIBLE_DEVICES=4,5, but --devices is 0,1" in only_message(rep, "devices", "warning")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1, 2")
    code, rep = doctor_json(runner, "--device-type", "npu", "--python", host.fake_python(GOOD_NPU))
    assert code == 1 and "is not a non-negative integer" in findings(rep, "devices", "error")[0]["message"]


def test_cuda_host(host, runner):
    host.tool("nvidia-smi", (SMI_DATA / "nvidia-smi-query-2gpu.csv").read_text())
    probe = answer(torch_npu=None, cann=None, torch_npu_import=None, torch="2.14.0",
                   torch_build={"path": "/x", "cuda": "12.8", "hip": None, "libs": ["libtorch_cuda.so"]},
                   devices={"kind": "cuda", "count": 2, "list": [
                       {"index": 0, "name": "NVIDIA H200", "free": 140 * GIB, "total": 141 * GIB},
                       {"index": 1, "name": "NVIDIA H200", "free": 90 * GIB, "total": 141 * GIB}]})
    code, rep = doctor_json(runner, "--device-type", "cuda", "--devices", "0,1", "--python", host.fake_python(probe))
    assert code == 0, rep["findings"]
    assert not findings(rep, "cann") and "nvidia-smi 570.124.06: 2 device(s)" in only_message(rep, "driver", "ok")
    assert host.probe_env()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert "fits 768p/5 s at BF16" in only_message(rep, "memory", "ok")
    cpu_build = dict(probe, torch_build={"path": "/x", "cuda": None, "hip": None, "libs": []})
    code, rep = doctor_json(runner, "--device-type", "cuda", "--python", host.fake_python(cpu_build))
    assert code == 1 and "is not a CUDA build" in only_message(rep, "torch", "error")


def test_a_bad_device_list_is_bad_input(runner):
    r = runner.invoke(main, ["doctor", "--device-type", "npu", "--devices", "1,0"])
    assert r.exit_code == 2 and "ids must be ascending" in r.output and "Traceback" not in r.output


def test_an_interpreter_that_cannot_answer(host, runner, tmp_path):
    bad = tmp_path / "broken-python"
    bad.write_text("#!/bin/sh\necho 'error while loading shared libraries: libpython3.11.so.1.0' >&2\nexit 127\n")
    bad.chmod(0o755)
    code, rep = doctor_json(runner, "--device-type", "cpu", "--python", str(bad))
    assert code == 1
    assert "could not run the environment probe (exit 127): error while loading shared libraries" in \
        only_message(rep, "interpreter", "error")
    code, rep = doctor_json(runner, "--device-type", "cpu", "--python", str(tmp_path / "nope"))
    assert code == 1 and "is not an executable file" in only_message(rep, "interpreter", "error")


@pytest.mark.torch  # the probe runs in this interpreter, which must be the ComfyUI environment
def test_the_real_interpreter_answers_without_torch_in_doctors_process(tmp_path):
    """The real probe in the real interpreter (torch imported there), and no torch in h3kit's process."""
    code = ("import sys, json\nfrom h3kit.cli import main\n"
            "try:\n    main(['doctor', '--json', '--device-type', 'cpu', '--python', sys.executable])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "print('TORCH=' + str('torch' in sys.modules) + ' RC=' + str(rc), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "TORCH=False RC=0" in proc.stderr, proc.stderr[-2000:]
    rep = jsondoc.data(proc.stdout)
    torch = only_message(rep, "torch", "ok")
    assert torch.startswith("torch 2.") and rep["facts"]["probe"]["torch_import"]["ok"] is True


# ---- models, tree ----------------------------------------------------------------------------------

def safetensors_bytes(n_floats=4):
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_floats], "data_offsets": [0, 4 * n_floats]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * (4 * n_floats)


def write_models(home, skip=(), elsewhere=None):
    for (kind, name) in doctor.shipped_model_files():
        if name in skip:
            continue
        folder = (elsewhere if elsewhere and kind == "loras" else home / "models" / kind)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(safetensors_bytes())


def test_shipped_workflows_name_the_h3_model_files():
    needed = doctor.shipped_model_files()
    assert needed[("diffusion_models", "minimax_h3_ref2va_bf16.safetensors")] == ["ref2va_8steps_lora.json"]
    assert needed[("vae", "minimax_h3_audio_vae_fp32.safetensors")] == [
        "fl2va_8steps_lora.json", "ref2va_8steps_lora.json", "t2va_8steps_lora.json"]
    assert len(needed) == 7


def test_model_files_missing_truncated_and_from_extra_model_paths(host, tmp_path, runner, monkeypatch):
    # small stand-in files: the published sizes (tens of GB) are tested in tests/test_models_pinned.py
    monkeypatch.setenv("H3KIT_MODELS_MANIFEST", str(manifest_with_figures(tmp_path / "manifest.json")))
    home = tmp_path / "ComfyUI"
    (home / "models").mkdir(parents=True)
    (home / "main.py").write_text("")
    lora_dir = tmp_path / "shared" / "loras"
    (home / "extra_model_paths.yaml").write_text(f"shared:\n  base_path: {tmp_path / 'shared'}\n  loras: loras\n")
    write_models(home, skip={"minimax_h3_ref2va_bf16.safetensors"}, elsewhere=lora_dir)
    args = ["--device-type", "cpu", "--comfy-home", str(home), "--python", host.fake_python(CPU_HOST)]
    code, rep = doctor_json(runner, *args)
    # two of three shipped workflows can run: the missing ref2va DiT is a warning naming its user
    missing = only_message(rep, "models", "warning")
    assert missing == "1 model file(s) missing, needed by ref2va_8steps_lora.json"
    (finding,) = findings(rep, "models", "warning")  # the fetch command; the file and its source, as models list says
    assert finding["fix"].startswith("h3kit models fetch ") and f"ref2va_8steps_lora.json --comfy-home {home}" in finding["fix"]
    (line,) = finding["lines"]
    assert line.startswith("diffusion_models/minimax_h3_ref2va_bf16.safetensors (needed by ref2va_8steps_lora.json;")
    assert "huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models/minimax_h3_ref2va_bf16.safetensors " \
           "(the workflow's properties.models)" in line
    info = findings(rep, "models", "info")[0]
    assert "6 of 7 model file(s) found" in info["message"] and "ready: fl2va_8steps_lora.json, t2va_8steps_lora.json" in info["message"]
    assert any(str(lora_dir) in line for line in info["lines"])  # found through extra_model_paths.yaml, with its size
    assert "is not a ComfyUI tree (not a git checkout)" in only_message(rep, "tree", "error")  # a folder, not an installed tree

    dit = home / "models" / "diffusion_models" / "minimax_h3_fl2va_bf16.safetensors"
    dit.write_bytes(safetensors_bytes(1000)[:500])  # a download cut short
    (home / "models" / "unet").mkdir()
    (home / "models" / "unet" / "minimax_h3_ref2va_bf16.safetensors").write_bytes(safetensors_bytes())
    code, rep = doctor_json(runner, *args)
    assert code == 1
    assert f"minimax_h3_fl2va_bf16.safetensors: truncated: 500 of {len(safetensors_bytes(1000))} bytes" in only_message(rep, "models", "error")
    assert not findings(rep, "models", "warning")  # the ref2va DiT is found in models/unet now

    for f in [*(home / "models").rglob("*.safetensors"), *lora_dir.iterdir()]:
        f.unlink()
    code, rep = doctor_json(runner, *args)
    (finding,) = findings(rep, "models", "error")  # no workflow can run: one error, one command for all seven
    assert finding["message"].startswith("7 model file(s) missing, needed by fl2va_8steps_lora.json, "
                                         "ref2va_8steps_lora.json, t2va_8steps_lora.json")
    assert len(finding["lines"]) == 7 and finding["fix"].count("h3kit models fetch ") == 1
    assert all(f"workflows/{wf}" in finding["fix"] for wf in ("fl2va_8steps_lora.json", "ref2va_8steps_lora.json",
                                                              "t2va_8steps_lora.json"))


@pytest.mark.parametrize("blob, fragment", [
    (b"", "too short"), (b"\xff" * 8 + b"{}", "does not fit"), ((5).to_bytes(8, "little") + b"nojsn", "unreadable"),
])
def test_safetensors_header_problems(tmp_path, blob, fragment):
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    assert fragment in doctor.safetensors_problem(str(path))
    path.write_bytes(safetensors_bytes())
    assert doctor.safetensors_problem(str(path)) is None


def _snapshot(tree):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in tree.rglob("*") if p.is_file()}


def test_a_broken_installed_tree_and_doctor_writes_nothing(installed_tree, host, tmp_path, runner):
    home = tmp_path / "tree"
    shutil.copytree(installed_tree, home, symlinks=True)  # new inodes: git would refresh its index if allowed
    args = ["--device-type", "cpu", "--comfy-home", str(home), "--python", host.fake_python(CPU_HOST)]
    before = _snapshot(home)
    code, rep = doctor_json(runner, *args)
    assert f"installed at the pin {MANIFEST['upstream']['commit'][:12]} with" in only_message(rep, "tree", "ok")
    assert "not running (no record)" in only_message(rep, "service", "info")
    assert _snapshot(home) == before, "doctor must not write into the tree (git index included)"
    target = home / "comfy" / "multinpu.py"
    target.write_text(target.read_text().replace("DEFAULT_TIMEOUT = 300.0", "DEFAULT_TIMEOUT = 30.0"))
    code, rep = doctor_json(runner, *args)
    assert code == 1
    assert any("comfy/multinpu.py differs from what the series produces" in f["message"]
               for f in findings(rep, "tree", "error")), rep["findings"]


# ---- the pieces ------------------------------------------------------------------------------------------

def test_npu_smi_table_parses_per_card():
    got = smi.parse_npu_smi(NPU_SMI)
    assert got["version"] == "25.2.0" and [d["npu"] for d in got["devices"]] == [0, 1, 2, 3]
    assert got["devices"][2] == {"npu": 2, "name": "910B3", "health": "Warning", "chip": 0, "bus_id": "0000:81:00.0",
                                 "used": 41250 * smi.MIB, "total": 65536 * smi.MIB}


def test_nvidia_smi_csv_parses():
    got = smi.parse_nvidia_smi((SMI_DATA / "nvidia-smi-query-2gpu.csv").read_text())
    assert got["version"] == "570.124.06"
    assert got["devices"][1] == {"index": 1, "name": "NVIDIA H200", "total": 143771 * smi.MIB, "free": 97211 * smi.MIB}


@pytest.mark.parametrize("version, verdict", [("9.2.0", "listed"), ("9.2.0.1", "listed"), ("9.1.3", "compatible"),
                                              ("9.1.RC1", "compatible"), ("9.0.0", None), ("8.5.0", None), ("", None)])
def test_cann_pairing(version, verdict):
    assert doctor.cann_pairing(version, MANIFEST["torch"]["npu"][0]) == verdict


def test_tier_memory_is_the_plans_memory():
    verdicts = doctor.tier_memory([64 * GIB, 64 * GIB, 64 * GIB, 20 * GIB])
    assert [(v["npu_count"], v["geometry"]) for v in verdicts] == [
        (1, "768p/5s"), (1, "768p/15s"), (2, "768p/5s"), (2, "768p/15s"), (4, "768p/5s"), (4, "768p/15s")]
    for v in verdicts:
        w, h, f = costmodel.GEOMETRIES[v["geometry"]]
        assert v["need_bf16"] == costmodel.plan(w, h, f, v["npu_count"])["memory_per_device"]["total"]
    by = {(v["npu_count"], v["geometry"]): v["verdict"] for v in verdicts}
    assert by[(1, "768p/5s")] == "INT8 weights fit; BF16 only with partial loading"
    assert by[(4, "768p/15s")] == "BF16 and INT8 only with partial loading"  # the 20 GiB card decides
    assert doctor.tier_memory([2 * GIB])[1]["verdict"] == "does not fit"
