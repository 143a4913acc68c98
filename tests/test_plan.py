"""`h3kit plan` and the cost model behind it. The frame and latent arithmetic is compared with the pin's
own functions; the exchange bytes, per run and per device, and the packed sequence length are measured
against a real parallel run in tests/test_parity_dit.py."""

from __future__ import annotations

import json

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
    # two HCCL communicators (the group, the side group for weight gathers), 2 x HCCL_BUFFSIZE (200 MB) each
    # and on device 0 the send/recv pair communicators formed at join (3 at 4 devices, 2 x P2P_HCCL_BUFFSIZE each)
    assert mem["pair_communicators"] == 3 * 2 * 20 * 2**20
    assert mem["communicators"] == 2 * 2 * 200 * 2**20 + mem["pair_communicators"]
    assert mem["total"] == mem["weights"] + mem["communicators"] + max(mem["activations"], mem["server_share"])
    assert costmodel.memory_per_device(38010, 1)["communicators"] == 0
    assert costmodel.memory_per_device(38010, 4, hccl_buffsize_mb=100)["communicators"] == 2 * 2 * 100 * 2**20 + \
        3 * 2 * 20 * 2**20


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


# ---- weights: INT8, sharded, and whether a tier fits a card (issue 14) --------------------------------------
# The sharded figures themselves (slice, resident bytes, bytes gathered) are measured against real runs of the
# tiny DiT on 2 and 4 devices in tests/test_parity_dit.py; here the real model's arithmetic and the command.

def test_int8_weights_keep_the_adaln_projections_in_bf16():
    q = costmodel.int8_parameters()
    assert 20.0e9 < q["weights"] < 20.1e9  # docs/int8.md: 385.3 M a block, 50 blocks and 2 refiner blocks
    int8 = costmodel.weight_bytes("int8")
    # the int8 linears, their fp32 scales, and the other 13 B parameters (adaLN) still at bf16
    assert int8 == q["weights"] + 4 * q["scales"] + 2 * (costmodel.parameter_counts()["model_dtype"] - q["weights"]) \
        + 4 * costmodel.parameter_counts()["fp32"]
    assert 46.0e9 < int8 < 46.5e9 and costmodel.weight_bytes("bf16") - int8 > 19e9


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sharded_weights_split_every_block(world):
    rep = costmodel.weights_per_device(world, "bf16", "replicated")
    shard = costmodel.weights_per_device(world, "bf16", "sharded")
    block = costmodel.block_tensor_bytes("bf16")
    assert 64.5e9 < 50 * sum(block) < 64.6e9  # the blocks hold 32.3 B of the 33.1 B parameters
    lay = costmodel.shard_layout(block, world)
    # each device keeps one slice of every block (a little over 1/N: slots and padding) and the rest whole
    assert lay["slice"] * world == lay["padded"] and lay["padded"] - lay["bytes"] < 32 * costmodel.SHARD_ALIGN
    assert shard["resident"] == rep["resident"] - 50 * (lay["bytes"] - lay["slice"])
    assert rep["resident"] / world < shard["resident"] < rep["resident"] / world + 2e9  # the non-block 1.7 GB
    # every forward gathers the other N-1 slices of all 50 blocks, on every device
    assert shard["received_per_forward"] == 50 * (world - 1) * lay["slice"]
    assert shard["moved_per_forward"] == world * shard["received_per_forward"]
    assert shard["gathered"] == 2 * lay["padded"]


def test_int8_blocks_shard_their_scales_with_their_data():
    block = costmodel.block_tensor_bytes("int8")
    linears = costmodel._linears(costmodel.H3)
    assert block[6::2] == [o * i for o, i in linears]  # int8 data, one byte a weight
    assert block[7::2] == [4 * o for o, _ in linears]  # an fp32 scale per output row, in the same layout
    assert sum(block[:6]) == sum(costmodel.block_tensor_bytes("bf16")[:6])  # norms and adaLN stay bf16


