"""check-workflow on crafted workflows: every check, both formats, nested subgraphs, malformed input, CLI."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import psutil
import pytest

from h3kit.cli import main
from h3kit.errors import DeviceListError, UsageError
from h3kit.workflow import report
from h3kit.workflow.checks import adapt_canvas, align_frame_count
from tests.support.check_workflow_helpers import ROOT, check_doc, deep, found, frontend_schema_errors, load_data, messages
from tests.support.pin_source import pin_functions
from tests.support.service_helpers import free_port
from tests.support import jsondoc

API = load_data("api_t2va.json")
NESTED = load_data("ui_nested_subgraphs.json")
SHIPPED = sorted((ROOT / "workflows").glob("*.json"))


# ------------------------------------------------------------------------------------- MiniMaxH3AddGuide

def _with_guide(frame_idx=61, image=True, audio=False, vae=True, audio_vae=True) -> dict:
    """The reference prompt with a MiniMaxH3AddGuide (upstream since 0.33.0) between the conditioning and the guider."""
    p = deep(API)
    p["20"] = {"class_type": "LoadImage", "inputs": {"image": "guide.png"}}
    p["21"] = {"class_type": "LoadAudio", "inputs": {"audio": "guide.wav"}}
    inputs = {"positive": ["7", 0], "latent": ["7", 1], "frame_idx": frame_idx}
    inputs.update({"image": ["20", 0]} if image else {}, **({"audio": ["21", 0]} if audio else {}))
    inputs.update({"vae": ["6", 2]} if vae else {}, **({"audio_vae": ["6", 3]} if audio_vae else {}))
    p["22"] = {"class_type": "MiniMaxH3AddGuide", "inputs": inputs}
    p["8"]["inputs"]["conditioning"] = ["22", 0]
    return p


@pytest.mark.parametrize("guide, expected", [
    (dict(), []),
    (dict(frame_idx=-124), []),                      # the first of 124 frames, counted from the end
    (dict(frame_idx=123, audio=True), []),
    (dict(frame_idx=124), [("H3207", "22")]),        # one past the last frame
    (dict(frame_idx=-125), [("H3207", "22")]),
    (dict(image=False), [("H3205", "22")]),
    (dict(vae=False), [("H3206", "22")]),
    (dict(image=False, audio=True, audio_vae=False), [("H3206", "22")]),
], ids=["middle", "negative-first", "last-with-audio", "past-the-end", "before-the-start", "nothing", "image-no-vae",
        "audio-no-vae"])
def test_add_guide_mistakes_are_caught_before_the_models_load(tmp_path, guide, expected):
    result = check_doc(tmp_path, _with_guide(**guide), devices="0,1,2,3")
    assert found(result) == expected, messages(result)


def test_add_guides_count_in_the_tier_memory(tmp_path):
    """A guide's frames and audio join the packed sequence (h3kit plan --guide): they count in H3109's estimate. On
    2 devices, where the forward's activations outweigh device 0's share of the server's encodes (held before
    sampling only: the larger of the two counts), so the guide's tokens move the peak."""
    from h3kit.runtime import costmodel
    plain = costmodel.plan(1344, 768, 124, 2, weights="bf16")["memory_per_device"]["total"]
    guided = costmodel.plan(1344, 768, 124, 2, weights="bf16", guides=((1, 0), (0, 63 / 24)))
    assert guided["segments"]["cond"] == 48 * 84 // 4 and guided["segments"]["cond_audio"] == 2 * 105
    card = (plain + guided["memory_per_device"]["total"]) / 2 / 1e9  # fits the plain prompt, not the guided one
    plain_doc, doc = deep(API), _with_guide(frame_idx=61, audio=True)
    for d in (plain_doc, doc):
        d["6"]["inputs"]["weights"] = "replicated"  # auto would shard where the replica does not fit
        d["6"]["inputs"]["npu_count"] = 2
    assert found(check_doc(tmp_path, plain_doc, devices="0,1", device_memory=card), "H3109") == []
    assert found(check_doc(tmp_path, doc, devices="0,1", device_memory=card), "H3109") == [("H3109", "6")]


# ------------------------------------------------------------------------------------------ API format

def test_api_reference_prompt_is_clean(tmp_path):
    result = check_doc(tmp_path, API, devices="0,1,2,3")
    assert found(result) == []
    assert result.exit_code == 0
    assert result.summary["device_count"] == 4


def test_prompt_request_body_is_read_as_api(tmp_path):
    body = {"prompt": deep(API), "client_id": "x", "extra_data": {}}
    body["prompt"]["7"]["inputs"]["width"] = 720
    result = check_doc(tmp_path, body, devices="0,1,2,3")
    assert found(result) == [("H3201", "7")]
    assert result.exit_code == 1


@pytest.mark.parametrize("mutate, expected", [
    (lambda p: p["7"]["inputs"].update(width=720), [("H3201", "7")]),
    (lambda p: p["7"]["inputs"].update(height=760), [("H3201", "7")]),
    (lambda p: p["7"]["inputs"].update(length=120), [("H3203", "7")]),
    (lambda p: p["7"]["inputs"].update(width=1920, height=1088), [("H3202", "7")]),
    (lambda p: p["7"]["inputs"].update(width=10 ** 30), [("H3204", "7")]),
    (lambda p: p["7"]["inputs"].update(length=-3), [("H3204", "7")]),
    (lambda p: p["7"]["inputs"].update(width="wide"), [("H3204", "7")]),
    (lambda p: p["6"]["inputs"].update(npu_count=3), [("H3101", "6")]),
    (lambda p: p["6"]["inputs"].update(npu_count=2), [("H3102", "6")]),
    (lambda p: p["10"]["inputs"].update(sampler_name="euler_ancestral"), [("H3302", "10")]),
    (lambda p: p["10"]["inputs"].update(sampler_name="dpmpp_2m_sde_gpu"), [("H3302", "10")]),
    (lambda p: p["5"]["inputs"].update(vae_name="minimax_h3_audio_vae_bf16.safetensors"), [("H3303", "5")]),
    (lambda p: p["1"]["inputs"].update(unet_name="minimax_h3_fl2va_pruned_int8_convrot.safetensors"),
     [("H3301", "2")]),
    (lambda p: p["12"]["inputs"].update(noise=["99", 0]), [("H3401", "12")]),
    (lambda p: p["12"]["inputs"].update(noise=["11", 3]), [("H3401", "12")]),
    (lambda p: p["12"]["inputs"].update(guider=["99", 0]), [("H3401", "12"), ("H3104", "6")]),
    (lambda p: p["12"]["inputs"].pop("sigmas"), [("H3402", "12")]),
    (lambda p: p["9"]["inputs"].pop("steps"), [("H3402", "9")]),
    (lambda p: p["2"]["inputs"].update(model=["6", 0]), [("H3403", "2")]),
])
def test_api_checks(tmp_path, mutate, expected):
    prompt = deep(API)
    mutate(prompt)
    result = check_doc(tmp_path, prompt, devices="0,1,2,3")
    assert found(result) == expected, result.findings


