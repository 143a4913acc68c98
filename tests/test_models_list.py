"""`h3kit models list`: the files the loaders name (UI, API, subgraphs), where a tree has them, their sources;
the shipped manifest against upstream's H3 templates; check-workflow's H3501 naming the source and the fetch
command. Fetching: tests/test_models_fetch.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from h3kit.cli import main
from h3kit.weights import sources
from h3kit.workflow import check_paths
from tests.support import jsondoc
from tests.support.check_workflow_api import to_api
from tests.support.check_workflow_helpers import messages
from tests.support.model_trees import home  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "workflows").glob("*.json"))
T2V = "video_minimax_h3_t2v.json"
LOCAL_H3 = ("image_minimax_h3_t2i*", "video_fasth3_*", "video_fastvideo_fasth3_*", "video_minimax_h3_*")


def models_list(runner, *args):
    r = runner.invoke(main, ["models", "list", *map(str, args), "--json"])
    return r.exit_code, jsondoc.document(r.stdout, r.exit_code)


def template_entries(doc: dict) -> dict:
    """{name: url} of every properties.models entry, subgraphs included, read independently of h3kit."""
    out = {}
    for g in [doc, *doc.get("definitions", {}).get("subgraphs", [])]:
        for node in g.get("nodes", []):
            for m in node.get("properties", {}).get("models", []):
                out.setdefault(m["name"], m["url"])
    return out



def test_shipped_workflows_name_their_sources_like_upstreams_templates(runner):
    rc, doc = models_list(runner, *SHIPPED)
    files = doc["data"]["files"]
    assert rc == 0 and len(files) == 7 and doc["data"]["comfy_home"] is None
    manifest = sources.load_manifest()
    for f in files:
        first = f["sources"][0]
        assert first["origin"] == "workflow" and first["url"].startswith("https://huggingface.co/"), f
        listed = manifest[(f["kind"], f["name"])][0]
        assert first["url"] == listed.url  # the workflow and the manifest agree
        assert (first["size"], first["sha256"]) == (listed.size, listed.sha256)  # the manifest's figures, no others
    figures = {f["name"]: (f["sources"][0]["size"], f["sources"][0]["sha256"]) for f in files}
    assert figures["qwen3vl_32b_minimax_h3_int8_convrot.safetensors"] == (
        27_141_342_152, "bc2ced0fbea64757fa9acddccfc0b3f4819d1dcf1da6c124d690d368be283923")
    assert figures["minimax_h3_ref2v_turbo_8step_v1.0_768p_comfyui_bf16.safetensors"] == (1_956_193_000, None)
    assert figures["minimax_h3_fl2va_bf16.safetensors"] == (None, None)  # nothing published: nothing invented
    dit = next(f for f in files if f["name"] == "minimax_h3_fl2va_bf16.safetensors")
    assert dit["kind"] == "diffusion_models" and dit["loaders"] == ["UNETLoader.unet_name"]
    assert [Path(w).name for w in dit["workflows"]] == ["fl2va_8steps_lora.json", "t2va_8steps_lora.json"]
    # the API-format demo workflow carries no properties: its tiny files are the demo's own, said so
    rc, doc = models_list(runner, ROOT / "workflows" / "api" / "demo_t2va_tiny.json")
    assert rc == 0 and all(not f["sources"] and "h3kit demo" in f["note"] for f in doc["data"]["files"])


def test_list_against_a_tree_models_folders_and_extra_model_paths(runner, home, tmp_path):
    wf = ROOT / "workflows" / "t2va_8steps_lora.json"
    (home / "models" / "unet").mkdir()
    (home / "models" / "unet" / "minimax_h3_fl2va_bf16.safetensors").write_bytes(b"x" * 123)  # legacy folder
    shared = tmp_path / "nfs"
    (shared / "loras").mkdir(parents=True)
    (shared / "loras" / "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors").write_bytes(b"y" * 7)
    (home / "extra_model_paths.yaml").write_text(f"nfs:\n    base_path: {shared}\n    loras: loras/\n")
    rc, doc = models_list(runner, wf, "--comfy-home", home)
    files = {f["name"]: f for f in doc["data"]["files"]}
    assert rc == 1 and doc["data"]["missing"] == 3 and doc["data"]["bad"] == 1 and not doc["ok"]
    dit = files["minimax_h3_fl2va_bf16.safetensors"]
    assert dit["via"] == "models/" and dit["size"] == 123 and dit["found"].endswith("models/unet/minimax_h3_fl2va_bf16.safetensors")
    assert "problem" not in dit  # no size is published for the bf16 DiT: nothing to compare
    lora = files["minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"]
    assert lora["via"] == "extra_model_paths.yaml" and lora["size"] == 7 and str(shared / "loras") in lora["searched"]
    assert lora["problem"].startswith("7 bytes on disk, 1956193000 published: an incomplete or other file")
    te = files["qwen3vl_32b_minimax_h3_int8_convrot.safetensors"]
    assert te["found"] is None and te["searched"] == [str(home / "models" / "text_encoders"), str(home / "models" / "clip")]
    # the text form says what is missing and how to fetch it
    r = runner.invoke(main, ["models", "list", str(wf), "--comfy-home", str(home)])
    assert r.exit_code == 1 and "MISSING text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors" in r.stdout
    assert "3 missing, 1 not the published file" in r.stdout
    assert f"h3kit models fetch {wf} --comfy-home {home}" in r.stdout


def test_list_refuses_what_is_not_a_workflow_or_not_comfyui(runner, tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    rc, doc = models_list(runner, tmp_path / "x.json")
    assert rc == 2 and doc["error"]["code"] == "bad_workflow"
    rc, doc = models_list(runner, SHIPPED[0], "--comfy-home", tmp_path)
    assert rc == 2 and doc["error"]["code"] == "no_comfy_tree" and "is not a ComfyUI tree" in doc["error"]["message"]


def test_upstream_t2v_template_ui_with_subgraph_and_its_api_form(runner, templates_dir, tmp_path):
    """The loaders sit inside subgraph 79dd8a95: listed from the UI file with the template's own URLs, and from
    its API form (no properties left) with the same URLs from h3kit's manifest."""
    path = templates_dir / T2V
    doc = json.loads(path.read_text(encoding="utf-8"))
    published = template_entries(doc)
    rc, ui = models_list(runner, path)
    assert rc == 0
    got = {f["name"]: f for f in ui["data"]["files"]}
    assert set(got) == set(published) and len(got) == 5
    for name, f in got.items():
        assert f["sources"][0]["origin"] == "workflow" and f["sources"][0]["url"] == published[name]
    assert got["minimax_h3_fl2va_pruned_int8_convrot.safetensors"]["kind"] == "diffusion_models"

    prompt = to_api(doc)
    loaders = [k for k, v in prompt.items() if v["class_type"] in ("UNETLoader", "CLIPLoader", "VAELoader")]
    assert loaders and all(k.startswith("140:") for k in loaders)  # execution ids inside the subgraph instance
    api = tmp_path / "t2v_api.json"
    api.write_text(json.dumps(prompt))
    rc, out = models_list(runner, api)
    by_name = {f["name"]: f for f in out["data"]["files"]}
    assert rc == 0 and set(by_name) == set(published)
    for name, f in by_name.items():
        assert f["sources"][0]["origin"] == "manifest" and f["sources"][0]["url"] == published[name], f
        assert T2V in f["sources"][0]["published_by"]


