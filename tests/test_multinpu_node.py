"""The device layer, the DiT wrapper and the MultiNPUParallelConfig node inside a patched tree.

tests/support/multinpu_node_checks.py runs once in the ComfyUI interpreter with 3 simulated devices
and reports what each check observed; the tests below assert on it. test_server_* boots the patched
server (simulating 2 devices) and drives the node through /object_info and /prompt, and runs the tiny
pipeline at npu_count 2 and 1, whose decoded frames and waveform must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
from pathlib import Path

import pytest

from h3kit.runtime import costmodel
from h3kit.runtime import parity_worker
from tests.support import av_pipeline, comfy_server

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
SUPPORT = Path(__file__).resolve().parent / "support"
RUNTIME = Path(parity_worker.__file__).resolve().parent
PORTS = (8540, 8560)  # inside the runtime area's range 8500-8599


@pytest.fixture(scope="module")
def patched_tree(installed_tree):
    return installed_tree


@pytest.fixture(scope="module")
def checks(patched_tree, comfy_python, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node_checks")
    env = dict(os.environ, H3KIT_SIM_DEVICES="3", H3KIT_RUNTIME_DIR=str(RUNTIME), H3KIT_CHECK_TMP=str(tmp))
    out = tmp / "checks.json"
    proc = subprocess.run([comfy_python, str(SUPPORT / "multinpu_node_checks.py"), "--comfy-home", str(patched_tree),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text()), tmp


def value(checks, name):
    result = checks[0][name]
    assert result["ok"], result.get("traceback")
    return result["value"]


def test_simulated_devices(checks):
    v = value(checks, "multidevice")
    assert v["kind"] == "cpu" and v["devices"] == ["cpu"] * 3
    assert v["counts"] == {"": 0, "unset": 0, "1": 1, "4": 4, "0": 1, "x": 1, "0,1": 1}
    assert v["describe"] == "3 simulated cpu devices (H3KIT_SIM_DEVICES=3)"
    assert v["devices_for_2"] == ["cpu", "cpu"] and v["devices_for_4"] is None
    assert v["stream"] is None


def test_simulated_devices_on_an_accelerator_share_its_one_card(checks):
    v = value(checks, "multidevice_sim_accelerator")
    assert v["sim"] == {"kind": "cuda", "devices": ["cuda:0"] * 3,
                        "describe": "3 simulated cuda devices on cuda:0 (H3KIT_SIM_DEVICES=3)",
                        "devices_for_3": ["cuda:0"] * 3, "devices_for_4": None}
    # unset, the visible cards in rank order with the model's own first, as before
    assert v["real"] == {"devices": ["cuda:0", "cuda:1"], "describe": "2 cuda devices (cuda:0, cuda:1)",
                         "devices_for_2": ["cuda:1", "cuda:0"], "devices_for_3": None}


def test_npu_arms_call_the_npu_runtime(checks):
    v = value(checks, "npu_arms")
    assert v["calls"][:5] == [
        ["set_device", "npu:1"],   # model_management.set_torch_device
        ["set_device", "npu:2"],   # cuda_device_context enters npu:2 ...
        ["set_device", "npu:1"],   # ... and restores npu:1
        ["synchronize", None],     # model_management.synchronize on an NPU host
        ["current_stream", None],  # model_management.current_stream(npu)
    ]
    assert v["inside"] == 2 and v["after"] == 1 and v["kind"] == "npu" and v["stream"]
    assert ["set_device", "npu:3"] in v["calls"] and ["synchronize", "npu:1"] in v["calls"]
    assert ["stream_synchronize", None] in v["calls"], "peer copies must wait for the producer's stream"
    assert v["calls"][-1] == ["set_device", "npu:0"], "a rank thread selects its NPU when it starts"


def test_node_schema(checks):
    v = value(checks, "schema")
    assert v["node_id"] == "MultiNPUParallelConfig" and v["category"] == "advanced/multigpu"
    # weights (issue 14) is optional and last: a prompt or workflow saved without it runs with auto
    assert v["required"] == ["model", "npu_count"] and v["optional"] == ["clip", "vae", "audio_vae", "weights"]
    assert v["npu_count"] == ["COMBO", ["auto", 1, 2, 4, 8], 4]
    assert v["weights"] == ["COMBO", ["auto", "replicated", "sharded"], "auto"]
    assert v["return_types"] == ["MODEL", "CLIP", "VAE", "VAE"]


def test_node_device_check(checks):
    v = value(checks, "device_check")
    assert v["verdicts"]["1"] is True
    for n in ("2", "4", "8"):
        msg = v["verdicts"][n]
        assert f"npu_count is {n} but this ComfyUI process sees 3 simulated cpu devices (H3KIT_SIM_DEVICES=3)" in msg
        assert "Fix: set npu_count to 3" in msg and f"H3KIT_SIM_DEVICES={n}" in msg
    assert "must be auto or one of [1, 2, 4, 8], got 3" in v["verdicts"]["3"]
    # auto is the server's own count: 3 simulated devices, which H3 cannot split across (issue 46)
    assert "npu_count auto is this server's device count, 3" in v["verdicts"]["auto"]
    assert v["raised"] == v["verdicts"]["4"], "execute must refuse with the same message"
    assert v["work_before_check"] == 0, "the check runs before any model work"
    assert v["one_passes_through"]


def test_wrapper_matches_one_device_and_shares_host_weights(checks):
    v = value(checks, "wrapper_paths")
    assert v["equal"] and v["forwards"] == 1 and v["rank_forwards"] == [1, 1, 1]
    tiny = parity_worker.TINY
    ex = costmodel.exchange_elements(71, 3, hidden=tiny["hidden_size"], heads=tiny["num_attention_heads"],
                                     head_dim=tiny["attention_head_dim"], blocks=tiny["num_layers"])
    assert ex["attention"] == "kv_gather" and v["bytes"] == ex["total"] * 4
    assert v["bytes_received"] == [x * 4 for x in ex["per_device"]]
    # every rank its own copy over the one host copy of the weights, none an additional model of the server's, which
    # stays on the host
    assert v["replicas"] == 3 and v["extra_models"] == 0 and v["replicas_share_weights"]
    assert v["server_device"] == "cpu"
    assert v["blocks_without_wrapper_equal"]
    assert v["reapplied_wrappers"] == 1 and v["reapplied_extra_models"] == 0


def test_the_final_output_is_gathered_to_rank0_only(checks):
    v = value(checks, "wrapper_paths")
    assert v["final_layer_calls"] == [1, 0, 0], "ranks 1..P-1 stop after the last block"
    # only rank 0 received the last hidden states (the per-device figures above include the final gather)
    tiny = parity_worker.TINY
    ex = costmodel.exchange_elements(71, 3, hidden=tiny["hidden_size"], heads=tiny["num_attention_heads"],
                                     head_dim=tiny["attention_head_dim"], blocks=tiny["num_layers"])
    assert ex["final_gather"] == (71 - costmodel.shard_sizes(71, 3)[0]) * tiny["hidden_size"]
    assert v["bytes_received"][0] - v["bytes_received"][1] == ex["final_gather"] * 4


def test_workers_copy_their_inputs_before_rank0_works(checks):
    v = value(checks, "inputs_copied_before_rank0_works")
    assert v["copies"] == 2 and v["rank0_started_after"]


def test_the_thread_runtime_runs_commands_as_the_process_driver_does(checks):
    v = value(checks, "thread_runtime")
    assert v["spec"] == {"backend": "threads", "world_size": 3, "rank1": "rank 1 (cpu)"}
    # every rank its own context and its own unpacked copy of the payload, in the caller's modes
    assert v["copies"] == 4 and set(v["seen"]) == {"0", "1", "2"}
    for r, s in v["seen"].items():
        assert s["same_context"] and s["device"] == "cpu" and s["inference"] and not s["grad"], (r, s)
        assert s["value"] == [0.0, 1.0, 2.0, 3.0] and s["text"] == "hello", (r, s)
    assert v["result"] == {"sum": [0.0, 3.0, 6.0, 9.0]}  # rank 0's return, through the wire code
    # After runs once the command closed, every rank having run it, in the caller's modes as on a worker process
    # (comfy.multinpu.ThreadGroup runs each rank's thread in them; a thread's own defaults are inference off, grad on)
    assert v["after"] == [[3, True, False]], v["after"]
    assert v["failed"] == {"message": "injected on rank 2", "notes": ["raised on rank 2 (cpu) of 3"]}
    assert "no program 'h3kit_no_such_program'" in v["unknown"]
    assert "the ranks do not hold the same DiT" in v["mismatch"] and "rank 0 (cpu) differs in files" in v["mismatch"]
    assert v["installed"] == [0, 1, 2]
    assert v["wrong_rank0"] == ["MultiNPU: rank 0 must be the VAE's device cpu, got meta",
                                "MultiNPU: rank 0 must be the VAE's device cpu, got no device"]


def test_threads_run_the_worker_programs_of_the_process_transport(checks):
    v = value(checks, "same_programs")
    # the functions the process workers run, found by name in the one registry
    assert v["registered"] == {"dit_config": "comfy.multinpu_dit._load_on_worker",
                               "dit_forward": "comfy.multinpu_dit._forward_on_worker",
                               "dit_empty_cache": "comfy.multinpu_dit._empty_cache_on_worker"}
    assert v["runtime"] == "comfy.multinpu_threads.ThreadRuntime" and v["equal"]
    # each called once per rank (the configuration, one forward, the cache after sampling), each rank its own context
    assert v["calls"] == {"dit_config": [0, 1, 2], "dit_forward": [0, 1, 2], "dit_empty_cache": [0, 1, 2]}
    assert v["contexts"] == {"dit_config": 3, "dit_forward": 3, "dit_empty_cache": 3}
    # one code path: no branch on the transport, nothing of the thread-only path left
    assert v["runtime_is_none"] == 0 and v["thread_only"] == []


def test_comfyuis_free_reaches_a_thread_runtimes_ranks(checks):
    # frees were wired to the process group only: a thread runtime's ranks kept their models after POST /free
    v = value(checks, "free_reaches_thread_ranks")
    assert v["held_before"] == [1, 1, 1] and v["installs_before_free"] == 3, "installed once, kept between forwards"
    assert v["pending"], "the free is asked of the thread runtime too"
    assert v["installs_after_free"] == 6, "every rank let go of it and installed it again for the next forward"


def test_refusals_name_the_problem(checks):
    v = value(checks, "refusals")
    assert "DiT blocks [1] are already replaced" in v["foreign_block"]
    assert "supports the MiniMax H3 DiT, not Linear" in v["not_h3"]
    assert "block 2 is no longer replaced" in v["overridden_later"]
    # refused with threads as with processes: the ranks run neither
    assert "1 diffusion-model wrapper(s) were added after MultiNPUParallelConfig" in v["wrapper_after"]
    assert "another node set an attention override" in v["attention_override"]


def test_rank_failure_surfaces_at_once(checks):
    v = value(checks, "rank_failure")
    assert v["error"]["type"] == "RuntimeError" and v["error"]["message"] == "injected failure on rank 2"
    assert v["error"]["notes"] == ["raised on rank 2 (cpu) of 3"]
    assert v["seconds"] < 150.0 and v["recovered"], "surfaced as it failed, not after the 300 s timeout"


def test_stalled_rank_surfaces_within_the_bound(checks):
    v = value(checks, "stall")
    assert v["error"]["type"] == "CollectiveTimeout"
    assert "rank(s) 1 (cpu) did not reach collective #2 within 1 s" in v["error"]["message"]
    assert v["seconds"] < 2 * v["timeout"] + 60  # a hang's bound, not a speed
    assert v["pool_broken"] and v["recovered"] and v["new_pool"] and v["old_workers_exited"]


# ---- the real server -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(patched_tree, comfy_python, checks, tiny_av_models, tmp_path_factory):
    """The patched server on 2 simulated devices, in its own folders, with the tiny pipeline's models."""
    work = tmp_path_factory.mktemp("server2")
    av_pipeline.install_models(work / "models", tiny_av_models)
    (work / "models" / "diffusion_models" / "h3kit_tiny_h3.safetensors").symlink_to(checks[1] / "tiny.safetensors")
    # a busy port band is an error (free_port raises), never a skip
    with comfy_server.running(patched_tree, work, comfy_python, PORTS, env={"H3KIT_SIM_DEVICES": "2"},
                              extra_args=av_pipeline.server_args(work)) as srv:
        yield srv


