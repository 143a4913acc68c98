"""The runtime area's patches: listed in order, DEP-3 headers, new files generated from patches/src,
and the whole series applying to the pin (the `patched_tree` the other runtime tests use)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
import multinpu_fixtures  # noqa: E402
import multinpu_tree  # noqa: E402

RUNTIME_PATCHES = {
    "multidevice-npu-device-layer.patch": ["comfy/multidevice.py", "comfy/model_management.py"],
    "multinpu-collectives.patch": ["comfy/multinpu.py"],
    "h3-dit-sequence-parallel.patch": ["comfy/multinpu_dit.py"],
    "multinpu-parallel-config-node.patch": ["comfy_extras/nodes_multinpu.py", "nodes.py"],
}


def test_series_order():
    names = [p.name for p in multinpu_tree.series()]
    mine = [n for n in names if n in RUNTIME_PATCHES]
    # collectives before the DiT code that calls them, the node last; each listed once
    assert mine == list(RUNTIME_PATCHES)


@pytest.mark.parametrize("name", list(RUNTIME_PATCHES))
def test_patch_format(name):
    text = (multinpu_tree.PATCHES / name).read_text()
    head, sections = multinpu_tree.split_patch(text)
    fields = dict(re.findall(r"^([A-Z][\w-]+): (.*)$", head, re.M))
    assert {"Description", "Origin", "Forwarded", "Last-Update"} <= set(fields)
    assert fields["Origin"] == "vendor, h3kit" and fields["Forwarded"] == "not-needed"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", fields["Last-Update"])
    assert head.endswith("\n---\n"), "the header ends with a line '---' before the first diff"
    assert re.search(r"^Description: .+\n( .+\n)+", head, re.M), "a summary line, then the long description"
    assert [path for path, _ in sections] == RUNTIME_PATCHES[name]
    assert not re.search(r"^index ", text, re.M)


@pytest.mark.parametrize("name", list(RUNTIME_PATCHES))
def test_new_files_match_their_sources(name):
    assert multinpu_tree.stale_new_files(multinpu_tree.PATCHES / name) == [], \
        f"run: python tests/support/multinpu_tree.py patches/{name}"


@pytest.mark.upstream
def test_series_applies_to_the_pin(pin_tree, tmp_path_factory):
    tree = multinpu_fixtures.patched_tree_for(pin_tree, tmp_path_factory)
    for name, paths in RUNTIME_PATCHES.items():
        for path in paths:
            assert (tree / path).is_file()
    for rel in ("comfy/multidevice.py", "comfy/multinpu.py", "comfy/multinpu_dit.py", "comfy_extras/nodes_multinpu.py"):
        assert (tree / rel).read_text() == (multinpu_tree.SRC / rel).read_text()
    mm = (tree / "comfy" / "model_management.py").read_text()
    assert "torch.npu.set_device(device)" in mm and "torch.npu.synchronize()" in mm
    assert '"nodes_multinpu.py",' in (tree / "nodes.py").read_text()
