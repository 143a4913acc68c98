"""Parity of the sequence-parallel H3 DiT against one device, run inside the ComfyUI interpreter.

    python parity_worker.py --comfy-home DIR [--component dit] --device-type cpu|npu|cuda --npu-count N
                            --out FILE [--inject-fault] [--layouts t2va,fl2va,ref2va] [--steps K] [--timeout S]

`h3kit parity` starts this script with the interpreter that runs ComfyUI; it imports nothing from
h3kit (that interpreter may not have it). It uses the patched tree's own code end to end:
- a tiny MiniMax H3 DiT built with the upstream class, random weights, saved with safetensors and
  loaded back through comfy.sd.load_diffusion_model (model detection reads every dimension);
- the MultiNPUParallelConfig node (validate_inputs, then execute) for the parallel model;
- real sampling (comfy.sample.sample: prepare_sampling loads the replicas, extra_conds builds the
  packed layout, CFG runs cond and uncond as separate forwards).
A capture wrapper, outermost in the DIFFUSION_MODEL chain, records the DiT's [video, audio] output of
every forward; the rows compare them forward by forward. Tiny dims are chosen so no layout's packed
length divides by 2 or 4. --inject-fault drops the last rank's shard from the all-gathers, which must
fail the gate. The JSON written to --out: {"ok", "rows": [...], "config": {...}} or {"ok": false, "error"}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback

# tiny H3: 8 heads (Ulysses for N = 2 and 4, K/V gather forced per row), rotary 6 * 2 = 12 of 16 dims
TINY = dict(hidden_size=64, num_layers=3, token_refiner_num_layers=1, num_attention_heads=8,
            attention_head_dim=16, ffn_hidden_size=128, text_dim=48, timestep_input_dim=32,
            time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=2)
TEXT_LEN = 7
VIDEO_SHAPE = (1, 24, 2, 8, 12)   # latent T=2 (5 frames), 4x6 patches per frame: 48 video tokens
AUDIO_SHAPE = (1, 32, 2, 8)       # 8 audio latents at 40 Hz, stereo: 16 rows
FRAME_COUNT = 5
LAYOUTS = ("t2va", "fl2va", "ref2va")
GATE_MAX_REL = 1e-5
FAULT_NOTE = "last rank's shard left out of every all_gather_v"


def _setup_comfy(comfy_home, device_type, npu_count):
    sys.path.insert(0, comfy_home)
    os.chdir(comfy_home)
    if device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(npu_count)
    import comfy.cli_args
    if device_type == "cpu":
        # before comfy.model_management is imported, or it probes CUDA
        comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401


def _tiny_checkpoint(path, seed):
    import torch
    import comfy.ldm.minimax.model
    import comfy.ops
    import comfy.utils
    model = comfy.ldm.minimax.model.MiniMaxH3Model(**TINY, operations=comfy.ops.manual_cast, device="cpu",
                                                   dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith("inv_freq"):
            n = v.shape[0]
            t = 1.0 / (100.0 ** (torch.arange(n, dtype=torch.float32) / n))
        elif v.dim() == 1 and "norm" in k:
            t = 1.0 + 0.1 * torch.randn(v.shape, generator=g)
        elif v.dim() == 1:
            t = 0.1 * torch.randn(v.shape, generator=g)
        else:  # fan-in scaling keeps activations O(1) through the blocks
            t = torch.randn(v.shape, generator=g) / math.sqrt(v.shape[-1])
        sd[k] = t.to(v.dtype)
    comfy.utils.save_torch_file(sd, path)


def _conditioning(layout, seed):
    """(positive, negative) conditioning as the H3 nodes build it, with random tensors in place of encoders."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g)

    extras = {"minimax_token_tags": torch.tensor([[1, 1, 0, 0, 0, 1, 1]])}  # vision-pad runs inside the text
    if layout == "fl2va":
        lat = VIDEO_SHAPE[3:]
        extras["minimax_keyframes"] = [{"resolved_frame_index": 0, "latent": randn(1, 24, 1, *lat)},
                                       {"resolved_frame_index": FRAME_COUNT - 1, "latent": randn(1, 24, 1, *lat)}]
        extras["minimax_frame_count"] = FRAME_COUNT
    elif layout == "ref2va":
        extras["minimax_refs"] = [
            {"kind": "image", "latent_h": 4, "latent_w": 6, "latent": randn(1, 24, 1, 4, 6)},
            {"kind": "video_audio", "latent_t": 2, "latent_h": 4, "latent_w": 4, "ref_audio_t": 3,
             "latent": randn(1, 24, 2, 4, 4), "audio_latent": randn(1, 32, 2, 3)},
            {"kind": "audio", "ref_audio_t": 2, "audio_latent": randn(1, 32, 2, 2)},
        ]
    positive = [[randn(1, TEXT_LEN, TINY["text_dim"]), dict(extras)]]
    negative = [[randn(1, TEXT_LEN, TINY["text_dim"]), dict(extras)]]
    return positive, negative


