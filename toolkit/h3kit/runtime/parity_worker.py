"""Parity of the multi-device H3 components against one device, run inside the ComfyUI interpreter.

    python parity_worker.py --comfy-home DIR --component dit|te|vae --device-type cpu|npu|cuda --npu-count N
                            --out FILE [--transport threads|process] [--faults none,NAME,...]
                            [--dtypes float32,bfloat16] [--no-lora] [--layouts ...] [--steps K] [--timeout S]

`h3kit parity` starts this script with the interpreter that runs ComfyUI; it imports nothing from
h3kit's package (that interpreter may not have it; the tiny model builders are loaded from their file).
It uses the patched tree's own code end to end, and the MultiNPUParallelConfig node (validate_inputs,
then execute) for the parallel side. N must be 2 or more: one device would be compared with itself.

dit: a tiny MiniMax H3 DiT built with the upstream class, random weights, saved with safetensors and
loaded back through comfy.sd.load_diffusion_model (model detection reads every dimension), sampled for
real (comfy.sample.sample: prepare_sampling loads the replicas, extra_conds builds the packed layout,
CFG runs cond and uncond as separate forwards), in fp32, in bf16 (computed in bf16, as on an NPU) and in
fp32 with a random LoRA applied through upstream's LoRA loader. A capture wrapper, outermost in the
DIFFUSION_MODEL chain, records the DiT's [video, audio] output of every forward; each output of each
forward is compared on its own scale and the row is judged on the worst. A row passes only when the
work was really split (the wrapper ran every forward on every rank and bytes moved) and, with the LoRA,
when every rank computed with the LoRA'd weights exactly once. Tiny dims are chosen so no layout's packed
length divides by 2 or 4. --faults runs a pass per fault (DIT_FAULTS) over the rows it can reach; each
must fail its gate. --weights int8 runs the
rows on the tiny DiT with its block linears in INT8 (ConvRot, as the published H3 INT8 files): both sides run
the NPU INT8 arm (comfy/npu_quant.py; its reference kernels on cpu), and each row also counts the arm's W8A8
and W8A16 calls, which must be non-zero on both sides.

te and vae: tiny random-weight checkpoints of the Qwen3-VL text encoder and the video and audio VAEs
(h3kit's tiny_models.py) loaded through the loader nodes (CLIPLoader type minimax, VAELoader), with every
weight-file read counted (weight_reads, which must be 1 per file). te encodes a prompt alone (t2va), with
a first-frame image (fl2va: the vision tower and DeepStack) and with image, video and audio references
(ref2va), through the node (tensor parallel) and forced to the layer split, from an fp32 and a bf16
checkpoint; gate max_rel <= 1e-5, cos >= 0.99999 and rel_rms <= 1e-4 (upstream computes the text
encoder in fp32 whatever the checkpoint), every rank's final hidden states identical and the same token
tags. A text encoder with a random LoRA must pass through the node to one device, unchanged. The reduce
fault drops rank 0's share of every reduction and corrupts the layer hand-overs. vae decodes
latents of 1 to 27 frames (1 to 5 temporal chunks, 2x2 spatial tiles in one) and an audio latent; gate
max_abs == 0. The chunks fault zeroes every chunk another device decoded.

--transport process: this script drives a process group of N worker processes, as the server does
(comfy.multinpu_process: one worker per device, rank 0 included, started from the tree with this
interpreter, gloo on CPU, hccl/nccl on devices) and the node runs every component over it; the workers load
the same checkpoint files, which therefore stay on disk for the whole run (in --out's folder). The DiT
faults travel to the workers with each forward (h3kit.runtime.parity_worker._DitFault, importable there) and
their strikes come back with the bytes each rank received; so does the LoRA probe (_WeightProbe): every
rank's lora_ranks verdict is its own weights'. The lora faults (which break a device copy in this process)
do not apply. bf16 rows need this process's CPU-only loader patch and run with the thread transport only.

The JSON written to --out: {"ok", "rows": [...], "config": {...}} or {"ok": false, "error"}; each row has
"pass" and, when it failed, the reasons in "failed".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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
DIT_OUTPUTS = ("video", "audio")
# bf16: three times the largest noise one device shows by itself when another attention backend computes the
# same bf16 model (measured per run, config["bf16_noise"]; 0.86-0.99e-2 on CPU, 2026-12-01). Run to run, a CPU
# is deterministic; on an accelerator that noise is reported too. fp32 parity on CPU is exact (max_abs 0).
DIT_GATES = {"float32": 1e-5, "bfloat16": 3e-2}
NOISE_REL = 1e-4
SHARD_FAULT_BYTES = 4  # shard-offset: one fp32 element (two bf16 ones)
LORA_RANK, LORA_SCALE = 4, 0.1
DIT_FAULTS = {
    "shard": "the last rank's shard zeroed in the final gather",
    "rope": "RoPE rows off by one on every rank > 0 (rank r reads positions start-1 .. stop-2)",
    "heads": "two heads swapped inside the Ulysses all-to-all (q, k and v of the last rank's first two heads)",
    "noise": f"{NOISE_REL:g} relative noise (std {NOISE_REL:g} x rms) on the last rank's attention output",
    "lora-twice": "the LoRA applied twice on the last rank (LoRA rows)",
    "lora-missing": "the LoRA missing on the last rank (LoRA rows)",
    "shard-offset": f"the last rank's slice of block 0 taken {SHARD_FAULT_BYTES} bytes off its offset (sharded rows)",
    "shard-order": "two ranks' slices of block 0 swapped in the last rank's gather (sharded rows)",
}
SHARDINGS = ("replicated", "sharded")

TE_LAYOUTS = LAYOUTS
TE_PROMPT = "A red fox trots through fresh snow at dawn, wind hissing through the pines."
TE_GATE_MAX_REL = 1e-5
TE_GATE_COS = 0.99999
TE_GATE_REL_RMS = 1e-4
TE_FAULT_NOTE = "rank 0's share left out of every all_reduce; layer hand-overs and the final broadcast zeroed"
# latent (T, h, w) per row: 1 frame (no chunks), then 1, 2, 4 and 5 temporal chunks; 73f has 2x2 spatial tiles
VAE_LAYOUTS = {"image": (1, 3, 4), "5f": (2, 3, 4), "39f": (12, 3, 4), "73f": (22, 5, 6), "90f": (27, 3, 4)}
VAE_TILES = dict(tile_size=64, tile_overlap_min=32)  # 64 px spatial tiles, so the 80x96 px row is tiled
VAE_FAULT_NOTE = "every chunk decoded on a device other than rank 0's zeroed on its way back"
AUDIO_LATENT_T = 10


def _start_group(args):
    """--transport process: this process drives N worker processes (they import the tree)."""
    if args.transport != "process":
        return None
    import comfy.model_management
    import comfy.multinpu_group as group
    import comfy.multinpu_process as mp
    key = os.environ.setdefault(group.KEY_ENV, group.new_key())
    # the workers unpickle the DiT fault hook: h3kit reaches them through PYTHONPATH (worker.run)
    spec = group.GroupSpec(local_size=args.npu_count, device_type=args.device_type, timeout=args.timeout,
                           join_timeout=args.timeout, worker_args=["--cpu"] if args.device_type == "cpu" else [])
    runtime = mp.start_runtime(spec, key, comfy.model_management.get_torch_device())
    mp.wait_ready(runtime, args.timeout)
    return runtime


def _stop_group():
    if "comfy.multinpu_process" in sys.modules:
        sys.modules["comfy.multinpu_process"].stop_runtime()  # the workers end with the report written


def _models_dir():
    """A folder for the tiny checkpoints, kept for the whole run: worker processes load them (in --out's
    folder, which h3kit parity removes)."""
    return contextlib.nullcontext(tempfile.mkdtemp(prefix="h3kit-parity-"))


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


def _int8_check(row, single_calls, parallel_calls):
    """(ok, reason) of an INT8 row's other condition: both sides ran the NPU INT8 arm in both modes."""
    modes = lambda calls: {k.split("/")[0] for k in calls}  # noqa: E731
    row.update(int8_calls_single=single_calls, int8_calls_parallel=parallel_calls)
    return (modes(single_calls) == modes(parallel_calls) == {"w8a8", "w8a16"},
            f"INT8 arm calls: one device {single_calls or 'none'}, parallel {parallel_calls or 'none'}")


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


