"""The text-encoder split, the VAE decode across devices and weights-read-once inside a patched tree.

tests/support/multinpu_te_vae_checks.py runs once in the ComfyUI interpreter with 4 simulated devices and
reports what each check observed; the tests below assert on it. The server test boots the patched server on
4 simulated devices with every weight-file read logged, and runs the tiny pipeline with a first frame
through MultiNPUParallelConfig (npu_count 4) twice, then with npu_count 1: the decoded frames and waveform
of 4 devices must match one device's.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from h3kit.runtime import parity_worker
from tests.support import av_pipeline, comfy_server

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
SUPPORT = Path(__file__).resolve().parent / "support"
TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
PORTS = (8560, 8580)  # inside the runtime area's range 8500-8599


@pytest.fixture(scope="module")
def patched_tree(installed_tree):
    return installed_tree


@pytest.fixture(scope="module")
def checks(patched_tree, comfy_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("te_vae_checks")
    env = dict(os.environ, H3KIT_SIM_DEVICES="4", H3KIT_CHECK_TMP=str(tmp),
               PYTHONPATH=os.pathsep.join([str(TOOLKIT), os.environ.get("PYTHONPATH", "")]))
    out = tmp / "checks.json"
    proc = subprocess.run([comfy_python, str(SUPPORT / "multinpu_te_vae_checks.py"), "--comfy-home", str(patched_tree),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def value(checks, name):
    result = checks[name]
    assert result["ok"], result.get("traceback")
    return result["value"]


def test_anchored_weights_return_to_the_host_copy(checks):
    v = value(checks, "anchors")
    assert v["bytes"] == (16 + 4 + 4 + 4 + 3) * 4
    assert v["shared_at_copy"] and v["copy_anchored"]
    assert v["on_meta"] and v["loaded_meta"], "the stand-in device really held the weights"
    assert v["back_by_to"] and v["back_by_detach"] and v["back_by_module"]
    # the control: without an anchor nothing can come back from that device, so the re-point is what works
    assert v["unanchored_back_from_meta"] == "fails"
    assert v["dtype_roundtrip_repoints"] is False, "only moves back from a device re-point"


def test_head_split_keeps_key_value_heads_with_their_queries(checks):
    v = value(checks, "head_split")
    q = lambda a, b: list(range(a, b))  # noqa: E731
    assert v["64/8/2"] == [[q(0, 32), q(0, 4)], [q(32, 64), q(4, 8)]]
    assert v["64/8/4"] == [[q(16 * r, 16 * r + 16), [2 * r, 2 * r + 1]] for r in range(4)]
    assert v["4/2/2"] == [[[0, 1], [0]], [[2, 3], [1]]]
    assert v["4/2/4"] == [[[0], [0]], [[1], [0]], [[2], [1]], [[3], [1]]], "two ranks share each key/value head"
    assert v["6/2/2"] == [[[0, 1, 2], [0]], [[3, 4, 5], [1]]]
    assert v["6/3/2"] == [[[0, 1, 2], [0, 0, 1]], [[3, 4, 5], [1, 2, 2]]], "uneven groups: one kv head per query"
    assert "4 query heads do not split over 3 devices" in v["4/2/3"]


def test_te_shards_view_the_one_host_copy(checks):
    v = value(checks, "te_weights_shared")
    assert v["mode"] == "tensor" and v["ranks"] == 4 and v["runtime"] == "ThreadRuntime"
    assert v["load_devices"] == ["cpu"] * 4
    # every rank its own modules (not the one object the loader shares), over the one host copy of the weights
    assert v["all_in_source"] and v["own_modules"] and v["anchored"]
    assert v["heads"] == [[1, 1, 128, 128, 128]] * 4
    # the server embeds and runs the vision tower; the ranks hold the layers only
    assert v["embeddings"] == [False] * 4 and v["server_embeddings"] and v["vision_on_server"]
    assert v["server_layers"] == 0
    ranks = v["rank_bytes"]
    assert len(set(ranks)) == 1 and v["patcher_sizes"] == ranks
    # summed over the 4 ranks: q, o and the MLP exactly once; the 2 key/value heads twice (4 query heads read
    # them in pairs); the norms on every rank
    source, total = zip(*(v["layer_bytes"][k] for k in ("split", "kv", "norm")))
    assert total == (source[0], 2 * source[1], 4 * source[2])


def test_threads_run_the_te_programs_of_the_process_transport(checks):
    v = value(checks, "te_same_programs")
    # the functions the process workers run, found by name in the one registry
    assert v["registered"] == {"te_config": "comfy.multinpu_te._load_on_worker",
                               "te_forward": "comfy.multinpu_te._forward_on_worker"}
    assert v["runtime"] == "comfy.multinpu_threads.ThreadRuntime" and v["mode"] == "tensor"
    assert v["max_rel"] <= parity_worker.TE_GATE_MAX_REL and len(v["second_shape"]) == 3
    # the configuration once per rank, then one forward per rank and encode, each rank its own context
    assert v["calls"] == {"te_config": [0, 1, 2], "te_forward": [0, 0, 1, 1, 2, 2]}
    assert v["contexts"] == {"te_config": 3, "te_forward": 3} and v["rank_contexts"]
    # one code path: no branch on the transport, nothing of the thread-only path left
    assert v["runtime_is_none"] == 0 and v["thread_only"] == []


def test_te_fallback_layer_split_is_exact(checks):
    v = value(checks, "te_fallback_split")
    assert v["six_heads_4"]["mode"] == "layers" and v["six_heads_4"]["max_abs"] == 0
    assert v["six_heads_4"]["ranges"] == [[0, 13], [13, 26], [26, 38], [38, 50]]
    assert v["four_heads_3"]["mode"] == "layers" and v["four_heads_3"]["max_abs"] == 0
    assert v["four_heads_3"]["ranges"] == [[0, 17], [17, 34], [34, 50]] and v["four_heads_3"]["bytes"] > 0
    assert "needs the query heads (4) divisible by the device count (3)" in v["forced_tensor_3"]
    assert "returns one hidden layer, not a list" in v["intermediate_list"]
    assert v["intermediate_max_abs"] == 0 and v["last_max_abs"] == 0


def test_te_uneven_gqa_groups(checks):
    v = value(checks, "te_gqa_uneven_groups")
    assert v["mode"] == "tensor" and v["rank0"] == [3, 3]
    assert v["tokens"] > 0 and v["cos"] >= 0.99999 and v["rel_rms"] <= 1e-4
    assert v["max_rel"] <= parity_worker.TE_GATE_MAX_REL, "the parity gate of the text encoder's rows"


def test_te_rank_failure_names_the_rank(checks):
    v = value(checks, "te_rank_failure")
    assert v["raised"] == "MemoryError" and v["notes"] == ["raised on rank 2 (cpu) of 4"]
    assert v["recovered"], "the next encode equals the one before the failure"


@pytest.mark.parametrize("component, copies", [("te", 3), ("vae", 3)])
def test_workers_copy_their_inputs_before_rank0_works(checks, component, copies):
    v = value(checks, f"{component}_inputs_copied_before_rank0_works")
    assert v["copies"] == copies and v["rank0_started_after"]


def test_a_lora_after_the_node_is_refused(checks):
    v = value(checks, "te_patch_after_node_refused")
    assert v["patched"] == 1
    assert v["raised"] and "after MultiNPUParallelConfig" in v["raised"] and "apply it before" in v["raised"]
    # a LoRA through upstream's loader whose key names a layer the ranks hold (the server's copy holds none)
    assert len(v["lora_patched"]) == 1 and ".layers.0." in v["lora_patched"][0], "the LoRA was left out"
    assert v["layer_meta"] and v["size_is_held"], "the copy names the ranks' weights at no size"
    assert v["lora_raised"] and "after MultiNPUParallelConfig" in v["lora_raised"]
    assert len(v["plain_still_runs"]) == 3  # the parallel CLIP itself still encodes


def test_every_rank_copy_loads_with_rank0(checks):
    v = value(checks, "loads_with_rank0")
    # the text encoder: the server's copy (embeddings, vision) and every rank's shard, each in its own forward
    assert v["te"] == [True] * 5 and v["vae"] == [True] * 4


def test_vae_replicas_share_and_return_to_the_host_copy(checks):
    v = value(checks, "vae_weights_shared")
    assert v["replicas"] == 3 and v["load_devices"] == ["cpu"] * 3
    assert v["all_in_source"] and v["loaded_away"] and v["back_in_source"]
    assert v["decode_max_abs"] == 0


def test_threads_run_the_vae_programs_of_the_process_transport(checks):
    v = value(checks, "vae_same_programs")
    # the functions the process workers run, found by name in the one registry
    assert v["registered"] == {"vae_config": "comfy.multinpu_vae._load_on_worker",
                               "vae_decode": "comfy.multinpu_vae._decode_on_worker"}
    assert v["runtime"] == "comfy.multinpu_threads.ThreadRuntime"
    assert v["max_abs"] == [0, 0], "the 2-chunk and the single-frame decode equal one device's"
    # the configuration once per rank; one command per decode on every rank (the single frame on worker rank 0)
    assert v["calls"] == {"vae_config": [0, 1, 2], "vae_decode": [0, 0, 1, 1, 2, 2]}
    assert v["contexts"] == {"vae_config": 3, "vae_decode": 3}
    assert v["counts"] == {"chunks": 2, "single_frames": 1, "chunk_ranks": [0, 1]}
    # each rank its own decoder copy and patcher (besides the loaded VAE and the server's copy), on its device
    assert v["own_copies"] == 5 and v["own_patchers"] == 3 and v["load_devices"] == ["cpu"] * 3
    # one code path: no branch on the transport, nothing of the thread-only path left
    assert v["runtime_is_none"] == 0 and v["thread_only"] == []


def test_dit_replicas_return_to_the_host_copy(checks):
    v = value(checks, "dit_weights_shared")
    assert v["replicas"] == 3 and v["all_in_source"] and v["loaded_away"] and v["back_in_source"]


def test_node_wires_clip_vae_and_audio_vae(checks):
    v = value(checks, "node_wiring")
    assert v["one_passes_through"]
    assert v["four"] == {"te": "tensor", "vae_devices": 4, "audio_same": True, "audio_dtype": "torch.float32"}
    assert v["lora_clip_passes_through"] and v["audio_in_vae_slot_passes_through"]
    assert v["already_split_passes_through"] and v["inputs_untouched"]


def test_with_processes_the_servers_te_and_vae_copies_hold_only_the_non_parallel_parts(checks):
    """The process transport: the server runs the text encoder's embeddings and vision tower and the VAE's encoder;
    the decoder's layers and the VAE decoder live only in the workers. "meta" stands in for device 0: what the
    server's copies place there during each command (upstream's loader), with a stand-in runtime computing the
    workers' part on the host, so each output is compared with one device's."""
    v = value(checks, "process_transport_server_copies")
    te = "qwen3vl_32b.transformer."
    vision = {te + p for p in ("visual.blocks", "visual.deepstack_merger_list", "visual.merger", "visual.patch_embed",
                               "visual.pos_embed", "visual.rotary_pos_emb")}
    for image in (False, True):
        row = v[f"te_image_{image}"]
        assert row["layers"] == 0 and not any(".layers" in p for p in row["parts"]), row
        assert set(row["parts"]) == {te + "model.embed_tokens", "qwen3vl_32b.logit_scale"} | vision, row
        assert row["max_abs"] == 0, "the encode equals one device's"
    assert v["te_calls"] == ["te_forward"] * 2, "both encodes ran the layers in the workers"
    # worker rank 0 holds the layers only: the server embeds, so device 0 holds each weight once
    assert v["te_worker0_parts"] == ["layers"]
    for command in ("decode", "decode_1", "encode_image", "encode_video"):
        row = v[f"vae_{command}"]
        assert row["parts"] == ["encoder", "latents_mean", "latents_std", "pixel_mean", "pixel_std", "quant_conv"], row
        assert row["max_abs"] == 0, f"{command}: equal to one device's"
    # the decode of 2 chunks and the single-frame decode both went to the workers
    assert v["vae_calls"] == ["vae_decode"] * 2 and v["vae_counts"] == {"chunks": 2, "single_frames": 1}
    assert v["vae_worker0_parts"] == ["decoder", "latents_mean", "latents_std", "pixel_mean", "pixel_std",
                                      "post_quant_conv"]


def test_each_file_read_once_in_the_checks(checks):
    reads = value(checks, "reads")
    assert reads and set(reads.values()) == {1}, reads


# ---- the real server -------------------------------------------------------------------------

def test_server_reads_each_file_once_and_matches_one_device(patched_tree, comfy_python, tiny_av_models, tmp_path):
    work = tmp_path / "server"
    av_pipeline.install_models(work / "models", tiny_av_models)
    env = dict(os.environ, H3KIT_SIM_DEVICES="4",
               PYTHONPATH=os.pathsep.join([str(TOOLKIT), os.environ.get("PYTHONPATH", "")]))
    with comfy_server.running(patched_tree, work, comfy_python, PORTS, count_loads=True, env=env,
                              extra_args=("--verbose", "DEBUG", *av_pipeline.server_args(work))) as srv:
        first = srv.run_prompt(av_pipeline.prompt(4, 1, "npu4"), timeout=240)
        second = srv.run_prompt(av_pipeline.prompt(4, 2, "npu4"), timeout=240)
        one = srv.run_prompt(av_pipeline.prompt(1, 1, "npu1"), timeout=240)  # the first prompt on one device
        log = srv.log_text()
        parity = av_pipeline.compare(av_pipeline.decoded(srv, one), av_pipeline.decoded(srv, first))
    reads = [ln.split()[-1] for ln in log.splitlines() if ln.startswith("H3KIT-LOAD") and "h3kit_tiny_" in ln]
    assert sorted(Path(p).name for p in reads) == sorted(Path(p).name for p in tiny_av_models.values()), reads
    assert "MultiNPU: text encoder tensor-parallel on 4 simulated cpu devices" in log
    assert "MultiNPU: video VAE decodes temporal chunks on 4 simulated cpu devices" in log
    assert "the audio VAE stays on one device, in fp32" in log
    # the work itself ran split: the text encoding on 4 ranks (the second prompt reuses its output), and
    # each prompt's decode with its 2 chunks on 2 devices
    assert log.count("MultiNPU: text encoder forward (tensor) on 4 simulated cpu devices") == 1
    assert log.count("MultiNPU: video VAE decode of 2 chunks on 4 devices") == 2
    for entry in (first, second, one):
        images = entry["outputs"]["15"]["images"]
        assert len(images) == 39, "every decoded frame reaches the output"
        assert entry["outputs"]["16"]["audio"]
    # what a user gets, decoded frames and waveform, on 4 devices against 1 (the same prompt and seed)
    assert parity["frames"]["shape"] == [39, 64, 64, 3] and parity["waveform"]["shape"][:2] == [1, 2]
    assert av_pipeline.within_gate(parity), parity
