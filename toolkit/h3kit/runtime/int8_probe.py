"""Measure the NPU INT8 arm (comfy/npu_quant.py) on a real INT8 H3 DiT, inside the ComfyUI interpreter.

Used by benchmarks/int8_linear_error.py and tests/support/int8_checks.py; it imports comfy.* and
comfy_kitchen, so it runs only where ComfyUI runs (the patched tree on sys.path, --cpu set first on a CPU
host). record_calls() keeps every call the arm serves during one forward; layer_errors() compares each with
upstream's own dequantized result (F.linear with the layer's weight.dequantize()), and with the pin's eager
int8_linear for scale.
"""

from __future__ import annotations


def quantized_layers(dm) -> dict:
    """{name: module} of the layers whose weight is a QuantizedTensor."""
    import comfy.quant_ops
    return {n: m for n, m in dm.named_modules() if isinstance(getattr(m, "weight", None), comfy.quant_ops.QuantizedTensor)}


def record_calls(dm, run) -> list:
    """[(layer name, kwargs, output)] of every int8_linear the arm serves while run() executes (copies: the model
    adds residuals into a linear's output in place)."""
    import comfy.npu_quant as nq
    names = {m.weight._qdata.data_ptr(): n for n, m in quantized_layers(dm).items()}
    calls, real = [], nq.int8_linear

    def recording(**kwargs):
        inputs = {k: v.clone() if hasattr(v, "clone") else v for k, v in kwargs.items()}
        out = real(**kwargs)
        calls.append((names.get(kwargs["weight"].data_ptr()), inputs, out.clone()))
        return out

    nq.int8_linear = recording  # the registry looks the implementation up on the module at every call
    try:
        run()
    finally:
        nq.int8_linear = real
    return calls


def dequantized(weight, x, input_act=None):
    """Upstream's own dequantized result: the call's activation, then F.linear with weight.dequantize() (comfy-
    kitchen's TensorWiseINT8Layout, ConvRot rotated back), in float64."""
    import torch

    import comfy.ops
    if input_act:
        x = comfy.ops.INPUT_ACT_EAGER[input_act](x.float())
    return torch.nn.functional.linear(x.double(), weight.dequantize().double())


def errors(out, ref) -> dict:
    """rel_rms = rms(out - ref) / rms(ref), max_rel = max|out - ref| / max|ref|, cos."""
    import torch
    a, b = out.double().flatten(), ref.double().flatten()
    d = (a - b).abs()
    return {"rel_rms": (d.pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item(),
            "max_rel": (d.max() / b.abs().max()).item(),
            "cos": torch.nn.functional.cosine_similarity(a, b, dim=0).item()}


def layer_errors(dm, calls) -> list:
    """Per recorded call: its layer, mode, rows, K -> N, and errors against upstream's dequantized result of
    the arm as it ran ("arm"), of the arm on bf16 activations (the NPU's compute dtype, "arm_bf16") and of
    the pin's eager int8_linear ("pin_eager", fp32)."""
    import torch

    import comfy.npu_quant as nq
    import comfy_kitchen.backends.eager as eager
    rows = []
    for name, kwargs, out in calls:
        weight = dm.get_submodule(name).weight
        x, act = kwargs["x"], kwargs.get("input_act")
        xb = dict(kwargs, x=x.to(torch.bfloat16), out_dtype=torch.bfloat16)
        m = x.reshape(-1, x.shape[-1]).shape[0]
        rows.append({"layer": name, "mode": nq.linear_mode(m, act, kwargs["convrot"]), "rows": int(m),
                     "k": int(weight._qdata.shape[1]), "n": int(weight._qdata.shape[0]),
                     "arm": errors(out, dequantized(weight, x, act)),
                     "arm_bf16": errors(nq.int8_linear(**xb), dequantized(weight, xb["x"], act)),
                     "pin_eager": errors(eager.int8_linear(**kwargs), dequantized(weight, x, act))})
    return rows
