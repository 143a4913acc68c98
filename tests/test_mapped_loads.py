"""Cached loads keep the weight file's mapping as the model's host weights (comfy.multinpu_models.mapped_loads):
no private copy beside the page cache's one, which every process of a host shares. Checked in a patched tree by
where each weight's bytes live (/proc/self/maps), against upstream's own load of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.checks_runner import run_script, value

pytestmark = [pytest.mark.upstream]
SCRIPT = Path(__file__).resolve().parent / "support" / "mapped_load_checks.py"


@pytest.fixture(scope="module")
def checks(installed_tree, comfy_python, tmp_path_factory):
    return run_script(SCRIPT, installed_tree, comfy_python, tmp_path_factory.mktemp("mapped_checks"))


def test_an_aligned_file_is_loaded_as_its_mapping_and_computes_the_same(checks):
    v = value(checks, "mapped")["aligned"]
    # every weight is the file's mapping; upstream's own load holds every weight in private memory
    assert v["mapped"] > 0 and v["private"] == 0, v
    assert v["upstream"]["mapped"] == 0 and v["upstream"]["private"] == v["mapped"], v
    assert v["equal"]


def test_a_file_aligned_to_8_bytes_keeps_private_copies_on_cpu(checks):
    # safetensors aligns tensors to 8 bytes; the CPU kernels round data at another alignment differently, so on a
    # process that computes on its CPU those weights are copied (on npu/cuda every weight maps)
    v = value(checks, "mapped")["plain"]
    assert v["private"] > 0 and v["equal"], v
