"""The runtime area's patches: listed in order, DEP-3 headers, new files generated from patches/src,
and the whole series applied to the pin (the installed tree the other runtime tests use)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from h3kit import manifest
from h3kit.patches import Series, structural_problems

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PATCHES = {
    "multidevice-npu-device-layer.patch": ["comfy/multidevice.py", "comfy/model_management.py"],
    "npu-int8-linear.patch": ["comfy/npu_quant.py", "comfy/quant_ops.py", "comfy/ops.py"],
    "multinpu-collectives.patch": ["comfy/multinpu.py"],
    "multinpu-weights-read-once.patch": ["comfy/multinpu_weights.py"],
    "h3-dit-sharded-weights.patch": ["comfy/multinpu_shard.py"],
    "h3-dit-sequence-parallel.patch": ["comfy/multinpu_dit.py"],
    "h3-text-encoder-tensor-parallel.patch": ["comfy/multinpu_te.py"],
    "h3-video-vae-decode-parallel.patch": ["comfy/multinpu_vae.py"],
    "multinpu-parallel-config-node.patch": ["comfy_extras/nodes_multinpu.py", "nodes.py"],
}


@pytest.fixture(scope="module")
def series():
    return Series.load(ROOT)


def test_series_order(series):
    mine = [n for n in series.names if n in RUNTIME_PATCHES]
    # collectives and the weight copies before the model code that uses them, the node last; each listed once
    assert mine == list(RUNTIME_PATCHES)


@pytest.mark.parametrize("name", list(RUNTIME_PATCHES))
def test_patch_format(series, name):
    patch = next(p for p in series.patches if p.name == name)
    assert patch.header["Origin"] == "vendor, h3kit" and patch.header["Forwarded"] == "not-needed"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", patch.header["Last-Update"])
    assert "\n" in patch.header["Description"], "a summary line, then the long description"
    assert patch.raw.decode().split("\ndiff --git ", 1)[0].endswith("\n---")
    assert patch.files == RUNTIME_PATCHES[name]


def test_new_files_match_their_sources(series):
    assert structural_problems(series, manifest.load(ROOT)) == []


@pytest.mark.upstream
def test_series_applied_to_the_pin(installed_tree):
    tree = installed_tree
    for rel in ("comfy/multidevice.py", "comfy/multinpu.py", "comfy/multinpu_weights.py", "comfy/multinpu_shard.py",
                "comfy/multinpu_dit.py",
                "comfy/multinpu_te.py", "comfy/multinpu_vae.py", "comfy_extras/nodes_multinpu.py", "comfy/npu_quant.py"):
        assert (tree / rel).read_text() == (ROOT / "patches" / "src" / rel).read_text()
    mm = (tree / "comfy" / "model_management.py").read_text()
    assert "torch.npu.set_device(device)" in mm and "torch.npu.synchronize()" in mm
    assert '"nodes_multinpu.py",' in (tree / "nodes.py").read_text()
    assert "comfy.npu_quant.register(ck.registry)" in (tree / "comfy" / "quant_ops.py").read_text()
    assert "p = comfy.npu_quant.landed(p)" in (tree / "comfy" / "ops.py").read_text()


def test_no_transport_fork_left_in_the_patch_sources():
    # one code path per component (issue 19 item 7): the process group and the thread transport are chosen in one
    # place each (comfy.multinpu_process.transport(), `runtime or ThreadRuntime.on(...)`), never branched on
    src = ROOT / "patches" / "src"
    forks = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "runtime is None" in line or "runtime is not None" in line]
    assert forks == [], forks
