"""`h3kit models fetch` against a stand-in for the Hugging Face Hub on 127.0.0.1 (tests/support/hub_standin.py),
reached the way an operator reaches a mirror: HF_ENDPOINT. No internet.

A fresh fetch, a re-run that downloads nothing, a download interrupted (SIGTERM mid-file) and resumed with a
Range request, size and hash mismatches refused with exit 1 and nothing under the model's name, a read-only
or full target refused before any download, --models-dir with extra_model_paths.yaml, plain URLs (fetched
over HTTP(S) with resume, or refused with the reason)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from h3kit import modelpaths
from tests.support import jsondoc, requires
from tests.support.fakekit import REAL_ROOT, h3, install, kit, payload, refreshed, upstream  # noqa: F401
from tests.support.hub_standin import HubStandin, manifest_with_figures
from tests.support.model_trees import home  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = ROOT / "toolkit"
SHIPPED = ROOT / "workflows" / "t2va_8steps_lora.json"
DIT = ("Comfy-Org/MiniMax-H3", "diffusion_models/minimax_h3_fl2va_bf16.safetensors")
SIZE = 300_000


def content(name: str, size: int = SIZE) -> bytes:
    """Bytes that differ by file and position (a resumed download joined at the wrong offset shows)."""
    seed = hashlib.sha256(name.encode()).digest()
    return b"".join(hashlib.sha256(seed + i.to_bytes(4, "little")).digest() for i in range(size // 32 + 1))[:size]


def shipped_sources(workflow: Path) -> dict[str, tuple[str, str, str]]:
    """{file name: (directory, repo, path)} from the workflow's own properties.models."""
    out = {}
    for node in json.loads(workflow.read_text())["nodes"]:
        for m in node.get("properties", {}).get("models", []):
            _, rest = m["url"].split("https://huggingface.co/", 1)
            owner, repo, _resolve, _rev, path = rest.split("/", 4)
            out[m["name"]] = (m["directory"], f"{owner}/{repo}", path)
    return out