class _Capture:
    """Outermost DIFFUSION_MODEL wrapper: keeps a copy of every forward's [video, audio] output."""

    def __init__(self):
        self.outputs = []

    def __call__(self, executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        self.outputs.append([o.detach().float().cpu().clone() for o in out])
        return out


def _prepare(patcher, layout, seed):
    """A clone of patcher with a fresh capture wrapper, and the sampling inputs for `layout`."""
    import comfy.nested_tensor
    import comfy.patcher_extension
    import comfy.sample
    import torch
    positive, negative = _conditioning(layout, seed)
    latent = comfy.nested_tensor.NestedTensor((torch.zeros(VIDEO_SHAPE), torch.zeros(AUDIO_SHAPE)))
    noise = comfy.sample.prepare_noise(latent, seed)
    capture = _Capture()
    m = patcher.clone()
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "h3kit_parity_capture", capture)
    return m, capture, (noise, positive, negative, latent)


def _run(m, capture, inputs, steps, seed):
    import comfy.sample
    noise, positive, negative, latent = inputs
    comfy.sample.sample(m, noise, steps, 2.0, "euler", "simple", positive, negative, latent, seed=seed,
                        disable_pbar=True)
    return capture.outputs


def _metrics(single, parallel):
    import torch
    a = torch.cat([t.flatten() for fwd in single for t in fwd]).double()
    b = torch.cat([t.flatten() for fwd in parallel for t in fwd]).double()
    diff = (b - a).abs()
    peak = a.abs().max().item()
    rms = a.pow(2).mean().sqrt().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    return {"max_abs": diff.max().item(), "max_rel": diff.max().item() / peak if peak else float("inf"),
            "cos": cos, "rel_rms": diff.pow(2).mean().sqrt().item() / rms if rms else float("inf")}


def _inject_fault():
    import comfy.multinpu
    real = comfy.multinpu.all_gather_v

    def dropped(x, comm, sizes=None, dim=0):
        out = real(x, comm, sizes=sizes, dim=dim)
        if comm.world_size > 1 and sizes is not None:
            n = sizes[-1]
            out.narrow(dim, out.shape[dim] - n, n).zero_()
        return out

    comfy.multinpu.all_gather_v = dropped


