"""INT8 pieces that need no ComfyUI tree: the reference of the NPU kernels (patches/src/comfy/npu_quant.py,
imported directly), the per-layer choice, and the demo's and parity's INT8 options."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from h3kit import demo
from h3kit.errors import UsageError
from h3kit.runtime import parity as parity_lib
from tests.support import requires

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nq():
    requires.module("torch", requires.NO_TORCH_REASON)
    requires.module("comfy_kitchen", "needs comfy-kitchen (the pin's INT8 layouts)")
    spec = importlib.util.spec_from_file_location("h3kit_src_npu_quant", ROOT / "patches/src/comfy/npu_quant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dynamic_quant_rounds_half_to_even_per_token(nq):
    import torch
    # row max 127 gives scale 1.0 exactly, so x / scale keeps the ties: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -127.0], [0, 0, 0, 0, 0, 0, 0]], dtype=torch.bfloat16)
    y, scale = nq.ReferenceOps.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (2,)
    assert y[0].tolist() == [127, 0, 2, 2, 0, -2, -127]
    assert scale.tolist() == [1.0, 0.0] and y[1].tolist() == [0] * 7, "a zero row quantizes to zeros"


def test_the_kernels_refuse_what_the_npu_ops_refuse(nq):
    import torch
    with pytest.raises(ValueError, match="fp16/bf16"):
        nq.ReferenceOps.npu_dynamic_quant(torch.zeros(2, 4))  # fp32: aclnnDynamicQuant takes FLOAT16/BFLOAT16
    x8 = torch.zeros(3, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"\(1,\) or \(N,\)"):
        nq.ReferenceOps.npu_quant_matmul(x8, torch.zeros(4, 5, dtype=torch.int8), torch.ones(3),
                                         output_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        nq.ReferenceOps.npu_quant_matmul(x8, torch.zeros(4, 5, dtype=torch.int8), torch.ones(5))  # int8 output
    with pytest.raises(ValueError, match="dtype"):
        nq.ReferenceOps.npu_weight_quant_batchmatmul(torch.zeros(3, 4, dtype=torch.bfloat16),
                                                     torch.zeros(4, 5, dtype=torch.int8), torch.ones(5))


def test_the_reference_matmul_off_cpu_is_exact_in_float32(nq):
    # an NPU has no float64: the reference's int32 product off the cpu uses float32 matmuls over K-chunks of
    # 1024, each exact; one float32 matmul over the whole K is not (partial sums pass 2**24)
    import torch
    g = torch.Generator().manual_seed(3)
    for k in (1, 1000, 1024, 1025, 5376, 14336):
        a = torch.randint(-128, 128, (4, k), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (k, 8), dtype=torch.int8, generator=g)
        assert torch.equal(nq._int32_matmul_f32(a, b), torch._int_mm(a, b)), k
    worst = torch.full((2, 14336), -128, dtype=torch.int8)
    assert torch.equal(nq._int32_matmul_f32(worst, worst.t().contiguous()), torch._int_mm(worst, worst.t().contiguous()))
    a = torch.randint(100, 128, (4, 14336), dtype=torch.int8, generator=g)
    b = torch.randint(100, 128, (14336, 8), dtype=torch.int8, generator=g)
    naive = (a.float() @ b.float()).to(torch.int32)
    assert not torch.equal(naive, torch._int_mm(a, b)), "the control: a single float32 matmul rounds"


def test_quant_matmul_is_int32_accumulation_then_one_rounding(nq):
    import torch
    g = torch.Generator().manual_seed(0)
    x1 = torch.randint(-128, 128, (6, 300), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (5, 300), dtype=torch.int8, generator=g)
    scale, tok = torch.rand(5, generator=g), torch.rand(6, generator=g)
    bias = torch.randn(5, generator=g)
    out = nq.ReferenceOps.npu_quant_matmul(x1, w.t(), scale, pertoken_scale=tok, bias=bias, output_dtype=torch.bfloat16)
    exact = (x1.double() @ w.double().t()) * scale.double() * tok.double().unsqueeze(-1) + bias.double()
    assert out.dtype == torch.bfloat16
    # one rounding to bf16 (8 significant bits): within half a bf16 ulp of the exact value, up to fp32's rounding
    half_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 8)
    assert ((out.double() - exact).abs() <= half_ulp * (1 + 1e-4)).all()


def test_weight_quant_batchmatmul_dequantizes_in_x_dtype(nq):
    import torch
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w = torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=g)
    s = (torch.rand(8, generator=g) / 100).to(torch.bfloat16)
    out = nq.ReferenceOps.npu_weight_quant_batchmatmul(x, w.t(), s)
    ref = x.double() @ (w.double() * s.double().unsqueeze(-1)).to(torch.bfloat16).double().t()
    assert out.dtype == torch.bfloat16 and torch.allclose(out.double(), ref, rtol=2 ** -8, atol=0)


def test_linear_mode(nq):
    assert nq.linear_mode(9503, environ={}) == nq.W8A8
    assert nq.linear_mode(3, environ={}) == nq.W8A16
    assert nq.linear_mode(9503, "swiglu", convrot=True, environ={}) == nq.W8A8
    assert nq.linear_mode(9503, "swiglu", convrot=False, environ={}) == nq.W8A16
    assert nq.linear_mode(3, environ={nq.LINEAR_ENV: "W8A8"}) == nq.W8A8
    assert nq.linear_mode(9503, environ={nq.LINEAR_ENV: "junk"}) == nq.W8A8


def test_demo_int8_uses_the_int8_dit():
    prompt = demo.demo_prompt(2, "t", "int8")
    loader = next(n for n in prompt.values() if n["class_type"] == "UNETLoader")
    assert loader["inputs"]["unet_name"] == "h3kit_tiny_dit_int8.safetensors"
    assert set(demo.tiny_components("int8")) == {"dit_int8", "te", "video_vae", "audio_vae"}
    assert demo.tiny_components("float") == demo.TINY
    assert next(n for n in demo.demo_prompt(2, "t").values() if n["class_type"] == "UNETLoader")["inputs"][
        "unet_name"] == "h3kit_tiny_dit.safetensors"


def test_demo_int8_requires_the_arm_in_the_server_log(tmp_path):
    log = tmp_path / "comfyui.log"
    log.write_text("Starting server\nRequested to load MiniMaxH3\n")
    with pytest.raises(demo.DemoFailed, match="not on the NPU INT8 arm") as e:
        demo.int8_arm_line(str(log))
    assert "npu-int8-linear.patch" in e.value.hint
    log.write_text("x\n2026-12-01 INFO NPU INT8: int8 linears on cpu run on reference kernels (docs/int8.md)\n")
    assert demo.int8_arm_line(str(log)) == "NPU INT8: int8 linears on cpu run on reference kernels (docs/int8.md)"


def test_parity_weights_apply_to_the_dit_only():
    parity_lib.check_request("dit", 2, None, "int8")
    parity_lib.check_request("te", 2, None, "float")
    with pytest.raises(UsageError, match="dit only"):
        parity_lib.check_request("vae", 2, None, "int8")
    assert "W8A8 and W8A16" in parity_lib.gate("dit", "int8") and parity_lib.gate("te", "int8") == parity_lib.GATES["te"]


def test_the_call_rule_leaves_what_the_kernels_cannot_take_to_upstream(nq, monkeypatch):
    import torch
    monkeypatch.setenv(nq.MODE_ENV, "reference")
    call = lambda k, n, scales: {"x": torch.zeros(2, k, dtype=torch.bfloat16),  # noqa: E731
                                 "weight": torch.zeros(n, k, dtype=torch.int8), "weight_scale": torch.ones(scales)}
    assert nq._applies(call(64, 8, 8)).success and nq._applies(call(64, 8, 1)).success
    assert nq._applies(call(70000, 1, 1)).failed_param == "weight", "K above 65535"
    assert nq._applies(call(64, 8, 3)).failed_param == "weight_scale"
    monkeypatch.setenv(nq.MODE_ENV, "off")
    assert nq._applies(call(64, 8, 8)).failed_param == "x"


def test_the_layout_twin_keeps_a_format_per_storage(nq):
    """ReferenceLayout, the CPU twin of npu_format_cast / get_npu_format: the format belongs to the storage (views and
    detached aliases share it, a copy is ND), a cast to the format a tensor has is a no-op, casts are counted."""
    import gc
    import torch
    twin = nq.ReferenceLayout()
    w = torch.arange(12, dtype=torch.int8).reshape(3, 4)
    nz = twin.npu_format_cast(w.t().contiguous(), nq.ACL_FORMAT_FRACTAL_NZ)
    assert twin.casts == 1 and nz.untyped_storage().data_ptr() != w.untyped_storage().data_ptr()
    assert torch.equal(nz, w.t()), "the values keep their logical [K, N] order"
    assert nq.npu_format(w) == nq.ACL_FORMAT_ND
    assert nq.npu_format(nz) == nq.npu_format(nz.detach()) == nq.npu_format(nz.t()) == nq.ACL_FORMAT_FRACTAL_NZ
    assert nq.npu_format(nz.clone()) == nq.ACL_FORMAT_ND
    assert twin.npu_format_cast(nz, nq.ACL_FORMAT_FRACTAL_NZ) is nz and twin.casts == 1
    n = len(nq._FORMATS)
    del nz
    gc.collect()
    assert len(nq._FORMATS) == n - 1, "a freed storage leaves the record"


def test_an_nz_weight_must_reach_the_kernel_contiguous(nq):
    """aclnnQuantMatmulWeightNz on A2/A3 takes no non-contiguous NZ x2; the reference kernels refuse it too, and count
    how each call received its weight (the transposeX2 op-plugin would pass)."""
    import torch
    twin = nq.ReferenceLayout()
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-128, 128, (8, 64), dtype=torch.int8, generator=g)  # [N, K]
    x8 = torch.randint(-128, 128, (3, 64), dtype=torch.int8, generator=g)
    nz = twin.npu_format_cast(w.t().contiguous(), nq.ACL_FORMAT_FRACTAL_NZ)
    before = nq.layout_stats()["x2"]
    a = nq.ReferenceOps.npu_quant_matmul(x8, nz, torch.ones(8), output_dtype=torch.bfloat16)
    b = nq.ReferenceOps.npu_quant_matmul(x8, w.t(), torch.ones(8), output_dtype=torch.bfloat16)
    assert torch.equal(a, b)
    after = nq.layout_stats()["x2"]
    assert after["npu_quant_matmul/nz/plain"] - before.get("npu_quant_matmul/nz/plain", 0) == 1
    assert after["npu_quant_matmul/nd/transposed"] - before.get("npu_quant_matmul/nd/transposed", 0) == 1
    nz_nk = twin.npu_format_cast(w, nq.ACL_FORMAT_FRACTAL_NZ)
    with pytest.raises(ValueError, match="contiguous"):
        nq.ReferenceOps.npu_quant_matmul(x8, nz_nk.t(), torch.ones(8), output_dtype=torch.bfloat16)
    assert nq.is_transpose_last_two_dims(w.t()) and not nq.is_transpose_last_two_dims(nz)


def test_landed_casts_an_int8_weight_once_and_keeps_its_meaning(nq, monkeypatch):
    """landed(): under the twin an INT8 weight becomes NpuNzINT8Layout over one [K, N] NZ copy, once; F.linear on it
    runs the arm with that copy and equals the ND weight's result bit for bit; dequantize() and state_dict() give
    upstream's [N, K]. No twin (the CPU simulation), H3KIT_NPU_INT8_NZ=0, a weight that is a view into a larger
    buffer (a sharded DiT's gathered block) or a float weight: returned as they are."""
    import torch
    from comfy_kitchen.tensor.base import QuantizedTensor
    nq.register_layout()
    monkeypatch.setenv(nq.MODE_ENV, "reference")
    monkeypatch.delenv(nq.NZ_ENV, raising=False)
    g = torch.Generator().manual_seed(4)
    qt = QuantizedTensor.from_float(torch.randn(96, 128, generator=g), "TensorWiseINT8Layout", per_channel=True,
                                    convrot=True, convrot_groupsize=64)
    x = torch.randn(2, 20, 128, generator=g).to(torch.bfloat16)
    ref = nq.int8_linear(x, qt._qdata, qt._params.scale, None, torch.bfloat16, True, 64)
    assert nq.landed(qt) is qt, "no twin: the CPU simulation never casts"
    twin = nq.ReferenceLayout()
    with nq.simulate_layout(twin):
        p = nq.landed(qt)
        assert twin.casts == 1 and p._layout_cls == nq.NZ_LAYOUT and tuple(p._qdata.shape) == (128, 96)
        assert nq.npu_format(p._qdata) == nq.ACL_FORMAT_FRACTAL_NZ and p.shape == qt.shape
        assert nq.landed(p) is p and twin.casts == 1, "already NZ: not cast again"
        monkeypatch.setenv(nq.NZ_ENV, "0")
        assert nq.landed(qt) is qt and twin.casts == 1, "the off switch"
        monkeypatch.delenv(nq.NZ_ENV)
        buffer = torch.zeros(2 * 96 * 128, dtype=torch.int8)
        view = QuantizedTensor(buffer[:96 * 128].view(96, 128), "TensorWiseINT8Layout", qt._params)
        assert nq.landed(view) is view, "a view into a larger buffer is not cast (its buffer would stay)"
        plain = torch.randn(4, 4)
        assert nq.landed(plain) is plain
        before = nq.layout_stats()["x2"].get("npu_quant_matmul/nz/plain", 0)
        out = torch.nn.functional.linear(x, torch.nn.Parameter(p, requires_grad=False))
        assert torch.equal(out, ref), "the same arithmetic as the ND weight"
        assert nq.layout_stats()["x2"]["npu_quant_matmul/nz/plain"] == before + 1 and twin.casts == 1
    assert torch.equal(p.dequantize(), qt.dequantize())
    assert torch.equal(p.state_dict()[""], qt._qdata) and torch.equal(p.state_dict()["_scale"], qt._params.scale)


def test_w8a16_never_gets_an_nz_weight(nq, monkeypatch):
    """op-plugin: npu_weight_quant_batchmatmul takes no FRACTAL_NZ weight in eager mode, and the reference kernel
    refuses one as torch_npu would. So only weights laid out for W8A8 are cast at load: a ConvRot weight (W8A8), not a
    non-ConvRot one (its down projection runs W8A16) nor any under H3KIT_NPU_INT8_LINEAR=w8a16; a call of 16 rows or
    fewer on a cast weight runs W8A8 (the kernel its layout was cast for), equal bit for bit to the ND weight's W8A8."""
    import torch
    from comfy_kitchen.tensor.base import QuantizedTensor
    nq.register_layout()
    monkeypatch.setenv(nq.MODE_ENV, "reference")
    monkeypatch.delenv(nq.NZ_ENV, raising=False)
    monkeypatch.delenv(nq.LINEAR_ENV, raising=False)
    g = torch.Generator().manual_seed(5)
    rot = QuantizedTensor.from_float(torch.randn(96, 128, generator=g), "TensorWiseINT8Layout", per_channel=True,
                                     convrot=True, convrot_groupsize=64)
    plain = QuantizedTensor.from_float(torch.randn(96, 128, generator=g), "TensorWiseINT8Layout", per_channel=True)
    x = torch.randn(3, 128, generator=g).to(torch.bfloat16)  # 3 rows: W8A16 by the row rule on an ND weight
    twin = nq.ReferenceLayout()
    nz_w = twin.npu_format_cast(plain._qdata.t().contiguous(), nq.ACL_FORMAT_FRACTAL_NZ)
    with pytest.raises(RuntimeError, match="graph mode"):
        nq.ReferenceOps.npu_weight_quant_batchmatmul(x, nz_w, torch.ones(96, dtype=torch.bfloat16))
    with nq.simulate_layout(twin):
        assert nq.landed(plain) is plain, "non-ConvRot: its down projection runs W8A16, so it stays ND"
        monkeypatch.setenv(nq.LINEAR_ENV, "w8a16")
        assert nq.landed(rot) is rot, "every layer W8A16: nothing is cast"
        monkeypatch.delenv(nq.LINEAR_ENV)
        p = nq.landed(rot)
        assert p._layout_cls == nq.NZ_LAYOUT and nq.npu_format(p._qdata) == nq.ACL_FORMAT_FRACTAL_NZ
        before = nq.layout_stats()["x2"]
        out = torch.nn.functional.linear(x, torch.nn.Parameter(p, requires_grad=False))
        after = nq.layout_stats()["x2"]
    assert after.get("npu_quant_matmul/nz/plain", 0) == before.get("npu_quant_matmul/nz/plain", 0) + 1
    monkeypatch.setenv(nq.LINEAR_ENV, "w8a8")
    ref = nq.int8_linear(x, rot._qdata, rot._params.scale, None, torch.bfloat16, True, 64)
    assert torch.equal(out, ref)
