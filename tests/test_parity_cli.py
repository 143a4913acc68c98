"""`h3kit parity` refuses a request that cannot mean anything before it looks for a tree or a device (no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3kit.runtime import parity as parity_lib
from tests.support import jsondoc
from tests.support.service_helpers import h3kit


@pytest.mark.parametrize("component", parity_lib.COMPONENTS)
def test_one_device_is_refused_for_every_component(tmp_path, component):
    proc = h3kit("parity", "--comfy-home", tmp_path, "--component", component, "--npu-count", "1", "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    error = jsondoc.error(proc.stdout, proc.returncode)
    assert error["code"] == "meaningless_count" and "compare a model with itself" in error["message"]
    assert "--npu-count 2 or 4" in error["fix"]


@pytest.mark.parametrize("component, fault", [("te", "rope"), ("vae", "heads"), ("dit", "reduce")])
def test_a_fault_of_another_component_is_refused(tmp_path, component, fault):
    proc = h3kit("parity", "--comfy-home", tmp_path, "--component", component, "--npu-count", "2",
                 "--inject-fault", fault)
    assert proc.returncode == 2 and f"{component} has no such fault" in proc.stderr
    assert ", ".join(parity_lib.FAULTS[component]) in proc.stderr and "Traceback" not in proc.stderr


def test_the_gate_is_exact_on_cpu_and_the_measured_floor_times_the_margin_elsewhere():
    from h3kit.runtime import parity_dit
    assert parity_dit._gate("cpu", 0.5) == ("max_abs == 0", None)
    text, limit = parity_dit._gate("npu", 0.01)
    assert limit == pytest.approx(parity_dit.GATE_MARGIN * 0.01) and "unmeasured on hardware" in text
    assert parity_dit._gate("cuda", 0.0)[1] == 0, "a device deterministic to the bit gets an exact gate"
    assert parity_dit.GATE_MARGIN == parity_lib.GATE_MARGIN
    assert "max_abs == 0" in parity_lib.gate("dit", "float", "cpu")
    assert "floor" in parity_lib.gate("dit", "float", "npu") and "unmeasured" in parity_lib.gate("dit", "int8", "cuda")


def test_the_faults_the_command_offers_are_the_worker_s():
    from h3kit.runtime import parity_worker
    for component, faults in parity_lib.FAULTS.items():
        assert set(faults) == set(parity_worker.FAULTS[component]), component


def test_a_rank_s_report_carries_its_lora_verdict_and_override_calls():
    from h3kit.runtime import parity_dit
    probe = parity_dit._DitFault("none", lora={"blocks.0.w": ("a", "b"), "blocks.1.w": ("c", "d")})
    probe.seen = {0: {"blocks.0.w": "once", "blocks.1.w": "once"}, 1: {"blocks.0.w": "once"},
                  2: {"blocks.0.w": "missing", "blocks.1.w": "missing"}, 3: {"blocks.0.w": "once", "blocks.1.w": "wrong"}}
    probe.override_calls = {0: 3}
    reports = [probe.report(r) for r in range(5)]
    assert [parity_dit.LORA_CODES[c % 8] for c in reports] == ["once", "unchecked", "missing", "wrong", "unchecked"]
    assert [c // 8 for c in reports] == [3, 0, 0, 0, 0]
    # what travels to a worker process: the fault and the expected digests, none of this process's counts
    import pickle
    again = pickle.loads(pickle.dumps(probe))
    assert again.lora == probe.lora and again.seen == {} and again.override_calls == {}


FAKE_WORKER = r'''#!{python}
import json, sys
if "--out" not in sys.argv:  # h3kit's interpreter check (envprobe.py): what an NPU host's interpreter holds
    print(json.dumps({{"python": "3.11.7", "torch": "2.14.0", "torch_npu": "2.14.0"}}))
    sys.exit(0)
out = sys.argv[sys.argv.index("--out") + 1]
floor = {{"run_to_run": 1e-3, "attention_variant": 2e-3}}
row = {{"layout": "t2va", "attention": "ulysses", "dtype": "bfloat16", "lora": False, "attention_override": False,
        "sharding": "replicated", "seq_len": 71, "forwards": 4, "max_abs": 0.01, "max_rel": 5e-3, "floor": floor,
        "worst": "video, forward 1", "bytes_received": [10, 12], "weight_bytes_received": [0, 0],
        "bytes_received_plan": [10, 12], "rank_forwards": [4, 4], "gate": "max_rel <= 0.008 (4 x floor 0.002; "
        "unmeasured on hardware)", "pass": True, "failed": []}}
config = {{"devices": ["npu:0", "npu:1"], "dtypes": ["bfloat16"], "steps": 2, "cfg": 2.0, "transport": "threads",
           "gate": "max_rel <= 4 x the floor one device measures on itself (unmeasured on hardware)",
           "floor": {{"bfloat16/t2va": floor}}}}
json.dump({{"ok": True, "rows": [row], "config": config}}, open(out, "w"))
'''


def test_on_npu_the_command_prints_the_gate_and_the_floor(tmp_path):
    """The npu/cuda path (unmeasured on hardware): what the worker reports there, the gate and the floor it was
    sized from, reaches the table; a stand-in worker plays the device's part."""
    import sys
    home = tmp_path / "ComfyUI"
    for rel in ("comfy/model_management.py",) + parity_lib.PATCHED_FILES:
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text("")
    worker = tmp_path / "python"
    worker.write_text(FAKE_WORKER.format(python=sys.executable))
    worker.chmod(0o755)
    proc = h3kit("parity", "--comfy-home", home, "--component", "dit", "--device-type", "npu", "--npu-count", "2",
                 "--python", worker)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gate: max_rel <= 4 x the floor one device measures on itself (unmeasured on hardware)" in proc.stdout
    assert "floor bfloat16/t2va: one device against itself run again 0.001, with another attention backend 0.002" \
        in proc.stdout
    assert "0.002" in proc.stdout.splitlines()[-1] and "pass" in proc.stdout.splitlines()[-1]
    assert "unmeasured on hardware" in proc.stderr  # the verdict line names the gate of the device type