@pytest.fixture
def hub(monkeypatch, tmp_path):
    with HubStandin() as h:
        for name, (_d, repo, path) in shipped_sources(SHIPPED).items():
            h.add(repo, path, content(name))
        monkeypatch.setenv("HF_ENDPOINT", h.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("H3KIT_MODELS_MANIFEST", str(manifest_with_figures(tmp_path / "manifest.json")))
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield h



def fetch(runner, *args):
    r = runner.invoke(__import__("h3kit.cli", fromlist=["main"]).main,
                      ["models", "fetch", *map(str, args), "--json"], catch_exceptions=False)
    return r.exit_code, jsondoc.document(r.stdout, r.exit_code), r.stderr


def resolve_gets(hub):
    return [r for r in hub.gets() if "/resolve/" in r[1] or r[1].startswith("/files/")]


def model_files(folder: Path) -> list[str]:
    """Every file under the folder, as ComfyUI's listing of a models folder would see it (hidden ones too)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def env_for(hub, **extra):
    env = dict(os.environ, PYTHONPATH=str(TOOLKIT), HF_ENDPOINT=hub.endpoint, HF_HUB_DISABLE_XET="1", **extra)
    env.pop("HF_TOKEN", None)
    return env


def test_fresh_fetch_then_a_rerun_that_downloads_nothing(runner, hub, home):
    rc, doc, err = fetch(runner, SHIPPED, "--comfy-home", home)
    assert rc == 0 and doc["ok"], (doc, err)
    files = {f["name"]: f for f in doc["data"]["files"]}
    assert {f["status"] for f in files.values()} == {"downloaded"}
    for name, (directory, repo, path) in shipped_sources(SHIPPED).items():
        target = home / "models" / directory / name   # by name under its folder, not the hub cache layout
        assert target.read_bytes() == content(name)
        assert files[name]["path"] == str(target) and files[name]["source"]["origin"] == "workflow"
        assert files[name]["sha256"] == hashlib.sha256(content(name)).hexdigest()  # the ETag the server named
    assert doc["data"]["downloaded_bytes"] == 5 * SIZE
    assert not any(".h3kit-fetch" in f or f.endswith(".part") for f in model_files(home / "models"))
    assert len(resolve_gets(hub)) == 5

    # ComfyUI (as check-workflow reads its folders) now finds every file
    r = runner.invoke(__import__("h3kit.cli", fromlist=["main"]).main,
                      ["models", "list", str(SHIPPED), "--comfy-home", str(home), "--json"])
    listed = jsondoc.document(r.stdout, r.exit_code)["data"]
    assert listed["missing"] == 0 and all(f["via"] == "models/" and f["size"] == SIZE for f in listed["files"])

    hub.requests.clear()
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home)
    assert rc == 0 and {f["status"] for f in doc["data"]["files"]} == {"present"}
    assert doc["data"]["downloaded_bytes"] == 0 and resolve_gets(hub) == [] and \
        not [r for r in hub.requests if r[0] == "HEAD"]


def test_an_interrupted_download_is_resumed_never_loaded(hub, home, tmp_path):
    """SIGTERM while the DiT is a third downloaded: nothing under its name, every byte that arrived kept (an odd
    count, well under huggingface_hub's 10 MB chunk, which kept nothing); the next run asks for the rest only
    (Range from the last byte written) and the joined file is the server's, byte for byte."""
    name = "minimax_h3_fl2va_bf16.safetensors"
    big = content(name, 3_000_000)
    dit = hub.add(*DIT, big)
    cut = 1_000_003
    dit.stall_after = cut
    cmd = [sys.executable, "-m", "h3kit", "models", "fetch", str(SHIPPED), "--comfy-home", str(home), "--json"]
    proc = subprocess.Popen(cmd, env=env_for(hub, HF_HOME=str(tmp_path / "hf-home")), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    staging = home / "models" / "diffusion_models" / ".h3kit-fetch"
    try:
        assert hub.stalled.wait(60), "the download never started"
        deadline = time.monotonic() + 60
        while True:  # the first two chunks reach the disk
            parts = list(staging.glob("*.part"))
            if parts and parts[0].stat().st_size >= cut:
                break
            assert time.monotonic() < deadline, \
                f"two chunks never reached the disk: {[(p.name, p.stat().st_size) for p in parts]}"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert not (home / "models" / "diffusion_models" / name).exists()
    parts = list(staging.glob("*.part"))
    assert len(parts) == 1 and parts[0].stat().st_size == cut, parts
    assert "the next fetch resumes there" in err

    dit.stall_after = None
    hub.requests.clear()
    r = subprocess.run(cmd, env=env_for(hub, HF_HOME=str(tmp_path / "hf-home")), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    dit_gets = [g for g in resolve_gets(hub) if g[1].endswith(name)]
    assert dit_gets == [("GET", f"/{DIT[0]}/resolve/main/{DIT[1]}", f"bytes={cut}-")]
    assert (home / "models" / "diffusion_models" / name).read_bytes() == big
    assert not staging.exists()
    row = next(f for f in json.loads(r.stdout)["data"]["files"] if f["name"] == name)
    assert row["status"] == "downloaded" and row["downloaded"] == len(big) - cut


def test_a_failed_download_is_resumed_by_the_next_run(runner, hub, home):
    """The server breaks off (500 after the transfer stopped): exit 1, the partial file kept, resumed next time."""
    name = "minimax_h3_fl2va_bf16.safetensors"
    f = hub.files[f"/{DIT[0]}/resolve/main/{DIT[1]}"]
    f.fail_gets = True
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home)
    dit = next(x for x in doc["data"]["files"] if x["name"] == name)
    assert rc == 1 and doc["ok"] is False and dit["status"] == "failed" and "run fetch again" in dit["reason"]
    assert not (home / "models" / "diffusion_models" / name).exists()
    assert sum(x["status"] == "downloaded" for x in doc["data"]["files"]) == 4  # the others came
    f.fail_gets = False
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home)
    assert rc == 0 and [x["status"] for x in doc["data"]["files"]].count("downloaded") == 1
    assert (home / "models" / "diffusion_models" / name).read_bytes() == content(name)


def test_a_corrupt_download_is_refused_and_deleted(runner, hub, home):
    """The server's bytes do not match the sha256 its ETag names (a broken mirror): exit 1, nothing under the
    name, and no partial file to resume into either."""
    name = "minimax_h3_fl2va_bf16.safetensors"
    bad = bytearray(content(name))
    bad[1234] ^= 0xFF
    hub.files[f"/{DIT[0]}/resolve/main/{DIT[1]}"].serve = bytes(bad)
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home)
    dit = next(x for x in doc["data"]["files"] if x["name"] == name)
    assert rc == 1 and dit["status"] == "mismatch" and "sha256" in dit["reason"]
    folder = home / "models" / "diffusion_models"
    assert model_files(folder) == []


def test_published_size_or_hash_that_the_server_contradicts_is_refused_before_download(runner, hub, home, tmp_path):
    """A properties.models entry with a sha256 (hash_type sha256) or a size the server does not have: refused
    before any byte moves, exit 1, nothing under the name."""
    doc = json.loads(SHIPPED.read_text())
    for node in doc["nodes"]:
        for m in node.get("properties", {}).get("models", []):
            if m["directory"] == "vae":
                m.update(hash="ab" * 32, hash_type="sha256")
            if m["directory"] == "loras":
                m["size"] = SIZE + 1
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(doc))
    rc, out, _ = fetch(runner, wf, "--comfy-home", home)
    bad = {f["name"]: f for f in out["data"]["files"] if f["status"] == "mismatch"}
    assert rc == 1 and out["ok"] is False
    assert set(bad) == {"minimax_h3_video_vae_fp16.safetensors", "minimax_h3_audio_vae_fp32.safetensors",
                        "minimax_h3_fl2v_turbo_8step_v1.0_comfyui_bf16.safetensors"}
    assert all("not downloaded" in f["reason"] for f in bad.values())
    assert model_files(home / "models" / "vae") == [] and model_files(home / "models" / "loras") == []
    assert not [g for g in resolve_gets(hub) if "/vae/" in g[1] or "Turbo" in g[1]]