def _worst(values):
    """The largest value, or inf when any is NaN (a Python max() over floats may skip a NaN)."""
    values = list(values)
    return float("inf") if any(v != v for v in values) else max(values)


def _metrics(single, parallel):
    import torch
    a = torch.cat([t.flatten() for fwd in single for t in fwd]).double()
    b = torch.cat([t.flatten() for fwd in parallel for t in fwd]).double()
    if a.shape != b.shape:
        return {"max_abs": float("inf"), "max_rel": float("inf"), "cos": float("-inf"), "rel_rms": float("inf")}
    diff = (b - a).abs()
    peak = a.abs().max().item()
    rms = a.pow(2).mean().sqrt().item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    max_abs = float("nan") if diff.isnan().any() else diff.max().item()
    return {"max_abs": max_abs, "max_rel": max_abs / peak if peak else float("inf"),
            "cos": cos if cos == cos else float("-inf"), "rel_rms": diff.pow(2).mean().sqrt().item() / rms if rms else float("inf")}


def _judge(row, checks):
    """row["pass"] when every (ok, reason) in `checks` holds; row["failed"] lists the reasons that did not."""
    row["failed"] = [reason for ok, reason in checks if not ok]
    row["pass"] = not row["failed"]
    return row


def _dit_metrics(single, parallel):
    """Metrics of every DiT output (video, audio) in every forward, and the worst of each over them.

    Each output is judged on its own scale in each forward (an audio error must not hide under the video's
    peak, nor a late forward's under an early one's): {"video": {..., "worst_forward"}, "audio": {...}}, and
    the row's figures are the worst of those (largest max_abs, max_rel, rel_rms; smallest cos).
    """
    if len(single) != len(parallel):
        bad = {"max_abs": float("inf"), "max_rel": float("inf"), "cos": float("-inf"), "rel_rms": float("inf")}
        return {name: dict(bad, worst_forward=None) for name in DIT_OUTPUTS}, dict(bad, worst="forward count")
    per = {}
    for o, name in enumerate(DIT_OUTPUTS):
        fwd = [_metrics([[s[o]]], [[p[o]]]) for s, p in zip(single, parallel)]
        rels = [m["max_rel"] for m in fwd]
        per[name] = {"max_abs": _worst(m["max_abs"] for m in fwd), "max_rel": _worst(rels),
                     "cos": -_worst(-m["cos"] for m in fwd), "rel_rms": _worst(m["rel_rms"] for m in fwd),
                     "worst_forward": max(range(len(rels)), key=lambda i: float("inf") if rels[i] != rels[i] else rels[i])}
    worst = max(DIT_OUTPUTS, key=lambda n: float("inf") if per[n]["max_rel"] != per[n]["max_rel"] else per[n]["max_rel"])
    row = {"max_abs": _worst(p["max_abs"] for p in per.values()), "max_rel": per[worst]["max_rel"],
           "cos": -_worst(-p["cos"] for p in per.values()), "rel_rms": _worst(p["rel_rms"] for p in per.values()),
           "worst": f"{worst}, forward {per[worst]['worst_forward']}" if per[worst]["max_rel"] != 0 else "-"}
    return per, row