def _prompt(npu_count):
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "h3kit_tiny_h3.safetensors", "weight_dtype": "default"}},
            "2": {"class_type": "MultiNPUParallelConfig", "inputs": {"model": ["1", 0], "npu_count": npu_count}},
            "3": {"class_type": "ModelSave", "inputs": {"model": ["2", 0], "filename_prefix": "h3kit_multinpu/tiny"}}}


def test_server_lists_the_node(server):
    info = comfy_server.http("GET", server.url + "/object_info/MultiNPUParallelConfig")["MultiNPUParallelConfig"]
    assert info["category"] == "advanced/multigpu"
    assert info["input"]["required"]["npu_count"][1]["options"] == ["auto", 1, 2, 4, 8]
    assert info["input"]["optional"]["weights"][1]["options"] == ["auto", "replicated", "sharded"]
    assert info["output"] == ["MODEL", "CLIP", "VAE", "VAE"]


def test_server_rejects_a_count_the_process_lacks(server):
    with pytest.raises(urllib.error.HTTPError) as refused:
        comfy_server.http("POST", server.url + "/prompt", {"prompt": _prompt(4)}, timeout=30)
    assert refused.value.code == 400
    errors = json.dumps(json.loads(refused.value.read())["node_errors"]["2"])
    assert "npu_count is 4 but this ComfyUI process sees 2 simulated cpu devices" in errors


