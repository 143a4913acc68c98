"""INT8 linears on Ascend NPU: the NPU arm of comfy-kitchen's int8_linear, and a reference of its kernels.

At this ComfyUI an INT8 checkpoint (per layer "comfy_quant" {"format": "int8_tensorwise", ...}, the
published H3 DiTs add "convrot": true) loads through comfy.ops.mixed_precision_ops into QuantizedTensor
weights of comfy-kitchen's TensorWiseINT8Layout: int8 data [N, K], a float32 scale (one per tensor, or
[N, 1] per output channel) and, with ConvRot, a weight already rotated by a block Hadamard matrix of
convrot_groupsize along K. Every INT8 matmul then reaches comfy-kitchen's int8_linear, from
MixedPrecisionOps.Linear (the QuantizedTensor linear handler) and from comfy.ops.linear_input_act (an
MLP's down projection, with its activation), and comfy-kitchen's registry runs the first capable backend
(cuda, triton, eager). None of them knows an NPU: eager would run torch._int_mm.

register() adds one backend, "npu", first in line, for int8_linear only. Its call rule accepts a call when
the activations are on an NPU (torch_npu's kernels), or when the reference below is selected; anything
else falls through to the backends that ran it before. The arm keeps comfy-kitchen's contract ([..., K]
activations, int8 [N, K] weight, scale scalar or per output channel, output in out_dtype) and runs:

- W8A8: torch_npu.npu_dynamic_quant (per-token symmetric int8, scale = row amax / 127) then
  torch_npu.npu_quant_matmul (int8 x int8 with int32 accumulation, times the per-channel weight scale and
  the per-token scale, plus bias, one rounding to bf16/fp16). The same arithmetic as comfy-kitchen's
  int8_linear on CUDA: activations quantized per row, weights per channel.
- W8A16: torch_npu.npu_weight_quant_batchmatmul (the int8 weight dequantized by its scale inside the
  matmul, activations kept in bf16/fp16).

linear_mode() picks one per layer (docs/int8.md has the table for H3 and the measurements behind it):
- W8A16 for calls of at most W8A16_MAX_ROWS rows (H3's time and adaLN path, if a file quantizes it: the
  matmul is weight-bound, quantizing a few rows saves nothing, and every token is scaled by the result);
- W8A16 for an MLP's down projection (an input_act call) whose weight is not ConvRot-rotated: its input,
  the SwiGLU product, is heavy-tailed, and per-token int8 doubles the error of the other linears;
- W8A8 for everything else, ConvRot down projections included (the rotation flattens those outliers;
  the published H3 INT8 files are ConvRot).
H3KIT_NPU_INT8_LINEAR=w8a8|w8a16 forces one mode for every layer.

The kernels' signatures and semantics, from Ascend's op-plugin documentation (docs/context/
torch_npu-npu_dynamic_quant.md, torch_npu-npu_quant_matmul.md, torch_npu-npu_weight_quant_batchmatmul.md)
and the CANN aclnnDynamicQuant / aclnnQuantMatmulV4 pages:
  npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None) -> (y int8, scale float32)
  npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None)
  npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                               quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0)
They take bf16/fp16 activations only, so an fp32 activation (a run forced to fp32, or ComfyUI on CPU) is
rounded to bf16 before them and the result cast back. This path has NOT been measured on an NPU.

ReferenceOps implements exactly those documented semantics in plain torch. It runs in the kernels' place
on a CPU that simulates devices (H3KIT_SIM_DEVICES, as `h3kit start --device-type cpu` sets it), so the
dispatch, the per-layer choice, the scales and the shapes are the ones an NPU runs, and tests compare them
with upstream's own dequantized result. H3KIT_NPU_INT8=reference selects it on any device (on an NPU: to
compare the kernels with it), =npu requires torch_npu's kernels, =off leaves every call to upstream.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import sys
import threading

import torch
from comfy_kitchen.constraints import ExactDims, FunctionConstraints, ParamConstraint, ValidationResult
from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation

BACKEND = "npu"
MODE_ENV = "H3KIT_NPU_INT8"            # unset (auto) | reference | npu | off
LINEAR_ENV = "H3KIT_NPU_INT8_LINEAR"   # unset (auto) | w8a8 | w8a16
W8A8 = "w8a8"
W8A16 = "w8a16"
# At or below this many rows a linear runs weight-only (W8A16): the time / adaLN projections of H3 see one
# row per timestep, where per-token quantization saves no time and every token is scaled by the result.
W8A16_MAX_ROWS = 16
# npu_quant_matmul and npu_weight_quant_batchmatmul take K (and N) up to 65535
MAX_DIM = 65535
KERNEL_DTYPES = (torch.bfloat16, torch.float16)

_stats = collections.Counter()
_stats_lock = threading.Lock()
_logged = set()


class ReferenceOps:
    """torch_npu's three INT8 kernels as documented, in plain torch; only the arguments the arm uses.

    Shapes: x, x1 [M, K]; x2, weight [K, N] (a transposed view of the [N, K] checkpoint weight); scale,
    antiquant_scale (N,) or (1,); pertoken_scale (M,); bias (N,).
    """

    @staticmethod
    def npu_dynamic_quant(x, *, smooth_scales=None, group_index=None, dst_type=None):
        """scale = row_max(|x|) / 127 (float32); y = round(x / scale) to int8.

        The division is float32 after x is widened (aclnnDynamicQuant's kernel casts bf16/fp16 to fp32 and
        divides), rounding is half to even (CAST_RINT), the result saturates to int8. A row of zeros, whose
        scale is 0, quantizes to zeros here (the kernel's result for 0/0 is unmeasured).
        """
        if smooth_scales is not None or group_index is not None or dst_type not in (None, torch.int8):
            raise NotImplementedError("reference npu_dynamic_quant: per-token int8 without smooth scales only")
        _require(x.dtype in KERNEL_DTYPES and x.dim() >= 2, "npu_dynamic_quant takes fp16/bf16 x of 2 or more dims",
                 x)
        xf = x.float()
        scale = xf.abs().amax(dim=-1) / 127.0
        y = torch.round(xf / scale.unsqueeze(-1)).nan_to_num_(0.0).clamp_(-128, 127).to(torch.int8)
        return y, scale

    @staticmethod
    def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
        """out = x1 @ x2 (int32) * scale * pertoken_scale + bias, rounded once to output_dtype (bf16/fp16)."""
        if offset is not None or output_dtype not in KERNEL_DTYPES:
            raise NotImplementedError("reference npu_quant_matmul: bf16/fp16 output without offset only")
        _require(x1.dtype == torch.int8 and x2.dtype == torch.int8 and x1.dim() == 2 and x2.dim() == 2
                 and x1.shape[1] == x2.shape[0] and x1.shape[1] <= MAX_DIM, "npu_quant_matmul takes int8 [M, K] @ [K, N]",
                 x1, x2)
        _require(scale.dim() == 1 and scale.numel() in (1, x2.shape[1]), "scale must be (1,) or (N,)", scale)
        out = _int32_matmul(x1, x2).float() * scale.float()
        if pertoken_scale is not None:
            _require(pertoken_scale.shape == (x1.shape[0],), "pertoken_scale must be (M,)", pertoken_scale)
            out = out * pertoken_scale.float().unsqueeze(-1)
        if bias is not None:
            out = out + bias.float()
        return out.to(output_dtype)

    @staticmethod
    def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0, inner_precise=0):
        """y = x @ (weight * antiquant_scale) + bias: the weight dequantized in x's dtype, fp32 accumulation."""
        if antiquant_offset is not None or quant_scale is not None or quant_offset is not None or antiquant_group_size:
            raise NotImplementedError("reference npu_weight_quant_batchmatmul: per-channel / per-tensor scale only")
        _require(x.dtype in KERNEL_DTYPES and x.dim() == 2 and weight.dtype == torch.int8 and weight.dim() == 2
                 and x.shape[1] == weight.shape[0], "npu_weight_quant_batchmatmul takes fp16/bf16 [M, K] @ int8 [K, N]",
                 x, weight)
        _require(antiquant_scale.dtype == x.dtype and antiquant_scale.numel() in (1, weight.shape[1]),
                 "antiquant_scale must have x's dtype and (1,) or (N,) elements", antiquant_scale)
        w = (weight.float() * antiquant_scale.float().reshape(1, -1)).to(x.dtype)
        out = x.float() @ w.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


def _require(ok: bool, what: str, *tensors):
    if not ok:
        raise ValueError(f"{what}; got " + ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors))


