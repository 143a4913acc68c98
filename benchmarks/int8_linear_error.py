"""Error of the NPU INT8 arm against upstream's dequantized result, per layer of an INT8 H3 DiT.

    python benchmarks/int8_linear_error.py --comfy-home TREE [--hidden 1024] [--ffn 4096] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches (h3kit install). It builds a
random-weight H3 DiT (2 blocks and 1 text-refiner block at the given widths, 8 heads of 128), quantizes its
block linears as the published H3 INT8 files are (int8_tensorwise, per-channel scales, ConvRot in groups of
256), loads it with comfy.sd's loader, runs one t2va forward (32 text tokens, 5 latent frames of 16x16, 5 audio
latents) on 4 simulated devices' worth of CPU, where comfy/npu_quant.py runs the reference of the NPU kernels,
and compares every INT8 linear with upstream's own dequantized result (F.linear with weight.dequantize(), in
float64):

- arm_bf16: the arm on bf16 activations, as H3 computes on an NPU (W8A8: npu_dynamic_quant + npu_quant_matmul;
  W8A16: npu_weight_quant_batchmatmul);
- w8a16_bf16: the same with every layer forced to W8A16 (H3KIT_NPU_INT8_LINEAR=w8a16);
- pin_eager: the pin's own eager int8_linear (W8A8, fp32), for scale.

It also measures W8A8 on each MLP down projection quantized without ConvRot, the case the per-layer choice
sends to W8A16. Figures are rel_rms = rms(error) / rms(reference). The kernels are the reference, not
measured on an NPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"


def _setup(comfy_home):
    sys.path.insert(0, str(TOOLKIT))
    sys.path.insert(0, comfy_home)
    os.chdir(comfy_home)
    os.environ["H3KIT_SIM_DEVICES"] = "4"
    for var in ("H3KIT_NPU_INT8", "H3KIT_NPU_INT8_LINEAR"):
        os.environ.pop(var, None)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401


def measure(hidden: int, ffn: int) -> dict:
    import torch

    import comfy.npu_quant as nq
    import comfy.quant_ops
    import comfy.sd
    from h3kit import tiny_models
    from h3kit.runtime import int8_probe

    dims = dict(hidden_size=hidden, num_layers=2, token_refiner_num_layers=1, num_attention_heads=8,
                attention_head_dim=128, ffn_hidden_size=ffn, text_dim=256, timestep_input_dim=256,
                time_embed_hidden_size=hidden, time_embed_dim=hidden // 2, rope_inv_freq_len=16)
    sd = tiny_models.int8_state_dict(tiny_models.dit_state_dict(7, dims), convrot_groupsize=256)
    dm = comfy.sd.load_diffusion_model_state_dict(sd).model.diffusion_model
    g = torch.Generator().manual_seed(7)

    def forward():
        ctx = dm.preprocess_text_embeds(torch.randn(1, 32, 256, generator=g))
        dm([torch.randn(1, 24, 5, 32, 32, generator=g), torch.randn(1, 32, 2, 5, generator=g)],
           torch.tensor([500.0]), ctx, transformer_options={}, minimax_payload={})

    calls = int8_probe.record_calls(dm, forward)
    rows = int8_probe.layer_errors(dm, calls)
    plain = []
    try:
        os.environ[nq.LINEAR_ENV] = nq.W8A16  # every layer weight-only too, for comparison
        for row, (name, kwargs, _) in zip(rows, calls):
            xb = kwargs["x"].to(torch.bfloat16)
            out = nq.int8_linear(**dict(kwargs, x=xb, out_dtype=torch.bfloat16))
            row["w8a16_bf16"] = int8_probe.errors(out, int8_probe.dequantized(dm.get_submodule(name).weight, xb,
                                                                               kwargs.get("input_act")))
        os.environ[nq.LINEAR_ENV] = nq.W8A8
        for name, kwargs, _ in calls:
            if kwargs.get("input_act") != "swiglu":
                continue
            w = dm.get_submodule(name).weight.dequantize().float()
            qt = comfy.quant_ops.QuantizedTensor.from_float(w, "TensorWiseINT8Layout", per_channel=True)
            x = kwargs["x"].to(torch.bfloat16)
            out = nq.int8_linear(x, qt._qdata, qt._params.scale, None, torch.bfloat16, False, 256, "swiglu")
            plain.append({"layer": name, **int8_probe.errors(out, int8_probe.dequantized(qt, x, "swiglu"))})
    finally:
        os.environ.pop(nq.LINEAR_ENV)
    return {"dims": dims, "rows": rows, "down_projection_w8a8_without_convrot": plain}


def _range(values):
    return f"{min(values):.2e} - {max(values):.2e}" if values else "-"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    _setup(args.comfy_home)
    result = measure(args.hidden, args.ffn)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"INT8 H3 DiT, hidden {args.hidden}, ffn {args.ffn}, ConvRot 256; rel_rms against upstream's dequantized result")
    print(f"{'layer':38} {'mode':6} {'rows':>5} {'K':>6} {'N':>6} {'arm_bf16':>10} {'cos':>10} {'w8a16_bf16':>10} "
          f"{'pin_eager':>10}")
    for r in result["rows"]:
        print(f"{r['layer']:38} {r['mode']:6} {r['rows']:>5} {r['k']:>6} {r['n']:>6} {r['arm_bf16']['rel_rms']:>10.2e} "
              f"{r['arm_bf16']['cos']:>10.7f} {r['w8a16_bf16']['rel_rms']:>10.2e} {r['pin_eager']['rel_rms']:>10.2e}")
    rows = result["rows"]
    print(f"arm (as chosen, {', '.join(sorted({r['mode'] for r in rows}))}): {_range([r['arm_bf16']['rel_rms'] for r in rows])}; "
          f"every layer W8A16: {_range([r['w8a16_bf16']['rel_rms'] for r in rows])}; "
          f"pin eager W8A8: {_range([r['pin_eager']['rel_rms'] for r in rows])} ({len(rows)} layers)")
    plain = result["down_projection_w8a8_without_convrot"]
    print(f"down projections quantized without ConvRot, W8A8: {_range([r['rel_rms'] for r in plain])} "
          "(the per-layer choice runs these W8A16)")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
