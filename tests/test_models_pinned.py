"""The shipped weights pinned by size and sha256 (workflows/models/manifest.json, figures from the public Hugging
Face listing): a file on disk of the right name but the wrong size is refused by fetch, `models list` and
doctor, offline; a server file or a download that differs from the published figures never lands under its
name; `fetch --dry-run` prints the published sizes without a server; `--verify-hash` compares the sha256 of a
file of the right size. Against tests/support/hub_standin.py or a port that refuses connections: no internet."""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path

import pytest

from h3kit.cli import main
from h3kit.doctor import Doctor, Options, check_models
from tests.support import jsondoc
from tests.support.hub_standin import HubStandin, manifest_with_figures
from tests.support.model_trees import home  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
T2VA = ROOT / "workflows" / "t2va_8steps_lora.json"
TE = "qwen3vl_32b_minimax_h3_int8_convrot.safetensors"
TE_PATH = f"text_encoders/{TE}"
TE_SIZE = 27_141_342_152
TE_SHA = "bc2ced0fbea64757fa9acddccfc0b3f4819d1dcf1da6c124d690d368be283923"
# the files of t2va whose size the listing publishes: TE, video VAE, audio VAE, fl2v Turbo LoRA (not the bf16 DiT)
T2VA_PUBLISHED = TE_SIZE + 5_207_808_496 + 605_254_808 + 1_956_193_000


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_ENDPOINT at a port that refuses connections (bound, never listening)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("H3KIT_MODELS_MANIFEST", raising=False)
    yield
    s.close()


def models(runner, *args):
    r = runner.invoke(main, ["models", *map(str, args), "--json"])
    assert "Traceback" not in r.output, r.output
    return r.exit_code, jsondoc.document(r.stdout, r.exit_code)


def rows(doc):
    return {f["name"]: f for f in doc["data"]["files"]}


def put(home: Path, kind: str, name: str, data: bytes) -> Path:
    path = home / "models" / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def file_errors(home: Path, path: Path, verify_hash: bool = False) -> list[str]:
    """doctor's model errors about the file at `path` (the missing ones are reported apart)."""
    d = Doctor(Options(comfy_home=home, device_type="cpu", verify_hash=verify_hash))
    check_models(d)
    return [f.message for f in d.findings if f.check == "models" and f.severity == "error" and str(path) in f.message]


def test_a_file_of_the_right_name_but_the_wrong_size_is_refused_offline(runner, home, offline):
    te = put(home, "text_encoders", TE, b"\0" * 1000)
    rc, doc = models(runner, "fetch", T2VA, "--comfy-home", home)
    got = rows(doc)[TE]
    assert rc == 1 and doc["ok"] is False and got["status"] == "wrong_size", got
    assert got["reason"].startswith(f"1000 bytes on disk, {TE_SIZE} published")
    assert te.read_bytes() == b"\0" * 1000  # never overwritten
    rc, doc = models(runner, "list", T2VA, "--comfy-home", home)
    assert rc == 1 and doc["data"]["bad"] == 1 and rows(doc)[TE]["problem"].startswith("1000 bytes on disk")
    assert file_errors(home, te) == [f"{te}: 1000 bytes on disk, {TE_SIZE} published: an incomplete or other file; "
                                     "move it away and run h3kit models fetch (h3kit never overwrites a file it did "
                                     "not write)"]


def test_dry_run_prints_the_published_sizes_without_a_server(runner, home, offline):
    rc, doc = models(runner, "fetch", T2VA, "--comfy-home", home, "--dry-run")
    data = doc["data"]
    assert rc == 1 and data["dry_run"] and data["to_download_bytes"] == T2VA_PUBLISHED
    got = rows(doc)
    assert got[TE]["status"] == "would_download" and got[TE]["size"] == TE_SIZE
    assert got[TE]["reason"].startswith(f"the size published in h3kit's manifest ({TE_SIZE} bytes)")
    assert got["minimax_h3_fl2va_bf16.safetensors"]["status"] == "failed"  # no size published, no server
    r = runner.invoke(main, ["models", "fetch", str(T2VA), "--comfy-home", str(home), "--dry-run"])
    assert "text_encoders/qwen3vl_32b_minimax_h3_int8_convrot.safetensors  27.14 GB" in r.stdout
    assert list((home / "models").iterdir()) == []


def test_a_server_file_of_another_size_is_not_downloaded(runner, home, monkeypatch, tmp_path):
    monkeypatch.delenv("H3KIT_MODELS_MANIFEST", raising=False)
    with HubStandin() as hub:
        hub.add("Comfy-Org/MiniMax-H3", TE_PATH, b"t" * 4096)
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        rc, doc = models(runner, "fetch", T2VA, "--comfy-home", home)
        gets = [r for r in hub.gets() if TE_PATH in r[1]]
    got = rows(doc)[TE]
    assert rc == 1 and got["status"] == "mismatch" and got["reason"] == (
        f"the server has 4096 bytes, {TE_SIZE} are published: not downloaded")
    assert gets == [] and not (home / "models" / "text_encoders").exists()


def test_a_download_whose_bytes_differ_from_the_published_sha256_is_deleted(runner, home, monkeypatch, tmp_path):
    good = b"g" * 5000
    with HubStandin() as hub:
        f = hub.add("Comfy-Org/MiniMax-H3", TE_PATH, good)
        f.serve = b"b" * 5000  # the ETag names the published file, the bytes are others
        monkeypatch.setenv("H3KIT_MODELS_MANIFEST", str(manifest_with_figures(
            tmp_path / "m.json", {TE_PATH: (5000, hashlib.sha256(good).hexdigest())})))
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        rc, doc = models(runner, "fetch", T2VA, "--comfy-home", home)
    got = rows(doc)[TE]
    assert rc == 1 and got["status"] == "mismatch" and "the download was deleted" in got["reason"], got
    assert not list((home / "models" / "text_encoders").rglob("*"))  # nothing under the name, no .part left


def test_verify_hash_reads_a_file_of_the_right_size(runner, home, monkeypatch, tmp_path):
    header = (2).to_bytes(8, "little") + b"{}"  # a safetensors file without tensors: doctor reads its header
    good, other = header + b"g" * 4990, header + b"o" * 4990
    monkeypatch.setenv("H3KIT_MODELS_MANIFEST", str(manifest_with_figures(
        tmp_path / "m.json", {TE_PATH: (5000, hashlib.sha256(good).hexdigest())})))
    te = put(home, "text_encoders", TE, other)
    rc, doc = models(runner, "list", T2VA, "--comfy-home", home)
    assert rc == 0 and "problem" not in rows(doc)[TE] and rows(doc)[TE]["hash_checked"] is False  # by size: fine
    rc, doc = models(runner, "list", T2VA, "--comfy-home", home, "--verify-hash")
    assert rc == 1 and rows(doc)[TE]["problem"].startswith(f"sha256 {hashlib.sha256(other).hexdigest()}, ")
    assert file_errors(home, te) == []
    (error,) = file_errors(home, te, verify_hash=True)
    assert f"{te}: sha256 " in error
    te.write_bytes(good)
    rc, doc = models(runner, "list", T2VA, "--comfy-home", home, "--verify-hash")
    assert rc == 0 and rows(doc)[TE]["hash_checked"] is True
