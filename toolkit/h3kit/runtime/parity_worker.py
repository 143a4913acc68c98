"""Parity of the multi-device H3 components against one device, run inside the ComfyUI interpreter.

    python parity_worker.py --comfy-home DIR --component dit|te|vae --device-type cpu|npu|cuda --npu-count N
                            --out FILE [--inject-fault] [--layouts ...] [--steps K] [--timeout S]

`h3kit parity` starts this script with the interpreter that runs ComfyUI; it imports nothing from
h3kit's package (that interpreter may not have it; the tiny model builders are loaded from their file).
It uses the patched tree's own code end to end, and the MultiNPUParallelConfig node (validate_inputs,
then execute) for the parallel side.

dit: a tiny MiniMax H3 DiT built with the upstream class, random weights, saved with safetensors and
loaded back through comfy.sd.load_diffusion_model (model detection reads every dimension), sampled for
real (comfy.sample.sample: prepare_sampling loads the replicas, extra_conds builds the packed layout,
CFG runs cond and uncond as separate forwards). A capture wrapper, outermost in the DIFFUSION_MODEL
chain, records the DiT's [video, audio] output of every forward; the rows compare them forward by
forward. Tiny dims are chosen so no layout's packed length divides by 2 or 4. --inject-fault drops the
last rank's shard from the all-gathers, which must fail the gate. --weights int8 runs the same rows on the
tiny DiT with its block linears in INT8 (ConvRot, as the published H3 INT8 files): both sides run the NPU
INT8 arm (comfy/npu_quant.py; its reference kernels on cpu), and each row also counts the arm's W8A8 and
W8A16 calls, which must be non-zero on both sides.

te and vae: tiny random-weight checkpoints of the Qwen3-VL text encoder and the video and audio VAEs
(h3kit's tiny_models.py) loaded through the loader nodes (CLIPLoader type minimax, VAELoader), with every
weight-file read counted (weight_reads, which must be 1 per file). te encodes a prompt alone (t2va), with
a first-frame image (fl2va: the vision tower and DeepStack) and with image, video and audio references
(ref2va), through the node (tensor parallel) and forced to the layer split; gate cos >= 0.99999 and
rel_rms <= 1e-4 in fp32, every rank's final hidden states identical and the same token tags.
--inject-fault drops the last rank's share of every reduction and corrupts the layer hand-overs. vae
decodes latents of 1 to 27 frames (1 to 5 temporal chunks, 2x2 spatial tiles in one) and an audio
latent; gate max_abs == 0. --inject-fault zeroes every chunk another device decoded.

The JSON written to --out: {"ok", "rows": [...], "config": {...}} or {"ok": false, "error"}.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

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
# INT8 rows: the same gate where the model computes in fp32 (cpu: the kernels' inputs are rounded to bf16 on
# both sides alike, and per-token scales do not depend on the shard); bf16 compute (an NPU) is looser, and
# that figure is provisional until measured on hardware
GATE_MAX_REL_INT8_BF16 = 2e-2
FAULT_NOTE = "last rank's shard left out of every all_gather_v"

TE_LAYOUTS = LAYOUTS
TE_PROMPT = "A red fox trots through fresh snow at dawn, wind hissing through the pines."
TE_GATE_COS = 0.99999
TE_GATE_REL_RMS = 1e-4
TE_FAULT_NOTE = "last rank's share left out of every all_reduce; layer hand-overs and the final broadcast zeroed"
# latent (T, h, w) per row: 1 frame (no chunks), then 1, 2, 4 and 5 temporal chunks; 73f has 2x2 spatial tiles
VAE_LAYOUTS = {"image": (1, 3, 4), "5f": (2, 3, 4), "39f": (12, 3, 4), "73f": (22, 5, 6), "90f": (27, 3, 4)}
VAE_TILES = dict(tile_size=64, tile_overlap_min=32)  # 64 px spatial tiles, so the 80x96 px row is tiled
VAE_FAULT_NOTE = "every chunk decoded on a device other than rank 0's zeroed on its way back"
AUDIO_LATENT_T = 10


def _setup_comfy(comfy_home, device_type, npu_count):
    sys.path.insert(0, comfy_home)
    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # h3kit itself (tiny_models)
    os.chdir(comfy_home)
    if device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(npu_count)
    import comfy.cli_args
    if device_type == "cpu":
        # before comfy.model_management is imported, or it probes CUDA
        comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401


def _tiny_checkpoint(path, seed, weights="float"):
    import comfy.utils

    from h3kit import tiny_models

    # the parity DiT: 3 blocks, and a rotary base of 100 so every rotary dimension turns within the tiny
    # packed sequences (with the model's 10000 most would barely move and a RoPE bug could hide)
    sd = tiny_models.dit_state_dict(seed, TINY, rope_base=100.0)
    comfy.utils.save_torch_file(tiny_models.int8_state_dict(sd) if weights == "int8" else sd, path)


def _int8_calls():
    """Calls of the NPU INT8 arm so far, {"w8a8/reference": n, ...}."""
    import comfy.npu_quant
    return comfy.npu_quant.stats()


def _calls_since(before):
    return {k: v - before.get(k, 0) for k, v in _int8_calls().items() if v - before.get(k, 0)}


def _int8_gate(row, single_calls, parallel_calls, dtype):
    """An INT8 row passes when both sides ran the arm in both modes and the outputs agree."""
    import torch
    modes = lambda calls: {k.split("/")[0] for k in calls}  # noqa: E731
    limit = GATE_MAX_REL if dtype == torch.float32 else GATE_MAX_REL_INT8_BF16
    row.update(int8_calls_single=single_calls, int8_calls_parallel=parallel_calls, gate_max_rel=limit)
    return modes(single_calls) == modes(parallel_calls) == {"w8a8", "w8a16"} and row["max_rel"] <= limit


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
    int8 = args.weights == "int8"
    with tempfile.TemporaryDirectory(prefix="h3kit-parity-") as tmp:
        ckpt = os.path.join(tmp, "tiny_h3_dit.safetensors")
        _tiny_checkpoint(ckpt, args.seed, args.weights)
        base = comfy.sd.load_diffusion_model(ckpt, model_options={} if int8 else {"dtype": torch.float32})
    dtype = base.model.get_dtype_inference()
    if int8:
        import comfy.npu_quant
        if comfy.npu_quant.kernels_for(base.load_device) is None:
            return {"ok": False, "error": {"code": "int8_arm_unavailable", "message": (
                f"the NPU INT8 arm does not run on {base.load_device.type} here (it needs torch_npu on an npu, or the "
                f"CPU simulation); {comfy.npu_quant.MODE_ENV}=reference runs its reference kernels on any device")}}
    params = sum(t.numel() for t in base.model.diffusion_model.state_dict().values() if t.dtype != torch.uint8)
    modes = ("auto", "kv_gather") if args.npu_count > 1 else ("auto",)
    rows = []
    for layout in args.layouts:
        m, capture, inputs = _prepare(base, layout, args.seed)
        calls = _int8_calls() if int8 else {}
        t0 = time.perf_counter()
        single = _run(m, capture, inputs, args.steps, args.seed)
        t_single = time.perf_counter() - t0
        single_calls = _calls_since(calls) if int8 else {}
        for attention in modes:
            m, capture, inputs = _prepare(base, layout, args.seed)
            # the node exactly as a workflow runs it; only the attention mode is forced per row
            m = node.execute(model=m, npu_count=args.npu_count).args[0]
            wrapper = comfy.multinpu_dit.get_wrapper(m)
            if wrapper is not None:
                wrapper.attention = attention
                wrapper.timeout = args.timeout
            calls = _int8_calls() if int8 else {}
            t0 = time.perf_counter()
            parallel = _run(m, capture, inputs, args.steps, args.seed)
            t_parallel = time.perf_counter() - t0
            parallel_calls = _calls_since(calls) if int8 else {}
            if wrapper is not None and wrapper._threads is not None:
                wrapper._threads.shutdown()
            if len(parallel) != len(single):
                raise RuntimeError(f"{layout}: {len(parallel)} forwards on {args.npu_count} devices, {len(single)} on one")
            heads = TINY["num_attention_heads"]
            used = "none" if args.npu_count == 1 else (
                "ulysses" if attention == "auto" and heads % args.npu_count == 0 else "kv_gather")
            row = {"component": "dit", "layout": layout, "attention": used, "npu_count": args.npu_count,
                   "device_type": args.device_type, "weights": args.weights, "seq_len": _seq_len(layout, args.seed),
                   "forwards": len(parallel), **_metrics(single, parallel),
                   "bytes_moved": wrapper.bytes_moved if wrapper else 0,
                   "parallel_forwards": wrapper.forwards if wrapper else 0,
                   "seconds_single": round(t_single, 4), "seconds_parallel": round(t_parallel, 4)}
            row["pass"] = (_int8_gate(row, single_calls, parallel_calls, dtype) if int8
                           else row["max_rel"] <= GATE_MAX_REL)
            rows.append(row)
    config = {"dit": TINY, "params": params, "text_len": TEXT_LEN, "video_latent": VIDEO_SHAPE,
              "audio_latent": AUDIO_SHAPE, "dtype": str(dtype).replace("torch.", ""), "weights": args.weights,
              "gate": (f"max_rel <= {GATE_MAX_REL} (fp32 compute; {GATE_MAX_REL_INT8_BF16} in bf16), the NPU INT8 "
                       "arm's W8A8 and W8A16 calls on both sides" if int8 else f"max_rel <= {GATE_MAX_REL}"),
              "steps": args.steps, "cfg": 2.0,
              "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]],
              "inject_fault": FAULT_NOTE if args.inject_fault else None}
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _tiny_models():
    """h3kit's tiny_models.py, loaded from its file (this interpreter may not have h3kit installed)."""
    path = Path(__file__).resolve().parents[1] / "tiny_models.py"
    spec = importlib.util.spec_from_file_location("h3kit_tiny_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count_reads():
    """Count every weight-file read from now on: {real path: reads} (the loaders all read through load_torch_file)."""
    import comfy.utils
    counts = collections.Counter()
    real = comfy.utils.load_torch_file

    def counted(ckpt, *args, **kwargs):
        counts[os.path.realpath(ckpt)] += 1
        return real(ckpt, *args, **kwargs)

    comfy.utils.load_torch_file = counted
    return counts


def _load_through_nodes(tmp, seed, components, vae_dims=None):
    """Tiny checkpoints of `components` (dit, te, video_vae, audio_vae) written to tmp and loaded by the loader
    nodes, with every weight-file read counted: (loaded, reads, paths, tiny_models)."""
    tiny = _tiny_models()
    files = {c: f"h3kit_parity_{c}.safetensors" for c in components}
    for component, name in files.items():
        tiny.write(component, os.path.join(tmp, name), seed, dims=vae_dims if component == "video_vae" else None)
    import folder_paths
    import nodes
    for folder in ("diffusion_models", "text_encoders", "vae"):
        folder_paths.add_model_folder_path(folder, tmp, is_default=True)
    reads = _count_reads()
    load = {"dit": lambda name: nodes.UNETLoader().load_unet(name, "default")[0],
            "te": lambda name: nodes.CLIPLoader().load_clip(name, type="minimax")[0],
            "video_vae": lambda name: nodes.VAELoader().load_vae(name)[0],
            "audio_vae": lambda name: nodes.VAELoader().load_vae(name)[0]}
    loaded = {c: load[c](name) for c, name in files.items()}
    paths = {c: os.path.realpath(os.path.join(tmp, n)) for c, n in files.items()}
    return loaded, reads, paths, tiny


def _node_or_error(args):
    import comfy_extras.nodes_multinpu as nodes_multinpu
    node = nodes_multinpu.MultiNPUParallelConfigNode
    problem = node.validate_inputs(npu_count=args.npu_count)
    return node, (None if problem is True else {"ok": False, "error": {"code": "device_check", "message": problem}})


def _te_tokens(clip, layout, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    image = torch.rand(1, 64, 64, 3, generator=g)
    if layout == "t2va":
        return clip.tokenize(TE_PROMPT)
    if layout == "fl2va":
        return clip.tokenize(TE_PROMPT, images=[image])
    frames = torch.rand(3, 64, 64, 3, generator=g)  # 3 frames at 2 fps: padded to two 2-frame video blocks
    return clip.tokenize(TE_PROMPT, minimax_ref_items=[{"type": "image", "data": image},
                                                      {"type": "video", "data": frames}, {"type": "audio"}])


def _encode(clip, layout, seed):
    out = clip.encode_from_tokens_scheduled(_te_tokens(clip, layout, seed))
    return out[0][0].detach().float().cpu(), out[0][1]["minimax_token_tags"]


def _inject_te_fault(npu_count):
    import comfy.multinpu
    all_reduce, broadcast, peer_copy = comfy.multinpu.all_reduce, comfy.multinpu.broadcast, comfy.multinpu.peer_copy

    def dropped_reduce(x, comm):
        return all_reduce(x * 0 if comm.rank == comm.world_size - 1 else x, comm)

    def zeroed_broadcast(x, comm, src=0):
        out = broadcast(x, comm, src)
        return out if comm.rank == src else out * 0

    def zeroed_copy(x, comm, src, dst):
        out = peer_copy(x, comm, src, dst)
        return out * 0 if comm.rank == dst and dst != src else out

    comfy.multinpu.all_reduce, comfy.multinpu.broadcast, comfy.multinpu.peer_copy = dropped_reduce, zeroed_broadcast, zeroed_copy


def _inject_vae_fault():
    import comfy.multinpu_vae
    fetch = comfy.multinpu_vae.fetch_chunk

    def zeroed(chunk, device, src_rank):
        out = fetch(chunk, device, src_rank)
        return out * 0 if src_rank != 0 else out

    comfy.multinpu_vae.fetch_chunk = zeroed


def _config(args, tiny, extra):
    import comfy.multidevice
    return {"dtype": "float32", "seed": args.seed,
            "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]], **extra}


def run_te(args):
    _setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multidevice
    import comfy.multinpu_te
    node, error = _node_or_error(args)
    if error:
        return error
    if args.inject_fault:
        _inject_te_fault(args.npu_count)
    with tempfile.TemporaryDirectory(prefix="h3kit-parity-") as tmp:
        loaded, reads, paths, tiny = _load_through_nodes(tmp, args.seed, ("dit", "te"))
    clip = loaded["te"]
    layouts = [x for x in args.layouts if x in TE_LAYOUTS] or list(TE_LAYOUTS)
    single = {}
    for layout in layouts:
        t0 = time.perf_counter()
        single[layout] = _encode(clip, layout, args.seed) + (time.perf_counter() - t0,)
    variants = [("node", node.execute(model=loaded["dit"], npu_count=args.npu_count, clip=clip).args[1])]
    if args.npu_count > 1:
        devices = comfy.multidevice.devices_for(clip.patcher.load_device, args.npu_count)
        variants.append(("layers", comfy.multinpu_te.apply_tensor_parallel(clip, devices, mode="layers")))
    rows = []
    for via, par in variants:
        runner = comfy.multinpu_te.get_runner(par)
        if runner is not None:
            runner.timeout = args.timeout
            runner.keep_rank_outputs = True
        for layout in layouts:
            before = runner.bytes_moved if runner else 0
            t0 = time.perf_counter()
            out, tags = _encode(par, layout, args.seed)
            seconds = time.perf_counter() - t0
            ref, ref_tags, t_single = single[layout]
            spread = 0.0
            if runner is not None:
                # torch.equal is False on a NaN (a Python max() over floats would skip it)
                spread = 0.0 if all(torch.equal(o, runner.rank_outputs[0]) for o in runner.rank_outputs) else \
                    float(torch.stack([(o.float() - runner.rank_outputs[0].float()).abs().max()
                                       for o in runner.rank_outputs]).nan_to_num(nan=float("inf")).max())
            row = {"component": "te", "layout": layout, "mode": runner.mode if runner else "none",
                   "npu_count": args.npu_count, "device_type": args.device_type, "tokens": int(ref.shape[1]),
                   **_metrics([[ref]], [[out]]), "rank_spread": spread, "tags_equal": bool(torch.equal(tags, ref_tags)),
                   "weight_reads": reads[paths["te"]], "bytes_moved": (runner.bytes_moved - before) if runner else 0,
                   "seconds_single": round(t_single, 4), "seconds_parallel": round(seconds, 4)}
            # with 2 or 4 devices the row must really have run split: a node that passed the text encoder
            # through on one device would compare a model with itself and pass every other test
            split = args.npu_count == 1 or (row["mode"] != "none" and row["bytes_moved"] > 0)
            row["split"] = split
            row["pass"] = (split and row["cos"] >= TE_GATE_COS and row["rel_rms"] <= TE_GATE_REL_RMS
                           and row["rank_spread"] == 0 and row["tags_equal"] and row["weight_reads"] == 1)
            rows.append(row)
        if runner is not None and runner._threads is not None:
            runner._threads.shutdown()
    te = tiny.TINY_TE
    config = _config(args, tiny, {"te": {k: te[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                             "num_attention_heads", "num_key_value_heads")},
                                  "gate": f"cos >= {TE_GATE_COS}, rel_rms <= {TE_GATE_REL_RMS}, rank_spread == 0, "
                                          "same token tags, weight_reads == 1",
                                  "reads": {c: reads[p] for c, p in paths.items()},
                                  "inject_fault": TE_FAULT_NOTE if args.inject_fault else None})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def run_vae(args):
    _setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multinpu_vae
    node, error = _node_or_error(args)
    if error:
        return error
    if args.inject_fault:
        _inject_vae_fault()
    with tempfile.TemporaryDirectory(prefix="h3kit-parity-") as tmp:
        loaded, reads, paths, tiny = _load_through_nodes(tmp, args.seed, ("dit", "video_vae", "audio_vae"),
                                                       vae_dims=VAE_TILES)
    vae, audio_vae = loaded["video_vae"], loaded["audio_vae"]
    out = node.execute(model=loaded["dit"], npu_count=args.npu_count, vae=vae, audio_vae=audio_vae).args
    par_vae, par_audio = out[2], out[3]
    runner = comfy.multinpu_vae.get_runner(par_vae)
    if runner is not None:
        runner.timeout = args.timeout
    g = torch.Generator().manual_seed(args.seed)
    layouts = [x for x in args.layouts if x in VAE_LAYOUTS] or list(VAE_LAYOUTS)
    rows = []
    for layout in layouts:
        t, h, w = VAE_LAYOUTS[layout]
        z = torch.randn(1, 24, t, h, w, generator=g)
        t0 = time.perf_counter()
        single = vae.decode(z)
        t1 = time.perf_counter()
        before = (runner.bytes_moved, runner.chunks) if runner else (0, 0)
        parallel = par_vae.decode(z)
        t2 = time.perf_counter()
        row = {"component": "vae", "layout": layout, "latent": [t, h, w], "npu_count": args.npu_count,
               "device_type": args.device_type, "frames": int(single.shape[1]),
               "chunks": (runner.chunks - before[1]) if runner else 0,
               "chunk_ranks": list(runner.chunk_ranks) if runner and t > 1 else [],
               **_metrics([[single]], [[parallel]]), "weight_reads": reads[paths["video_vae"]],
               "bytes_moved": (runner.bytes_moved - before[0]) if runner else 0,
               "seconds_single": round(t1 - t0, 4), "seconds_parallel": round(t2 - t1, 4)}
        # several chunks on several devices must really have been spread (else the node passed the VAE through)
        split = args.npu_count == 1 or (runner is not None and (row["chunks"] < 2 or any(row["chunk_ranks"])))
        row["split"] = split
        row["pass"] = (split and row["max_abs"] == 0 and tuple(single.shape) == tuple(parallel.shape)
                       and row["weight_reads"] == 1)
        rows.append(row)
    # the audio VAE stays on one device in fp32: the node must hand back the one it got
    za = torch.randn(1, 32, 2, AUDIO_LATENT_T, generator=g)
    t0 = time.perf_counter()
    a_single = audio_vae.decode(za)
    t1 = time.perf_counter()
    a_par = par_audio.decode(za)
    t2 = time.perf_counter()
    row = {"component": "vae", "layout": "audio", "latent": [2, AUDIO_LATENT_T], "npu_count": args.npu_count,
           "device_type": args.device_type, "frames": int(a_single.shape[1]), "chunks": 0, "chunk_ranks": [],
           **_metrics([[a_single]], [[a_par]]), "weight_reads": reads[paths["audio_vae"]], "bytes_moved": 0,
           "dtype": str(par_audio.vae_dtype).replace("torch.", ""), "split": False,  # one device, by design
           "seconds_single": round(t1 - t0, 4), "seconds_parallel": round(t2 - t1, 4)}
    row["pass"] = (row["max_abs"] == 0 and row["weight_reads"] == 1 and par_audio.vae_dtype == torch.float32
                   and comfy.multinpu_vae.get_runner(par_audio) is None)
    rows.append(row)
    if runner is not None and runner._threads is not None:
        runner._threads.shutdown()
    config = _config(args, tiny, {"video_vae": dict(tiny.TINY_VIDEO_VAE, **VAE_TILES), "gate": "max_abs == 0, weight_reads == 1",
                                  "reads": {c: reads[p] for c, p in paths.items()},
                                  "inject_fault": VAE_FAULT_NOTE if args.inject_fault else None})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


COMPONENTS = {"dit": run_dit, "te": run_te, "vae": run_vae}


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
    ap.add_argument("--weights", choices=("float", "int8"), default="float", help="dit: the tiny DiT's weights")
    ap.add_argument("--layouts", default="", help="comma-separated rows to run (default: all of the component's)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    if args.component == "dit":
        args.layouts = args.layouts or list(LAYOUTS)
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