def test_server_runs_the_node(server):
    server.run_prompt(_prompt(2), timeout=120)
    assert "MultiNPU: MiniMax H3 DiT sequence-parallel on 2 simulated cpu devices" in server.log_text()


def test_server_runs_npu_count_auto_on_its_own_devices(server):
    """npu_count auto (issue 46) runs on the server's 2 devices, as npu_count 2 does."""
    before = server.log_text().count("sequence-parallel on 2 simulated cpu devices")
    server.run_prompt(_prompt("auto"), timeout=120)
    assert server.log_text().count("sequence-parallel on 2 simulated cpu devices") == before + 1


def test_server_two_devices_match_one_in_decoded_frames_and_audio(server):
    """The same prompt at npu_count 2 and 1: what a user gets (decoded frames, waveform) must agree."""
    two = server.run_prompt(av_pipeline.prompt(2, 1, "npu2"), timeout=240)
    one = server.run_prompt(av_pipeline.prompt(1, 1, "npu1"), timeout=240)
    log = server.log_text()
    assert "MultiNPU: text encoder tensor-parallel on 2 simulated cpu devices" in log
    assert "MultiNPU: video VAE decodes temporal chunks on 2 simulated cpu devices" in log
    parity = av_pipeline.compare(av_pipeline.decoded(server, one), av_pipeline.decoded(server, two))
    assert parity["frames"]["shape"] == [39, 64, 64, 3] and parity["waveform"]["shape"][:2] == [1, 2]
    assert av_pipeline.within_gate(parity), parity
    # the same prompt with the DiT's weights sharded over the two devices: what the user gets is the same, exactly
    sharded = av_pipeline.prompt(2, 1, "npu2s")
    sharded["5"]["inputs"]["weights"] = "sharded"
    same = av_pipeline.compare(av_pipeline.decoded(server, two),
                               av_pipeline.decoded(server, server.run_prompt(sharded, timeout=240)))
    assert all(same[k]["max_abs"] == 0 for k in same), same
    assert "every device keeps 1/2 of each DiT block's weights" in server.log_text()