# K-chunks whose int8 x int8 partial sums are exact in float32: |a b| <= 2**14, so a sum of 1024 stays <= 2**24
EXACT_F32_CHUNK = 1024


def _int32_matmul(a, b):
    # int8 x int8 products summed exactly in int32 (|sum| <= 2**14 * 65535 < 2**31): torch._int_mm on a cpu,
    # float32 over K-chunks elsewhere (CUDA's _int_mm wants aligned shapes; an NPU has no float64)
    if a.device.type == "cpu":
        return torch._int_mm(a, b)
    return _int32_matmul_f32(a, b)


def _int32_matmul_f32(a, b):
    """The exact int32 product with float32 matmuls only: each K-chunk of EXACT_F32_CHUNK has integer partial sums
    of at most 2**24, which float32 holds exactly in any summation order (and under TF32/HF32 input rounding:
    an int8 fits its mantissa), so each chunk's result is exact; the chunks add up in int32."""
    out = None
    for k in range(0, a.shape[1], EXACT_F32_CHUNK):
        part = (a[:, k:k + EXACT_F32_CHUNK].float() @ b[k:k + EXACT_F32_CHUNK].float()).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out if out is not None else torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)


@functools.cache
def _torch_npu():
    try:
        import torch_npu
    except ImportError:
        return None
    return torch_npu


