"""check-workflow on the real upstream templates (comfyui-workflow-templates-json 0.1.123) and on variants of
them: every H3 template parses with no false error, real values resolve, and each trap planted in a real
graph (UI, its API form, one subgraph deeper) is found at the right node."""

from __future__ import annotations

import copy
import json
import re

import pytest

from h3kit.workflow import check_paths
from h3kit.workflow.catalog import load_catalog
from h3kit.workflow.graph import build_graph
from h3kit.workflow.load import classify, read_workflow
from h3kit.workflow.resolve import UNKNOWN, value
from tests.support.check_workflow_api import to_api
from tests.support.check_workflow_helpers import check_doc, found, messages, ui_node

H3_PATTERNS = ("api_minimax_h3_*", "image_minimax_h3_t2i*", "video_fasth3_*", "video_fastvideo_fasth3_*",
               "video_minimax_h3_*")
T2V = "video_minimax_h3_t2v.json"
SUB_T2V = "79dd8a95"
# Templates with subgraphs nested in subgraphs (none of them H3): they must expand without a false H3404/H3401
NESTED = ("flux1_dev_uso_reference_image_gen.json", "flux_depth_lora_example.json", "video_wan_vace_flf2v.json",
          "image_netayume_lumina_t2i.json", "video_wan_dancer.json", "utility_void_video_inpainting.json")


@pytest.fixture(scope="module")
def h3_templates(templates_dir):
    paths = sorted({p for pattern in H3_PATTERNS for p in templates_dir.glob(pattern + ".json")})
    # 9 cloud-API graphs (MiniMax's hosted H3), 10 local graphs: the pinned package's full H3 set
    assert len(paths) == 19, [p.name for p in paths]
    return paths


@pytest.fixture
def t2v(templates_dir):
    return json.loads((templates_dir / T2V).read_text(encoding="utf-8"))


CATALOG = load_catalog()


def _graph(doc):
    return build_graph(classify(doc), CATALOG)


def test_every_h3_template_has_no_false_finding(h3_templates):
    for path in h3_templates:
        result = check_paths([str(path)], devices="0,1,2,3", environ={})
        codes = {c for c, _ in found(result)}
        assert result.exit_code == 0, (path.name, result.findings)
        # the one thing worth saying about the local graphs: none of them has MultiNPUParallelConfig
        assert codes <= {"H3107"}, (path.name, result.findings)
        assert ("H3107" in codes) == (not path.name.startswith("api_")), path.name
        assert check_paths([str(path)], devices="0", environ={}).findings == []


def test_real_values_resolve_through_subgraphs_and_math(templates_dir):
    # duration in seconds -> ComfyMathExpression "max(5, round(a * 24)) + (5 - ...) % 17" -> a 17k+5 length
    cases = [(T2V, "140:131", 124), ("video_minimax_h3_i2v.json", "105:104", 124),
             ("video_minimax_h3_r2v.json", "136", 124), ("video_fastvideo_fasth3_i2v.json", "105:104", 124),
             ("video_minimax_h3_multiframe_reference.json", "136", 124)]
    for name, node_id, length in cases:
        graph = _graph(read_workflow(str(templates_dir / name)).data)
        node = graph.nodes[node_id]
        assert value(graph, node, "length") == length, name
        assert value(graph, node, "width") is UNKNOWN  # the Resolution Selector computes it at run time
    graph = _graph(read_workflow(str(templates_dir / "video_minimax_h3_i2v_continuation.json")).data)
    # a subgraph input with no outer link takes the instance's widget value
    assert value(graph, graph.nodes["105:15"], "noise_seed") == 757358688076805
    assert value(graph, graph.nodes["105:6"], "unet_name") == "minimax_h3_fl2va_pruned_int8_convrot.safetensors"