def test_a_full_disk_is_refused_before_any_download(runner, hub, home):
    """The server announces a file larger than the free space: refused (disk_full), nothing fetched."""
    hub.files[f"/{DIT[0]}/resolve/main/{DIT[1]}"].claim_size = 10 ** 16
    rc, doc, err = fetch(runner, SHIPPED, "--comfy-home", home)
    assert rc == 1 and doc["error"]["code"] == "disk_full" and "nothing was downloaded" in doc["error"]["fix"]
    assert "minimax_h3_fl2va_bf16.safetensors" in doc["error"]["message"]
    assert resolve_gets(hub) == [] and model_files(home / "models") == []


def test_a_read_only_target_is_refused_before_any_request(hub, home, tmp_path):
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        requires.skip("running as root without setpriv (util-linux): cannot make a folder read-only for h3kit")
    models = home / "models"
    models.chmod(0o555)
    try:
        cmd = [sys.executable, "-m", "h3kit", "models", "fetch", str(SHIPPED), "--comfy-home", str(home), "--json"]
        if os.geteuid() == 0:  # root ignores permission bits
            cmd = [shutil.which("setpriv"), "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--", *cmd]
        r = subprocess.run(cmd, env=env_for(hub, HF_HOME=str(tmp_path / "hf-home")), capture_output=True,
                           text=True, timeout=120)
    finally:
        models.chmod(0o755)
    doc = jsondoc.document(r.stdout, r.returncode)
    assert r.returncode == 1 and doc["error"]["code"] == "not_writable", r.stderr
    assert str(models) in doc["error"]["message"] and "Traceback" not in r.stderr
    assert [q for q in hub.requests if "/resolve/" in q[1]] == [] and model_files(models) == []