class _DitFault:
    """The comfy.multinpu_dit.fault_hook that `--inject-fault NAME` installs; counts where it struck."""

    def __init__(self, name):
        self.name = name
        self.fired = 0

    def __call__(self, stage, state, t):
        import torch
        comm = state.comm
        last = comm.rank == comm.world_size - 1
        if self.name == "rope" and stage == "rope" and comm.rank > 0:
            self.fired += 1
            return torch.roll(t, 1, dims=1)  # rank r reads the RoPE rows of positions start-1 .. stop-2
        if self.name == "heads" and stage == "ulysses" and last and t.shape[1] > 1:
            self.fired += 1
            return t[:, [1, 0] + list(range(2, t.shape[1]))]  # q, k, v of its first two heads trade places
        if self.name == "noise" and stage == "attention" and last:
            self.fired += 1
            g = torch.Generator().manual_seed(self.fired)
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            return t + (noise * NOISE_REL * t.float().pow(2).mean().sqrt().item()).to(t.device, t.dtype)
        if self.name == "shard" and stage == "gathered":
            self.fired += 1
            t = t.clone()
            t[t.shape[0] - state.sizes[-1]:] = 0
            return t
        if self.name == "shard-offset" and stage == "shard" and last and state.block == 0:
            self.fired += 1
            return torch.roll(t, -SHARD_FAULT_BYTES)  # the slice at start + 4 .. stop + 4
        if self.name == "shard-order" and stage == "weights" and last and state.block == 0:
            self.fired += 1
            n = state.shard
            return torch.cat([t[n:2 * n], t[:n], t[2 * n:]])  # ranks 0 and 1's slices trade places
        return t


def _reaches(fault, with_lora, attention, npu_count, transport="threads", sharding="replicated"):
    """Whether a row runs the code `fault` corrupts (a fault pass runs only those rows; "none" runs all)."""
    if fault.startswith("shard-"):
        return sharding == "sharded"
    if fault.startswith("lora"):
        return with_lora and transport == "threads"  # processes: no device copy here to break
    if fault == "heads":  # the Ulysses all-to-all
        return attention == "auto" and TINY["num_attention_heads"] % npu_count == 0
    return True


def _lora_state_dict(weights, prefix, key_prefix, seed):
    """A random LoRA (rank LORA_RANK) on every linear weight of `weights` under `prefix`, in upstream's generic key
    format (key_prefix + "<module>.lora_up/lora_down.weight"), its delta about LORA_SCALE of each weight."""
    import torch
    g = torch.Generator().manual_seed(seed + 101)
    sd = {}
    for name, t in weights.items():
        if not (name.startswith(prefix) and name.endswith(".weight") and t.dim() == 2):
            continue
        out_f, in_f = t.shape
        key = key_prefix + name[:-len(".weight")]
        down = torch.randn(LORA_RANK, in_f, generator=g) / in_f ** 0.5
        up = torch.randn(out_f, LORA_RANK, generator=g) * (LORA_SCALE * t.float().std().item() / LORA_RANK ** 0.5)
        sd[key + ".lora_down.weight"], sd[key + ".lora_up.weight"] = down, up
    return sd


def _apply_lora(base, lora):
    """(the model with the LoRA, as the LoraLoader node applies it; the LoRA's patch dict, to apply again)."""
    import comfy.lora
    import comfy.lora_convert
    import comfy.sd
    patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0]
    expected = len(lora) // 2
    if len(patched.patches) != expected:
        raise RuntimeError(f"the LoRA patched {len(patched.patches)} of its {expected} weights")
    keys = comfy.lora.model_lora_keys_unet(base.model, {})
    return patched, comfy.lora.load_lora(comfy.lora_convert.convert_lora(lora), keys)


class _WeightProbe:
    """Records, per rank, the LoRA'd weights each rank's DiT actually computes with (each block's, as it starts:
    a sharded DiT holds a block's weights only while that block runs)."""

    def __init__(self, keys):
        self.keys = keys
        self.seen = {}
        self.handles = []

    def attach(self, rank, dm):
        for i, block in enumerate(dm.blocks):
            prefix = f"blocks.{i}."
            keys = [k for k in self.keys if k.startswith(prefix)]

            def pre_hook(module, args, rank=rank, keys=keys, prefix=prefix):
                seen = self.seen.setdefault(rank, {})
                if keys and keys[0] not in seen:
                    params = dict(module.named_parameters())
                    seen.update({k: params[k[len(prefix):]].detach().float().cpu().clone() for k in keys})
            self.handles.append(block.register_forward_pre_hook(pre_hook))

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _lora_verdicts(seen, expected, base_weights, world):
    """Per rank: "once" (its weights equal one device's LoRA'd weights), "missing" (the base weights) or
    "wrong" (anything else: applied twice, partly, or not at all on some key); None when the rank never ran."""
    import torch
    out = []
    for r in range(world):
        w = seen.get(r)
        if w is None:
            out.append(None)
        elif all(torch.equal(w[k], expected[k]) for k in expected):
            out.append("once")
        elif all(torch.equal(w[k], base_weights[k]) for k in expected):
            out.append("missing")
        else:
            out.append("wrong")
    return out


