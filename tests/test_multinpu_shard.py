"""Sharded DiT weights (comfy/multinpu_shard.py) in a patched tree, beyond the parity rows of test_parity_dit.py:
what happens when ComfyUI cannot load the slices, the node's weights auto, the warning when a tier does not fit a
card, unload and reload, and the one host copy. tests/support/multinpu_shard_checks.py runs once in the ComfyUI
interpreter with 2 simulated devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checks_runner import run_script, value

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parent / "support" / "multinpu_shard_checks.py"


@pytest.fixture(scope="module")
def checks(installed_tree, comfy_python, tmp_path_factory):
    return run_script(SCRIPT, installed_tree, comfy_python, tmp_path_factory.mktemp("shard_checks"),
                      env={"H3KIT_SIM_DEVICES": "2"})


def test_slices_comfyui_did_not_load_are_built_on_use_and_the_lora_applies_once(checks):
    v = value(checks, "partial_load")
    # a partial load: ComfyUI left the slices' module off the device and gave the LoRA'd block modules LowVramPatches
    assert v["guard"]["model_lowvram"] and not v["guard"]["built"] and v["guard"]["rebuilt"] == 6  # 3 blocks x 2
    assert v["guard"]["max_abs"] == 0 and v["guard"]["lowvram_patches_left"] == 0
    # the control: left in place, those patches apply the LoRA a second time to the gathered (patched) weights
    assert v["no_guard"]["max_abs"] > 1e-3 and v["no_guard"]["lowvram_patches_left"] > 0


def test_weights_auto_shards_when_a_replica_would_not_fit(checks):
    v = value(checks, "auto")
    # a replica needs the model plus ComfyUI's minimum inference memory (about 1.3 GB): not on a 0.5 MB card
    assert v["model_bytes"] + v["min_inference"] > 0.0005e9
    assert v["chosen"] == {"0.0005": "sharded", "100": "replicated"}


def test_a_tier_that_does_not_fit_warns_with_the_fix(checks):
    messages = value(checks, "short_card_warns")
    assert len(messages) == 4  # both ranks, replicated then sharded
    replicated, sharded = messages[0], messages[2]
    assert "cpu (rank 0) needs" in replicated and "replicated weights" in replicated
    assert "Fix: weights sharded on MultiNPUParallelConfig, INT8 weights" in replicated
    assert "sharded weights" in sharded and "Fix: INT8 weights, a smaller or shorter video" in sharded


def test_unload_frees_the_slices_and_the_host_copy_stays_one(checks):
    v = value(checks, "unload_and_host_copies")
    assert v["loaded"] == [True, True] and v["unloaded"] == [False, False] and v["reloaded"] == [True, True]
    # resident: the slices and everything outside the blocks; after the unload only the latter (on the host)
    assert all(a < b for a, b in zip(v["after_unload"], v["resident"]))
    assert v["hosts_in_source"] and v["host_tensors"] == 30  # 3 blocks x 10 weights, all the loaded model's


def test_the_node_applied_twice_to_a_sharded_model_refuses(checks):
    assert "already sharded by MultiNPUParallelConfig; apply the node once" in value(checks, "reapply")


def test_a_short_card_keeps_the_slices_that_fit_and_builds_only_its_own_bytes_of_the_others(checks):
    v = value(checks, "per_block_slope")
    assert v["max_abs"] == 0
    for r in v["ranks"]:
        loaded = r["loaded"]
        # each block's slice is a module of its own: ComfyUI kept some on the device, not all or nothing
        assert any(loaded) and not all(loaded), loaded
        missing = [i for i, ok in enumerate(loaded) if not ok]
        assert r["rebuilt"] == len(missing) * v["forwards"]
        # load and every forward moved this rank's slices only (no patches here: a weight is cut before it moves),
        # never whole blocks: the bytes of the loaded slices once, of the others once a forward
        moved = sum(v["slice_bytes"][i] for i in range(len(loaded))) + sum(v["slice_bytes"][i] for i in missing) * v["forwards"]
        assert 0 < r["h2d_bytes"] <= moved, (r, moved)
        assert r["h2d_bytes"] < sum(v["block_bytes"]) / 2 + sum(v["block_bytes"][i] for i in missing) * v["forwards"] / 2
