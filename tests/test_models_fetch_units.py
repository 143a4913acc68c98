"""h3kit.weights.fetch's verification and placement, and its report, without a hub (the whole command against a
local hub stand-in is test_models_fetch.py). Written for the survivors of tools/mutate.py --module fetch."""

from __future__ import annotations

import errno
import hashlib
import os
import types

import pytest

from h3kit.weights import fetch


def job_for(tmp_path, data: bytes, *, size="right", sha="right"):
    wanted = types.SimpleNamespace(kind="vae", name="sub/m.safetensors", sources=[], workflows=["w.json"])
    job = fetch.Job(wanted, str(tmp_path / "models"))
    job.source = types.SimpleNamespace(url="http://127.0.0.1:1/m.safetensors", to_dict=lambda: {})
    job.size = len(data) if size == "right" else size
    job.sha256 = hashlib.sha256(data).hexdigest() if sha == "right" else sha
    os.makedirs(job.staging, exist_ok=True)
    path = os.path.join(job.staging, "m.part")
    with open(path, "wb") as f:
        f.write(data)
    return job, path


def test_a_verified_download_is_placed_under_its_name(tmp_path):
    said = []
    job, path = job_for(tmp_path, b"x" * 1000)
    fetch._verify_and_place(job, path, said.append)
    assert job.status == "downloaded" and job.size == 1000 and job.reason is None
    assert open(job.target, "rb").read() == b"x" * 1000 and not os.path.exists(path)
    assert job.target == str(tmp_path / "models" / "vae" / "sub" / "m.safetensors")
    assert not os.path.exists(job.staging)  # emptied: removed
    assert said == ["sub/m.safetensors: checking sha256 ...", f"sub/m.safetensors: 1.00 kB at {job.target}"]


@pytest.mark.parametrize("size, sha, why", [
    (999, "right", "1000 bytes downloaded, 999 expected"),
    ("right", "0" * 64, "sha256 " + hashlib.sha256(b"x" * 1000).hexdigest() + ", expected " + "0" * 64)])
def test_a_download_that_fails_its_check_is_deleted(tmp_path, size, sha, why):
    job, path = job_for(tmp_path, b"x" * 1000, size=size, sha=sha)
    fetch._verify_and_place(job, path, lambda m: None)
    assert job.status == "mismatch" and job.reason.startswith(why + ": the download was deleted"), job.reason
    assert not os.path.exists(path) and not os.path.exists(job.target)


def test_no_published_hash_checks_the_size_only(tmp_path):
    said = []
    job, path = job_for(tmp_path, b"y" * 10, sha=None)
    fetch._verify_and_place(job, path, said.append)
    assert job.status == "downloaded" and not any("sha256" in m for m in said)


def test_a_file_placed_meanwhile_by_someone_else_stays(tmp_path):
    job, path = job_for(tmp_path, b"new")
    os.makedirs(os.path.dirname(job.target))
    with open(job.target, "wb") as f:
        f.write(b"theirs")
    fetch._verify_and_place(job, path, lambda m: None)
    assert job.status == "present" and open(job.target, "rb").read() == b"theirs" and not os.path.exists(path)


def test_a_download_on_another_file_system_is_copied_then_renamed(tmp_path, monkeypatch):
    job, path = job_for(tmp_path, b"z" * 64)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 1:  # the first rename crosses file systems (the Xet staging folder)
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)
    monkeypatch.setattr(fetch.os, "replace", replace)
    fetch._verify_and_place(job, path, lambda m: None)
    assert job.status == "downloaded" and open(job.target, "rb").read() == b"z" * 64 and not os.path.exists(path)
    assert calls[1][0].startswith(job.staging) and calls[1][1] == job.target
    job, path = job_for(tmp_path / "b", b"z" * 64)
    monkeypatch.setattr(fetch.os, "replace", lambda src, dst: (_ for _ in ()).throw(OSError(errno.EACCES, "no")))
    with pytest.raises(OSError):  # any other failure is not taken for a cross-device rename
        fetch._verify_and_place(job, path, lambda m: None)


def test_why_a_source_failed_is_its_type_and_first_line():
    assert fetch._why(ValueError("bad gateway\nmore")) == "ValueError: bad gateway"
    assert fetch._why(TimeoutError()) == "TimeoutError"


