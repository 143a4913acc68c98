"""Time the sequence-parallel H3 DiT forward on 1 and N devices, side by side, and calibrate the cost model.

    python benchmarks/multinpu_dit_forward.py --comfy-home TREE [--device-type cpu|npu|cuda]
        [--npu-count 1,2,4] [--size small|real] [--blocks K] [--width W --height H --frames F]
        [--text-tokens T] [--dtype fp32|bf16] [--repeats R] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches. It builds a MiniMax H3
DiT with the upstream class and random weights (K blocks; --size real is the real width: hidden 5376,
56x128 heads, ffn 14336; small is hidden 512, 8x64 heads, ffn 1024), sets it up with
comfy.multinpu_dit.apply_sequence_parallel exactly as the node does, loads the replicas through
comfy.model_management, and times direct DiT forwards on a t2va input of the given geometry. For each
device count it prints seconds per forward (median of R after one warm-up), the effective TFLOP/s per
device against the cost model's FLOPs (the number `h3kit plan --tflops` takes), the bytes moved
against the cost model, and max_rel against the 1-device output (parity beside every timing).

On the CPU simulation every "device" shares the host's cores: the timings there are no speed claim for
real devices (at small sizes, ranks in parallel threads mostly overlap per-op overhead). On NPU/CUDA, K = 2 blocks at the real
width and --width 1344 --height 768 --frames 124 is the calibration run the plan asks for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toolkit"))
from h3kit.runtime import costmodel  # noqa: E402  (pure Python)

SIZES = {
    "small": dict(hidden_size=512, num_attention_heads=8, attention_head_dim=64, ffn_hidden_size=1024,
                  text_dim=256, time_embed_hidden_size=512, time_embed_dim=256, timestep_input_dim=256),
    "real": dict(hidden_size=5376, num_attention_heads=56, attention_head_dim=128, ffn_hidden_size=14336,
                 text_dim=5120, time_embed_hidden_size=5376, time_embed_dim=2688, timestep_input_dim=256),
}


def build(args, torch):
    import comfy.ldm.minimax.model
    import comfy.ops
    import comfy.sd
    # rotary dims 6 x len fit the head: 96 of 128 at the real width, as in H3
    dims = dict(SIZES[args.size], num_layers=args.blocks, token_refiner_num_layers=1,
                rope_inv_freq_len=SIZES[args.size]["attention_head_dim"] // 8)
    proto = comfy.ldm.minimax.model.MiniMaxH3Model(**dims, operations=comfy.ops.disable_weight_init,
                                                   device="meta", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in proto.state_dict().items():
        if k.endswith("inv_freq"):
            t = 1.0 / (10000.0 ** (torch.arange(v.shape[0], dtype=torch.float32) / v.shape[0]))
        elif v.dim() == 1:
            t = (1.0 if "norm" in k else 0.0) + 0.02 * torch.randn(v.shape, generator=g)
        else:
            t = torch.randn(v.shape, generator=g) / v.shape[-1] ** 0.5
        sd[k] = t
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": dtype})
    return patcher, dims


def inputs(args, dims, torch, device):
    seq = costmodel.packed_sequence(args.width, args.height, args.frames, args.text_tokens)
    lt, lh, lw = seq["latent"]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn((1, 24, lt, lh, lw), generator=g).to(device),
         torch.randn((1, 32, 2, seq["audio_latents"]), generator=g).to(device)]
    ctx = torch.randn((1, args.text_tokens, dims["hidden_size"]), generator=g)  # already refined: skips the refiner
    return x, ctx.to(device), seq["seq_len"]


def forward(patcher, x, ctx, torch):
    import comfy.patcher_extension
    to = comfy.patcher_extension.copy_nested_dicts(patcher.model_options["transformer_options"])
    to["wrappers"] = comfy.patcher_extension.copy_nested_dicts(patcher.wrappers)
    dtype = patcher.model.get_dtype_inference() if hasattr(patcher.model, "get_dtype_inference") else torch.float32
    with torch.no_grad():
        return patcher.model.diffusion_model(x, torch.tensor([500.0], device=x[0].device), ctx.to(dtype),
                                             transformer_options=to, minimax_payload={})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", default="1,2")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--height", type=int, default=256)
    ap.add_argument("--frames", type=int, default=22)
    ap.add_argument("--text-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.npu_count.split(",")]
    sys.path.insert(0, args.comfy_home)
    os.chdir(args.comfy_home)
    if args.device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(max(counts))
    import comfy.cli_args
    comfy.cli_args.args.cpu = args.device_type == "cpu"
    import torch
    import comfy.model_management
    import comfy.multidevice
    import comfy.multinpu_dit

    base, dims = build(args, torch)
    cfg = dict(costmodel.H3, blocks=args.blocks, hidden=dims["hidden_size"], heads=dims["num_attention_heads"],
               head_dim=dims["attention_head_dim"], ffn=dims["ffn_hidden_size"])
    x, ctx, seq_len = inputs(args, dims, torch, base.load_device)
    results, reference = [], None
    for n in counts:
        m = base
        if n > 1:
            m = comfy.multinpu_dit.apply_sequence_parallel(base, comfy.multidevice.devices_for(base.load_device, n))
        comfy.model_management.load_models_gpu([m] + m.get_nested_additional_models(), force_full_load=True)
        forward(m, x, ctx, torch)  # warm-up: kernels, caches, worker threads
        times, out = [], None
        wrapper = comfy.multinpu_dit.get_wrapper(m)
        moved0 = wrapper.bytes_moved if wrapper else 0
        for _ in range(args.repeats):
            for d in comfy.multidevice.get_devices()[:n]:
                comfy.multidevice.synchronize(d)
            t0 = time.perf_counter()
            out = forward(m, x, ctx, torch)
            for d in comfy.multidevice.get_devices()[:n]:
                comfy.multidevice.synchronize(d)
            times.append(time.perf_counter() - t0)
        flat = torch.cat([o.float().flatten().cpu() for o in out])
        if reference is None:
            reference = flat
        max_rel = ((flat - reference).abs().max() / reference.abs().max()).item()
        sec = statistics.median(times)
        flops = costmodel.flops_per_device(seq_len, n, cfg)["total"]
        ex = costmodel.exchange_elements(seq_len, n, hidden=cfg["hidden"], heads=cfg["heads"], head_dim=cfg["head_dim"],
                                         blocks=cfg["blocks"])
        moved = ((wrapper.bytes_moved - moved0) // args.repeats) if wrapper else 0
        results.append({"npu_count": n, "seconds_per_forward": sec, "speedup": None, "tflops_per_device": flops / sec / 1e12,
                        "bytes_moved_per_forward": moved, "bytes_model": ex["total"] * (4 if args.dtype == "fp32" else 2),
                        "max_rel_vs_1": max_rel, "attention": ex["attention"]})
        if wrapper is not None:
            wrapper.runtime.shutdown()
        comfy.model_management.unload_all_models()
    for r in results:
        r["speedup"] = results[0]["seconds_per_forward"] / r["seconds_per_forward"]
    report = {"size": args.size, "blocks": args.blocks, "dtype": args.dtype, "device_type": args.device_type,
              "geometry": f"{args.width}x{args.height}x{args.frames}", "seq_len": seq_len, "results": results}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"H3 DiT {args.size} ({dims['hidden_size']} hidden, {dims['num_attention_heads']}x{dims['attention_head_dim']} heads), "
          f"{args.blocks} blocks, {args.dtype}, {args.device_type}, {report['geometry']} -> S = {seq_len}")
    print(f"{'devices':>7} {'s/forward':>10} {'speedup':>8} {'TFLOP/s/dev':>12} {'bytes moved':>12} {'model':>12} {'max_rel':>9}  attention")
    for r in results:
        print(f"{r['npu_count']:>7} {r['seconds_per_forward']:>10.4f} {r['speedup']:>8.2f} {r['tflops_per_device']:>12.4f} "
              f"{r['bytes_moved_per_forward']:>12} {r['bytes_model']:>12} {r['max_rel_vs_1']:>9.2e}  {r['attention']}")
    if args.device_type == "cpu":
        print("cpu: the simulated devices share the host's cores, so these timings are no speed claim for "
              "real devices; they show the path runs, moves what the model predicts, and stays exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
