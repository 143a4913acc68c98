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

INT8 weights in the kernels' layout, cast once per load (UNMEASURED ON HARDWARE). An INT8 weight laid out for W8A8
(load_mode: ConvRot, or H3KIT_NPU_INT8_LINEAR=w8a8; op-plugin's npu_weight_quant_batchmatmul takes no FRACTAL_NZ
weight in eager mode, so a weight that may run W8A16 stays ND, and a cast weight runs W8A8 at any row count) that lands
on an NPU (ComfyUI's load: module.to(device) reaches comfy.ops._quantized_apply, which calls landed() for
each parameter it moved) is transposed to [K, N] and cast with torch_npu.npu_format_cast(w, 29) to
FRACTAL_NZ, the layout vLLM-Ascend and MindIE give W8A8 weights once at load (vllm-ascend
quantization/methods/w8a8/w8a8_dynamic.py, process_weights_after_loading: transpose(0, 1).contiguous() then
maybe_trans_nz). torch_npu's npu_quant_matmul then runs aclnnQuantMatmulWeightNz with transposeX2 false
(op-plugin QuantMatmulKernelNpuOpApi.cpp picks it when x2's storage format is FRACTAL_NZ; ops-nn
aclnnQuantMatmulWeightNz.md: on A2/A3 an NZ x2 must be contiguous, (n1, k1, k0=16, n0=32) for transposeX2
false). The cast result replaces the loaded parameter: the ND device copy is released, nothing is kept
twice. The weight becomes a QuantizedTensor of NpuNzINT8Layout (TensorWiseINT8Layout with its int8 data
stored [K, N]): dequantize(), state_dict() and a move back to the host give upstream's [N, K] values, and
its linear calls the arm with the [K, N] weight as it is, so a forward never casts or copies it again.
H3KIT_NPU_INT8_NZ=0 keeps the ND weights (the A/B switch on hardware). Only weights that own their device
storage are cast (a sharded DiT's gathered block views are not). The CPU simulation never casts; tests run
the same steps against ReferenceLayout, the twin of npu_format_cast / get_npu_format (simulate_layout()).
"""

from __future__ import annotations

import collections
import functools
import logging
import os
import contextlib
import dataclasses
import sys
import threading
import weakref

import torch
from comfy_kitchen.constraints import ExactDims, FunctionConstraints, ParamConstraint, ValidationResult
from comfy_kitchen.tensor.base import QuantizedTensor, dequantize_args, register_layout_class
from comfy_kitchen.tensor.int8 import TensorWiseINT8Layout
from comfy_kitchen.tensor.int8_utils import _build_hadamard, _rotate_activation

BACKEND = "npu"
MODE_ENV = "H3KIT_NPU_INT8"            # unset (auto) | reference | npu | off
LINEAR_ENV = "H3KIT_NPU_INT8_LINEAR"   # unset (auto) | w8a8 | w8a16
NZ_ENV = "H3KIT_NPU_INT8_NZ"           # unset / 1: INT8 weights cast to FRACTAL_NZ when they land on an NPU; 0: kept ND
ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
NZ_LAYOUT = "NpuNzINT8Layout"
W8A8 = "w8a8"
W8A16 = "w8a16"
# At or below this many rows a linear runs weight-only (W8A16): the time / adaLN projections of H3 see one
# row per timestep, where per-token quantization saves no time and every token is scaled by the result.
W8A16_MAX_ROWS = 16
# npu_quant_matmul and npu_weight_quant_batchmatmul take K (and N) up to 65535
MAX_DIM = 65535
KERNEL_DTYPES = (torch.bfloat16, torch.float16)

_stats = collections.Counter()
_x2_stats = collections.Counter()
_layout_stats = collections.Counter()
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
        _x2_layout("npu_quant_matmul", x2)
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
        if npu_format(weight) == ACL_FORMAT_FRACTAL_NZ:
            raise RuntimeError("npu_weight_quant_batchmatmul: a FRACTAL_NZ weight is supported in graph mode only, "
                               "not in a single-operator (eager) call (op-plugin torch_npu-npu_weight_quant_batchmatmul"
                               ".md); pass the ND weight")
        _x2_layout("npu_weight_quant_batchmatmul", weight)
        w = (weight.float() * antiquant_scale.float().reshape(1, -1)).to(x.dtype)
        out = x.float() @ w.float()
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype)


def is_transpose_last_two_dims(t) -> bool:
    """op-plugin's rule (QuantMatmulKernelNpuOpApi.cpp): a 2-D x2 whose strides are those of a transposed
    contiguous matrix is passed to the kernel as transposed (transposeX2 true); a contiguous one is not."""
    return t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0] and not (t.shape[0] == 1 and t.shape[1] == 1)


def _x2_layout(kernel: str, x2):
    """Count how a kernel received its weight: FRACTAL_NZ (the pre-cast one), or ND and transposed or not. An NZ
    weight must be contiguous [K, N] (aclnnQuantMatmulWeightNz on A2/A3: no non-contiguous NZ x2)."""
    fmt = npu_format(x2)
    transposed = is_transpose_last_two_dims(x2)
    if fmt == ACL_FORMAT_FRACTAL_NZ:
        _require(x2.is_contiguous() and x2.storage_offset() == 0,
                 f"{kernel}: a FRACTAL_NZ weight must be a contiguous [K, N] tensor (transposeX2 false)", x2)
    key = f"{kernel}/{'nz' if fmt == ACL_FORMAT_FRACTAL_NZ else 'nd'}/{'transposed' if transposed else 'plain'}"
    with _stats_lock:
        _x2_stats[key] += 1


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


# ---- INT8 weights in the kernels' layout, cast once when they land on an NPU (unmeasured on hardware) ----

_FORMATS = weakref.WeakKeyDictionary()  # the twin's storage formats: {untyped storage: ACL format}


def npu_format(t) -> int:
    """The ACL format of t's storage: torch_npu's for an NPU tensor, else the twin's record (ND unless ReferenceLayout
    cast it). A format belongs to the storage, as torch_npu keeps it in the NPU storage's description: views and
    detached aliases share it, a copy does not."""
    if t.device.type == "npu" and _torch_npu() is not None:
        return int(_torch_npu().get_npu_format(t))
    return _FORMATS.get(t.untyped_storage(), ACL_FORMAT_ND)


class ReferenceLayout:
    """The CPU twin of torch_npu.npu_format_cast / get_npu_format for the INT8 weight cast: the same contract (a
    new tensor whose storage carries the format, a no-op when the format is already the one asked for) with the
    values kept in their logical [K, N] order, and a count of the casts it made."""

    def __init__(self):
        self.casts = 0

    def npu_format_cast(self, t, fmt):
        if npu_format(t) == fmt:
            return t
        out = t.clone(memory_format=torch.contiguous_format)
        if fmt != ACL_FORMAT_ND:
            _FORMATS[out.untyped_storage()] = fmt
        self.casts += 1
        return out

    @staticmethod
    def get_npu_format(t):
        return npu_format(t)


class _TorchNpuLayout:
    """torch_npu's cast. torch.npu.config.allow_internal_format (default False on A3, True on A2: op-plugin docs,
    torch_npu-npu-config-allow_internal_format.md) forbids allocating a private-format tensor, so it is allowed
    for the cast alone; a cast that still comes back ND is reported and the weight kept as it was."""

    @staticmethod
    def npu_format_cast(t, fmt):
        config = getattr(getattr(torch, "npu", None), "config", None)
        before = getattr(config, "allow_internal_format", None)
        try:
            if config is not None:
                config.allow_internal_format = True
            return _torch_npu().npu_format_cast(t, fmt)
        finally:
            if config is not None and before is not None:
                config.allow_internal_format = before

    @staticmethod
    def get_npu_format(t):
        return int(_torch_npu().get_npu_format(t))


_simulated = None  # (ReferenceLayout, device types that stand for NPUs): tests only


@contextlib.contextmanager
def simulate_layout(twin: ReferenceLayout, device_types=("cpu",)):
    """Within: weights landing on these device types are cast by the twin as on an NPU (tests, on the CPU)."""
    global _simulated
    before, _simulated = _simulated, (twin, frozenset(device_types))
    try:
        yield twin
    finally:
        _simulated = before


def layout_ops_for(device: torch.device):
    """What casts an INT8 weight that lands on `device` to FRACTAL_NZ: torch_npu where its kernels run the arm,
    the twin under simulate_layout(), None elsewhere (the CPU simulation, H3KIT_NPU_INT8=reference or off,
    H3KIT_NPU_INT8_NZ=0)."""
    if os.environ.get(NZ_ENV, "").strip() == "0":
        return None
    if _simulated is not None and device.type in _simulated[1]:
        return _simulated[0] if kernels_for(device) is not None else None
    if device.type == "npu" and _torch_npu() is not None and kernels_for(device) is _torch_npu():
        return _TorchNpuLayout
    return None


class NpuNzINT8Layout(TensorWiseINT8Layout):
    """TensorWiseINT8Layout with its int8 data stored [K, N] (FRACTAL_NZ on an NPU): the weight as the kernels take
    it. Logically the same tensor: shape [N, K], dequantize() and state_dict_tensors() give upstream's [N, K]."""

    @classmethod
    def get_logical_shape_from_storage(cls, storage_shape):
        return tuple(reversed(storage_shape))

    @classmethod
    def quantize(cls, *args, **kwargs):
        qdata, params = TensorWiseINT8Layout.quantize(*args, **kwargs)
        return qdata.t().contiguous(), params

    @classmethod
    def dequantize(cls, qdata, params):
        return TensorWiseINT8Layout.dequantize(qdata.t().contiguous(), params)

    @classmethod
    def state_dict_tensors(cls, qdata, params):
        return TensorWiseINT8Layout.state_dict_tensors(qdata.t().contiguous(), params)


