"""`h3kit models` as a new user meets it (issue 31, items 6-9), against the Hub stand-in on 127.0.0.1
(tests/support/hub_standin.py) reached through HF_ENDPOINT: lines name the endpoint used, one request per
source, the resume hint only where a re-run helps, 401 with and without a token, no empty staging folder,
progress and resume in small steps, `--dry-run`, `models list` sizes and targets, the Hugging Face cache reused."""

from __future__ import annotations

import hashlib
import os
import json
from pathlib import Path

import pytest

from h3kit.cli import main
from tests.support import jsondoc
from tests.support.model_trees import home  # noqa: F401  (a fixture)
from tests.test_models_fetch import DIT, SHIPPED, SIZE, content, hub, model_files, resolve_gets  # noqa: F401

DIT_NAME = "minimax_h3_fl2va_bf16.safetensors"
DIT_PATH = f"/{DIT[0]}/resolve/main/{DIT[1]}"


def run(runner, *args):
    r = runner.invoke(main, ["models", *map(str, args)])
    return r.exit_code, r.stdout, r.stderr


def fetch_json(runner, *args):
    r = runner.invoke(main, ["models", "fetch", *map(str, args), "--json"])
    doc = jsondoc.document(r.stdout, r.exit_code)
    return r.exit_code, doc, r.stderr


def row(doc, name=DIT_NAME):
    return next(f for f in doc["data"]["files"] if f["name"] == name)


def test_lines_name_the_endpoint_used_and_each_source_is_asked_once(runner, hub, home):
    del hub.files[DIT_PATH]  # the workflow and the manifest both name this file: one HEAD, one failure line
    code, out, err = run(runner, "fetch", SHIPPED, "--comfy-home", home)
    assert code == 1
    assert f"from {hub.endpoint}/Comfy-Org/MiniMax-H3/resolve/main/vae/" in err
    assert "from https://huggingface.co" not in err
    heads = [r for r in hub.requests if r[0] == "HEAD" and r[1] == DIT_PATH]
    assert len(heads) == 1, hub.requests
    assert out.count(f"{hub.endpoint}{DIT_PATH}: not found") == 1, out
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert row(doc)["url"] == hub.endpoint + DIT_PATH and row(doc)["status"] == "failed"
    # models list names the same source the same way, and that it goes through the mirror
    code, out, _ = run(runner, "list", SHIPPED, "--comfy-home", home)
    assert f"fetched through HF_ENDPOINT={hub.endpoint}" in out


@pytest.mark.parametrize("fault, hint", [("checksum", False), ("missing", False), ("refused", False), ("500", True)])
def test_the_resume_hint_only_where_a_rerun_helps(runner, hub, home, monkeypatch, fault, hint):
    f = hub.files[DIT_PATH]
    if fault == "checksum":
        f.serve = b"x" * len(f.content)
    elif fault == "missing":
        del hub.files[DIT_PATH]
    elif fault == "refused":
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    else:
        f.fail_gets = True
    code, out, _ = run(runner, "fetch", SHIPPED, "--comfy-home", home)
    assert code == 1
    assert ("run the same command again" in out) is hint, out
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert row(doc)["retry_helps"] is hint and ("run fetch again" in row(doc)["reason"]) is hint


def test_no_empty_staging_folder_after_a_rejected_download(runner, hub, home):
    f = hub.files[DIT_PATH]
    f.serve = b"x" * len(f.content)  # the bytes do not match the sha256 the ETag names
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert code == 1 and row(doc)["status"] == "mismatch"
    assert not (home / "models" / "diffusion_models" / ".h3kit-fetch").exists()
    f.serve, f.fail_gets = None, True  # an error before any byte arrived: no empty .part either
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert code == 1 and row(doc)["status"] == "failed"
    assert not (home / "models" / "diffusion_models" / ".h3kit-fetch").exists()


def test_401_without_a_token_and_with_a_token_that_has_no_access(runner, hub, home, monkeypatch):
    hub.files[DIT_PATH].token = "hf_right"
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    reason = row(doc)["reason"]
    assert code == 1 and "is gated or private (401) and no token is set" in reason and "HF_TOKEN" in reason
    assert row(doc)["retry_helps"] is False
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home)
    reason = row(doc)["reason"]
    assert code == 1 and "HF_TOKEN is set, but this token has no access to Comfy-Org/MiniMax-H3 (401)" in reason
    assert "no token is set" not in reason


def test_progress_moves_in_small_steps(runner, hub, home, monkeypatch):
    from h3kit.weights import fetch as fetch_mod

    hub.files[DIT_PATH].content = content(DIT_NAME, 3_000_000)
    steps = []
    real_bar = fetch_mod._bar

    def recording(progress):
        base = real_bar(progress)

        class Bar(base):
            def update(self, n=1):
                steps.append(n)
                return super().update(n)
        return Bar

    monkeypatch.setattr(fetch_mod, "_bar", recording)
    code, doc, err = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert code == 0, err
    assert sum(steps) == 3_000_000 + 4 * SIZE and max(steps) <= 1 << 20 and len(steps) >= 5, steps


