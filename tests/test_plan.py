"""`h3kit plan` and the cost model behind it. The frame and latent arithmetic is compared with the pin's
own functions; the exchange bytes, per run and per device, and the packed sequence length are measured
against a real parallel run in tests/test_parity_dit.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3kit.cli import main
from h3kit.runtime import costmodel
from tests.support import jsondoc
from tests.support.pin_source import pin_functions


@pytest.mark.upstream
def test_frames_and_latents_follow_the_pin(pin_tree):
    # the pin's align_frame_count / video_latent_t / temporal_shape (comfy_extras/nodes_minimax_h3.py)
    pin = pin_functions(pin_tree, "comfy_extras/nodes_minimax_h3.py",
                        ("align_frame_count", "video_latent_t", "temporal_shape"))
    for frames in range(1, 800):
        count, latent_t, audio_t = pin["temporal_shape"](frames)
        seq = costmodel.packed_sequence(1344, 768, frames)
        assert costmodel.align_frame_count(frames) == count == seq["frames"]
        assert costmodel.video_latent_t(count) == latent_t == seq["latent"][0]
        assert seq["audio_latents"] == audio_t and seq["segments"]["audio"] == 2 * audio_t  # stereo rows


def test_keyframes_add_one_latent_frame_each():
    base = costmodel.packed_sequence(1344, 768, 124)
    lt, lh, lw = base["latent"]
    assert base["segments"]["video"] == lt * (lh // 2) * (lw // 2)  # 2x2 patches
    assert costmodel.packed_sequence(1344, 768, 124, keyframes=2)["seq_len"] == base["seq_len"] + 2 * (lh // 2) * (lw // 2)


def test_parameters_and_weights_match_the_33b_model():
    counts = costmodel.parameter_counts()
    assert 33.0e9 < counts["total"] < 33.2e9
    mem = costmodel.memory_per_device(38010, 4)
    assert 66e9 < mem["weights"] < 66.6e9  # "about 66 GB at BF16", on every device


def test_exchange_model_modes():
    # the byte counts themselves are measured against real runs (tests/test_parity_dit.py); here the choices
    kw = dict(hidden=5376, heads=56, head_dim=128, blocks=50)
    assert costmodel.exchange_elements(38010, 1, **kw)["total"] == 0
    assert costmodel.exchange_elements(38010, 4, **kw)["attention"] == "ulysses"
    assert costmodel.exchange_elements(38010, 3, **kw)["attention"] == "kv_gather"  # 56 heads do not split over 3
    with pytest.raises(ValueError, match="divisible"):
        costmodel.exchange_elements(38010, 3, attention="ulysses", **kw)


def test_one_forward_per_step_unless_cfg(runner):
    basic, cfg = (costmodel.plan(1344, 768, 124, 4, guider=g) for g in ("basic", "cfg"))
    assert basic["forwards_per_step"] == 1 and basic["bytes_per_step"] == basic["bytes_per_forward"]
    assert cfg["forwards_per_step"] == 2 and cfg["bytes_per_step"] == 2 * basic["bytes_per_step"]
    assert cfg["flops_per_device_step"] == 2 * basic["flops_per_device_step"]
    argv = ["plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "4"]
    out = runner.invoke(main, argv).output
    assert "BasicGuider, 1 forward per step" in out and "pass --cfg for a CFG guider" in out
    out = runner.invoke(main, argv + ["--cfg"]).output
    assert "CFG guider, 2 forwards per step" in out
    r = runner.invoke(main, argv + ["--cfg", "--json"])
    doc = jsondoc.data(r.stdout, r.exit_code)
    assert doc["plans"][0]["guider"] == "cfg" and doc["plans"][0]["forwards_per_step"] == 2


def test_more_devices_less_work_each():
    plans = [costmodel.plan(1344, 768, 124, n) for n in (1, 2, 4)]
    flops = [p["flops_per_device_step"] for p in plans]
    assert flops[0] > flops[1] > flops[2] and abs(flops[0] / flops[2] - 4) < 0.01
    assert [p["bytes_per_step"] for p in plans][0] == 0
    assert plans[2]["memory_per_device"]["activations"] < plans[0]["memory_per_device"]["activations"]


def test_plan_command_prints_three_columns(runner):
    result = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "124",
                                  "--npu-count", "1", "--npu-count", "2", "--npu-count", "4"])
    assert result.exit_code == 0, result.output
    assert "packed sequence S = 38010 tokens" in result.output
    line = next(ln for ln in result.output.splitlines() if ln.startswith("tokens per device"))
    assert line.split()[-3:] == ["38010", "19005", "9503"]
    assert "weights per device" in result.output and "66.3 GB" in result.output


def test_plan_accepts_eight_devices(runner):
    # 56 heads / 8 = 7: Ulysses, and each device holds an eighth of the tokens (an 8-card server, or 2 x 4 hosts)
    result = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "124",
                                  "--npu-count", "4", "--npu-count", "8", "--json"])
    assert result.exit_code == 0, result.output
    four, eight = jsondoc.data(result.output, result.exit_code)["plans"]
    assert eight["npu_count"] == 8 and eight["attention"] == "ulysses" and max(eight["tokens_per_device"]) == 4752
    assert abs(four["flops_per_device_step"] / eight["flops_per_device_step"] - 2) < 0.01
    assert eight["bytes_per_device_step"] < four["bytes_per_device_step"]


def test_plan_json_and_calibration_flags(runner):
    result = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "4",
                                  "--tflops", "200", "--link-gbs", "50", "--json"])
    assert result.exit_code == 0, result.output
    doc = jsondoc.data(result.stdout, result.exit_code)
    (p,) = doc["plans"]
    assert doc["model"]["hidden"] == 5376 and p["npu_count"] == 4 and p["attention"] == "ulysses"
    assert p["seconds_compute_step"] == pytest.approx(p["flops_per_device_step"] / 200e12)
    assert p["seconds_exchange_step"] == pytest.approx(p["bytes_per_device_step"] / 50e9)


@pytest.mark.parametrize("args, fragment", [
    (["--width", "1280", "--height", "720"], "multiples of 32"),
    (["--width", "1344", "--height", "768", "--npu-count", "3"], "'3' is not one of"),
])
def test_plan_bad_input_exits_2(runner, args, fragment):
    base = {"--frames": "124", "--npu-count": "4"}
    argv = ["plan"] + args
    for k, v in base.items():
        if k not in args:
            argv += [k, v]
    result = runner.invoke(main, argv)
    assert result.exit_code == 2 and fragment in result.output


def test_runtime_commands_import_no_torch():
    code = ("import sys; from h3kit.cli import main\n"
            "for cmd in (['parity', '--help'], ['plan', '--help']):\n"
            "    try:\n        main(cmd)\n    except SystemExit:\n        pass\n"
            "print('HEAVY=' + ','.join(m for m in ('torch', 'git', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY="