def test_the_thread_transport_needs_the_runtime_modules_too(tmp_path):
    """The components ask comfy.multinpu_process.runtime_for for their runtime and the thread transport runs the wire
    code and built-ins of the process runtime: a tree without them is refused for threads, not only for processes;
    the worker's module alone is the process transport's."""
    for rel in ("comfy/model_management.py",) + parity_lib.PATCHED_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    parity_lib.check_tree(tmp_path, "threads")
    with pytest.raises(Exception, match=r"\(comfy/multinpu_worker.py missing\)"):
        parity_lib.check_tree(tmp_path, "process")
    (tmp_path / "comfy" / "multinpu_wire.py").unlink()
    for transport in ("threads", "process"):
        with pytest.raises(Exception, match=r"\(comfy/multinpu_wire\.py[ ,]") as e:
            parity_lib.check_tree(tmp_path, transport)
        assert e.value.code == "not_patched"


def test_every_file_the_series_adds_is_demanded_for_the_transport_that_imports_it(tmp_path):
    """Issue 40: comfy/multidevice.py and comfy/model_cache.py are added by the series and imported on the thread
    transport too (multinpu_threads, multinpu_runtime_base): a half-patched tree without them is `not_patched`, not an
    ImportError in the worker. Every file under patches/src is demanded, the worker's module by processes only, except
    the server's own (the /metrics route), which no parity run imports."""
    src = Path(__file__).resolve().parents[1] / "patches" / "src"
    added = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    assert set(parity_lib.PATCHED_FILES) | set(parity_lib.PROCESS_FILES) | set(parity_lib.SERVER_FILES) == added
    for rel in ("comfy/model_management.py",) + parity_lib.PATCHED_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "comfy" / "multidevice.py").unlink()
    with pytest.raises(Exception, match=r"\(comfy/multidevice\.py missing\)") as e:
        parity_lib.check_tree(tmp_path, "threads")
    assert e.value.code == "not_patched"