def test_dry_run_prints_sizes_targets_total_and_free_space_and_writes_nothing(runner, hub, home):
    code, out, err = run(runner, "fetch", SHIPPED, "--comfy-home", home, "--dry-run")
    assert code == 0, err
    assert f"({5 * SIZE} bytes) to download for 5 file(s)" in out and "nothing was written" in out
    assert f"-> {home / 'models' / 'diffusion_models' / DIT_NAME}" in out
    assert f"from {hub.endpoint}{DIT_PATH}" in out
    assert " free, " in out and "needed" in out
    assert model_files(home / "models") == [] and list((home / "models").iterdir()) == []
    assert resolve_gets(hub) == []  # sizes from HEAD only
    code, doc, _ = fetch_json(runner, SHIPPED, "--comfy-home", home, "--dry-run")
    data = doc["data"]
    assert data["dry_run"] and data["to_download_bytes"] == 5 * SIZE
    assert {f["status"] for f in data["files"]} == {"would_download"} and row(doc)["size"] == SIZE
    assert data["disks"][0]["free"] > 0 and data["disks"][0]["enough"] is True


def test_models_list_shows_sizes_and_where_each_file_goes(runner, home):
    (home / "models" / "vae").mkdir()
    (home / "models" / "vae" / "minimax_h3_video_vae_fp16.safetensors").write_bytes(b"v" * 12_345)
    code, out, _ = run(runner, "list", SHIPPED, "--comfy-home", home)
    assert code == 1  # 12,345 bytes where 5,207,808,496 are published
    assert "problem: 12345 bytes on disk, 5207808496 published" in out
    assert "ok      vae/minimax_h3_video_vae_fp16.safetensors  12.35 kB" in out or \
        "vae/minimax_h3_video_vae_fp16.safetensors  0.01 MB" in out, out
    assert f"fetch puts it at: {home / 'models' / 'diffusion_models' / DIT_NAME}" in out
    assert "size: not published (h3kit models fetch --dry-run asks the server)" in out
    r = runner.invoke(main, ["models", "list", str(SHIPPED), "--comfy-home", str(home), "--json"])
    files = {f["name"]: f for f in jsondoc.data(r.stdout)["files"]}
    assert files[DIT_NAME]["target"] == str(home / "models" / "diffusion_models" / DIT_NAME)
    assert files["minimax_h3_video_vae_fp16.safetensors"]["size"] == 12_345


def hf_cache_put(hf_home: Path, repo: str, path: str, data: bytes, revision="main",
                 commit="0123456789abcdef0123456789abcdef01234567") -> Path:
    """A file in huggingface_hub's cache layout (blobs named by sha256, snapshots linking to them, refs)."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    snap = root / "snapshots" / commit / path
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / revision).write_text(commit)
    return blob


@pytest.mark.parametrize("mode", ["link", "copy"])
def test_a_file_in_the_hugging_face_cache_is_linked_or_copied_not_downloaded(runner, hub, home, tmp_path,
                                                                              monkeypatch, mode):
    from h3kit.weights import fetch as fetch_mod

    blob = hf_cache_put(tmp_path / "hf-home", DIT[0], DIT[1], content(DIT_NAME))
    if mode == "copy":  # the cache on another file system
        monkeypatch.setattr(fetch_mod, "_cache_mode", lambda job: "copy")
    code, out, _ = run(runner, "fetch", SHIPPED, "--comfy-home", home, "--dry-run")
    assert code == 0 and f"from the Hugging Face cache ({blob})" in out
    assert f"({4 * SIZE} bytes) to download for 4 file(s), 1 from the Hugging Face cache" in out
    code, doc, err = fetch_json(runner, SHIPPED, "--comfy-home", home)
    assert code == 0, err
    target = home / "models" / "diffusion_models" / DIT_NAME
    assert row(doc)["status"] == ("linked" if mode == "link" else "copied") and row(doc)["hf_cache"] == str(blob)
    assert target.read_bytes() == content(DIT_NAME) and os.path.samefile(target, blob) is (mode == "link")
    assert not [g for g in resolve_gets(hub) if g[1] == DIT_PATH] and doc["data"]["downloaded_bytes"] == 4 * SIZE
    assert not (home / "models" / "diffusion_models" / ".h3kit-fetch").exists()


def test_a_cached_file_that_is_not_the_published_one_is_downloaded(runner, hub, home, tmp_path):
    wf = json.loads(SHIPPED.read_text())
    entry = next(m for n in wf["nodes"] for m in n.get("properties", {}).get("models", []) if m["name"] == DIT_NAME)
    entry["hash"], entry["hash_type"] = hashlib.sha256(content(DIT_NAME)).hexdigest(), "sha256"
    (tmp_path / "wf.json").write_text(json.dumps(wf))
    hf_cache_put(tmp_path / "hf-home", DIT[0], DIT[1], b"another file of the same name")
    code, doc, err = fetch_json(runner, tmp_path / "wf.json", "--comfy-home", home)
    assert code == 0 and row(doc)["status"] == "downloaded" and row(doc)["hf_cache"] is None, err