def _is_int8_weight(t) -> bool:
    return (isinstance(t, QuantizedTensor) and t._layout_cls in ("TensorWiseINT8Layout", NZ_LAYOUT)
            and not getattr(t._params, "transposed", False) and t._qdata.dtype == torch.int8 and t._qdata.dim() == 2)


def _owns_storage(t) -> bool:
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def landed(param):
    """The parameter a module keeps after a move: an INT8 weight on a device whose kernels take FRACTAL_NZ is cast
    once, here, ([N, K] -> [K, N] -> NZ) and the result replaces it (the ND copy goes when the caller drops it);
    anything else, or a weight already in NZ, is returned as it is. Called by comfy.ops._quantized_apply."""
    if not _is_int8_weight(param):
        return param
    q = param._qdata
    ops = layout_ops_for(q.device)
    if ops is None or ops.get_npu_format(q) == ACL_FORMAT_FRACTAL_NZ or max(q.shape) > MAX_DIM or not _owns_storage(q):
        return param
    if load_mode(getattr(param._params, "convrot", False)) != W8A8:  # W8A16 takes no NZ weight in eager mode
        with _stats_lock:
            _layout_stats["nd_for_w8a16"] += 1
        return param
    kn = q if param._layout_cls == NZ_LAYOUT else q.t().contiguous()
    nz = ops.npu_format_cast(kn, ACL_FORMAT_FRACTAL_NZ)
    del kn
    if ops.get_npu_format(nz) != ACL_FORMAT_FRACTAL_NZ:
        with _stats_lock:
            _layout_stats["kept_nd"] += 1
        _log_once(("nz", "kept"), f"NPU INT8: npu_format_cast to FRACTAL_NZ returned format {ops.get_npu_format(nz)} "
                                  f"on {q.device}; INT8 weights stay ND ({NZ_ENV}=0 skips the attempt)")
        return param
    with _stats_lock:
        _layout_stats["casts"] += 1
    _log_once(("nz", q.device.type), f"NPU INT8: INT8 weights on {q.device.type} are cast once to FRACTAL_NZ [K, N] "
                                     f"as they load ({NZ_ENV}=0 keeps them ND; docs/int8.md)")
    return QuantizedTensor(nz, NZ_LAYOUT, param._params)