def test_plain_urls_are_fetched_with_resume_or_refused_with_the_reason(runner, hub, home, tmp_path):
    """A properties.models URL off the Hub: https (or http on this machine) is fetched, with the size the
    server gives checked; plain http elsewhere and other schemes are refused without a request."""
    data = content("plain")
    hub.add_plain("other.safetensors", data)
    doc = {"nodes": [
        {"id": 1, "type": "LoraLoaderModelOnly", "mode": 0, "inputs": [], "outputs": [],
         "widgets_values": ["other.safetensors", 1.0],
         "properties": {"models": [{"name": "other.safetensors", "directory": "loras",
                                    "url": f"{hub.endpoint}/files/other.safetensors"}]}},
        {"id": 2, "type": "VAELoader", "mode": 0, "inputs": [], "outputs": [], "widgets_values": ["insecure.safetensors"],
         "properties": {"models": [{"name": "insecure.safetensors", "directory": "vae",
                                    "url": "http://models.example.com/insecure.safetensors"}]}},
        {"id": 3, "type": "CLIPLoader", "mode": 0, "inputs": [], "outputs": [],
         "widgets_values": ["ftp.safetensors", "minimax", "default"],
         "properties": {"models": [{"name": "ftp.safetensors", "directory": "text_encoders",
                                    "url": "ftp://models.example.com/ftp.safetensors"}]}},
        {"id": 4, "type": "CheckpointLoaderSimple", "mode": 0, "inputs": [], "outputs": [],
         "widgets_values": ["pickled.ckpt"],
         "properties": {"models": [{"name": "pickled.ckpt", "directory": "checkpoints",
                                    "url": f"{hub.endpoint}/files/pickled.ckpt"}]}},
    ], "links": []}
    hub.add_plain("pickled.ckpt", b"p" * 100)
    wf = tmp_path / "plain.json"
    wf.write_text(json.dumps(doc))
    rc, out, _ = fetch(runner, wf, "--comfy-home", home)
    files = {f["name"]: f for f in out["data"]["files"]}
    assert rc == 1
    assert files["other.safetensors"]["status"] == "downloaded"
    assert (home / "models" / "loras" / "other.safetensors").read_bytes() == data
    assert files["insecure.safetensors"]["status"] == "refused" and "plain http" in files["insecure.safetensors"]["reason"]
    assert files["ftp.safetensors"]["status"] == "refused" and "ftp scheme" in files["ftp.safetensors"]["reason"]
    assert files["pickled.ckpt"]["status"] == "refused" and "pickle" in files["pickled.ckpt"]["reason"]
    assert [g[1] for g in resolve_gets(hub)] == ["/files/other.safetensors"]


def test_hf_token_reaches_a_gated_hub_file_and_never_a_plain_url(runner, hub, home, tmp_path, monkeypatch):
    dit = hub.files[f"/{DIT[0]}/resolve/main/{DIT[1]}"]
    dit.token = "hf_secret"
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home)
    row = next(f for f in doc["data"]["files"] if f["name"] == "minimax_h3_fl2va_bf16.safetensors")
    assert rc == 1 and row["status"] == "failed" and "HF_TOKEN" in row["reason"]
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    hub.add_plain("other.safetensors", b"o" * 1000)
    wf = json.loads(SHIPPED.read_text())
    wf["nodes"][1]["properties"]["models"][0]["url"] = f"{hub.endpoint}/files/other.safetensors"
    wf["nodes"][1]["widgets_values"][0] = wf["nodes"][1]["properties"]["models"][0]["name"] = "other.safetensors"
    (tmp_path / "wf.json").write_text(json.dumps(wf))
    hub.authorization.clear()
    rc, doc, _ = fetch(runner, tmp_path / "wf.json", "--comfy-home", home)
    assert rc == 0 and (home / "models" / "diffusion_models" / "minimax_h3_fl2va_bf16.safetensors").is_file()
    assert ("/" + "/".join([DIT[0], "resolve", "main", DIT[1]]), "Bearer hf_secret") in hub.authorization
    assert [a for p, a in hub.authorization if p.startswith("/files/")] == [None, None]  # HEAD and GET, no token


def test_an_unreachable_endpoint_fails_the_file_and_names_hf_endpoint(runner, hub, home, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    rc, doc, err = fetch(runner, SHIPPED, "--comfy-home", home)
    assert rc == 1 and {f["status"] for f in doc["data"]["files"]} == {"failed"}
    assert all("HF_ENDPOINT" in f["reason"] for f in doc["data"]["files"]) and "Traceback" not in err
    assert model_files(home / "models") == []


def test_a_name_that_leaves_the_models_folder_is_refused(runner, hub, home, tmp_path):
    prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "../../escape.safetensors",
                                                           "weight_dtype": "default"}}}
    wf = tmp_path / "api.json"
    wf.write_text(json.dumps(prompt))
    rc, doc, _ = fetch(runner, wf, "--comfy-home", home)
    assert rc == 1 and doc["data"]["files"][0]["status"] == "refused"
    assert not (tmp_path / "escape.safetensors").exists() and hub.requests == []