def test_the_manifest_covers_every_local_h3_template_and_invents_nothing(templates_dir):
    """Every file a local H3 template lists is in the manifest under that URL (published_by names the
    template); a source no template lists says why it is listed; every size and sha256 says where it was read."""
    manifest = sources.load_manifest()
    paths = sorted({p for pattern in LOCAL_H3 for p in templates_dir.glob(pattern + ".json")})
    assert len(paths) == 10
    for path in paths:
        doc = json.loads(path.read_text(encoding="utf-8"))
        entries = sources.workflow_entries(doc)
        for (directory, name), entry in entries.items():
            listed = manifest[(directory, name)]
            match = [s for s in listed if s.url == entry["url"]]
            assert match and path.name in match[0].published_by, (path.name, name)
    for srcs in manifest.values():
        for s in srcs:
            if s.published_by:
                assert all((templates_dir / t).is_file() for t in s.published_by)
    raw = json.loads((ROOT / "workflows" / "models" / "manifest.json").read_text(encoding="utf-8"))
    for entry in raw["files"]:
        for s in entry["sources"]:
            assert s["published_by"] or s.get("listed_because"), (entry["name"], s["repo"])
            assert s.get("figures_from"), (entry["name"], s["repo"])
            if "size" in s or "sha256" in s:
                assert not s["figures_from"].startswith("none"), (entry["name"], s["repo"])


