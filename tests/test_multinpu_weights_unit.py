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


class _Int8Linear(torch.nn.Module):
    """A linear holding its weight as the pin's INT8 loader does: a Parameter around comfy-kitchen's
    QuantizedTensor (TensorWiseINT8Layout, per-channel, ConvRot), moved by a re-wrapping _apply like
    upstream's MixedPrecisionOps.Linear."""

    def __init__(self, ck_tensor):
        super().__init__()
        w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        self.weight = torch.nn.Parameter(ck_tensor.QuantizedTensor.from_float(
            w, "TensorWiseINT8Layout", per_channel=True, convrot=True, convrot_groupsize=16), requires_grad=False)

    def _apply(self, fn, recurse=True):
        for key, param in self._parameters.items():
            self.register_parameter(key, torch.nn.Parameter(fn(param), requires_grad=False))
        return self


@pytest.mark.parametrize("anchor", [True, False])
def test_int8_weights_come_back_to_the_anchor(weights, anchor):
    ck_tensor = requires.module("comfy_kitchen.tensor", "needs comfy-kitchen (the pin's INT8 layouts)")
    m = _Int8Linear(ck_tensor)
    qdata = m.weight._qdata.untyped_storage().data_ptr()
    if anchor:
        assert weights.anchor_host_copy(m) == 8 * 16 + 8 * 4  # the int8 data and the fp32 per-channel scales
    m.to("meta")
    assert m.weight.device.type == "meta" and m.weight._qdata.device.type == "meta"
    if not anchor:  # the control: nothing can come back from the stand-in device without the anchor
        with pytest.raises(NotImplementedError):
            m.to("cpu")
        return
    m.to("cpu")
    assert type(m.weight).__name__ == "QuantizedTensor" and m.weight._qdata.untyped_storage().data_ptr() == qdata
    assert weights.host_storages(m) == {qdata}