# ---------------------------------------------------------------------------------- --models-dir

@pytest.fixture
def kit_with_template(refreshed):
    shutil.copy(REAL_ROOT / "additional_files" / modelpaths.TEMPLATE,
                refreshed / "additional_files" / modelpaths.TEMPLATE)
    return refreshed


def test_models_dir_on_an_h3kit_tree_lands_there_and_is_named_in_extra_model_paths(kit_with_template, upstream,
                                                                                   runner, hub, tmp_path):
    up, _ = upstream
    home = tmp_path / "ComfyUI"
    shared = tmp_path / "nfs" / "h3"
    assert install(runner, home, "--source", up).exit_code == 0
    (home / modelpaths.CONFIG).write_text("# mine\ncomfyui:\n    base_path: /srv/other/\n    loras: models/loras/\n")
    rc, doc, err = fetch(runner, SHIPPED, "--comfy-home", home, "--models-dir", shared)
    assert rc == 0, (doc, err)
    assert doc["data"]["extra_model_paths"] == {"added": True, "named": True}
    assert f"adding {shared} to {modelpaths.CONFIG} (h3kit install --models-dir) ..." in err  # the operator is told
    for name, (directory, _repo, _path) in shipped_sources(SHIPPED).items():
        assert (shared / directory / name).read_bytes() == content(name)
    assert not (home / "models").exists() or model_files(home / "models") == []
    text = (home / modelpaths.CONFIG).read_text()
    assert text.startswith("# mine\ncomfyui:\n") and yaml.safe_load(text)["h3kit_1"]["base_path"] == str(shared)
    # install recorded it: verify is clean and sees the files; list finds them through extra_model_paths.yaml
    v = payload(h3(runner, "verify", "--comfy-home", home, "--json"))
    assert v["problems"] == [] and v["models"]["dirs"] == [str(shared)]
    r = h3(runner, "models", "list", SHIPPED, "--comfy-home", home, "--json")
    listed = jsondoc.document(r.stdout, r.exit_code)["data"]
    assert listed["missing"] == 0 and {f["via"] for f in listed["files"]} == {"extra_model_paths.yaml"}
    # again: nothing downloaded, nothing added
    hub.requests.clear()
    rc, doc, err = fetch(runner, SHIPPED, "--comfy-home", home, "--models-dir", shared)
    assert rc == 0 and doc["data"]["extra_model_paths"] == {"added": False, "named": True}
    assert "adding" not in err
    assert resolve_gets(hub) == []


def test_models_dir_that_cannot_be_named_is_refused_before_download(runner, hub, home, tmp_path):
    """A tree h3kit did not install: fetch does not write its extra_model_paths.yaml, and says how."""
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home, "--models-dir", tmp_path / "nfs")
    assert rc == 1 and doc["error"]["code"] == "models_dir_not_named"
    assert "h3kit install --comfy-home" in doc["error"]["fix"] and resolve_gets(hub) == []
    assert not (tmp_path / "nfs").exists() and not (home / modelpaths.CONFIG).exists()
    # a folder the user's own section already names is used as it is
    (home / modelpaths.CONFIG).write_text(f"mine:\n    base_path: {tmp_path / 'nfs'}\n    diffusion_models: diffusion_models/\n"
                                          "    text_encoders: text_encoders/\n    vae: vae/\n    loras: loras/\n")
    rc, doc, _ = fetch(runner, SHIPPED, "--comfy-home", home, "--models-dir", tmp_path / "nfs")
    assert rc == 0 and doc["data"]["extra_model_paths"] == {"added": False, "named": True}
    assert (tmp_path / "nfs" / "vae" / "minimax_h3_video_vae_fp16.safetensors").is_file()