def test_the_report_says_what_is_in_place_and_how_to_resume():
    files = [{"status": "present", "kind": "vae", "name": "a", "path": "/m/a", "size": 5, "reason": None,
              "retry_helps": False},
             {"status": "failed", "kind": "vae", "name": "b", "path": "/m/b", "size": None,
              "reason": "no source answered", "retry_helps": True}]
    text = fetch.render_text({"files": files, "downloaded_bytes": 2 * 10**9})
    assert text.splitlines() == ["ok      vae/a  -> /m/a", "FAILED  vae/b  size unknown  -> /m/b",
                                 "        no source answered", "",
                                 "1 of 2 model file(s) in place; downloaded 2.00 GB",
                                 "run the same command again to resume the downloads marked 'run fetch again'"]
    files[1]["status"] = "downloaded"
    assert "run the same command again" not in fetch.render_text({"files": files, "downloaded_bytes": 0})
    assert [fetch._gb(n) for n in (None, 999, 1000, 10**6, 10**9)] == [
        "size unknown", "999 bytes", "1.00 kB", "1.00 MB", "1.00 GB"]


def test_a_file_another_fetch_is_downloading_is_left_to_it(tmp_path):
    import fcntl
    job, _ = job_for(tmp_path, b"")
    job.source = types.SimpleNamespace(url="http://127.0.0.1:1/m.safetensors", is_hf=False)
    job.meta = types.SimpleNamespace(location="http://127.0.0.1:1/m.safetensors", etag=None)
    job.part = job.part_path()
    with open(job.part, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the other fetch
        assert fetch._download_http(job, lambda m: None, False) is None
    assert job.status == "failed" and job.reason == f"another h3kit models fetch is downloading it ({job.part})"


def test_every_source_that_failed_is_named_in_the_reason(tmp_path, monkeypatch):
    import huggingface_hub
    from h3kit.weights import sources

    def refuse(url, **kw):
        raise ConnectionError(f"refused: {url}")
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", refuse)
    job, _ = job_for(tmp_path, b"")
    job.sources = [sources.Source(origin="test", url="http://127.0.0.1:1/a.safetensors"),
                   sources.Source(origin="test", url="http://127.0.0.1:2/a.safetensors")]
    fetch._metadata([job], lambda m: None)
    assert job.retry_helps is True  # no server answered: a re-run may reach one
    assert job.status == "failed" and job.reason.startswith(
        "no source answered: http://127.0.0.1:1/a.safetensors: ConnectionError: refused: http://127.0.0.1:1/a.safetensors; "
        "http://127.0.0.1:2/a.safetensors: ConnectionError: refused: http://127.0.0.1:2/a.safetensors ("), job.reason


def test_a_download_resumes_from_the_part_file_and_restarts_one_longer_than_the_file(tmp_path, monkeypatch):
    calls = []

    def get_range(url, f, have, headers, size, step):  # the Range GET loop, tested against the Hub stand-in
        calls.append((url, have, size))
        f.write(b"b" * (size - have))
        step(size - have)
        return size
    monkeypatch.setattr(fetch, "get_range", get_range)
    job, _ = job_for(tmp_path, b"")
    job.size = 10
    job.source = types.SimpleNamespace(url="http://127.0.0.1:1/m.safetensors", is_hf=False)
    job.meta = types.SimpleNamespace(location="http://127.0.0.1:1/m.safetensors", etag=None)
    job.part = job.part_path()
    stale = os.path.join(job.staging, "m.safetensors.0123456789abcdef.part")  # an older version's partial file
    for path, data in ((job.part, b"a" * 3), (stale, b"old")):
        with open(path, "wb") as f:
            f.write(data)
    said = []
    assert fetch._download_http(job, said.append, False) == job.part
    assert calls == [("http://127.0.0.1:1/m.safetensors", 3, 10)] and job.downloaded == 7
    assert open(job.part, "rb").read() == b"aaa" + b"b" * 7 and not os.path.exists(stale)
    assert said == ["sub/m.safetensors: resuming at 3 bytes of 10 bytes"]
    with open(job.part, "ab") as f:
        f.write(b"c" * 5)  # longer than the file: not resumed, downloaded again
    said.clear()
    assert fetch._download_http(job, said.append, False) == job.part
    assert calls[-1][1] == 0 and job.downloaded == 10 and said == ["sub/m.safetensors: downloading 10 bytes"]


def test_a_file_found_in_the_other_folder_of_its_kind_is_reported_where_it_is(tmp_path):
    """A diffusion model ComfyUI finds under models/unet/ (its older folder) is present there: not reported at
    models/diffusion_models/, where fetch would put it, and nothing is asked of a server."""
    import json
    home = tmp_path / "ComfyUI"
    (home / "models" / "unet").mkdir(parents=True)
    (home / "main.py").write_text("")
    (home / "models" / "unet" / "m.safetensors").write_bytes(b"w" * 7)
    wf = tmp_path / "api.json"
    wf.write_text(json.dumps({"1": {"class_type": "UNETLoader",
                                    "inputs": {"unet_name": "m.safetensors", "weight_dtype": "default"}}}))
    doc = fetch.fetch([str(wf)], str(home))
    [row] = doc["files"]
    assert row["status"] == "present" and row["size"] == 7, row
    assert row["path"] == str(home / "models" / "unet" / "m.safetensors")
    assert not (home / "models" / "diffusion_models").exists()


def test_a_failure_the_server_answered_is_not_retried_one_it_did_not_answer_is(tmp_path):
    from h3kit.weights import sources
    source = sources.Source(origin="test", url="http://127.0.0.1:1/a.safetensors")

    def answered(status):
        e = RuntimeError(f"status {status}")
        e.response = types.SimpleNamespace(status_code=status)
        return e
    assert fetch.classify(answered(400), source) == ("RuntimeError: status 400", False)
    assert fetch.classify(answered(404), source) == ("not found on the server: RuntimeError: status 404", False)
    assert fetch.classify(answered(429), source) == ("RuntimeError: status 429", True)
    assert fetch.classify(answered(503), source) == ("RuntimeError: status 503", True)
    assert fetch.classify(TimeoutError("slow"), source) == ("TimeoutError: slow", True)


def test_the_disk_keeps_its_reserve_free(tmp_path, monkeypatch):
    job, _ = job_for(tmp_path, b"")
    job.size = 1000
    job.meta = types.SimpleNamespace(etag=None)
    for free, enough in ((1000 + fetch.RESERVE_BYTES, True), (1000 + fetch.RESERVE_BYTES - 1, False)):
        monkeypatch.setattr(fetch.shutil, "disk_usage", lambda path, free=free: types.SimpleNamespace(free=free))
        [disk] = fetch._space([job], report=True)
        assert disk["needed"] == 1000 and disk["free"] == free and disk["enough"] is enough, disk
        assert (fetch._space([job]) == []) is enough


def test_a_hub_file_in_the_hf_cache_is_checked_against_its_blob_name_and_placed(tmp_path, monkeypatch):
    import huggingface_hub
    from h3kit.weights import sources
    data = b"cached" * 10
    blob = tmp_path / "hf" / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True)
    blob.write_bytes(data)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **kw: str(blob))
    job, part = job_for(tmp_path, b"")
    os.remove(part)  # the staging folder holds nothing but what the placement puts there
    job.sources = [sources.Source(origin="test", repo="o/r", path="m.safetensors")]  # no published sha256
    fetch._from_hf_cache(job)
    assert job.cached == str(blob) and job.size == len(data) and job.sha256 == hashlib.sha256(data).hexdigest()
    fetch._place_from_cache(job, lambda m: None)
    assert job.status in ("linked", "copied") and open(job.target, "rb").read() == data
    assert not os.path.exists(job.staging) and blob.read_bytes() == data
    # a cache blob whose bytes are not the sha256 it is named by: refused, and nothing left behind
    blob.write_bytes(b"rotten" * 10)
    job, part = job_for(tmp_path / "again", b"")
    os.remove(part)
    job.sources = [sources.Source(origin="test", repo="o/r", path="m.safetensors")]
    fetch._from_hf_cache(job)
    fetch._place_from_cache(job, lambda m: None)
    assert job.status == "mismatch" and job.reason.startswith("sha256 "), job.reason
    assert not os.path.exists(job.target) and not os.path.exists(job.staging)


def test_the_progress_bar_shows_only_when_asked():
    import io
    for progress in (False, True):
        out = io.StringIO()
        with fetch._bar(progress)(total=10, file=out, mininterval=0) as bar:
            bar.update(10)
        assert bool(out.getvalue()) is progress, out.getvalue()


def test_a_transfer_that_keeps_failing_without_progress_gives_up_after_the_retries(monkeypatch):
    import contextlib
    import time

    import huggingface_hub.utils
    calls = []

    @contextlib.contextmanager
    def dropped(method, url, **kw):
        calls.append(kw["headers"].get("Range"))
        if len(calls) > 3 * fetch.RETRIES:
            raise RuntimeError("still retrying")  # bounds the loop of a get_range that never gives up
        raise OSError("connection dropped")
        yield
    monkeypatch.setattr(huggingface_hub.utils, "http_stream_backoff", dropped)
    monkeypatch.setattr(time, "sleep", lambda s: None)
    with pytest.raises(OSError, match="connection dropped"):
        fetch.get_range("http://127.0.0.1:1/m", None, 5, {}, 10, lambda n: None)
    assert calls == ["bytes=5-"] * fetch.RETRIES