def layout_stats() -> dict:
    """{"casts": weights cast to NZ so far, "kept_nd": casts that came back ND, "nd_for_w8a16": weights left ND
    because their layer runs W8A16} and how the kernels received their
    weights ({"npu_quant_matmul/nz/plain": n, ...}; counted by the reference kernels)."""
    with _stats_lock:
        return {"casts": _layout_stats["casts"], "kept_nd": _layout_stats["kept_nd"],
                "nd_for_w8a16": _layout_stats["nd_for_w8a16"],
                "x2": dict(sorted(_x2_stats.items()))}


def _log_once(key, message):
    with _stats_lock:
        first = key not in _logged
        _logged.add(key)
    if first:
        logging.info(message)


def _nz_call(x, weight, bias, out_dtype, transposed: bool):
    """x @ W.T (+ bias) for an NpuNzINT8Layout weight W: the arm with the [K, N] data as it is (no copy, no cast).
    `transposed`: whether the weight arrives as W.t() (F.linear reaches a QuantizedTensor as t() then mm/addmm)."""
    if not (isinstance(weight, QuantizedTensor) and weight._layout_cls == NZ_LAYOUT
            and bool(getattr(weight._params, "transposed", False)) == transposed) or isinstance(bias, QuantizedTensor):
        return None
    if isinstance(x, QuantizedTensor):
        x = x.dequantize()
    p = weight._params
    if kernels_for(x.device) is None or max(weight._qdata.shape) > MAX_DIM:  # arm off since the cast: upstream math
        w = weight.dequantize().to(x.dtype)
        return torch.nn.functional.linear(x, w.t() if transposed else w, bias)
    return int8_linear(x.contiguous(), weight._qdata, p.scale, bias, out_dtype or x.dtype,
                       getattr(p, "convrot", False), getattr(p, "convrot_groupsize", 256), weight_kn=True)