def run_dit(args):
    _setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multidevice
    import comfy.multinpu_dit
    import comfy.sd
    import comfy_extras.nodes_multinpu as nodes_multinpu

    node = nodes_multinpu.MultiNPUParallelConfigNode
    problem = node.validate_inputs(npu_count=args.npu_count)
    if problem is not True:
        return {"ok": False, "error": {"code": "device_check", "message": problem}}
    if args.inject_fault:
        _inject_fault()
    with tempfile.TemporaryDirectory(prefix="h3kit-parity-") as tmp:
        ckpt = os.path.join(tmp, "tiny_h3_dit.safetensors")
        _tiny_checkpoint(ckpt, args.seed)
        base = comfy.sd.load_diffusion_model(ckpt, model_options={"dtype": torch.float32})
    params = sum(t.numel() for t in base.model.diffusion_model.state_dict().values())
    modes = ("auto", "kv_gather") if args.npu_count > 1 else ("auto",)
    rows = []
    for layout in args.layouts:
        m, capture, inputs = _prepare(base, layout, args.seed)
        t0 = time.perf_counter()
        single = _run(m, capture, inputs, args.steps, args.seed)
        t_single = time.perf_counter() - t0
        for attention in modes:
            m, capture, inputs = _prepare(base, layout, args.seed)
            # the node exactly as a workflow runs it; only the attention mode is forced per row
            m = node.execute(model=m, npu_count=args.npu_count).args[0]
            wrapper = comfy.multinpu_dit.get_wrapper(m)
            if wrapper is not None:
                wrapper.attention = attention
                wrapper.timeout = args.timeout
            t0 = time.perf_counter()
            parallel = _run(m, capture, inputs, args.steps, args.seed)
            t_parallel = time.perf_counter() - t0
            if wrapper is not None and wrapper._threads is not None:
                wrapper._threads.shutdown()
            if len(parallel) != len(single):
                raise RuntimeError(f"{layout}: {len(parallel)} forwards on {args.npu_count} devices, {len(single)} on one")
            heads = TINY["num_attention_heads"]
            used = "none" if args.npu_count == 1 else (
                "ulysses" if attention == "auto" and heads % args.npu_count == 0 else "kv_gather")
            row = {"component": "dit", "layout": layout, "attention": used, "npu_count": args.npu_count,
                   "device_type": args.device_type, "seq_len": _seq_len(layout, args.seed),
                   "forwards": len(parallel), **_metrics(single, parallel),
                   "bytes_moved": wrapper.bytes_moved if wrapper else 0,
                   "parallel_forwards": wrapper.forwards if wrapper else 0,
                   "seconds_single": round(t_single, 4), "seconds_parallel": round(t_parallel, 4)}
            row["pass"] = row["max_rel"] <= GATE_MAX_REL
            rows.append(row)
    config = {"dit": TINY, "params": params, "text_len": TEXT_LEN, "video_latent": VIDEO_SHAPE,
              "audio_latent": AUDIO_SHAPE, "dtype": "float32", "gate": f"max_rel <= {GATE_MAX_REL}",
              "steps": args.steps, "cfg": 2.0,
              "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]],
              "inject_fault": FAULT_NOTE if args.inject_fault else None}
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


COMPONENTS = {"dit": run_dit}


def _seq_len(layout, seed):
    import comfy.ldm.minimax.model
    extras = _conditioning(layout, seed)[0][0][1]
    return comfy.ldm.minimax.model.PackedLayout(
        TEXT_LEN, VIDEO_SHAPE[2], VIDEO_SHAPE[3], VIDEO_SHAPE[4], AUDIO_SHAPE[3],
        keyframes=extras.get("minimax_keyframes"), refs=extras.get("minimax_refs"),
        frame_count=extras.get("minimax_frame_count")).seq_len


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--component", choices=sorted(COMPONENTS), default="dit")
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", type=int, required=True)
    ap.add_argument("--inject-fault", action="store_true")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    try:
        result = COMPONENTS[args.component](args)
        code = 0 if result["ok"] else (2 if "error" in result else 1)
    except Exception as e:
        traceback.print_exc()
        result = {"ok": False, "error": {"code": "worker_failed", "message": f"{type(e).__name__}: {e}"}}
        code = 3
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the report is written; skip interpreter teardown, where torch's static destructors occasionally
    # abort ("terminate called without an active exception") once rank threads have run
    os._exit(code)