def _break_lora(m, fault, lora_patches):
    """--inject-fault lora-twice / lora-missing: the last rank's DiT copy gets the LoRA twice, or not at all."""
    import comfy.multinpu_dit
    last = m.get_additional_models_with_key(comfy.multinpu_dit.KEY)[-1]
    if fault == "lora-missing":
        last.patches.clear()
    else:
        last.add_patches(lora_patches, 1.0)
    return 1


def _load_dit(path, dtype):
    """The tiny DiT through upstream's loader, at `dtype`. bf16 on a CPU: ComfyUI would store bf16 weights
    and compute in fp32 there (should_use_bf16 is False for CPUs); the bf16 rows want bf16 arithmetic, so
    the model is loaded as on an Ascend NPU, where bf16 is computed in bf16 (no manual cast)."""
    import torch
    import comfy.model_management
    import comfy.sd
    real = comfy.model_management.unet_manual_cast
    if dtype == torch.bfloat16:
        comfy.model_management.unet_manual_cast = lambda weight_dtype, *a, **k: (
            None if weight_dtype == torch.bfloat16 else real(weight_dtype, *a, **k))
    try:
        return comfy.sd.load_diffusion_model(path, model_options={"dtype": dtype})
    finally:
        comfy.model_management.unet_manual_cast = real