def test_server_rejects_a_weights_value_the_node_does_not_take(server):
    bad = _prompt(2)
    bad["2"]["inputs"]["weights"] = "shared"
    with pytest.raises(urllib.error.HTTPError) as refused:
        comfy_server.http("POST", server.url + "/prompt", {"prompt": bad}, timeout=30)
    assert refused.value.code == 400 and "weights" in json.dumps(json.loads(refused.value.read())["node_errors"]["2"])


def test_with_processes_the_servers_dit_copy_stays_on_the_host_unpatched(checks):
    # worker rank 0 computes on device 0; a server copy loaded there too would hold a second DiT on that card
    for weights, v in value(checks, "process_transport_server_copy").items():
        assert v["load_device"] == v["offload_device"] == "cpu" and v["devices"] == ["cpu"], (weights, v)
        assert v["rank_device"] == "meta", (weights, v)  # the fit check asks worker rank 0's device
        assert v["server_patches"] == 0 and v["sent_patches"] > 0, (weights, v)  # the LoRA goes to the workers
    assert value(checks, "process_transport_server_copy")["sharded"]["shard_device"] == "cpu"
    assert value(checks, "process_transport_server_copy")["sharded"]["on_load"] == 0  # no slices built on the host


def test_the_servers_share_of_device_0_is_freed_before_sampling_with_processes(checks):
    """Issue 45 item 5 (unmeasured on hardware): the server's models on worker rank 0's device are unloaded (ComfyUI's
    free_memory of everything on that device) before sampling with the process transport; nothing with threads or on
    a CPU. Before: the server's text encoder stayed on device 0 through sampling, unseen by rank 0's memory manager."""
    v = value(checks, "server_share_freed")
    assert v["process_cuda0"] == [[1e30, "cuda:0"]]
    assert v["process_cpu"] == [] and v["threads_cuda0"] == []
    assert v["rank_memory_calls_it"]
