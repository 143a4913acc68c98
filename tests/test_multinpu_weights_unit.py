"""comfy/multinpu_weights.py's host anchors, imported straight from patches/src (it needs torch alone):
a move back to the host re-points at the one host copy; a dtype-only call leaves the weights where they are."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.support import requires

torch = requires.torch_module()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights():
    spec = importlib.util.spec_from_file_location("h3kit_src_multinpu_weights",
                                                  ROOT / "patches/src/comfy/multinpu_weights.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def anchored(weights):
    m = torch.nn.Linear(4, 3)
    host = {n: p.detach().untyped_storage().data_ptr() for n, p in m.named_parameters()}
    weights.anchor_host_copy(m)
    return m, host


def test_back_to_the_host_reuses_the_anchor(weights):
    m, host = anchored(weights)
    m.to("meta")  # "meta" stands in for a device: a real move, no data
    assert all(p.device.type == "meta" for p in m.parameters())
    m.to("cpu")
    assert {n: p.detach().untyped_storage().data_ptr() for n, p in m.named_parameters()} == host


@pytest.mark.parametrize("call", [lambda m: m.to(torch.float32), lambda m: m.float(),
                                  lambda m: m.to(dtype=torch.float32)])
def test_a_dtype_only_call_keeps_the_weights_on_their_device(weights, call):
    m, _ = anchored(weights)
    m.to("meta")
    call(m)
    assert all(p.device.type == "meta" for p in m.parameters())