def _attention_variant():
    """An optimized_attention_override running another of upstream's attention backends than the default
    (torch's SDPA, attention_pytorch, or attention_split where SDPA is the default): the same attention in
    another rounding order, what a bf16 model's output moves by on one device when a user switches backends."""
    import comfy.ldm.modules.attention as attention
    other = attention.attention_pytorch if attention.optimized_attention is not attention.attention_pytorch \
        else attention.attention_split

    def variant(func, *args, **kwargs):
        return other(*args, **kwargs)
    return variant


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
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    int8 = args.weights == "int8"
    runtime = _start_group(args)
    notes = []
    if runtime is not None and args.device_type == "cpu" and "bfloat16" in args.dtypes:
        # bf16 on a CPU needs _load_dit's loader patch, which the worker processes do not share
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"]
        notes.append("bf16 rows: thread transport only on cpu (they patch this process's loader)")
    with _models_dir() as tmp:
        ckpt = os.path.join(tmp, "tiny_h3_dit.safetensors")
        _tiny_checkpoint(ckpt, args.seed, args.weights)
        # INT8: one variant, the file as saved (upstream picks its compute dtype); else one per --dtypes
        bases = ({"int8": comfy.sd.load_diffusion_model(ckpt)} if int8 else
                 {name: _load_dit(ckpt, dtypes[name]) for name in args.dtypes})
    gates = {name: DIT_GATES[name] for name in args.dtypes}
    if int8:
        import comfy.npu_quant
        base = bases["int8"]
        if comfy.npu_quant.kernels_for(base.load_device) is None:
            return {"ok": False, "error": {"code": "int8_arm_unavailable", "message": (
                f"the NPU INT8 arm does not run on {base.load_device.type} here (it needs torch_npu on an npu, or the "
                f"CPU simulation); {comfy.npu_quant.MODE_ENV}=reference runs its reference kernels on any device")}}
        compute = base.model.get_dtype_inference()
        gates = {"int8": GATE_MAX_REL if compute == torch.float32 else GATE_MAX_REL_INT8_BF16}
    base32 = bases.get("float32")
    params = sum(t.numel() for t in next(iter(bases.values())).model.diffusion_model.state_dict().values()
                 if t.dtype != torch.uint8)  # not the INT8 layers' comfy_quant tags
    lora = (_lora_state_dict(base32.model.diffusion_model.state_dict(), "blocks.", "diffusion_model.", args.seed)
            if args.lora and base32 is not None else None)
    lora_patcher, lora_patches = _apply_lora(base32, lora) if lora else (None, None)
    lora_keys = sorted(k[len("diffusion_model."):] for k in lora_patcher.patches) if lora else []
    # the weights as loaded, before any run patches them in place
    base_weights = {k: v.detach().float().cpu().clone() for k, v in base32.model.diffusion_model.named_parameters()
                    if k in lora_keys} if lora else {}
    # (dtype, lora) variants: every layout at fp32 and bf16; the LoRA (at fp32) concerns the device copies, not the
    # layout, so its rows run the first layout only
    variants = [(name, False, bases[name]) for name in bases] + ([("float32", True, lora_patcher)] if lora else [])
    layouts_of = lambda with_lora: args.layouts[:1] if with_lora else args.layouts  # noqa: E731
    modes = ("auto", "kv_gather")

    # one-device references (and, for bf16, that device's own noise: run again, and with another attention backend)
    single, noise, lora_expected, seconds, single_calls = {}, {}, None, {}, {}
    for dtype, with_lora, patcher in variants:
        for layout in layouts_of(with_lora):
            m, capture, inputs = _prepare(patcher, layout, args.seed)
            probe = _WeightProbe(lora_keys) if with_lora else None
            if probe:
                probe.attach(0, m.model.diffusion_model)
            calls = _int8_calls() if int8 else {}
            t0 = time.perf_counter()
            single[(dtype, with_lora, layout)] = _run(m, capture, inputs, args.steps, args.seed)
            seconds[(dtype, with_lora, layout)] = time.perf_counter() - t0
            single_calls[layout] = _calls_since(calls) if int8 else {}
            if probe:
                probe.detach()
                lora_expected = probe.seen[0]
            if dtype == "bfloat16":
                m, capture, inputs = _prepare(patcher, layout, args.seed)
                again = _run(m, capture, inputs, args.steps, args.seed)
                m, capture, inputs = _prepare(patcher, layout, args.seed)
                m.model_options["transformer_options"]["optimized_attention_override"] = _attention_variant()
                variant = _run(m, capture, inputs, args.steps, args.seed)
                ref = single[(dtype, with_lora, layout)]
                noise[layout] = {"run_to_run": _dit_metrics(ref, again)[1]["max_rel"],
                                 "attention_variant": _dit_metrics(ref, variant)[1]["max_rel"]}

    rows = []
    # with processes the hook travels to the workers: its class must be importable there, not __main__'s
    fault_class = _importable_fault_class() if runtime is not None else _DitFault
    for fault in args.faults:
        hook = fault_class(fault) if fault in DIT_FAULTS and not fault.startswith("lora") else None
        comfy.multinpu_dit.fault_hook = hook
        for dtype, with_lora, patcher in variants:
            for layout in layouts_of(with_lora):
                ref = single[(dtype, with_lora, layout)]
                replicated = {}  # attention -> the replicated run's outputs, what a sharded row must equal
                for attention in modes:
                    for sharding in args.sharding:
                        if sharding == "sharded" and attention != "auto":
                            continue  # where the weights live is independent of the attention exchange
                        if not _reaches(fault, with_lora, attention, args.npu_count, args.transport, sharding):
                            continue
                        if sharding == "sharded" and attention not in replicated:
                            # its replicated twin, not a row in this pass (the fault does not reach it)
                            replicated[attention] = _parallel_run(node, patcher, layout, attention, "replicated",
                                                                  args)[0]
                        outputs, row = _parallel_run(node, patcher, layout, attention, sharding, args,
                                                     fault=fault, lora_patches=lora_patches,
                                                     lora_keys=lora_keys if with_lora else None, hook=hook)
                        if sharding == "replicated":
                            replicated[attention] = outputs
                        per_output, worst = _dit_metrics(ref, outputs)
                        row.update({"component": "dit", "layout": layout, "dtype": dtype, "lora": with_lora,
                                    "weights": args.weights, "transport": args.transport,
                                    "fault": fault if fault != "none" else None, "npu_count": args.npu_count,
                                    "device_type": args.device_type, "seq_len": _seq_len(layout, args.seed),
                                    "forwards": len(outputs), **worst, "outputs": per_output,
                                    "seconds_single": round(seconds[(dtype, with_lora, layout)], 4)})
                        forwards = row["forwards"]
                        # the work must really have been split: the wrapper ran every forward on every rank, and
                        # data moved (a node that passed the model through would compare one device with itself)
                        row["split"] = (row["parallel_forwards"] == forwards > 0
                                        and row["rank_forwards"] == [forwards] * args.npu_count
                                        and row["bytes_moved"] > 0)
                        gate = gates[dtype]
                        row["gate"] = f"max_rel <= {gate:g}"
                        checks = [(row["split"], "not split over every device"),
                                  (row["max_rel"] <= gate, f"max_rel > {gate:g} ({row['worst']})")]
                        if sharding == "sharded":
                            twin = _dit_metrics(replicated[attention], outputs)[1]
                            row["max_abs_vs_replicated"] = twin["max_abs"]
                            row["gate"] += ", max_abs == 0 against the replicated run"
                            checks.append((twin["max_abs"] == 0, f"differs from the replicated run by max_abs "
                                           f"{twin['max_abs']:.3g} ({twin['worst']})"))
                            checks.append((row["weight_bytes"] > 0, "no weights were gathered"))
                        if with_lora:
                            row["lora_ranks"] = _lora_verdicts(row.pop("lora_seen"), lora_expected, base_weights,
                                                               args.npu_count)
                            checks.append((row["lora_ranks"] == ["once"] * args.npu_count,
                                           "LoRA per device: " + ", ".join(str(v) for v in row["lora_ranks"])))
                        if int8:
                            checks.append(_int8_check(row, single_calls[layout], row.pop("int8_calls")))
                        if dtype == "bfloat16":
                            row["noise"] = noise[layout]
                        rows.append(_judge(row, checks))
        comfy.multinpu_dit.fault_hook = None
    config = {"dit": TINY, "params": params, "text_len": TEXT_LEN, "video_latent": VIDEO_SHAPE,
              "audio_latent": AUDIO_SHAPE, "dtypes": list(bases), "weights": args.weights,
              "gate": {d: f"max_rel <= {g:g} on every output of every forward"
                          + (", the NPU INT8 arm's W8A8 and W8A16 calls on both sides" if d == "int8" else "")
                       for d, g in gates.items()},
              "steps": args.steps, "cfg": 2.0, "lora": {"rank": LORA_RANK, "keys": len(lora_keys)} if lora else None,
              "bf16_noise": noise or None,
              "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]],
              "transport": args.transport, "notes": notes,
              "faults": {f: DIT_FAULTS[f] for f in args.faults if f != "none"}}
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _parallel_run(node, patcher, layout, attention, sharding, args, fault="none", lora_patches=None, lora_keys=None,
                  hook=None):
    """One sampling through the node on args.npu_count devices with the weights `sharding`: (the DiT's outputs of
    every forward, the row's measured fields: forwards per rank, bytes moved, weight gathers, resident bytes...)."""
    import comfy.multinpu_dit
    fired_before = hook.fired if hook else 0
    m, capture, inputs = _prepare(patcher, layout, args.seed)
    # the node exactly as a workflow runs it; only the attention mode is forced per row
    m = node.execute(model=m, npu_count=args.npu_count, weights=sharding).args[0]
    wrapper = comfy.multinpu_dit.get_wrapper(m)
    lora_fired = (_break_lora(m, fault, lora_patches)
                  if lora_keys is not None and fault in ("lora-twice", "lora-missing") and wrapper else 0)
    probe = _WeightProbe(lora_keys) if lora_keys is not None else None
    if wrapper is not None:
        wrapper.attention = attention
        wrapper.timeout = args.timeout
        wrapper.count_bytes = True  # processes: every rank's bytes (and fault strikes) to rank 0
        if probe and wrapper.runtime is not None:
            from h3kit.runtime import parity_worker as importable  # the workers unpickle it by this name
            probe.__class__ = importable._WeightProbe
            comfy.multinpu_dit.weight_probe = probe  # every worker (rank 0 too) probes its own DiT
        elif probe:
            probe.attach(0, m.model.diffusion_model)
            for r, replica in enumerate(wrapper.replicas[1:], start=1):
                probe.attach(r, replica.diffusion_model)
    calls = _int8_calls() if args.weights == "int8" else {}
    t0 = time.perf_counter()
    outputs = _run(m, capture, inputs, args.steps, args.seed)
    seconds = time.perf_counter() - t0
    if probe:
        probe.detach()
        comfy.multinpu_dit.weight_probe = None
    if wrapper is not None and wrapper._threads is not None:
        wrapper._threads.shutdown()
    heads = TINY["num_attention_heads"]
    w = wrapper
    row = {"attention": "ulysses" if attention == "auto" and heads % args.npu_count == 0 else "kv_gather",
           "sharding": w.weights if w else None,
           "parallel_forwards": w.forwards if w else 0, "rank_forwards": list(w.rank_forwards) if w else [],
           "bytes_moved": w.bytes_moved if w else 0, "bytes_received": list(w.bytes_received) if w else [],
           "weight_bytes": sum(w.weight_bytes_received) if w else 0,
           "weight_bytes_received": list(w.weight_bytes_received) if w else [],
           "resident_bytes": list(w.resident_bytes) if w else [],
           "memory_estimates": [list(e) for e in w.memory_estimates] if w and w.memory_estimates else None,
           "memory_estimate_one_device": list(w.memory_estimate_one) if w and w.memory_estimate_one else None,
           "memory_used": list(w.memory_used) if w else [],
           "caches_emptied": list(w.caches_emptied) if w else [],
           "fault_fired": (hook.fired - fired_before if hook else 0) + lora_fired,
           "seconds_parallel": round(seconds, 4)}
    if probe:
        row["lora_seen"] = probe.seen
    if args.weights == "int8":
        row["int8_calls"] = _calls_since(calls)
    return outputs, row