def test_messages_name_the_fix(tmp_path):
    prompt = deep(API)
    prompt["7"]["inputs"].update(width=720, length=120)
    result = check_doc(tmp_path, prompt, devices="0,1,2,3")
    assert "set it to 704 or 736" in messages(result, "H3201")[0]
    assert "snaps it up to 124" in messages(result, "H3203")[0]
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = 4
    result = check_doc(tmp_path, prompt, devices="0,1")
    assert "set npu_count to 2" in messages(result, "H3102")[0]


def test_turbo_lora_follows_switches_and_strength(tmp_path):
    prompt = deep(API)
    prompt["1"]["inputs"]["unet_name"] = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
    # the upstream templates' shape: a switch picks the LoRA branch or the bare base
    prompt["20"] = {"class_type": "PrimitiveBoolean", "inputs": {"value": False}}
    prompt["21"] = {"class_type": "ComfySwitchNode",
                    "inputs": {"switch": ["20", 0], "on_false": ["1", 0], "on_true": ["2", 0]}}
    prompt["6"]["inputs"]["model"] = ["21", 0]
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []
    prompt["20"]["inputs"]["value"] = True
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3301", "2")]
    prompt["2"]["inputs"]["strength_model"] = 0
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []


def test_parallel_config_placement(tmp_path):
    # the config's MODEL output goes nowhere: the guider and scheduler take the LoRA's output directly
    prompt = deep(API)
    prompt["8"]["inputs"]["model"] = ["2", 0]
    prompt["9"]["inputs"]["model"] = ["2", 0]
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3104", "6")]
    # a second active config
    prompt = deep(API)
    prompt["30"] = {"class_type": "MultiNPUParallelConfig", "inputs": {"model": ["6", 0], "npu_count": 4}}
    prompt["8"]["inputs"]["model"] = ["30", 0]
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3103", "30")]
    # through a model patch (MiniMaxH3SigmaShift) and a CFGGuider the model still reaches the sampler
    prompt = deep(API)
    prompt["31"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["6", 0], "shift_video": 12.0,
                                                                    "shift_audio": 3.0}}
    prompt["8"] = {"class_type": "CFGGuider", "inputs": {"model": ["31", 0], "positive": ["7", 0],
                                                         "negative": ["7", 0], "cfg": 1.0}}
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []


def test_npu_count_eight_only_against_eight_exposed_devices(tmp_path):
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = 8
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3,4,5,6,7")) == []
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3102", "6")]
    result = check_doc(tmp_path, prompt)
    assert ("H3108", "6") in found(result) and result.exit_code == 1
    assert "needs 8 exposed devices" in messages(result, "H3108")[0]
    prompt["6"]["inputs"]["npu_count"] = 4
    assert "set npu_count to 8" in messages(check_doc(tmp_path, prompt, devices="0,1,2,3,4,5,6,7"), "H3102")[0]


def test_npu_count_auto_is_the_count_of_the_devices_named(tmp_path):
    """Issue 46: one workflow for a 4-card and an 8-card server; the report says what auto will be."""
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = "auto"
    for devices, n in (("0,1,2,3", 4), ("0,1,2,3,4,5,6,7", 8), ("4", 1)):
        result = check_doc(tmp_path, prompt, devices=devices)
        assert found(result) == [("H3112", "6")] and result.exit_code == 0, devices
        assert messages(result, "H3112")[0] == f"npu_count is auto: {n} on --devices {devices}"
    result = check_doc(tmp_path, prompt)  # no server named: said, and nothing compared
    assert found(result) == [("H3105", "6"), ("H3112", "6")] and result.exit_code == 0
    assert "--port" in messages(result, "H3112")[0]


def test_npu_count_from_a_primitive_and_unresolvable(tmp_path):
    prompt = deep(API)
    prompt["40"] = {"class_type": "PrimitiveInt", "inputs": {"value": 2}}
    prompt["6"]["inputs"]["npu_count"] = ["40", 0]
    assert found(check_doc(tmp_path, prompt, devices="0,1")) == []
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3102", "6")]
    prompt["40"] = {"class_type": "SomeCustomCounter", "inputs": {}}
    result = check_doc(tmp_path, prompt, devices="0,1,2,3")
    assert ("H3106", "6") in found(result)
    assert result.exit_code == 0


def test_single_device_bf16_768p_15s(tmp_path):
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = 1
    prompt["7"]["inputs"]["length"] = 362
    assert found(check_doc(tmp_path, prompt, devices="0")) == [("H3304", "7")]
    prompt["1"]["inputs"]["unet_name"] = "minimax_h3_fl2va_int8_convrot.safetensors"
    assert found(check_doc(tmp_path, prompt, devices="0")) == []
    prompt["1"]["inputs"]["unet_name"] = "minimax_h3_fl2va_bf16.safetensors"
    prompt["7"]["inputs"].update(width=864, height=480)
    assert found(check_doc(tmp_path, prompt, devices="0")) == []


def test_sampler_nodes_and_sage_attention(tmp_path):
    prompt = deep(API)
    prompt["10"] = {"class_type": "SamplerEulerAncestral", "inputs": {"eta": 1.0, "s_noise": 1.0}}
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3302", "10")]
    prompt["10"]["inputs"]["eta"] = 0.0
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []
    prompt = deep(API)
    prompt["32"] = {"class_type": "ModelAttentionBackend", "inputs": {"model": ["6", 0], "attention": "sage attention"}}
    prompt["8"]["inputs"]["model"] = ["32", 0]
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == [("H3305", "32")]