def test_instance_widgets_match_the_templates_named_values(templates_dir):
    """Instance widget values map to subgraph inputs as widgets_values_named (added by the template package) says."""
    checked = 0
    for path in sorted(templates_dir.glob("*.json")):
        text = path.read_text(encoding="utf-8")
        if '"widgets_values_named"' not in text or '"definitions"' not in text:
            continue
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
            continue
        graph = _graph(doc)
        for node in doc["nodes"]:
            named = node.get("widgets_values_named")
            if str(node["id"]) in graph.instances and isinstance(named, dict):
                assert graph.instances[str(node["id"])] == named, (path.name, node["id"])
                checked += 1
    assert checked >= 40


def test_templates_with_nested_subgraphs_expand(templates_dir):
    for name in NESTED:
        result = check_paths([str(templates_dir / name)], environ={})
        assert result.exit_code in (0, 1)
        assert not {"H3404", "H3401", "H3002"} & {c for c, _ in found(result)}, (name, result.findings)
        graph = _graph(read_workflow(str(templates_dir / name)).data)
        assert any(nid.count(":") >= 2 for nid in graph.nodes), name


def test_turbo_lora_off_in_t2i_is_not_reported_and_on_is(templates_dir, tmp_path):
    doc = json.loads((templates_dir / "image_minimax_h3_t2i.json").read_text(encoding="utf-8"))
    assert found(check_doc(tmp_path, doc, devices="0")) == []
    ui_node(doc, 58)["widgets_values"][3] = True          # "enable_turbo_lora"
    result = check_doc(tmp_path, doc, devices="0")
    assert found(result) == [("H3301", "58:41")]
    assert "minimax_h3_fl2va_pruned_int8_convrot.safetensors" in result.findings[0].message
    assert "minimax_h3_fl2va_int8_convrot.safetensors" in result.findings[0].message  # the full base to use


# ------------------------------------------------------------------------------ variants of the t2v graph

def _width_720(doc):
    instance = ui_node(doc, 140)
    next(i for i in instance["inputs"] if i["name"] == "width")["link"] = None
    instance["widgets_values"][1] = 720


def _length_120(doc):
    ui_node(doc, 132, SUB_T2V)["widgets_values"][0] = "round(a * 24)"   # 5 s -> 120 frames, off the grid


def _turbo_on(doc):
    ui_node(doc, 140)["widgets_values"][9] = True


def _ancestral(doc):
    ui_node(doc, 123, SUB_T2V)["widgets_values"][0] = "euler_ancestral"


def _audio_vae_bf16(doc):
    ui_node(doc, 140)["widgets_values"][8] = "minimax_h3_audio_vae_bf16.safetensors"


def _lora_bypassed_turbo_on(doc):
    _turbo_on(doc)
    ui_node(doc, 134, SUB_T2V)["mode"] = 4


def _unet_muted(doc):
    ui_node(doc, 127, SUB_T2V)["mode"] = 2


def add_config(doc, npu_count=4, nid=900, after=135):
    """MultiNPUParallelConfig inside the t2v subgraph, between `after` (the turbo switch) and the guider/scheduler."""
    sub = next(s for s in doc["definitions"]["subgraphs"] if s["id"].startswith(SUB_T2V))
    source = ui_node(doc, after, SUB_T2V)
    source["outputs"][0]["links"] = [nid]
    sub["nodes"].append({"id": nid, "type": "MultiNPUParallelConfig", "mode": 0,
                         "inputs": [{"name": "model", "type": "MODEL", "link": nid}],
                         "outputs": [{"name": "MODEL", "type": "MODEL", "links": [234, 241]}],
                         "widgets_values": [npu_count]})
    links = {link["id"]: link for link in sub["links"]}
    links[234]["origin_id"] = links[241]["origin_id"] = nid
    sub["links"].append({"id": nid, "origin_id": after, "origin_slot": 0, "target_id": nid, "target_slot": 0,
                         "type": "MODEL"})