def _importable_fault_class():
    """_DitFault from h3kit.runtime.parity_worker (this file imported by its package name), so that worker
    processes can unpickle the hook sent with each forward."""
    from h3kit.runtime import parity_worker
    return parity_worker._DitFault


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
        # rank 0's share: with the process transport only rank 0's process is patched, and its zero still
        # reaches every rank through the collective
        return all_reduce(x * 0 if comm.rank == 0 else x, comm)

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


def _bf16_copy(path):
    """A bf16 checkpoint of the same weights beside `path` (what deployments load), metadata kept. Read with
    safetensors itself: this copy is the harness's, not a read the loaders' count should see."""
    import safetensors
    import safetensors.torch
    import torch
    import comfy.utils
    sd = safetensors.torch.load_file(path)
    with safetensors.safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    out = path.replace(".safetensors", "_bf16.safetensors")
    comfy.utils.save_torch_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()},
                                out, metadata=metadata)
    return out


def _rank_spread(runner):
    """The largest difference between any rank's final hidden states and rank 0's (inf for a NaN)."""
    import torch
    outs = runner.rank_outputs
    if all(torch.equal(o, outs[0]) for o in outs):  # torch.equal is False on a NaN
        return 0.0
    return float(torch.stack([(o.float() - outs[0].float()).abs().max() for o in outs]).nan_to_num(nan=float("inf")).max())