def test_not_h3_no_h3_warnings(tmp_path):
    prompt = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "sd15.safetensors"}},
        "2": {"class_type": "EmptyLatentImage", "inputs": {"width": 720, "height": 512, "batch_size": 1}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "x", "clip": ["1", 1]}},
        "4": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": 1, "steps": 20, "cfg": 7.0,
                                                   "sampler_name": "euler_ancestral", "scheduler": "normal",
                                                   "positive": ["3", 0], "negative": ["3", 0],
                                                   "latent_image": ["2", 0], "denoise": 1.0}},
        "5": {"class_type": "VAEDecode", "inputs": {"samples": ["4", 0], "vae": ["1", 2]}},
        "6": {"class_type": "SaveImage", "inputs": {"images": ["5", 0], "filename_prefix": "x"}},
    }
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []


# ------------------------------------------------------------------------------------------- UI format

def test_nested_subgraph_values_and_paths(tmp_path):
    result = check_doc(tmp_path, NESTED, devices="0")
    assert found(result) == [("H3201", "1:5:3"), ("H3203", "1:5:3")]
    f = result.findings[0]
    assert f.path == "Outer #1 > Inner (latent) #5 > EmptyMiniMaxH3LatentAV #3"
    # the outer instance's widget reaches the inner node through two subgraph inputs
    doc = deep(NESTED)
    doc["nodes"][0]["widgets_values"] = [736]
    assert found(check_doc(tmp_path, doc, devices="0")) == [("H3203", "1:5:3")]


def test_nested_outer_link_wins_over_widget(tmp_path):
    doc = deep(NESTED)
    doc["nodes"].append({"id": 7, "type": "PrimitiveInt", "mode": 0, "inputs": [],
                         "outputs": [{"name": "INT", "type": "INT", "links": [2]}], "widgets_values": [810, "fixed"]})
    doc["nodes"][0]["inputs"] = [{"name": "width", "type": "INT", "widget": {"name": "width"}, "link": 2}]
    doc["links"].append([2, 7, 0, 1, 0, "INT"])
    result = check_doc(tmp_path, doc, devices="0")
    assert found(result, "H3201") == [("H3201", "1:5:3")]
    assert "width 810" in messages(result, "H3201")[0]


def test_self_containing_subgraph_is_an_error_not_a_loop(tmp_path):
    doc = deep(NESTED)
    inner = doc["definitions"]["subgraphs"][1]
    outer_id = doc["definitions"]["subgraphs"][0]["id"]
    inner["nodes"].append({"id": 9, "type": outer_id, "mode": 0, "inputs": [], "outputs": [], "widgets_values": [64]})
    result = check_doc(tmp_path, doc, devices="0")
    assert [c for c, _ in found(result)] == ["H3404"]
    assert "contains itself" in result.findings[0].message
    # directly recursive, too
    doc = deep(NESTED)
    inner = doc["definitions"]["subgraphs"][1]
    inner["nodes"].append({"id": 9, "type": inner["id"], "mode": 0, "inputs": [], "outputs": []})
    assert [c for c, _ in found(check_doc(tmp_path, doc, devices="0"))] == ["H3404"]


def _ui_chain():
    """UNET -> LoRA -> KSampler -> VAEDecode -> SaveImage, with an H3 latent; UI format."""
    def n(i, kind, inputs, outputs, widgets, mode=0):
        return {"id": i, "type": kind, "mode": mode, "inputs": inputs, "outputs": outputs, "widgets_values": widgets}
    nodes = [
        n(1, "UNETLoader", [], [{"name": "MODEL", "type": "MODEL", "links": [1]}],
          ["minimax_h3_fl2va_pruned_int8_convrot.safetensors", "default"]),
        n(2, "LoraLoaderModelOnly", [{"name": "model", "type": "MODEL", "link": 1}],
          [{"name": "MODEL", "type": "MODEL", "links": [2]}],
          ["minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors", 1]),
        n(3, "EmptyMiniMaxH3LatentAV", [], [{"name": "LATENT", "type": "LATENT", "links": [3]}], [1344, 768, 124]),
        n(4, "KSampler", [{"name": "model", "type": "MODEL", "link": 2},
                          {"name": "positive", "type": "CONDITIONING", "link": 5},
                          {"name": "negative", "type": "CONDITIONING", "link": 6},
                          {"name": "latent_image", "type": "LATENT", "link": 3}],
          [{"name": "LATENT", "type": "LATENT", "links": [4]}], [1, "fixed", 8, 1.0, "res_multistep", "simple", 1.0]),
        n(5, "SaveLatent", [{"name": "samples", "type": "LATENT", "link": 4}], [], ["latents/x"]),
        n(6, "ConditioningZeroOut", [{"name": "conditioning", "type": "CONDITIONING", "link": None}],
          [{"name": "CONDITIONING", "type": "CONDITIONING", "links": [5, 6]}], []),
    ]
    links = [[1, 1, 0, 2, 0, "MODEL"], [2, 2, 0, 4, 0, "MODEL"], [3, 3, 0, 4, 3, "LATENT"],
             [4, 4, 0, 5, 0, "LATENT"], [5, 6, 0, 4, 1, "CONDITIONING"], [6, 6, 0, 4, 2, "CONDITIONING"]]
    return {"nodes": nodes, "links": links, "version": 0.4}


def test_ui_control_after_generate_values_are_skipped(tmp_path):
    doc = _ui_chain()
    doc["nodes"][3]["widgets_values"] = [1, "randomize", 8, 1.0, "dpmpp_sde", "simple", 1.0]
    result = check_doc(tmp_path, doc, devices="0")
    assert ("H3302", "4") in found(result)
    assert "'dpmpp_sde'" in messages(result, "H3302")[0]