def kernels_for(device: torch.device):
    """The kernels an int8_linear on `device` runs: torch_npu, ReferenceOps, or None (upstream's backends)."""
    setting = os.environ.get(MODE_ENV, "").strip().lower()
    if setting == "off":
        return None
    if setting == "reference":
        return ReferenceOps
    if device.type == "npu":
        return _torch_npu()
    if setting == "npu":
        return None
    # a CPU that stands in for NPUs runs their kernels' reference (imported here: comfy.multidevice imports
    # comfy.model_management, which imports comfy.quant_ops, which registers this module)
    import comfy.multidevice
    if device.type == "cpu" and comfy.multidevice.sim_device_count() > 0:
        return ReferenceOps
    return None


def linear_mode(rows: int, input_act=None, convrot=False, environ=None) -> str:
    """W8A8 or W8A16 for one linear call (docs/int8.md: which H3 layer takes which, and why).

    rows: activation rows of the call; input_act: the activation folded into the call (an MLP's down
    projection); convrot: whether the weight is ConvRot-rotated.
    """
    forced = (os.environ if environ is None else environ).get(LINEAR_ENV, "").strip().lower()
    if forced in (W8A8, W8A16):
        return forced
    if rows <= W8A16_MAX_ROWS or (input_act not in (None, "none") and not convrot):
        return W8A16
    return W8A8