@pytest.mark.parametrize("url, kind, repo, path, refused", [
    ("https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/vae/a%20b.safetensors?download=true", "hf",
     "Comfy-Org/MiniMax-H3", "vae/a b.safetensors", None),
    ("https://hf.co/datasets/o/r/resolve/v1/x.bin", "hf", "o/r", "x.bin", None),
    ("https://civitai.example/api/download/1", "plain", None, None, None),
    ("http://127.0.0.1:8000/x.safetensors", "plain", None, None, None),
    ("http://models.example/x.safetensors", "plain", None, None, "plain http"),
    ("ftp://models.example/x.safetensors", "plain", None, None, "ftp scheme"),
    ("https://huggingface.co/spaces/o/r/resolve/main/x.bin", "plain", None, None, "Space"),
])
def test_urls_are_sorted_into_hub_files_plain_urls_and_refusals(url, kind, repo, path, refused, monkeypatch):
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    s = sources.from_url(url, origin="workflow")
    assert s.is_hf == (kind == "hf") and s.repo == repo and s.path == path
    assert (s.refused is None) if refused is None else (refused in s.refused)


def test_check_workflow_h3501_names_the_source_and_the_fetch_command(home, tmp_path):
    wf = ROOT / "workflows" / "t2va_8steps_lora.json"
    result = check_paths([str(wf)], comfy_home=str(home), devices="0,1,2,3", environ={})
    missing = messages(result, "H3501")
    assert len(missing) == 5
    dit = next(m for m in missing if "minimax_h3_fl2va_bf16" in m)
    assert f"h3kit models fetch {wf} --comfy-home {home}" in dit
    assert "https://huggingface.co/Comfy-Org/MiniMax-H3/resolve/main/diffusion_models/minimax_h3_fl2va_bf16.safetensors" \
           " (the workflow's properties.models)" in dit and "models/diffusion_models/" in dit
    # an API prompt: the manifest's source; a file nobody publishes: by hand
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "minimax_h3_fl2va_bf16.safetensors",
                                                           "weight_dtype": "default"}},
              "2": {"class_type": "VAELoader", "inputs": {"vae_name": "my_own_vae.safetensors"}},
              "3": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "x"}},
              "4": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["2", 0]}},
              "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}}
    api = tmp_path / "api.json"
    api.write_text(json.dumps(prompt))
    got = messages(check_paths([str(api)], comfy_home=str(home), environ={}), "H3501")
    assert any("my_own_vae.safetensors" in m and "no source is known for it" in m for m in got)


@pytest.mark.parametrize("kind", ["folder", "fifo", "device", "truncated"])
def test_hostile_files_are_refused_not_read_or_waited_on(runner, tmp_path, kind):
    """The same guard as check-workflow (h3kit.workflow.load.read_capped): exit 2 at once, no traceback."""
    path = tmp_path / "wf.json"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # no writer: a plain open would block forever
    elif kind == "device":
        path = Path("/dev/zero")
    else:
        path.write_text(SHIPPED[0].read_text()[:500])
    r = runner.invoke(main, ["models", "list", str(path), "--json"])
    assert r.exit_code == 2 and jsondoc.document(r.stdout, r.exit_code)["error"]["code"] == "bad_workflow"
    assert "Traceback" not in r.output
