"""`h3kit plan` and the cost model behind it (no upstream needed; the byte-exact check against a real
parallel run is in tests/test_parity_dit.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3kit.cli import main
from h3kit.runtime import costmodel
from tests.support import jsondoc


def test_packed_sequence_at_768p_124_frames():
    seq = costmodel.packed_sequence(1344, 768, 124)
    # 124 frames -> 37 latents (7 clips of 17 frames -> 5 latents, +2), 768/16 x 1344/16 latents,
    # 2x2 patches: 24 x 42 = 1008 tokens a frame; 124 / 24 s x 40 Hz = 207 audio latents, stereo
    assert seq["frames"] == 124 and seq["latent"] == [37, 48, 84] and seq["audio_latents"] == 207
    assert seq["segments"] == {"text": 300, "cond": 0, "audio": 414, "video": 37 * 1008}
    assert seq["seq_len"] == 38010  # "about 38k" (H3_FACTS section 3)


@pytest.mark.parametrize("frames, snapped", [(1, 5), (5, 5), (6, 22), (120, 124), (124, 124), (362, 362)])
def test_frames_snap_to_the_17k_plus_5_grid(frames, snapped):
    assert costmodel.align_frame_count(frames) == snapped


def test_keyframes_add_one_latent_frame_each():
    base = costmodel.packed_sequence(1344, 768, 124)["seq_len"]
    assert costmodel.packed_sequence(1344, 768, 124, keyframes=2)["seq_len"] == base + 2 * 1008


def test_parameters_and_weights_match_the_33b_model():
    counts = costmodel.parameter_counts()
    assert 33.0e9 < counts["total"] < 33.2e9
    mem = costmodel.memory_per_device(38010, 4)
    assert 66e9 < mem["weights"] < 66.6e9  # "about 66 GB at BF16", on every device


def test_exchange_model():
    kw = dict(hidden=5376, heads=56, head_dim=128, blocks=50)
    assert costmodel.exchange_elements(38010, 1, **kw)["total"] == 0
    u = costmodel.exchange_elements(38010, 4, **kw)
    assert u["attention"] == "ulysses"
    assert u["per_block"] == 4 * 38010 * 3 * (7168 // 4)  # q, k, v there and the output back, 3/4 of it remote
    sizes = costmodel.shard_sizes(38010, 4)
    assert sizes == [9503, 9503, 9502, 9502]
    assert u["final_gather"] == 4 * 3 * 9503 * 5376
    g = costmodel.exchange_elements(38010, 3, **kw)  # 56 heads do not split over 3: K/V gather
    assert g["attention"] == "kv_gather" and g["per_block"] == 3 * 2 * 12670 * 2 * 7168
    with pytest.raises(ValueError, match="divisible"):
        costmodel.exchange_elements(38010, 3, attention="ulysses", **kw)


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