VARIANTS = {
    "width_720": (_width_720, [("H3201", "140:131")]),
    "length_120": (_length_120, [("H3203", "140:131")]),
    "turbo_on_pruned": (_turbo_on, [("H3301", "140:134")]),
    "ancestral_sampler": (_ancestral, [("H3302", "140:123")]),
    "audio_vae_bf16": (_audio_vae_bf16, [("H3303", "140:120")]),
    "lora_bypassed": (_lora_bypassed_turbo_on, []),
    # the LoRA and the switch's off branch lose their model (validation covers both branches of a switch)
    "unet_muted": (_unet_muted, [("H3402", "140:134"), ("H3402", "140:135")]),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_t2v_variants_ui_and_api(t2v, tmp_path, name):
    mutate, expected = VARIANTS[name]
    doc = copy.deepcopy(t2v)
    mutate(doc)
    assert sorted(found(check_doc(tmp_path, doc, devices="0"))) == expected
    if name != "unet_muted":  # the frontend drops a muted node's links from the prompt: nothing left to check
        assert sorted(found(check_doc(tmp_path, to_api(doc), name="api.json", devices="0"))) == expected


def test_t2v_variant_messages(t2v, tmp_path):
    doc = copy.deepcopy(t2v)
    _width_720(doc)
    _length_120(doc)
    result = check_doc(tmp_path, doc, devices="0")
    assert messages(result, "H3201") == ["width 720 is not a multiple of 32, which H3's patchify needs: set it to "
                                         "704 or 736"]
    assert "snaps it up to 124" in messages(result, "H3203")[0]
    assert result.findings[0].path == "Image to Video (MiniMax H3) #140 > MiniMaxH3ImageToVideo #131"


def test_parallel_config_inside_the_template_subgraph(t2v, tmp_path):
    doc = copy.deepcopy(t2v)
    add_config(doc)
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3")) == []
    assert found(check_doc(tmp_path, doc, devices="0,1")) == [("H3102", "140:900")]
    assert found(check_doc(tmp_path, to_api(doc), name="api.json", devices="0,1")) == [("H3102", "140:900")]
    add_config(doc, nid=901, after=900)   # a second one, chained after the first
    assert found(check_doc(tmp_path, doc, devices="0,1,2,3")) == [("H3103", "140:901")]


def test_template_one_subgraph_deeper(t2v, tmp_path):
    """The t2v instance wrapped in a new subgraph whose own widget drives turbo mode two levels down."""
    doc = copy.deepcopy(t2v)
    instance = ui_node(doc, 140)
    selector = ui_node(doc, 115)
    turbo_slot = next(i for i, inp in enumerate(instance["inputs"]) if inp["name"] == "value")
    instance["inputs"][turbo_slot]["link"] = 501
    instance["outputs"][0]["links"] = [502]
    wrapper = {
        "id": "5e1f0000-0000-4000-8000-00000000wrap", "name": "H3 wrapper", "version": 1,
        "inputNode": {"id": -10}, "outputNode": {"id": -20},
        "inputs": [{"id": "w-in", "name": "turbo", "type": "BOOLEAN", "linkIds": [501]}],
        "outputs": [{"id": "w-out", "name": "VIDEO", "type": "VIDEO", "linkIds": [502]}],
        "nodes": [instance, selector],
        "links": [{"id": 246, "origin_id": 115, "origin_slot": 0, "target_id": 140, "target_slot": 2, "type": "INT"},
                  {"id": 247, "origin_id": 115, "origin_slot": 1, "target_id": 140, "target_slot": 3, "type": "INT"},
                  {"id": 501, "origin_id": -10, "origin_slot": 0, "target_id": 140, "target_slot": turbo_slot,
                   "type": "BOOLEAN"},
                  {"id": 502, "origin_id": 140, "origin_slot": 0, "target_id": -20, "target_slot": 0, "type": "VIDEO"}],
    }
    save = ui_node(doc, 92)
    save["inputs"][0]["link"] = 600
    doc["nodes"] = [save, {"id": 1000, "type": wrapper["id"], "mode": 0, "inputs": [],
                           "outputs": [{"name": "VIDEO", "type": "VIDEO", "links": [600]}], "widgets_values": [False]}]
    doc["links"] = [[600, 1000, 0, 92, 0, "VIDEO"]]
    doc["definitions"]["subgraphs"].append(wrapper)
    assert found(check_doc(tmp_path, doc, devices="0")) == []
    doc["nodes"][1]["widgets_values"] = [True]
    result = check_doc(tmp_path, doc, devices="0")
    assert found(result) == [("H3301", "1000:140:134")]
    assert result.findings[0].path.startswith("H3 wrapper #1000 > Image to Video (MiniMax H3) #140 > ")
    assert found(check_doc(tmp_path, to_api(doc), name="api.json", devices="0")) == [("H3301", "1000:140:134")]


def test_template_subgraph_containing_itself(t2v, tmp_path):
    doc = copy.deepcopy(t2v)
    sub = next(s for s in doc["definitions"]["subgraphs"] if s["id"].startswith(SUB_T2V))
    sub["nodes"].append({"id": 999, "type": sub["id"], "mode": 0, "inputs": [], "outputs": []})
    result = check_doc(tmp_path, doc, devices="0")
    assert [c for c, _ in found(result)] == ["H3404"] and result.exit_code == 1


# ------------------------------------------------------------------------------ --comfy-home at the pin

def test_templates_against_the_pinned_tree(templates_dir, pin_tree):
    """True findings: the pin has none of the models, and lacks node types newer templates use (MiniMaxH3AddGuide,
    which the multi-frame reference template chains, is upstream since the pin moved to 0.33.0+, and its guides
    raise no H3205-H3207 there)."""
    expect_unknown = {"video_minimax_h3_fun_controlnet_union.json": {"MiniMaxH3FunControlNetApply"},
                      "video_minimax_h3_multiframe_reference.json": set(),
                      "video_fasth3_ominiref_r2v.json": {"BlockSparseAttention"},
                      "video_minimax_h3_t2v.json": set()}
    for name, unknown in expect_unknown.items():
        result = check_paths([str(templates_dir / name)], comfy_home=str(pin_tree), devices="0", environ={})
        got = {re.search(r"node type '([^']+)'", m).group(1) for m in messages(result, "H3502")}
        assert got == unknown, name
        assert not [c for c, _ in found(result) if c in ("H3205", "H3206", "H3207")], name
        missing = " ".join(messages(result, "H3501"))
        assert "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors" in missing and "models/text_encoders/" in missing
        assert result.exit_code == 1


def test_all_templates_sweep(templates_dir):
    """All 660 files of the pinned package: nothing crashes, non-workflows exit 2, and the only findings are
    true ones at the pin (an output node fed by an unconnected subgraph input, a subgraph output pointing at a
    link its subgraph lacks, a switch branch the pin still requires)."""
    result = check_paths([str(p) for p in sorted(templates_dir.glob("*.json"))], environ={})
    assert result.exit_code == 2 and result.summary["files"] == 660
    unreadable = [f.file.rsplit("/", 1)[-1] for f in result.findings if f.code == "H3001"]
    findings = {(f.file.rsplit("/", 1)[-1], f.code, f.node) for f in result.findings if f.code != "H3001"}
    assert all(n.startswith(("index", "fuse_options")) for n in unreadable) and len(unreadable) == 16
    assert findings == {("video_ltx2_i2v_lora.json", "H3401", "75"),
                        ("image_ernie_image.json", "H3402", "88:92"), ("image_ernie_image.json", "H3402", "88:93"),
                        ("image_ernie_image_turbo.json", "H3402", "88:99"),
                        ("image_ernie_image_turbo.json", "H3402", "88:100"),
                        ("video_wan_animate2.json", "H3402", "672:651")}