def test_ui_muted_and_bypassed_nodes(tmp_path):
    doc = _ui_chain()
    base = found(check_doc(tmp_path, doc, devices="0"))
    assert ("H3301", "2") in base and ("H3402", "6") in base  # the unconnected conditioning source
    # a bypassed LoRA passes the base model through: no LoRA runs
    doc["nodes"][1]["mode"] = 4
    assert ("H3301", "2") not in found(check_doc(tmp_path, doc, devices="0"))
    # a muted loader leaves the sampler's model input empty
    doc = _ui_chain()
    doc["nodes"][0]["mode"] = 2
    result = check_doc(tmp_path, doc, devices="0")
    assert ("H3402", "2") in found(result)
    assert "muted" in [m for m in messages(result, "H3402") if "'model'" in m][0]
    # a bypassed node with nothing of the wanted type to pass on
    doc = _ui_chain()
    doc["nodes"][2]["mode"] = 4
    result = check_doc(tmp_path, doc, devices="0")
    assert any("bypassed" in m for m in messages(result, "H3402"))


def test_ui_broken_links_and_cycles(tmp_path):
    doc = _ui_chain()
    doc["links"][1] = [2, 77, 0, 4, 0, "MODEL"]          # origin node missing
    assert ("H3401", "4") in found(check_doc(tmp_path, doc, devices="0"))
    doc = _ui_chain()
    doc["links"][1] = [2, 2, 5, 4, 0, "MODEL"]           # origin slot missing
    assert ("H3401", "4") in found(check_doc(tmp_path, doc, devices="0"))
    doc = _ui_chain()
    doc["nodes"][3]["inputs"][0]["link"] = 999           # link id not in the table
    assert ("H3401", "4") in found(check_doc(tmp_path, doc, devices="0"))
    doc = _ui_chain()                                     # reroute loop
    doc["nodes"].append({"id": 8, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 9}],
                         "outputs": [{"name": "", "type": "MODEL", "links": [9]}]})
    doc["links"].append([9, 8, 0, 8, 0, "MODEL"])
    doc["nodes"][3]["inputs"][0]["link"] = 10
    doc["links"].append([10, 8, 0, 4, 0, "MODEL"])
    assert ("H3403", "4") in found(check_doc(tmp_path, doc, devices="0"))
    doc = _ui_chain()                                     # node-level cycle
    doc["nodes"][1]["inputs"][0]["link"] = 11
    doc["links"].append([11, 4, 0, 2, 0, "MODEL"])
    doc["nodes"][3]["outputs"][0]["links"].append(11)
    assert "H3403" in [c for c, _ in found(check_doc(tmp_path, doc, devices="0"))]


def test_legacy_primitive_and_reroute_are_followed(tmp_path):
    doc = _ui_chain()
    doc["nodes"][0]["widgets_values"][0] = "minimax_h3_fl2va_bf16.safetensors"
    doc["nodes"].append({"id": 10, "type": "PrimitiveNode", "mode": 0, "inputs": [],
                         "outputs": [{"name": "INT", "type": "INT", "links": [20]}], "widgets_values": [720, "fixed"]})
    doc["nodes"].append({"id": 11, "type": "Reroute", "mode": 0, "inputs": [{"name": "", "type": "*", "link": 20}],
                         "outputs": [{"name": "", "type": "INT", "links": [21]}]})
    doc["nodes"][2]["inputs"] = [{"name": "width", "type": "INT", "widget": {"name": "width"}, "link": 21}]
    doc["links"] += [[20, 10, 0, 11, 0, "INT"], [21, 11, 0, 3, 0, "INT"]]
    assert ("H3201", "3") in found(check_doc(tmp_path, doc, devices="0"))


def test_dangling_branch_is_not_validated(tmp_path):
    doc = _ui_chain()
    doc["nodes"][5]["inputs"][0]["link"] = None
    doc["nodes"].append({"id": 12, "type": "ImageScaleToTotalPixels", "mode": 0,
                         "inputs": [{"name": "image", "type": "IMAGE", "link": None}],
                         "outputs": [{"name": "IMAGE", "type": "IMAGE", "links": []}],
                         "widgets_values": ["nearest-exact", 1.0, 1]})
    codes = found(check_doc(tmp_path, doc, devices="0"))
    assert ("H3402", "12") not in codes and ("H3402", "6") in codes


# ------------------------------------------------------------------------------------ malformed input

@pytest.mark.parametrize("text, fragment", [
    ('{"nodes": [', "not valid JSON"),
    ("", "not valid JSON"),
    ("[1, 2, 3]", "not a ComfyUI workflow"),
    ('{"hello": "world"}', "not a ComfyUI workflow"),
    ('{"prompt": [1]}', "not an API-format prompt"),
    ('{"nodes": "not a list"}', "not a ComfyUI workflow"),
    ("[" * 100000 + "]" * 100000, "nests JSON too deeply"),
    ('{"nodes": [], "x": ' + "9" * 5000 + "}", "cannot hold"),
    (b"\xff\xfe\x00garbage", "not UTF-8"),
])
def test_unreadable_files_exit_2(tmp_path, text, fragment):
    path = tmp_path / "bad.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    from h3kit.workflow import check_paths
    result = check_paths([str(path)], environ={})
    assert result.exit_code == 2
    assert found(result) == [("H3001", None)]
    assert fragment in result.findings[0].message