def _nz_linear(qt, args, kwargs):
    out = _nz_call(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"), kwargs.get("out_dtype"), False)
    return out if out is not None else torch.nn.functional.linear(*dequantize_args(args), **dequantize_args(kwargs))


def _nz_mm(qt, args, kwargs):
    out = _nz_call(args[0], args[1], None, kwargs.get("out_dtype"), True)
    return out if out is not None else torch.mm(*dequantize_args(args), **dequantize_args(kwargs))


def _nz_addmm(qt, args, kwargs):
    out = None
    if len(args) == 3 and kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1:
        out = _nz_call(args[1], args[2], args[0], kwargs.get("out_dtype"), True)
    return out if out is not None else torch.addmm(*dequantize_args(args), **dequantize_args(kwargs))


def _nz_transpose(qt, args, kwargs):
    """t() flips the logical shape and the `transposed` flag, the data stays (upstream's rule for INT8)."""
    t = args[0]
    old = t._params
    params = dataclasses.replace(old, orig_shape=(old.orig_shape[1], old.orig_shape[0]), transposed=not old.transposed)
    return QuantizedTensor(t._qdata, NZ_LAYOUT, params)


def _dequantized_op(func):
    def handler(qt, args, kwargs):
        return func(*dequantize_args(args), **dequantize_args(kwargs))
    return handler


def register_layout():
    """Make NpuNzINT8Layout a comfy-kitchen layout: F.linear (t, then mm or addmm) runs the arm on the [K, N]
    weight as TensorWiseINT8Layout's handlers do on [N, K]; any other op goes through dequantize()."""
    import comfy_kitchen.tensor.base as ck_base
    register_layout_class(NZ_LAYOUT, NpuNzINT8Layout)
    for op, handlers in list(ck_base._LAYOUT_DISPATCH_TABLE.items()):
        if TensorWiseINT8Layout in handlers:
            handlers[NpuNzINT8Layout] = _dequantized_op(op)
    for op, handler in ((torch.ops.aten.linear.default, _nz_linear), (torch.ops.aten.mm.default, _nz_mm),
                        (torch.ops.aten.addmm.default, _nz_addmm), (torch.ops.aten.t.default, _nz_transpose)):
        ck_base.register_layout_op(op, NpuNzINT8Layout)(handler)


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


def load_mode(convrot: bool, environ=None) -> str:
    """The mode a layer's weight is laid out for when it lands (FRACTAL_NZ for W8A8 only: op-plugin's
    npu_weight_quant_batchmatmul takes no NZ weight outside graph mode). What is known at load: a forced mode, and
    ConvRot. A ConvRot layer runs W8A8 (down projections included); a non-ConvRot one may be a down projection, which
    runs W8A16 (linear_mode), and a load cannot tell which, so non-ConvRot weights stay ND (W8A8 takes an ND weight
    as a transposed view)."""
    forced = (os.environ if environ is None else environ).get(LINEAR_ENV, "").strip().lower()
    if forced in (W8A8, W8A16):
        return forced
    return W8A8 if convrot else W8A16


def int8_linear(x, weight, weight_scale, bias=None, out_dtype=torch.bfloat16, convrot=False, convrot_groupsize=256,
                input_act=None, weight_kn=False):
    """comfy-kitchen's int8_linear on the NPU kernels: [..., K] activations, int8 [N, K] -> [..., N] out_dtype.

    As upstream: input_act (an MLP's activation) is applied first, then the ConvRot rotation in x's dtype;
    the activations then go to the kernels in bf16/fp16. weight_kn: the weight is already [K, N] (an
    NpuNzINT8Layout weight, FRACTAL_NZ on an NPU) and goes to the kernels as it is; otherwise the kernels get
    the [N, K] weight's transposed view (transposeX2 true).
    """
    ops = kernels_for(x.device)
    if input_act not in (None, "none"):
        x = _input_act(x, input_act)
    if convrot:
        x = _rotate_activation(x, _build_hadamard(convrot_groupsize, device=x.device, dtype=x.dtype), convrot_groupsize)
    shape = x.shape
    weight = weight.to(device=x.device)
    w_kn = weight if weight_kn else weight.t()
    n = w_kn.shape[1]
    kdtype = x.dtype if x.dtype in KERNEL_DTYPES else torch.bfloat16
    x2 = x.reshape(-1, shape[-1]).to(kdtype)
    scale = weight_scale.to(device=x.device, dtype=torch.float32).reshape(-1)
    # a weight cast to FRACTAL_NZ was cast for W8A8 (load_mode) and runs it at any row count: W8A16 takes no NZ weight
    nz = weight_kn and npu_format(w_kn) == ACL_FORMAT_FRACTAL_NZ
    mode = W8A8 if nz else linear_mode(x2.shape[0], input_act, convrot)
    if mode == W8A8:
        x8, token_scale = ops.npu_dynamic_quant(x2)
        out = ops.npu_quant_matmul(x8, w_kn, scale, pertoken_scale=token_scale,
                                   bias=None if bias is None else bias.to(device=x.device, dtype=torch.float32),
                                   output_dtype=kdtype)
    else:
        bias_dtype = torch.float32 if kdtype == torch.bfloat16 else kdtype  # the kernel's rule for bias
        out = ops.npu_weight_quant_batchmatmul(x2, w_kn, scale.to(kdtype),
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
    register_layout()
    order = getattr(registry, "_priority", ["cuda", "triton", "eager"])
    registry.set_priority([BACKEND] + [b for b in order if b != BACKEND])