def test_tiers_fit_or_not_with_headroom():
    def need(n, weights, sharding, frames=124, card=64):
        return costmodel.plan(1344, 768, frames, n, weights=weights, sharding=sharding, device_memory_gb=card)["fit"]
    assert not need(4, "bf16", "replicated")["fits"]          # 66.3 GB of weights on each 64 GB card
    four = need(4, "bf16", "sharded")
    # device 0's headroom: less 3 pair communicators and the larger of the forward's activations and the server's
    # share (4.3 GB at 1344x768, freed when sampling starts) (issue 45)
    assert four["fits"] and 37.5e9 < four["headroom"] < 39.5e9
    # H3_FACTS: one card at BF16 768p/15 s is not a supported setting, INT8 is (on a 64 GB card, not a 32 GB one)
    assert not need(1, "bf16", "replicated", 362)["fits"] and need(1, "int8", "replicated", 362)["fits"]
    assert not need(1, "int8", "replicated", 362, card=32)["fits"] and need(4, "int8", "sharded", 362, card=32)["fits"]
    p = costmodel.plan(1344, 768, 124, 4, sharding="sharded", guider="cfg")
    assert p["weight_bytes_per_device_step"] == 2 * costmodel.weights_per_device(4, "bf16", "sharded")["received_per_forward"]
    assert costmodel.plan(1344, 768, 124, 1, sharding="sharded")["weight_bytes_per_step"] == 0  # nothing to gather


def test_plan_command_weights_sharding_and_device_memory(runner):
    argv = ["plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "1", "--npu-count", "4"]
    out = runner.invoke(main, argv + ["--sharding", "sharded", "--weights", "int8", "--device-memory", "32"]).output
    assert "weights per device (int8, sharded)" in out and "two gathered blocks" in out
    fit = next(ln for ln in out.splitlines() if ln.startswith("fits a 32 GB card"))
    # 1 device holds all 46.3 GB; 4 hold their slices and two HCCL communicators' buffers (0.84 GB)
    assert fit.split()[-6:] == ["no,", "-18.8", "GB", "yes,", "12.7", "GB"], fit  # 4 devices: the server's share counts
    assert "weight gathers per step (per device)" in out
    r = runner.invoke(main, argv + ["--sharding", "sharded", "--device-memory", "32", "--json"])
    one, four = jsondoc.data(r.stdout, r.exit_code)["plans"]
    assert one["fit"]["fits"] is False and four["fit"]["fits"] is True
    assert four["weight_bytes_per_device_step"] > 0 and one["weight_bytes_per_device_step"] == 0
    out = runner.invoke(main, argv).output
    assert "fits a" not in out and "weight gathers" not in out  # the plain plan as before


def test_tiers_as_json(runner):
    r = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "124",
                             "--tiers", "--device-memory", "64", "--json"])
    doc = jsondoc.data(r.stdout, r.exit_code)
    # 1 device replicated (bf16, int8), then 2, 4 and 8 devices x bf16/int8 x replicated/sharded
    assert len(doc["tiers"]) == 2 + 3 * 4 and doc["frames"] == 124
    four = {(t["weights"], t["sharding"]): t for t in doc["tiers"] if t["npu_count"] == 4}
    assert not four[("bf16", "replicated")]["fit"]["64"]["fits"] and four[("bf16", "sharded")]["fit"]["64"]["fits"]


def test_tiers_honour_npu_count_and_plan_needs_one_without_tiers(runner):
    geo = ["plan", "--width", "1344", "--height", "768", "--frames", "124"]
    doc = jsondoc.data(*_out(runner.invoke(main, geo + ["--tiers", "--npu-count", "4", "--npu-count", "2", "--json"])))
    assert sorted({t["npu_count"] for t in doc["tiers"]}) == [2, 4] and len(doc["tiers"]) == 2 * 4
    table = runner.invoke(main, geo + ["--tiers", "--npu-count", "1"]).output
    assert table.count("\n| 1 |") == 2 and "\n| 2 |" not in table
    r = runner.invoke(main, geo)
    assert r.exit_code == 2 and "Missing option '--npu-count' (or --tiers" in r.output