def run_te(args):
    _setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multidevice
    import comfy.multinpu_te
    import nodes
    node, error = _node_or_error(args)
    if error:
        return error
    runtime = _start_group(args)
    with _models_dir() as tmp:
        loaded, reads, paths, tiny = _load_through_nodes(tmp, args.seed, ("dit", "te"))
        if "bfloat16" in args.dtypes:
            paths["te_bf16"] = os.path.realpath(_bf16_copy(paths["te"]))
            loaded["te_bf16"] = nodes.CLIPLoader().load_clip(os.path.basename(paths["te_bf16"]), type="minimax")[0]
    if args.faults != ["none"]:
        _inject_te_fault(args.npu_count)
    layouts = [x for x in args.layouts if x in TE_LAYOUTS] or list(TE_LAYOUTS)
    clips = {"float32": ("te", loaded["te"])}
    if "bfloat16" in args.dtypes:
        clips["bfloat16"] = ("te_bf16", loaded["te_bf16"])
    # the bf16 checkpoint: the first layout (tensor parallel); upstream computes in fp32 either way, and one
    # device's bf16 encodes cost several times the fp32 ones on a CPU (every weight cast at every call)
    layouts_of = lambda dtype: layouts if dtype == "float32" else layouts[:1]  # noqa: E731
    single, noise = {}, {}
    for dtype, (component, clip) in clips.items():
        for layout in layouts_of(dtype):
            t0 = time.perf_counter()
            single[(dtype, layout)] = _encode(clip, layout, args.seed) + (time.perf_counter() - t0,)
        if dtype == "bfloat16":  # one device's own bf16 noise: the same encode again
            noise[dtype] = _metrics([[single[(dtype, layouts[0])][0]]], [[_encode(clip, layouts[0], args.seed)[0]]])["max_rel"]
    rows = []
    for dtype, (component, clip) in clips.items():
        variants = [node.execute(model=loaded["dit"], npu_count=args.npu_count, clip=clip).args[1]]
        if dtype == "float32":  # the layer split runs each layer unchanged, whatever the dtype: once is enough
            devices = comfy.multidevice.devices_for(clip.patcher.load_device, args.npu_count)
            variants.append(comfy.multinpu_te.apply_tensor_parallel(clip, devices, mode="layers", runtime=runtime))
        for par in variants:
            runner = comfy.multinpu_te.get_runner(par)
            if runner is not None:
                runner.timeout = args.timeout
                runner.keep_rank_outputs = True
            for layout in layouts_of(dtype):
                before = runner.bytes_moved if runner else 0
                t0 = time.perf_counter()
                out, tags = _encode(par, layout, args.seed)
                seconds = time.perf_counter() - t0
                ref, ref_tags, t_single = single[(dtype, layout)]
                row = {"component": "te", "layout": layout, "mode": runner.mode if runner else "none", "dtype": dtype,
                       "lora": False, "npu_count": args.npu_count, "device_type": args.device_type,
                       "transport": args.transport,
                       "tokens": int(ref.shape[1]), **_metrics([[ref]], [[out]]),
                       "rank_spread": _rank_spread(runner) if runner else 0.0,
                       "tags_equal": bool(torch.equal(tags, ref_tags)), "weight_reads": reads[paths[component]],
                       "bytes_moved": (runner.bytes_moved - before) if runner else 0,
                       "seconds_single": round(t_single, 4), "seconds_parallel": round(seconds, 4)}
                # the row must really have run split: a node that passed the text encoder through on one device
                # would compare a model with itself and pass every other test
                row["split"] = row["mode"] != "none" and row["bytes_moved"] > 0
                rows.append(_judge(row, [
                    (row["split"], "not split over the devices"),
                    (row["max_rel"] <= TE_GATE_MAX_REL, f"max_rel > {TE_GATE_MAX_REL:g}"),
                    (row["cos"] >= TE_GATE_COS, f"cos < {TE_GATE_COS}"),
                    (row["rel_rms"] <= TE_GATE_REL_RMS, f"rel_rms > {TE_GATE_REL_RMS:g}"),
                    (row["rank_spread"] == 0, "the devices' hidden states differ"),
                    (row["tags_equal"], "token tags differ"),
                    (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times")]))
            if runner is not None and runner._threads is not None:
                runner._threads.shutdown()
    if args.lora:
        rows.append(_te_lora_row(args, node, loaded, layouts[0], single[("float32", layouts[0])][0],
                                 lambda: reads[paths["te"]]))
    te = tiny.TINY_TE
    config = _config(args, tiny, {"te": {k: te[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                             "num_attention_heads", "num_key_value_heads")},
                                  "dtypes": list(clips), "bf16_noise": {"run_to_run": noise.get("bfloat16")},
                                  "gate": f"max_rel <= {TE_GATE_MAX_REL:g}, cos >= {TE_GATE_COS}, rel_rms <= "
                                          f"{TE_GATE_REL_RMS:g}, rank_spread == 0, same token tags, weight_reads == 1 "
                                          "(bf16 checkpoints too: upstream computes the text encoder in fp32)",
                                  "reads": {c: reads[p] for c, p in paths.items()},
                                  "faults": {"reduce": TE_FAULT_NOTE} if args.faults != ["none"] else {}})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _te_lora_row(args, node, loaded, layout, plain, te_reads):
    """A text encoder with a random LoRA through the node: it must pass through, unchanged, to one device
    (its LoRA names weights tensor parallelism would split), and still carry the LoRA."""
    import comfy.multinpu_te
    import comfy.sd
    clip = loaded["te"]
    lora = _lora_state_dict(clip.cond_stage_model.state_dict(), "qwen3vl_32b.transformer.model.layers.",
                            "text_encoders.", args.seed)
    lora_clip = comfy.sd.load_lora_for_models(None, clip, lora, 0.0, 1.0)[1]
    ref = _encode(lora_clip, layout, args.seed)[0]
    out_clip = node.execute(model=loaded["dit"], npu_count=args.npu_count, clip=lora_clip).args[1]
    out = _encode(out_clip, layout, args.seed)[0]
    effect = _metrics([[plain]], [[ref]])["max_rel"]
    row = {"component": "te", "layout": layout, "mode": "one device", "dtype": "float32", "lora": True,
           "npu_count": args.npu_count, "device_type": args.device_type, "tokens": int(ref.shape[1]),
           **_metrics([[ref]], [[out]]), "weight_reads": te_reads(),
           "bytes_moved": 0, "split": False, "lora_patches": len(lora_clip.patcher.patches), "lora_effect": effect,
           "passed_through": out_clip is lora_clip and comfy.multinpu_te.get_runner(out_clip) is None}
    return _judge(row, [(row["passed_through"], "the node split a text encoder carrying a LoRA"),
                        (row["lora_patches"] == len(lora) // 2, "the LoRA did not patch every weight it names"),
                        (row["max_abs"] == 0, "the output changed on the way through the node"),
                        (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times"),
                        (effect > 1e-3, f"the LoRA changed the output by max_rel {effect:.2g} only")])


def run_vae(args):
    _setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multinpu_vae
    node, error = _node_or_error(args)
    if error:
        return error
    if args.faults != ["none"]:
        _inject_vae_fault()
    _start_group(args)
    with _models_dir() as tmp:
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
               "device_type": args.device_type, "transport": args.transport, "frames": int(single.shape[1]),
               "chunks": (runner.chunks - before[1]) if runner else 0,
               "chunk_ranks": list(runner.chunk_ranks) if runner and t > 1 else [],
               **_metrics([[single]], [[parallel]]), "weight_reads": reads[paths["video_vae"]],
               "bytes_moved": (runner.bytes_moved - before[0]) if runner else 0,
               "seconds_single": round(t1 - t0, 4), "seconds_parallel": round(t2 - t1, 4)}
        # several chunks on several devices must really have been spread (else the node passed the VAE through)
        row["split"] = runner is not None and (row["chunks"] < 2 or any(row["chunk_ranks"]))
        rows.append(_judge(row, [(row["split"], "not spread over the devices"),
                                 (row["max_abs"] == 0 and tuple(single.shape) == tuple(parallel.shape),
                                  "not bit-identical to one device"),
                                 (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times")]))
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
    rows.append(_judge(row, [(row["max_abs"] == 0, "not identical to one device"),
                             (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times"),
                             (par_audio.vae_dtype == torch.float32, "not fp32"),
                             (comfy.multinpu_vae.get_runner(par_audio) is None, "split across devices")]))
    if runner is not None and runner._threads is not None:
        runner._threads.shutdown()
    config = _config(args, tiny, {"video_vae": dict(tiny.TINY_VIDEO_VAE, **VAE_TILES), "gate": "max_abs == 0, weight_reads == 1",
                                  "reads": {c: reads[p] for c, p in paths.items()},
                                  "faults": {"chunks": VAE_FAULT_NOTE} if args.faults != ["none"] else {}})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


COMPONENTS = {"dit": run_dit, "te": run_te, "vae": run_vae}
FAULTS = {"dit": DIT_FAULTS, "te": {"reduce": TE_FAULT_NOTE}, "vae": {"chunks": VAE_FAULT_NOTE}}


def _bad_arguments(args):
    """A message when the arguments cannot make a meaningful run, else None."""
    if args.npu_count < 2:
        return (f"--npu-count {args.npu_count}: parity compares several devices with one; with one device it "
                "would compare a model with itself")
    known = FAULTS[args.component]
    unknown = [f for f in args.faults if f != "none" and f not in known]
    if unknown or not args.faults:
        return f"--faults {','.join(args.faults)}: {args.component} knows none and {', '.join(known)}"
    if any(f.startswith("lora") for f in args.faults) and not args.lora:
        return "--faults lora-*: the LoRA faults need the LoRA rows (drop --no-lora)"
    if args.weights != "float" and args.component != "dit":
        return f"--weights {args.weights}: dit only"
    if args.weights == "int8" and any(f.startswith("lora") for f in args.faults):
        return "--faults lora-*: the INT8 rows carry no LoRA"
    if args.component == "dit" and not args.sharding:
        return f"--sharding: one or both of {', '.join(SHARDINGS)}"
    if any(f.startswith("shard-") for f in args.faults) and "sharded" not in args.sharding:
        return "--faults shard-*: the sharded-weight faults need the sharded rows (--sharding sharded)"
    if args.component != "dit" and len(args.faults) != 1:
        return f"--faults: {args.component} runs one pass, none or {', '.join(known)}"
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16")]
    if bad or not args.dtypes or (args.component == "dit" and "float32" not in args.dtypes):
        return f"--dtypes {','.join(args.dtypes)}: float32 (always, for dit) and/or bfloat16"
    return None


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
    ap.add_argument("--weights", choices=("float", "int8"), default="float", help="dit: the tiny DiT's weights")
    ap.add_argument("--transport", choices=("threads", "process"), default="threads")
    ap.add_argument("--faults", default="none",
                    help="comma-separated passes: none (the clean run) and/or faults of the component (FAULTS)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dit and te: the dtypes to compare in")
    ap.add_argument("--no-lora", dest="lora", action="store_false", help="dit: leave out the LoRA rows")
    ap.add_argument("--sharding", default=",".join(SHARDINGS),
                    help="dit: the weights of the parallel rows, replicated and/or sharded (the sharded rows run the "
                         "default attention and must equal their replicated twin exactly)")
    ap.add_argument("--layouts", default="", help="comma-separated rows to run (default: all of the component's)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.faults = [x for x in args.faults.split(",") if x]
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    args.sharding = [x for x in SHARDINGS if x in args.sharding.split(",")]
    # checkpoints stay on disk while workers may load them: in --out's folder, which h3kit parity removes
    tempfile.tempdir = os.path.dirname(os.path.abspath(args.out))
    if args.component == "dit":
        args.layouts = args.layouts or list(LAYOUTS)
    problem = _bad_arguments(args)
    try:
        result = {"ok": False, "error": {"code": "bad_arguments", "message": problem}} if problem else \
            COMPONENTS[args.component](args)
        code = 0 if result["ok"] else (2 if "error" in result else 1)
    except Exception as e:
        traceback.print_exc()
        result = {"ok": False, "error": {"code": "worker_failed", "message": f"{type(e).__name__}: {e}"}}
        code = 3
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    _stop_group()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the report is written; skip interpreter teardown, where torch's static destructors occasionally
    # abort ("terminate called without an active exception") once rank threads have run
    os._exit(code)
