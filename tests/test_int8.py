"""INT8 H3 weights in a patched tree: the pin's layout through the stock loader, the NPU arm (comfy/npu_quant.py,
its reference kernels on this CPU) against upstream's own dequantized result, the per-layer choice, sequence
parallel parity with INT8 weights, and INT8 weights anchored once per host.

tests/support/int8_checks.py runs once in the ComfyUI interpreter with 4 simulated devices and reports what each
check observed; the tests below assert on it. The parity tests run `h3kit parity --weights int8` (on 4 devices) and
the same runs through the library (PARITY_JOBS, in one worker).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from h3kit.runtime import parity as parity_lib
from tests.support import checks_runner
from tests.support.checks_runner import value
from tests.support.service_helpers import h3kit
from tests.support import jsondoc
from tests.test_parity_dit import check_weights

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
SUPPORT = Path(__file__).resolve().parent / "support"
# the gates against upstream's dequantized result (docs/int8.md): measured 6.2e-3 to 7.1e-3 (W8A8) and 3.1e-3 to
# 4.2e-3 (W8A16, the bf16 rounding) on the tiny DiT; the pin's own eager W8A8 measures 5.9e-3 to 6.7e-3
W8A8_REL_RMS, W8A8_COS, W8A8_VS_PIN = 1e-2, 0.9999, 1.25
W8A16_REL_RMS, W8A16_COS = 6e-3, 0.99995


@pytest.fixture(scope="module")
def checks(installed_tree, comfy_python, tmp_path_factory):
    return checks_runner.run_script(SUPPORT / "int8_checks.py", installed_tree, comfy_python,
                                    tmp_path_factory.mktemp("int8_checks"),
                                    env={"H3KIT_NPU_INT8": None, "H3KIT_NPU_INT8_LINEAR": None})


def test_the_tiny_int8_dit_is_stored_and_loaded_as_the_pin_does_int8(checks):
    v = value(checks, "layout")
    assert v["model"] == "MiniMaxH3Model" and v["quant_config"] == {"mixed_ops": True}
    assert v["ops"].endswith("MixedPrecisionOps.Linear")
    blocks = [f"{p}blocks.{i}.{lin}" for p, n in (("", 2), ("token_refiner.", 1)) for i in range(n)
              for lin in ("attn.out_proj", "attn.qkv_proj", "mlp.fc1", "mlp.fc2")]
    assert v["layers"] == sorted(blocks)
    assert v["layout"] == "TensorWiseINT8Layout" and v["qdata"] == "torch.int8"
    assert v["convrot"] is True and v["groupsize"] == 64
    assert v["scale"] == ["torch.float32", [384, 1]], "per output channel"
    assert v["float_layers"] == ["Parameter", "Parameter"], "fp32 islands and adaLN stay in float"
    assert v["keys_per_layer"] == ["comfy_quant", "weight", "weight_scale"] and v["int8_keys"] == 36
    assert v["state_dict_round_trip"], "upstream's own state_dict() gives the file's INT8 entries back"


def test_both_int8_entry_points_reach_the_npu_arm(checks):
    v = value(checks, "dispatch")
    assert v["priority"][0] == "npu" and v["backend"] == "npu" and v["kernels"] == "ReferenceOps"
    # MixedPrecisionOps.Linear (qkv_proj, fc1) and linear_input_act (fc2, swiglu), 40 rows, ConvRot: W8A8
    assert v["calls"] == {"w8a8/reference": 3}
    assert v["off"] == {"backend": "eager", "calls": {}}, "H3KIT_NPU_INT8=off: upstream's path"
    assert v["npu_without_torch_npu"] == "eager" and v["no_simulation"] == "eager"


def test_per_layer_choice_and_the_measurement_behind_it(checks):
    v = value(checks, "policy")
    t = v["table"]
    assert all(t[f"{rows}/{act}/{rot}"] == "w8a16" for rows in (7, 16) for act in ("None", "swiglu")
               for rot in ("False", "True")), "few rows: weight-only"
    assert t["4096/None/False"] == t["4096/None/True"] == t["4096/swiglu/True"] == t["17/None/True"] == "w8a8"
    assert t["4096/swiglu/False"] == t["17/swiglu/False"] == "w8a16", "down projection without ConvRot"
    assert v["forced"] == ["w8a16", "w8a8"]
    e = v["w8a8_rel_rms"]
    assert v["kurtosis"]["fc2_in"] > 3 * v["kurtosis"]["fc1_in"], "the SwiGLU product is heavy-tailed"
    assert e["fc2/plain"] > 1.5 * e["fc1/plain"], "without ConvRot per-token int8 hurts the down projection"
    assert e["fc2/convrot"] < 1.2 * e["fc1/convrot"], "ConvRot flattens it: W8A8 is fine there"


def test_the_arm_against_upstreams_dequantized_result(checks):
    rows = value(checks, "versus_upstream")
    assert {r["mode"] for r in rows} == {"w8a8", "w8a16"} and len(rows) == 12
    for r in rows:
        for side in ("arm", "arm_bf16"):
            m = r[side]
            if r["mode"] == "w8a8":
                assert m["rel_rms"] <= W8A8_REL_RMS and m["cos"] >= W8A8_COS, r
                assert m["rel_rms"] <= W8A8_VS_PIN * r["pin_eager"]["rel_rms"], r
            else:
                assert m["rel_rms"] <= W8A16_REL_RMS and m["cos"] >= W8A16_COS, r


def test_subtle_faults_miss_the_gates(checks):
    v = value(checks, "faults")
    pin = v["pin_eager"]["rel_rms"]
    assert v["sound"]["rel_rms"] <= W8A8_REL_RMS and v["sound"]["rel_rms"] <= W8A8_VS_PIN * pin
    for fault in ("not_rotated", "per_tensor_scale", "truncating"):
        m = v[fault]
        assert m["rel_rms"] > W8A8_REL_RMS or m["rel_rms"] > W8A8_VS_PIN * pin, (fault, m)


def test_the_reference_w8a8_is_the_pins_w8a8(checks):
    v = value(checks, "exact_w8a8")
    assert v["int8_equal"] and v["scales_equal"], "same int8 activations and per-token scales as comfy-kitchen's"
    assert v["max_ulp"] <= 1, "outputs within one bf16 rounding of the pin's fp32 result"
    assert 0 < v["bf16_division_differs"] < 0.5 and v["bf16_division_max_step"] == 1, \
        "the pin's bf16 path divides in bf16: some values one step apart (documented difference)"


def test_per_token_scales_make_shards_exact(checks):
    v = value(checks, "shards")
    assert v["w8a8"] and v["w8a16"]
    assert v["per_tensor_max_rel"] > 1e-5, "a per-tensor activation scale would break sequence-parallel parity"


def test_int8_weights_stay_one_host_copy_through_unload_cycles(checks):
    v = value(checks, "anchors")
    assert v["replicas"] == 3 and v["cycles"] == 9 and v["int8_weights"] == 12
    assert v["all_back_to_source"] and v["host_copies"] == 1.0 and v["anchored_storages_equal"]
    assert v["unanchored_back_from_meta"] == "fails", "the control: only the anchor brings them back"


# the library-driven INT8 parity runs, in one parity worker (parity_lib.run_jobs: one interpreter and ComfyUI import
# for both), each still a run of its own; the rows on 4 devices come from `h3kit parity` itself
PARITY_JOBS = {"rows": dict(component="dit", npu_count=2, weights="int8"),
               # the gather fault on two layouts (the CLI's exit code for it is covered by tests/test_parity_te_vae.py)
               "fault": dict(component="dit", npu_count=2, weights="int8", fault="shard",
                             extra_args=("--layouts", "t2va,ref2va"))}


@pytest.fixture(scope="module")
def parity_runs(installed_tree, comfy_python):
    reports = parity_lib.run_jobs(installed_tree, "cpu", list(PARITY_JOBS.values()), python=comfy_python,
                                  timeout=1800)
    return {name: (report, PARITY_JOBS[name]["npu_count"]) for name, report in zip(PARITY_JOBS, reports, strict=True)}


@pytest.mark.parametrize("n", [2, 4])
def test_int8_parity_rows(installed_tree, comfy_python, request, n):
    if n == 2:  # the shared worker's run
        report = parity_lib.checked(*request.getfixturevalue("parity_runs")["rows"])
        assert report["ok"], report["log_tail"][-3000:]
        rows = report["rows"]
    else:  # the command, which also says the INT8 gate
        proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "dit", "--device-type", "cpu",
                     "--npu-count", str(n), "--weights", "int8", "--python", comfy_python, "--json")
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = jsondoc.data(proc.stdout, proc.returncode)
        assert f"parity passed: 9 row(s) within {parity_lib.gate('dit', 'int8')}" in proc.stderr
    # replicated in both attention modes, and sharded (INT8 data and scales sliced by one cut) with Ulysses
    assert len(rows) == 9 and {r["weights"] for r in rows} == {"int8"}
    assert sorted(r["sharding"] for r in rows) == ["replicated"] * 6 + ["sharded"] * 3
    for r in rows:
        assert r["pass"] and r["max_abs"] == 0 and r["gate"].startswith("max_abs == 0"), r  # exact on cpu
        for side in ("int8_calls_single", "int8_calls_parallel"):
            assert set(r[side]) == {"w8a8/reference", "w8a16/reference"}, r
        # every rank ran its blocks' four INT8 linears in W8A8: 3 blocks x 4 linears x n ranks x 4 forwards
        assert r["int8_calls_parallel"]["w8a8/reference"] == 3 * 4 * n * 4
        check_weights(r, n)  # resident bytes and gathers against the plan's INT8 layout; sharded == replicated


def test_int8_parity_injected_fault_fails(parity_runs):
    report = parity_lib.checked(*parity_runs["fault"])
    rows = report["rows"]
    assert not report["ok"] and len(rows) == 6 and not any(r["pass"] for r in rows)
    assert all(r["max_rel"] > 0.1 and set(r["int8_calls_parallel"]) == {"w8a8/reference", "w8a16/reference"}
               for r in rows), "the INT8 rows fail on the fault itself, not on missing calls"


def test_int8_parity_refusals(installed_tree, comfy_python):
    """--weights int8 is for the DiT; where the NPU INT8 arm cannot run (here: switched off), an error says so."""
    import os
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "te", "--device-type", "cpu",
                 "--npu-count", "2", "--weights", "int8", "--python", comfy_python)
    assert proc.returncode == 2 and "--weights int8 applies to --component dit only" in proc.stderr
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "dit", "--device-type", "cpu",
                 "--npu-count", "2", "--weights", "int8", "--python", comfy_python, "--json",
                 env=dict(os.environ, H3KIT_NPU_INT8="off"))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    error = jsondoc.error(proc.stdout, proc.returncode)
    assert error["code"] == "int8_arm_unavailable" and "H3KIT_NPU_INT8=reference" in error["message"]
    assert "Traceback" not in proc.stderr


def test_demo_with_int8_weights_end_to_end(tmp_path, comfy_source, comfy_python):
    """h3kit demo --weights int8 on 2 simulated devices in a folder of its own: the tiny INT8 DiT written and loaded
    by the stock UNETLoader in the real server, its INT8 linears on the NPU arm, the video with its audio track,
    and the whole pipeline's latents equal to npu_count 1 within the DiT parity gate."""
    from h3kit.demo import PARITY_GATE
    from tests.support.service_helpers import free_port

    home = tmp_path / "ComfyUI"
    r = h3kit("install", "--comfy-home", home, "--source", comfy_source, "--python", comfy_python)
    assert r.returncode == 0, r.stderr
    r = h3kit("demo", "--comfy-home", home, "--device-type", "cpu", "--npu-count", "2", "--weights", "int8",
              "--port", free_port(8590, 8599), "--python", comfy_python, "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rep = jsondoc.data(r.stdout, r.returncode)
    assert rep["weights"] == "int8"
    assert [s["stage"] for s in rep["stages"]] == ["install", "checkpoints", "start", "check-workflow", "prompt",
                                                  "parity", "stop"]
    assert rep["stages"][1]["detail"] == "wrote audio_vae, dit_int8, te, video_vae"
    assert (home / "models/diffusion_models/h3kit_tiny_dit_int8.safetensors").is_file()
    assert not (home / "models/diffusion_models/h3kit_tiny_dit.safetensors").exists()
    assert rep["int8_arm"] == "NPU INT8: int8 linears on cpu run on reference kernels (docs/int8.md)"
    video = Path(rep["video"]["path"])
    assert video.name.startswith("npu2_int8_video") and set(rep["video"]["tracks"]) >= {"vide", "soun"}
    parity = rep["parity"]
    assert parity["ok"] and parity["max_rel"] <= PARITY_GATE and parity["rows"]["video"]["non_finite"] == 0


def test_int8_weights_take_the_kernels_layout_once_per_load(checks):
    """The FRACTAL_NZ pre-cast (comfy/npu_quant.py landed(); unmeasured on hardware) on its CPU twin: each of the 12
    INT8 weights is cast once when it lands (not per forward), the ND device copy is released and one copy's bytes
    are held, the kernels get the held [K, N] NZ weight untransposed, outputs equal the ND path bit for bit; an
    unload gives upstream's values back and a reload casts once more; H3KIT_NPU_INT8_NZ=0 and the CPU simulation
    never cast. No NZ weight reaches W8A16's npu_weight_quant_batchmatmul (the reference kernel raises on one, as
    op-plugin documents for eager mode). The faults (the ND copy kept, a cast per forward) miss these."""
    v = value(checks, "nz_precast")
    n = v["layers"]
    assert n == 12
    calls = {"npu_quant_matmul": 8, "npu_weight_quant_batchmatmul": 4}  # per forward of the tiny DiT: W8A8, W8A16
    load = v["load"]
    assert load["casts"] == n and load["layouts"] == ["NpuNzINT8Layout"] and load["formats"] == [29]
    assert load["storage_shapes"], "the int8 data is held [K, N]"
    assert load["nd_copies"] == n and load["nd_released"] == n, "the ND device copies are released"
    assert load["held_bytes"] == load["one_copy_bytes"], "one copy of each weight, no second one"
    f = v["forwards"]
    assert f["casts"] == n, "three forwards cast nothing"
    assert f["equal"] and f["weights_passed_are_held"], "bit for bit the ND path with every layer W8A8"
    assert v["w8a8_differs_from_auto"], "the tiny DiT's 16-row calls run W8A16 on ND weights"
    # W8A16 never gets an NZ weight (op-plugin: eager mode takes none): the layers whose calls run W8A16 on ND
    # weights (16 rows or fewer) run W8A8 on their NZ weight, the kernel it was cast for
    nz_calls = {"npu_quant_matmul": sum(calls.values())}
    assert f["x2"] == {f"{k}/nz/plain": 3 * c for k, c in nz_calls.items()}, "the NZ weight as it is, transposeX2 false"
    u = v["unload"]
    assert u["casts"] == 0 and u["formats"] == [2] and u["held_bytes"] == u["one_copy_bytes"]
    assert u["dequantize_equal"] and u["state_dict_equal"], "upstream's [N, K] values after the copy back"
    assert u["equal"] and u["x2"] == {f"{k}/nd/plain": c for k, c in calls.items()}
    r = v["reload"]
    assert r["casts"] == n and r["formats"] == [29] and r["equal"]
    assert r["x2"] == {f"{k}/nz/plain": 2 * c for k, c in nz_calls.items()}
    off = v["off"]
    assert off["casts"] == 0 and off["layouts"] == ["TensorWiseINT8Layout"] and off["equal"]
    assert off["x2"] == {f"{k}/nd/transposed": c for k, c in calls.items()}, "H3KIT_NPU_INT8_NZ=0: the ND path"
    sim = v["simulation"]
    assert sim["ops"] and sim["casts"] == 0 and sim["layouts"] == ["TensorWiseINT8Layout"] and sim["equal"]
    assert sim["x2"] == {f"{k}/nd/transposed": c for k, c in calls.items()}
    # the faults: each misses one of the assertions above
    assert v["fault_keep_nd"]["nd_copies"] == n and v["fault_keep_nd"]["nd_released"] < n
    assert v["fault_cast_per_forward"]["casts"] > n