def _out(r):
    return r.stdout, r.exit_code


def test_the_tier_table_in_the_docs_is_the_commands():
    """docs/deployment.md's tier tables are `h3kit plan --tiers` output, pasted: they must not drift."""
    from pathlib import Path
    from click.testing import CliRunner
    doc = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text()
    for frames in (124, 362):
        out = CliRunner().invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", str(frames),
                                        "--tiers"]).output
        assert out.strip() in doc, f"docs/deployment.md lacks the current tier table for {frames} frames"


def test_plan_counts_add_guide_anchors(runner):
    """MiniMaxH3AddGuide: an image is one latent frame of tokens, a 22-frame clip is encoded like a 22-frame video
    (7 latent frames), and audio adds two rows per audio latent (40 a second), cropped to the video's length."""
    base = ["plan", "--width", "1344", "--height", "768", "--frames", "124", "--npu-count", "4"]
    result = runner.invoke(main, [*base, "--guide", "1", "--guide", "22", "--guide-audio", "2", "--guide-audio", "60"])
    assert result.exit_code == 0, result.output
    per_frame = 48 * 84 // 4
    assert f"cond {8 * per_frame}, cond_audio {2 * (80 + 207)}," in result.output  # 60 s cropped to the 207 latents
    assert "3 AddGuide anchor(s)" not in result.output and "4 AddGuide anchor(s)" in result.output
    result = runner.invoke(main, [*base, "--guide", "5", "--json"])
    plan = json.loads(result.output)["data"]["plans"][0]
    assert plan["segments"]["cond"] == 2 * per_frame and plan["guides"] == [[5, 0]]
    assert runner.invoke(main, [*base, "--guide", "0"]).exit_code == 2


def test_plan_counts_pair_communicators_buffers_and_the_servers_share(runner):
    """Issue 45: the send/recv pair communicators each device holds once the join formed them (rank 0: P - 1), each
    group's largest message and the buffer that holds it, the server's share of device 0; all in device 0's memory.
    Before: 2 communicators per device and no server share."""
    p = costmodel.plan(1344, 768, 362, 8)
    assert p["pair_communicators"] == [7, 2, 3, 3, 3, 3, 3, 2]
    assert p["memory_per_device"]["pair_communicators"] == 7 * 2 * 20 * 2**20
    # the q/k/v all-to-all's send buffer, 3 x 13671 x 7168 x 2 bytes at S = 109362: over HCCL's 200 MB
    assert p["hccl"]["largest_message"]["group"] == 3 * 13671 * 7168 * 2
    assert p["hccl"]["buffsize_mb"] == {"group": 561, "side": 200} and p["hccl"]["env"] == "H3KIT_HCCL_BUFFSIZE=561,200"
    share = p["server_share"]
    assert share["text_encoder"] == 2.8e9 and share["total"] == p["memory_per_device"]["server_share"] > 4e9
    mem = p["memory_per_device"]
    # freed when sampling starts (free_server_share): device 0 holds it or the forward's activations, not both
    assert mem["total"] == mem["weights"] + mem["communicators"] + max(mem["activations"], share["total"])
    sharded = costmodel.plan(1344, 768, 362, 8, weights="int8", sharding="sharded")
    assert sharded["hccl"]["largest_message"]["side"] == sharded["memory_per_device"]["weights_gathered"] // 2
    one = costmodel.plan(1344, 768, 124, 1)
    assert one["server_share"]["total"] == 0 and one["memory_per_device"]["communicators"] == 0
    out = runner.invoke(main, ["plan", "--width", "1344", "--height", "768", "--frames", "362", "--npu-count", "8"]).output
    assert "pair communicators (device 0 / most)" in out and "export H3KIT_HCCL_BUFFSIZE=561,200" in out
    assert "server's share of device 0" in out