def int8_linear(x, weight, weight_scale, bias=None, out_dtype=torch.bfloat16, convrot=False, convrot_groupsize=256,
                input_act=None):
    """comfy-kitchen's int8_linear on the NPU kernels: [..., K] activations, int8 [N, K] -> [..., N] out_dtype.

    As upstream: input_act (an MLP's activation) is applied first, then the ConvRot rotation in x's dtype;
    the activations then go to the kernels in bf16/fp16.
    """
    ops = kernels_for(x.device)
    if input_act not in (None, "none"):
        x = _input_act(x, input_act)
    if convrot:
        x = _rotate_activation(x, _build_hadamard(convrot_groupsize, device=x.device, dtype=x.dtype), convrot_groupsize)
    shape = x.shape
    n = weight.shape[0]
    kdtype = x.dtype if x.dtype in KERNEL_DTYPES else torch.bfloat16
    x2 = x.reshape(-1, shape[-1]).to(kdtype)
    weight = weight.to(device=x.device)
    scale = weight_scale.to(device=x.device, dtype=torch.float32).reshape(-1)
    mode = linear_mode(x2.shape[0], input_act, convrot)
    if mode == W8A8:
        x8, token_scale = ops.npu_dynamic_quant(x2)
        out = ops.npu_quant_matmul(x8, weight.t(), scale, pertoken_scale=token_scale,
                                   bias=None if bias is None else bias.to(device=x.device, dtype=torch.float32),
                                   output_dtype=kdtype)
    else:
        bias_dtype = torch.float32 if kdtype == torch.bfloat16 else kdtype  # the kernel's rule for bias
        out = ops.npu_weight_quant_batchmatmul(x2, weight.t(), scale.to(kdtype),
                                               bias=None if bias is None else bias.to(device=x.device, dtype=bias_dtype))
    _count(mode, ops, x.device)
    return out.to(out_dtype).reshape(*shape[:-1], n)


def _input_act(x, input_act):
    import comfy.ops  # upstream's eager activations, the ones its own fallback applies
    return comfy.ops.INPUT_ACT_EAGER[input_act](x)


def _count(mode, ops, device):
    kernels = "reference" if ops is ReferenceOps else "torch_npu"
    with _stats_lock:
        _stats[(mode, kernels)] += 1
        first = (kernels, device.type) not in _logged
        _logged.add((kernels, device.type))
    if first:
        logging.info(f"NPU INT8: int8 linears on {device.type} run on {kernels} kernels (docs/int8.md)")


def stats() -> dict:
    """Calls so far, {"w8a8/reference": n, ...} (tests, parity)."""
    with _stats_lock:
        return {f"{m}/{k}": v for (m, k), v in sorted(_stats.items())}


def _applies(kwargs) -> ValidationResult:
    x, weight, scale = kwargs.get("x"), kwargs.get("weight"), kwargs.get("weight_scale")
    if kernels_for(x.device) is None:
        return ValidationResult.fail("x", f"no NPU INT8 kernels for {x.device.type} ({MODE_ENV} to select the reference)")
    if weight.shape[1] > MAX_DIM or weight.shape[0] > MAX_DIM:
        return ValidationResult.fail("weight", f"K and N must be at most {MAX_DIM}, got {tuple(weight.shape)}")
    if scale.numel() not in (1, weight.shape[0]):
        return ValidationResult.fail("weight_scale", f"{scale.numel()} scales for {weight.shape[0]} output channels")
    return ValidationResult.ok()


def register(registry):
    """Add the NPU arm to comfy-kitchen's registry, ahead of every other int8_linear backend."""
    floats = frozenset({torch.float32, torch.float16, torch.bfloat16})
    constraints = FunctionConstraints(
        params={"x": ParamConstraint(dtypes=floats),
                "weight": ParamConstraint(dtypes=frozenset({torch.int8}), shape_rules=(ExactDims(2),)),
                "weight_scale": ParamConstraint(dtypes=floats)},
        default_devices=frozenset({"*"}),
        call_rules=(_applies,))
    registry.register(BACKEND, sys.modules[__name__], {"int8_linear": constraints})
    order = getattr(registry, "_priority", ["cuda", "triton", "eager"])
    registry.set_priority([BACKEND] + [b for b in order if b != BACKEND])