@pytest.mark.parametrize("doc", [
    {"nodes": [1, "two", None, {"id": None, "type": 5}, {"id": 1}]},
    {"nodes": [{"id": 1, "type": "KSampler", "inputs": "x", "outputs": 7, "widgets_values": {"a": [1]},
                "mode": "loud"}], "links": [["a"], None, {"id": "x"}]},
    {"nodes": [{"id": 1, "type": "EmptyMiniMaxH3LatentAV", "widgets_values": [1e308, float("nan"), 10 ** 40]}]},
    {"nodes": [{"id": 1, "type": "EmptyMiniMaxH3LatentAV", "widgets_values": [[[]], {"a": 1}, True]}]},
    {"nodes": [{"id": 1, "type": "x" * 10000, "inputs": [{"name": None, "link": 3}]}], "links": [[3, 1, 0, 1, 0]]},
    {"nodes": [], "definitions": {"subgraphs": [None, {"id": 5}, {"id": "s", "nodes": None, "inputs": [7]}]}},
    {"1": {"class_type": "KSampler", "inputs": [1, 2]}, "2": "text", "3": {"class_type": None},
     "4": {"class_type": "VAEDecode", "inputs": {"samples": ["1", 10 ** 30], "vae": [[], 0]}}},
    {"1": {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": 1e999, "height": -1e999, "length": 10 ** 100}}},
])
def test_wrong_types_never_crash(tmp_path, doc):
    result = check_doc(tmp_path, json.dumps(doc, allow_nan=True), devices="0")
    assert result.exit_code in (0, 1)
    for f in result.findings:
        assert f.code in report.CODES


def test_deep_subgraph_nesting_is_bounded(tmp_path):
    subgraphs = []
    for i in range(60):
        child = [{"id": 1, "type": f"sg{i + 1}", "mode": 0, "inputs": [], "outputs": []}] if i < 59 else []
        subgraphs.append({"id": f"sg{i}", "name": f"level {i}", "nodes": child, "links": [], "inputs": [],
                          "outputs": []})
    doc = {"nodes": [{"id": 1, "type": "sg0", "mode": 0}], "links": [], "definitions": {"subgraphs": subgraphs}}
    result = check_doc(tmp_path, doc, devices="0")
    assert result.exit_code == 2 and found(result) == [("H3002", None)]


def test_long_reroute_chains_are_bounded(tmp_path):
    doc = _ui_chain()
    prev_link = 2
    for i in range(2000):
        nid, lid = 100 + i, 1000 + i
        doc["nodes"].append({"id": nid, "type": "Reroute", "mode": 0,
                             "inputs": [{"name": "", "type": "*", "link": prev_link}],
                             "outputs": [{"name": "", "type": "MODEL", "links": [lid]}]})
        if prev_link == 2:
            doc["links"][1] = [2, 2, 0, nid, 0, "MODEL"]
        else:
            doc["links"].append([prev_link, nid - 1, 0, nid, 0, "MODEL"])
        prev_link = lid
    doc["links"].append([prev_link, 2099, 0, 4, 0, "MODEL"])
    doc["nodes"][3]["inputs"][0]["link"] = prev_link
    result = check_doc(tmp_path, doc, devices="0")
    assert result.exit_code in (1, 2)
    assert any("longer than" in f.message or f.code == "H3002" for f in result.findings)


def test_cli_never_prints_a_traceback(tmp_path):
    cases = {"trunc.json": '{"nodes": [{"id": 1', "types.json": json.dumps({"nodes": [{"id": [], "type": {}}]}),
             "deep.json": "[" * 50000 + "]" * 50000}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
    proc = subprocess.run([sys.executable, "-m", "h3kit", "check-workflow", *[str(tmp_path / n) for n in cases],
                           str(tmp_path / "missing.json"), "--devices", "0"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.count("H3001") == 3 and "H3405" in proc.stdout


# ------------------------------------------------------------------------------------------ the CLI

def test_cli_json_document_and_exit_codes(tmp_path, runner):
    bad = deep(API)
    bad["7"]["inputs"]["length"] = 120
    bad["6"]["inputs"]["npu_count"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    (tmp_path / "good.json").write_text(json.dumps(API))
    result = runner.invoke(main, ["check-workflow", "--json", "--devices", "0,1,2,3", str(tmp_path / "bad.json"),
                                  str(tmp_path / "good.json")])
    assert result.exit_code == 1
    doc = jsondoc.data(result.stdout, result.exit_code)
    assert {tuple(sorted(f)) for f in doc["findings"]} == {("code", "file", "message", "node", "path", "severity")}
    assert {(f["code"], f["severity"], f["node"]) for f in doc["findings"]} == {
        ("H3101", "error", "6"), ("H3203", "warning", "7")}
    assert doc["summary"]["errors"] == 1 and doc["summary"]["warnings"] == 1 and doc["summary"]["files"] == 2
    result = runner.invoke(main, ["check-workflow", "--devices", "0,1,2,3", str(tmp_path / "good.json")])
    assert result.exit_code == 0 and "OK:" in result.output


def test_cli_text_groups_by_severity(tmp_path, runner):
    bad = deep(API)
    bad["7"]["inputs"].update(length=120, width=720)
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    result = runner.invoke(main, ["check-workflow", str(tmp_path / "bad.json")])
    out = result.output
    assert result.exit_code == 1
    assert out.index("Errors (1):") < out.index("H3201") < out.index("Warnings (1):") < out.index("H3203") \
        < out.index("Notes (1):") < out.index("H3105")


def test_cli_bad_device_list_is_usage_error(tmp_path, runner):
    (tmp_path / "good.json").write_text(json.dumps(API))
    result = runner.invoke(main, ["check-workflow", "--devices", "1, 2,3", str(tmp_path / "good.json")])
    assert result.exit_code == 2
    assert "bad_device_list" in result.output
    with pytest.raises(DeviceListError):
        check_doc(tmp_path, API, devices="0,1,2")


def test_check_workflow_imports_nothing_heavy(tmp_path):
    (tmp_path / "wf.json").write_text(json.dumps(API))
    code = ("import sys\nfrom h3kit.cli import main\n"
            f"try:\n    main(['check-workflow', '--devices', '0,1,2,3', {str(tmp_path / 'wf.json')!r}])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print('HEAVY=' + ','.join(m for m in ('torch', 'git', 'numpy', 'requests', 'yaml') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "HEAVY="


# ----------------------------------------------------------------------------------- device sources

def test_devices_from_the_environment(tmp_path):
    result = check_doc(tmp_path, API, environ={"ASCEND_RT_VISIBLE_DEVICES": "4,5"})
    assert found(result) == [("H3102", "6")]
    assert result.summary["device_source"] == "ASCEND_RT_VISIBLE_DEVICES=4,5"
    # --devices wins over the environment
    assert found(check_doc(tmp_path, API, devices="0,1,2,3", environ={"ASCEND_RT_VISIBLE_DEVICES": "4,5"})) == []
    with pytest.raises(DeviceListError):
        check_doc(tmp_path, API, environ={"ASCEND_RT_VISIBLE_DEVICES": "1, 2,3"})


class _FakeComfy(BaseHTTPRequestHandler):
    stats: dict = {}

    def do_GET(self):
        body = {"/system_stats": self.stats, "/object_info": {}}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(json.dumps(body or {}).encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_service():
    server = HTTPServer(("127.0.0.1", 0), _FakeComfy)  # the kernel's choice: nothing else can hold it
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


_SERVERS: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _stop_fake_servers():
    yield
    while _SERVERS:
        proc = _SERVERS.pop()
        proc.kill()
        proc.wait()


def _home(tmp_path, record, node_types=None):
    """A fake comfy home; `record` (port, listen, device_type, devices) is completed into a server record
    naming a process that runs this home's main.py as h3kit would have started it (it only sleeps: this
    test process serves the fake port from a thread), so the record passes h3kit's identity check."""
    home = tmp_path / "ComfyUI"
    (home / "models").mkdir(parents=True)
    (home / "main.py").write_text("import time\ntime.sleep(600)\n")
    types = node_types if node_types is not None else sorted({n["class_type"] for n in API.values()})
    (home / "nodes.py").write_text("NODE_CLASS_MAPPINGS = {\n" + "".join(f'    "{t}": {t},\n' for t in types) + "}\n")
    if record is not None:
        argv = ["-B", "main.py", "--listen", record["listen"], "--port", str(record["port"])]
        proc = subprocess.Popen([sys.executable, *argv] + (["--cpu"] if record["device_type"] == "cpu" else []),
                                cwd=home)
        _SERVERS.append(proc)
        server = psutil.Process(proc.pid)
        while "main.py" not in server.cmdline():
            time.sleep(0.01)
        full = {"pid": proc.pid, "create_time": server.create_time(), "cmdline": server.cmdline(),
                "python": sys.executable, "comfy_home": str(home),
                "log": str(home / ".h3kit" / "run" / "logs" / "comfyui-1.log"), "extra_args": [], **record}
        (home / ".h3kit" / "run").mkdir(parents=True)
        (home / ".h3kit" / "run" / "server.json").write_text(json.dumps(full))
    return home


def test_devices_from_the_running_service(tmp_path, fake_service):
    _FakeComfy.stats = {"system": {"argv": ["main.py"]}, "devices": [{"name": "npu:0"}, {"name": "npu:1"}]}
    home = _home(tmp_path, {"port": fake_service.server_port, "listen": "127.0.0.1", "device_type": "npu", "devices": [0, 1]})
    result = check_doc(tmp_path, API, comfy_home=str(home))
    assert found(result, "H3102") == [("H3102", "6")]
    assert result.summary["device_count"] == 2
    assert str(fake_service.server_port) in result.summary["device_source"]
    # a CPU server in simulation mode: the record's device list is the simulated one
    _FakeComfy.stats = {"system": {"argv": ["main.py", "--use-sage-attention"]}, "devices": [{"name": "cpu"}]}
    home = _home(tmp_path / "b", {"port": fake_service.server_port, "listen": "0.0.0.0", "device_type": "cpu", "devices": [0, 1, 2, 3]})
    result = check_doc(tmp_path, API, comfy_home=str(home))
    assert result.summary["device_count"] == 4
    assert found(result, "H3102") == [] and found(result, "H3305") == [("H3305", None)]


def test_a_proxy_in_the_environment_does_not_hide_the_local_service(tmp_path, fake_service, monkeypatch):
    """Firewalled hosts set http_proxy; the local server must still be asked directly."""
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    _FakeComfy.stats = {"system": {"argv": ["main.py"]}, "devices": [{"name": "npu:0"}, {"name": "npu:1"}]}
    home = _home(tmp_path, {"port": fake_service.server_port, "listen": "127.0.0.1", "device_type": "npu", "devices": [0, 1]})
    result = check_doc(tmp_path, API, comfy_home=str(home))
    assert found(result, "H3102") == [("H3102", "6")]


def test_card_memory_from_the_running_service(tmp_path, fake_service):
    prompt = deep(API)
    prompt["6"]["inputs"]["weights"] = "replicated"
    _FakeComfy.stats = {"system": {"argv": ["main.py"]}, "devices": [
        {"name": "npu:0", "vram_total": 64 * 10**9}, {"name": "npu:1", "vram_total": 32 * 10**9},
        {"name": "npu:2", "vram_total": 64 * 10**9}, {"name": "npu:3", "vram_total": 64 * 10**9}]}
    home = _home(tmp_path, {"port": fake_service.server_port, "listen": "127.0.0.1", "device_type": "npu", "devices": [0, 1, 2, 3]})
    result = check_doc(tmp_path, prompt, comfy_home=str(home))
    assert found(result, "H3109") == [("H3109", "6")] and result.summary["device_memory_gb"] == 32  # the smallest
    assert f"the cards have 32 GB (/system_stats of http://127.0.0.1:{fake_service.server_port})" in messages(result, "H3109")[0]
    # --device-memory wins over the service's figure
    assert found(check_doc(tmp_path, prompt, comfy_home=str(home), device_memory=80), "H3109") == []


def test_npu_count_auto_on_a_server_of_three_cards_is_an_error(tmp_path, fake_service):
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = "auto"
    _FakeComfy.stats = {"system": {"argv": ["main.py"]}, "devices": [{"name": f"npu:{i}"} for i in range(3)]}
    home = _home(tmp_path, {"port": fake_service.server_port, "listen": "127.0.0.1", "device_type": "npu",
                            "devices": [0, 1, 2, 3]})
    result = check_doc(tmp_path, prompt, comfy_home=str(home))
    assert found(result, "H3101") == [("H3101", "6")] and result.exit_code == 1
    assert "npu_count is auto, which is 3 on the running service at" in messages(result, "H3101")[0]


def test_a_record_whose_process_is_gone_says_nothing(tmp_path, fake_service):
    _FakeComfy.stats = {"system": {"argv": ["main.py"]}, "devices": [{"name": "npu:0"}, {"name": "npu:1"}]}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    home = _home(tmp_path, {"port": fake_service.server_port, "listen": "127.0.0.1", "device_type": "npu", "devices": [0, 1],
                            "pid": int(dead.stdout), "create_time": 1.0})
    result = check_doc(tmp_path, API, comfy_home=str(home))
    assert found(result, "H3102") == [] and found(result, "H3105") == [("H3105", "6")]
    assert "not running" in result.summary["device_source"]


def test_no_device_source_is_a_note(tmp_path):
    silent = free_port(8600, 8699)  # reserved for this test and free: nothing answers there
    home = _home(tmp_path, {"port": silent, "listen": "127.0.0.1", "device_type": "npu", "devices": [0]})
    result = check_doc(tmp_path, API, comfy_home=str(home))
    assert found(result, "H3105") == [("H3105", "6")]
    assert "does not answer" in result.summary["device_source"]
    assert result.exit_code == 1  # the model files are missing from the empty home
    assert {c for c, _ in found(result)} == {"H3105", "H3501"}


# ------------------------------------------------------------------------------ --comfy-home checks

def test_model_files_and_extra_model_paths(tmp_path):
    home = _home(tmp_path, None)
    store = tmp_path / "store"
    for rel in ("diffusion/minimax_h3_fl2va_bf16.safetensors", "loras/minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"):
        (store / rel).parent.mkdir(parents=True, exist_ok=True)
        (store / rel).write_bytes(b"")
    (home / "models" / "clip").mkdir()
    (home / "models" / "clip" / "qwen3vl_32b_minimax_h3_int8_convrot.safetensors").write_bytes(b"")
    (home / "models" / "vae").mkdir()
    (home / "models" / "vae" / "minimax_h3_video_vae_fp16.safetensors").write_bytes(b"")
    (home / "extra_model_paths.yaml").write_text(
        f"store:\n  base_path: {store}\n  unet: diffusion\n  loras: |\n    nowhere\n    loras\n")
    result = check_doc(tmp_path, API, devices="0,1,2,3", comfy_home=str(home))
    assert found(result) == [("H3501", "5")]
    assert "minimax_h3_audio_vae_fp32.safetensors" in result.findings[0].message
    (home / "extra_model_paths.yaml").write_text("store: [unclosed\n")
    result = check_doc(tmp_path, API, devices="0,1,2,3", comfy_home=str(home))
    assert ("H3503", None) in found(result)


def test_unknown_node_types_from_a_static_scan(tmp_path):
    home = _home(tmp_path, None, node_types=["UNETLoader", "VAELoader"])
    (home / "comfy_extras").mkdir()
    (home / "comfy_extras" / "nodes_x.py").write_text('io.Schema(node_id="MiniMaxH3ImageToVideo")\n')
    (home / "custom_nodes" / "pack").mkdir(parents=True)
    (home / "custom_nodes" / "pack" / "__init__.py").write_text(
        'NODE_CLASS_MAPPINGS = {}\nNODE_CLASS_MAPPINGS["BasicGuider"] = G\n'
        'NODE_CLASS_MAPPINGS.update({"SamplerCustomAdvanced": S, "RandomNoise": R})\n')
    result = check_doc(tmp_path, API, devices="0,1,2,3", comfy_home=str(home))
    unknown = {re.search(r"node type '([^']+)'", m).group(1) for m in messages(result, "H3502")}
    assert unknown == {"LoraLoaderModelOnly", "CLIPLoader", "BasicScheduler", "KSamplerSelect", "VAEDecode",
                       "VAEDecodeAudio", "CreateVideo", "SaveVideo"}  # MultiNPUParallelConfig is h3kit's own


def test_comfy_home_must_be_comfyui(tmp_path):
    with pytest.raises(UsageError):
        check_doc(tmp_path, API, comfy_home=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError):
        check_doc(tmp_path, API, comfy_home=str(tmp_path / "empty"))


# ------------------------------------------------------------------------- shipped workflows, docs

@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_workflows_pass_on_four_devices(path, tmp_path):
    from h3kit.workflow import check_paths
    result = check_paths([str(path)], devices="0,1,2,3", environ={})
    assert found(result) == [] and result.exit_code == 0
    assert found(check_paths([str(path)], devices="0,1", environ={})) == [("H3102", "6")]
    doc = json.loads(path.read_text())
    config = [n for n in doc["nodes"] if n["type"] == "MultiNPUParallelConfig"]
    assert len(config) == 1 and config[0]["widgets_values"][0] == 4
    config[0]["widgets_values"][0] = 2
    assert found(check_doc(tmp_path, doc, devices="0,1")) == []
    unet = next(n for n in doc["nodes"] if n["type"] == "UNETLoader")["widgets_values"][0]
    lora = next(n for n in doc["nodes"] if n["type"] == "LoraLoaderModelOnly")["widgets_values"][0]
    assert "pruned" not in unet and "turbo_8step" in lora


def test_frontend_schema_check_catches_what_the_frontend_rejects():
    doc = json.loads(SHIPPED[0].read_text())
    assert frontend_schema_errors(doc) == []
    doc["id"] = None
    doc["nodes"][0]["pos"] = [0]
    doc["links"][0] = doc["links"][0][:5]
    assert len(frontend_schema_errors(doc)) == 3


def test_npu_count_is_the_first_widget_even_if_the_node_grows(tmp_path):
    doc = json.loads(SHIPPED[0].read_text())
    config = next(n for n in doc["nodes"] if n["type"] == "MultiNPUParallelConfig")
    config["widgets_values"] = [2, "sharded", "a widget a later runtime adds"]
    result = check_doc(tmp_path, doc, devices="0,1,2,3")
    assert found(result) == [("H3406", "6"), ("H3102", "6")]


def test_the_weights_widget_follows_npu_count_and_may_be_missing(tmp_path):
    """Issue 14 appended the optional weights widget: [npu_count, weights] from a current frontend, [npu_count]
    from one saved before (it keeps its default, auto); a value the node does not take is an error."""
    doc = json.loads(SHIPPED[0].read_text())
    config = next(n for n in doc["nodes"] if n["type"] == "MultiNPUParallelConfig")
    assert config["widgets_values"] == [4, "auto"]
    config["widgets_values"] = [4]  # saved before the widget existed: no note, weights auto
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3")) == []
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3", device_memory=64)) == []  # auto shards: it fits
    config["widgets_values"] = [4, "replicated"]
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3")) == []
    # the value was read: replicated BF16 on four 64 GB cards does not fit (H3109), sharded does
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3", device_memory=64)) == [("H3109", "6")]
    config["widgets_values"] = [4, "sharded"]
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3", device_memory=64)) == []
    config["widgets_values"] = [4, "shared"]
    result = check_doc(tmp_path, doc, devices="0,1,2,3")
    assert found(result) == [("H3110", "6")] and "takes auto, replicated, sharded" in messages(result, "H3110")[0]


def test_the_tier_must_fit_the_cards(tmp_path):
    """H3109: the workflow's tier (npu_count, BF16/INT8 DiT, weights, canvas and length) against one card, with
    the first change that fits; the figures are h3kit plan's (cost model)."""
    from h3kit.runtime import costmodel
    prompt = deep(API)  # 4 devices, minimax_h3_fl2va_bf16, 1344x768, 124 frames, no weights value: auto
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3", device_memory=64)) == []  # auto shards
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3")) == []  # no card size: nothing said
    prompt["6"]["inputs"]["weights"] = "replicated"
    result = check_doc(tmp_path, prompt, devices="0,1,2,3", device_memory=64)
    assert found(result) == [("H3109", "6")] and result.exit_code == 0  # a warning: it runs, streaming weights
    need = costmodel.plan(1344, 768, 124, 4, sharding="replicated")["memory_per_device"]["total"]
    message = messages(result, "H3109")[0]
    assert f"need {need / 1e9:.1f} GB per device and the cards have 64 GB (--device-memory 64)" in message
    sharded = costmodel.plan(1344, 768, 124, 4, sharding="sharded")["memory_per_device"]["total"]
    assert f"Fix: set weights to sharded (or auto) on MultiNPUParallelConfig ({sharded / 1e9:.1f} GB per device" \
        in message
    # 15 s, sharded BF16 on 4 cards: 28.2 GB per device (HCCL buffers and device 0's share of the server's encodes
    # included) fits a 32 GB card, not a 24 GB one
    prompt["7"]["inputs"]["length"] = 362
    prompt["6"]["inputs"]["weights"] = "sharded"
    assert found(check_doc(tmp_path, prompt, devices="0,1,2,3", device_memory=32)) == []
    result = check_doc(tmp_path, prompt, devices="0,1,2,3", device_memory=24)
    assert found(result) == [("H3109", "6")]
    int8 = costmodel.plan(1344, 768, 362, 4, weights="int8", sharding="sharded")["memory_per_device"]["total"]
    assert f"Fix: use the INT8 DiT (minimax_h3_*_int8_convrot) with weights sharded ({int8 / 1e9:.1f} GB" \
        in messages(result, "H3109")[0]
    prompt["1"]["inputs"]["unet_name"] = "minimax_h3_fl2va_int8_convrot.safetensors"  # INT8: one step further
    result = check_doc(tmp_path, prompt, devices="0,1,2,3", device_memory=16)
    message = messages(result, "H3109")[0]
    assert "Fix: run on 8 devices with weights sharded (h3kit start --devices 0,1,2,3,4,5,6,7, npu_count 8) " \
           f"({costmodel.plan(1344, 768, 362, 8, weights='int8', sharding='sharded')['memory_per_device']['total'] / 1e9:.1f}" \
           " GB per device" in message
    # one device: nothing to shard; the INT8 DiT is the fix at 64 GB, 5 s
    prompt = deep(API)
    prompt["6"]["inputs"]["npu_count"] = 1
    result = check_doc(tmp_path, prompt, devices="0", device_memory=64)
    assert found(result) == [("H3109", "6")] and "Fix: use the INT8 DiT" in messages(result, "H3109")[0]


def test_shipped_set_is_complete():
    assert {p.name for p in SHIPPED} == {"t2va_8steps_lora.json", "fl2va_8steps_lora.json", "ref2va_8steps_lora.json"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_workflows_are_consistent_ui_documents(path):
    """Every link is in both endpoints' slot lists and every slot link is in the table (what the frontend needs)."""
    from h3kit.workflow.catalog import load_catalog
    catalog = load_catalog()
    doc = json.loads(path.read_text())
    assert frontend_schema_errors(doc) == []
    nodes = {n["id"]: n for n in doc["nodes"]}
    assert doc["last_node_id"] == max(nodes) and doc["last_link_id"] == max(link[0] for link in doc["links"])
    for lid, src, slot, dst, dslot, kind in doc["links"]:
        assert lid in nodes[src]["outputs"][slot]["links"] and nodes[dst]["inputs"][dslot]["link"] == lid
        assert nodes[src]["outputs"][slot]["type"] == kind
    for node in doc["nodes"]:
        nd = catalog.get(node["type"])
        assert nd is not None, node["type"]
        slots = nd.widget_slots()
        assert len(node["widgets_values"]) == len(slots) or not nd.widget_slots_complete
        for inp in node["inputs"]:
            assert inp["name"].split(".")[0] in {i[0] for i in nd.inputs}


def test_every_code_is_documented():
    doc = (ROOT / "docs" / "check-workflow.md").read_text()
    table = dict(re.findall(r"^\| (H3\d{3}) \| (\w+) \|", doc, re.M))
    assert table == {code: sev for code, (sev, _title) in report.CODES.items()}
    used = set()
    for source in (ROOT / "toolkit" / "h3kit" / "workflow").glob("*.py"):
        used |= set(re.findall(r'"(H3\d{3})"', source.read_text()))
    assert used == set(report.CODES)


@pytest.mark.upstream
def test_geometry_helpers_match_upstream(pin_tree):
    # the pin's own align_frame_count and adapt_canvas (comfy_extras/nodes_minimax_h3.py), not values copied from it
    pin = pin_functions(pin_tree, "comfy_extras/nodes_minimax_h3.py", ("align_frame_count", "adapt_canvas"))
    assert all(align_frame_count(n) == pin["align_frame_count"](n) for n in range(1, 4000))
    sides = range(16, 4097, 16)
    assert all(adapt_canvas(w, h) == pin["adapt_canvas"](w, h) for w in sides for h in sides)
