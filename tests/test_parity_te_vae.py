"""`h3kit parity --component te|vae` on the CPU simulation, in a tree patched with patches/series.

te: a tiny Qwen3-VL text encoder (50 layers, 4 query heads over 2 key/value heads) loaded by CLIPLoader
encodes a prompt alone, with a first-frame image and with image/video/audio references, on one device and
split over N: tensor-parallel through the MultiNPUParallelConfig node, and by layers. vae: a tiny video VAE
loaded by VAELoader decodes 1 to 27 latent frames (1 to 5 temporal chunks); the audio VAE stays put.
Every row must pass its gate with each weight file read once, the injected faults must fail it, and the
VAE's bytes moved must equal the decoded chunks other devices handed back.

The runs the tests read through the library share one parity worker (THREAD_JOBS: parity.run_jobs), each still
a run of its own; the *_cli tests and the CLI's failing run start `h3kit parity`. The rows over the process group
(every rank a worker process) are in tests/test_parity_process.py, with the DiT's.
"""

from __future__ import annotations


import pytest

from h3kit.runtime import parity_worker
from tests.support.service_helpers import h3kit
from tests.support import jsondoc
from tests.support.parity_runs import run
from tests.support import parity_runs

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
TE_LAYOUTS = {"t2va", "fl2va", "ref2va"}
# the library-driven runs with threads, in one parity worker (parity.run_jobs: one interpreter and ComfyUI
# import for them all); the CLI tests run `h3kit parity` on their own; the process transport's:
# tests/test_parity_process.py
THREAD_JOBS = {"te": dict(component="te", npu_count=2),
               "te_fault": dict(component="te", npu_count=4, fault="reduce", extra_args=("--dtypes", "float32",
                                                                                          "--no-lora")),
               "vae": dict(component="vae", npu_count=2)}


@pytest.fixture(scope="module")
def thread_runs(installed_tree, comfy_python):
    return parity_runs.runs(installed_tree, comfy_python, THREAD_JOBS, "threads")


def _check_te(rows, n):
    split = [r for r in rows if not r["lora"]]
    assert {(r["layout"], r["mode"], r["dtype"]) for r in split} == \
        {(lay, m, "float32") for lay in TE_LAYOUTS for m in ("tensor", "layers")} | \
        {("t2va", "tensor", "bfloat16")}
    for r in split:
        assert r["pass"] and r["npu_count"] == n and r["split"], r
        assert r["max_rel"] <= 1e-5 and r["cos"] >= 0.99999 and r["rel_rms"] <= 1e-4, r
        assert r["rank_spread"] == 0 and r["tags_equal"] and r["weight_reads"] == 1, r
        assert r["bytes_moved"] > 0
        if r["mode"] == "layers":
            assert r["max_abs"] == 0, "the layer split runs every layer unchanged: exact"
    # the vision tower's tokens are in the sequence: image and video blocks lengthen it
    tokens = {r["layout"]: r["tokens"] for r in split}
    assert tokens["t2va"] < tokens["fl2va"] < tokens["ref2va"]
    # a text encoder carrying a LoRA passes through the node to one device, LoRA and output unchanged
    (lora,) = [r for r in rows if r["lora"]]
    assert lora["pass"] and lora["passed_through"] and not lora["split"] and lora["max_abs"] == 0, lora
    assert lora["lora_effect"] > 1e-3


def _chunk_bytes(row):
    _, h, w = row["latent"]
    return 3 * 28 * 16 * h * 16 * w * 4  # a decoded chunk: 3 channels, 7 latents = 28 frames, fp32


def _check_vae(rows, n):
    assert [r["layout"] for r in rows] == list(parity_worker.VAE_LAYOUTS) + ["audio"]
    chunks = {r["layout"]: r["chunks"] for r in rows}
    assert chunks == {"image": 0, "5f": 1, "39f": 2, "73f": 4, "90f": 5, "audio": 0}
    for r in rows:
        assert r["pass"] and r["failed"] == [] and r["max_abs"] == 0 and r["weight_reads"] == 1, r
        assert r["split"] is (r["layout"] != "audio"), r  # the audio VAE stays on one device
        assert r["chunk_ranks"] == [i % n for i in range(r["chunks"])], "chunk i decodes on rank i % N"
        if r["chunks"]:
            assert r["bytes_moved"] == sum(1 for rank in r["chunk_ranks"] if rank) * _chunk_bytes(r)
    audio = rows[-1]
    assert audio["dtype"] == "float32" and audio["bytes_moved"] == 0


def test_te_parity_two_devices(thread_runs):
    report = run(thread_runs, "te")
    assert report["ok"]
    _check_te(report["rows"], 2)
    cfg = report["config"]
    assert cfg["devices"] == ["cpu", "cpu"] and set(cfg["reads"].values()) == {1}
    assert cfg["reads"].keys() == {"dit", "te", "te_bf16"}  # each checkpoint read once, the bf16 one included
    assert cfg["te"]["num_attention_heads"] == 4 and cfg["te"]["num_key_value_heads"] == 2
    assert cfg["bf16_noise"]["run_to_run"] == 0  # one device, twice: the bf16 rows keep the fp32 gate


def test_te_parity_four_devices_cli(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "te", "--device-type", "cpu",
                "--npu-count", "4", "--python", comfy_python, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_te(jsondoc.data(proc.stdout, proc.returncode), 4)
    assert "parity passed: 8 row(s)" in proc.stderr


def test_te_injected_fault_fails_the_gate(thread_runs):
    report = run(thread_runs, "te_fault")
    rows = report["rows"]
    assert not report["ok"] and len(rows) == 6 and report["config"]["faults"] == {"reduce": parity_worker.TE_FAULT_NOTE}
    assert all(not r["pass"] and r["failed"][0].startswith("max_rel > 1e-05") for r in rows), rows


def test_vae_parity_two_devices(thread_runs):
    report = run(thread_runs, "vae")
    assert report["ok"]
    _check_vae(report["rows"], 2)
    assert set(report["config"]["reads"].values()) == {1}


def test_vae_parity_four_devices_cli(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "vae", "--device-type", "cpu",
                "--npu-count", "4", "--python", comfy_python, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_vae(jsondoc.data(proc.stdout, proc.returncode), 4)
    assert "parity passed: 6 row(s)" in proc.stderr


def test_vae_injected_fault_fails_the_gate(installed_tree, comfy_python):
    proc = h3kit("parity", "--comfy-home", str(installed_tree), "--component", "vae", "--device-type", "cpu",
                "--npu-count", "2", "--python", comfy_python, "--inject-fault", "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    rows = jsondoc.data(proc.stdout, proc.returncode)
    # every row where another device decoded a chunk fails; the others had nothing to transport
    failed = {r["layout"] for r in rows if not r["pass"]}
    assert failed == {"39f", "73f", "90f"}
    assert "parity FAILED: 3 of 6 row(s)" in proc.stderr
