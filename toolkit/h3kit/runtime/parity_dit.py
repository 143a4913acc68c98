"""Parity of the DiT split over devices (sequence parallel) against one device; run by parity_worker.py in the
ComfyUI interpreter.

A tiny MiniMax H3 DiT built with the upstream class, random weights, saved with safetensors and loaded back
through comfy.sd.load_diffusion_model (model detection reads every dimension), sampled for real
(comfy.sample.sample: prepare_sampling loads the replicas, extra_conds builds the packed layout, CFG runs cond and
uncond as separate forwards), in fp32, in bf16 (computed in bf16, as on an NPU), in fp32 with a random LoRA
applied through upstream's LoRA loader, and in fp32 with a user attention override (upstream's attention with
its output halved, set in transformer_options as an attention node would: every rank must run it). A capture wrapper, outermost in the
DIFFUSION_MODEL chain, records the DiT's [video, audio] output of every forward; each output of each forward is
compared on its own scale and the row is judged on the worst. Tiny dims are chosen so no layout's packed length
divides by 2, 4 or 8.

Gates (GATES): on cpu the split is exact, both transports, fp32 and bf16: max_abs == 0 against one device. On
npu/cuda the gate is the floor measured in the run times GATE_MARGIN: the floor is what one device's own output
moves by when only its arithmetic order changes (the same sampling again, and with another attention backend),
per dtype and layout. That path is unmeasured on hardware. Every row also holds what each rank measured on
itself (comfy.multinpu_dit.fault_hook's "rank" stage and report(), gathered over the group with processes): it
ran every block of every forward, received bytes (each > 0 and equal to the cost model's for its shard), computed
with the LoRA'd weights exactly once (each block's weights hashed on the rank as the block starts, against the
one device's), and called the user's attention override as often as one device did.

--faults runs a pass per fault (DIT_FAULTS) over the rows it can reach; each must fail. --weights int8 runs the
rows on the tiny DiT with its block linears in INT8 (ConvRot, as the published H3 INT8 files): both sides run the
NPU INT8 arm (comfy/npu_quant.py; its reference kernels on cpu), and each row also counts the arm's W8A8 and W8A16
calls, which must be non-zero on both sides.

With the process transport the probe travels to the workers with each forward (this module must be importable
there: h3kit is on their PYTHONPATH) and their counts come back with the bytes each rank received. A worker's
LoRA is also proven by the digest check before the first forward, so the lora faults (which break a device copy
in this process) do not apply; a user attention override is refused there (it cannot run in a worker process),
so the override rows run with threads only; bf16 rows need this process's CPU-only loader patch and run with
threads only on cpu.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
import time

from h3kit.runtime import parity_common as common

# tiny H3: 8 heads (Ulysses for N = 2, 4 and 8, K/V gather forced per row), rotary 6 * 2 = 12 of 16 dims
TINY = dict(hidden_size=64, num_layers=3, token_refiner_num_layers=1, num_attention_heads=8,
            attention_head_dim=16, ffn_hidden_size=128, text_dim=48, timestep_input_dim=32,
            time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=2)
TEXT_LEN = 7
# at 8 devices the prompt is longer, so that every rank holds 12 rows or more: the CPU's sgemm (MKL) rounds a call of
# 1-3, 5-7 or 9-11 rows differently from the same rows inside a longer call (measured, torch 2.14), and a rank's
# shard is such a call; 12 rows up and 4 or 8 rows compute each row alike, which the exact cpu gate rests on
TEXT_LEN_8 = 33


def text_len(npu_count):
    """The tiny prompt's tokens in the rows on npu_count devices (every layout's length odd: uneven shards)."""
    return TEXT_LEN if npu_count <= 4 else TEXT_LEN_8

VIDEO_SHAPE = (1, 24, 2, 8, 12)   # latent T=2 (5 frames), 4x6 patches per frame: 48 video tokens
AUDIO_SHAPE = (1, 32, 2, 8)       # 8 audio latents at 40 Hz, stereo: 16 rows
FRAME_COUNT = 5
LAYOUTS = ("t2va", "fl2va", "ref2va")
DIT_OUTPUTS = ("video", "audio")
# npu/cuda: the gate is this many times the floor one device measures on itself (unmeasured on hardware)
GATE_MARGIN = 4
GATES = {"cpu": "max_abs == 0 against one device (the split is exact)",
         "npu": f"max_rel <= {GATE_MARGIN} x the floor one device measures on itself (unmeasured on hardware)",
         "cuda": f"max_rel <= {GATE_MARGIN} x the floor one device measures on itself (unmeasured on hardware)"}
# relative noise (std x the tensor's rms) of the noise faults: the named 1e-4 one, and the 1e-6 ones that an exact
# gate must catch as well (below a bf16 rounding step, 3.9e-3: in bf16 rows they change nothing, so they reach
# the fp32 rows only)
NOISE = {"noise": ("attention", 1e-4), "noise-attention": ("attention", 1e-6), "noise-mlp": ("mlp", 1e-6)}
SHARD_FAULT_BYTES = 4  # shard-offset: one fp32 element (two bf16 ones)
DIT_FAULTS = {
    "shard": "the last rank's shard zeroed in the final gather",
    "rope": "RoPE rows off by one on every rank > 0 (rank r reads positions start-1 .. stop-2)",
    "heads": "two heads swapped inside the Ulysses all-to-all (q, k and v of the last rank's first two heads)",
    "noise": "1e-4 relative noise (std 1e-4 x rms) on the last rank's attention output",
    "noise-attention": "1e-6 relative noise on the last rank's attention output (fp32 rows)",
    "noise-mlp": "1e-6 relative noise on the last rank's MLP output in every block (fp32 rows)",
    "lora-twice": "the LoRA applied twice on the last rank (LoRA rows)",
    "lora-missing": "the LoRA missing on the last rank (LoRA rows)",
    "shard-offset": f"the last rank's slice of block 0 taken {SHARD_FAULT_BYTES} bytes off its offset (sharded rows)",
    "shard-order": "two ranks' slices of block 0 swapped in the last rank's gather (sharded rows)",
}
SHARDINGS = ("replicated", "sharded")
OVERRIDE_SCALE = 0.5  # the override rows' attention: upstream's, halved
# a rank's LoRA verdict, as it reports it (report(rank) % 8)
LORA_CODES = {0: None, 1: "once", 2: "missing", 3: "wrong", 4: "unchecked"}


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


def _conditioning(layout, seed, text=TEXT_LEN):
    """(positive, negative) conditioning as the H3 nodes build it, with random tensors in place of encoders, for a
    prompt of `text` tokens."""
    import torch
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g)

    # vision-pad runs inside the text
    extras = {"minimax_token_tags": torch.tensor([[1, 1, 0, 0, 0] + [1] * (text - 5)])}
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
    positive = [[randn(1, text, TINY["text_dim"]), dict(extras)]]
    negative = [[randn(1, text, TINY["text_dim"]), dict(extras)]]
    return positive, negative


class _Capture:
    """Outermost DIFFUSION_MODEL wrapper: keeps a copy of every forward's [video, audio] output."""

    def __init__(self):
        self.outputs = []

    def __call__(self, executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        self.outputs.append([o.detach().float().cpu().clone() for o in out])
        return out


def _prepare(patcher, layout, seed, text=TEXT_LEN):
    """A clone of patcher with a fresh capture wrapper, and the sampling inputs for `layout`."""
    import comfy.nested_tensor
    import comfy.patcher_extension
    import comfy.sample
    import torch
    positive, negative = _conditioning(layout, seed, text)
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


def _dit_metrics(single, parallel):
    """Metrics of every DiT output (video, audio) in every forward, and the worst of each over them.

    Each output is judged on its own scale in each forward (an audio error must not hide under the video's
    peak, nor a late forward's under an early one's): {"video": {..., "worst_forward"}, "audio": {...}}, and
    the row's figures are the worst of those (largest max_abs, max_rel, rel_rms; smallest cos).
    """
    if len(single) != len(parallel) or not single:
        bad = common.BAD
        return {name: dict(bad, worst_forward=None) for name in DIT_OUTPUTS}, dict(bad, worst="forward count")
    per = {}
    for o, name in enumerate(DIT_OUTPUTS):
        fwd = [common.metrics([[s[o]]], [[p[o]]]) for s, p in zip(single, parallel)]
        rels = [m["max_rel"] for m in fwd]
        per[name] = {"max_abs": common.worst(m["max_abs"] for m in fwd), "max_rel": common.worst(rels),
                     "cos": -common.worst(-m["cos"] for m in fwd), "rel_rms": common.worst(m["rel_rms"] for m in fwd),
                     "worst_forward": max(range(len(rels)), key=lambda i: float("inf") if rels[i] != rels[i] else rels[i])}
    worst = max(DIT_OUTPUTS, key=lambda n: float("inf") if per[n]["max_rel"] != per[n]["max_rel"] else per[n]["max_rel"])
    row = {"max_abs": common.worst(p["max_abs"] for p in per.values()), "max_rel": per[worst]["max_rel"],
           "cos": -common.worst(-p["cos"] for p in per.values()), "rel_rms": common.worst(p["rel_rms"] for p in per.values()),
           "worst": f"{worst}, forward {per[worst]['worst_forward']}" if per[worst]["max_rel"] != 0 else "-"}
    return per, row


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


def _break_lora(w, fault, lora_patches):
    """--inject-fault lora-twice / lora-missing: the last rank's DiT copy gets the LoRA twice, or not at all (threads:
    the ranks' copies live in this process; the configuration is installed and checked first, by a real command)."""
    w.runtime.run("dit_empty_cache", None, configs=[w.config])
    last = w.runtime.contexts[-1].configs[w.config.id].patcher
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


def _seq_len(layout, seed, text=TEXT_LEN):
    import comfy.ldm.minimax.model
    extras = _conditioning(layout, seed, text)[0][0][1]
    layout_cls = comfy.ldm.minimax.model.PackedLayout
    options = {"keyframes": extras.get("minimax_keyframes"), "refs": extras.get("minimax_refs")}
    # the pin places a last-frame keyframe by the clip's frame count; upstream 0.33.0 dropped the argument (its
    # anchors count from the target timeline), so it is passed only where the layout takes it
    if "frame_count" in inspect.signature(layout_cls.__init__).parameters:
        options["frame_count"] = extras.get("minimax_frame_count")
    return layout_cls(text, VIDEO_SHAPE[2], VIDEO_SHAPE[3], VIDEO_SHAPE[4], AUDIO_SHAPE[3], **options).seq_len


class _DitFault:
    """comfy.multinpu_dit.fault_hook of every parity pass: the fault `name` ("none": none), and the probe of what
    each rank does, measured on that rank: `lora` ({weight key: (digest of one device's LoRA'd weight, digest of
    the base weight)}) is checked against the weights each block computes with as it starts, and the calls of
    the user attention override (attention(), set as the override of the override rows) are counted per rank.
    report(rank): the rank's LoRA verdict (LORA_CODES) + 8 x its override calls in the forward. Counts its
    strikes in `fired`. Pickled to the worker processes with each forward."""

    def __init__(self, name, lora=None):
        self.name = name
        self.fired = 0
        self.lora = lora or {}
        self.seen = {}            # rank -> {key: "once" | "missing" | "wrong"}, this forward
        self.override_calls = {}  # rank -> calls of attention(), this forward
        self._thread_rank = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["seen"], state["override_calls"], state["_thread_rank"] = {}, {}, {}
        return state

    def __call__(self, stage, state, t):
        import torch
        comm = state.comm
        last = comm.rank == comm.world_size - 1
        if stage == "rank":
            self._start_rank(state, t)
            return t
        if self.name == "rope" and stage == "rope" and comm.rank > 0:
            self.fired += 1
            return torch.roll(t, 1, dims=1)  # rank r reads the RoPE rows of positions start-1 .. stop-2
        if self.name == "heads" and stage == "ulysses" and last and t.shape[1] > 1:
            self.fired += 1
            return t[:, [1, 0] + list(range(2, t.shape[1]))]  # q, k, v of its first two heads trade places
        if NOISE.get(self.name, (None,))[0] == stage == "attention" and last:
            return self._noise(t)
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

    def _noise(self, t):
        import torch
        self.fired += 1
        g = torch.Generator().manual_seed(self.fired)
        noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
        return t + (noise * NOISE[self.name][1] * t.float().pow(2).mean().sqrt().item()).to(t.device, t.dtype)

    def _start_rank(self, state, dm):
        """Stage "rank": this rank's forward starts on `dm`; hooks on its modules, removed as the forward ends."""
        rank = state.comm.rank
        self._thread_rank[threading.get_ident()] = rank
        self.seen[rank], self.override_calls[rank] = {}, 0
        handles = []
        if self.lora:
            for i, block in enumerate(dm.blocks):
                keys = [k for k in self.lora if k.startswith(f"blocks.{i}.")]
                if keys:
                    handles.append(block.register_forward_pre_hook(
                        lambda module, args, keys=keys, prefix=f"blocks.{i}.": self._check_lora(rank, module, keys,
                                                                                                prefix)))
        if NOISE.get(self.name, (None,))[0] == "mlp" and rank == state.comm.world_size - 1:
            for block in dm.blocks:
                handles.append(block.mlp.register_forward_hook(lambda module, args, out: self._noise(out)))
        state.cleanup.extend(h.remove for h in handles)

    def _check_lora(self, rank, module, keys, prefix):
        seen = self.seen[rank]
        if keys[0] in seen:
            return  # once per forward: the weights do not change between a block's calls
        params = dict(module.named_parameters())
        for k in keys:
            got = _digest(params[k[len(prefix):]])
            once, base = self.lora[k]
            seen[k] = "once" if got == once else "missing" if got == base else "wrong"

    def attention(self, func, *args, **kwargs):
        """The user attention override of the override rows, counted per rank: upstream's attention halved (an
        exact scaling, which no split changes; a rank that ran without it would differ by its whole output)."""
        rank = self._thread_rank.get(threading.get_ident(), 0)
        self.override_calls[rank] = self.override_calls.get(rank, 0) + 1
        return func(*args, **kwargs) * OVERRIDE_SCALE

    def report(self, rank):
        seen = self.seen.get(rank, {})
        if not self.lora:
            code = 0
        elif len(seen) != len(self.lora):
            code = 4
        else:
            verdicts = set(seen.values())
            code = 1 if verdicts == {"once"} else 2 if verdicts == {"missing"} else 3
        return code + 8 * self.override_calls.get(rank, 0)


def _digest(t):
    return hashlib.sha256(t.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:24]


def _other_attention():
    """Another of upstream's attention backends than the default (torch's SDPA, attention_pytorch, or
    attention_split where SDPA is the default): the same attention in another rounding order."""
    import comfy.ldm.modules.attention as attention
    return attention.attention_pytorch if attention.optimized_attention is not attention.attention_pytorch \
        else attention.attention_split


def _attention_variant(func, *args, **kwargs):
    """An optimized_attention_override running _other_attention(): what one device's output moves by when a user
    switches backends (part of the floor)."""
    return _other_attention()(*args, **kwargs)


def _reaches(fault, variant, attention, npu_count, transport="threads", sharding="replicated"):
    """Whether a row runs the code `fault` corrupts (a fault pass runs only those rows; "none" runs all)."""
    if fault.startswith("shard-"):
        return sharding == "sharded"
    if fault.startswith("lora"):
        return variant.lora and transport == "threads"  # processes: no device copy here to break
    if fault == "heads":  # the Ulysses all-to-all
        return attention == "auto" and TINY["num_attention_heads"] % npu_count == 0
    if fault in NOISE and NOISE[fault][1] < 1e-4:
        return variant.dtype != "bfloat16"  # below one bf16 rounding step: nothing changes in bf16
    return True


class _Variant:
    """One model variant the rows run: its dtype name, the patcher, whether it carries the LoRA and whether the
    user attention override is set."""

    def __init__(self, dtype, patcher, lora=False, override=False):
        self.dtype, self.patcher, self.lora, self.override = dtype, patcher, lora, override

    @property
    def name(self):
        return self.dtype + (" + LoRA" if self.lora else "") + (" + attention override" if self.override else "")


def _gate(device_type, floor):
    """(text, max_rel threshold or None for exact) of a row on `device_type` given its measured floor."""
    if device_type == "cpu":
        return "max_abs == 0", None
    limit = GATE_MARGIN * floor
    return f"max_rel <= {limit:.3g} ({GATE_MARGIN} x floor {floor:.3g}; unmeasured on hardware)", limit


def _plan_bytes(row, activation_bytes):
    """Bytes each rank receives in the row's forwards by the cost model (the sharded weights' gathers apart)."""
    from h3kit.runtime import costmodel
    ex = costmodel.exchange_elements(row["seq_len"], row["npu_count"], hidden=TINY["hidden_size"],
                                     heads=TINY["num_attention_heads"], head_dim=TINY["attention_head_dim"],
                                     blocks=TINY["num_layers"], attention=row["attention"])
    return [x * activation_bytes * row["forwards"] for x in ex["per_device"]]


class _Reference:
    """One device's run of a variant and layout: its outputs, seconds, INT8 arm calls, the override's calls per
    forward, and (for the variants that define it) the floor: how far its output moves run again and with another
    attention backend."""

    def __init__(self, variant, layout, args, lora_keys, measure_floor):
        import comfy.multinpu_dit  # noqa: F401  (the tree's module, imported before any hook is set)
        probe = _DitFault("none")
        m, capture, inputs = _prepare(variant.patcher, layout, args.seed, text_len(args.npu_count))
        if variant.override:
            m.model_options["transformer_options"]["optimized_attention_override"] = probe.attention
        weights = _WeightProbe(lora_keys) if variant.lora else None
        if weights:
            weights.attach(0, m.model.diffusion_model)
        calls = _int8_calls() if args.weights == "int8" else {}
        t0 = time.perf_counter()
        self.outputs = _run(m, capture, inputs, args.steps, args.seed)
        self.seconds = time.perf_counter() - t0
        self.int8_calls = _calls_since(calls) if args.weights == "int8" else {}
        self.override_calls = probe.override_calls.get(0, 0) // max(1, len(self.outputs))
        self.lora_weights = None
        if weights:
            weights.detach()
            self.lora_weights = weights.seen[0]
        self.floor = None
        if measure_floor:
            m, capture, inputs = _prepare(variant.patcher, layout, args.seed, text_len(args.npu_count))
            again = _run(m, capture, inputs, args.steps, args.seed)
            m, capture, inputs = _prepare(variant.patcher, layout, args.seed, text_len(args.npu_count))
            m.model_options["transformer_options"]["optimized_attention_override"] = _attention_variant
            other = _run(m, capture, inputs, args.steps, args.seed)
            self.floor = {"run_to_run": _dit_metrics(self.outputs, again)[1]["max_rel"],
                          "attention_variant": _dit_metrics(self.outputs, other)[1]["max_rel"]}


def _dit_row(ctx, variant, layout, attention, sharding, fault, hook, twins):
    """One parallel run of `variant` on `layout` and its verdict. twins: {attention: outputs} of the replicated
    runs, which a sharded row must equal exactly (filled in by the replicated rows)."""
    args = ctx.args
    ref = ctx.references[(variant.name, layout)]
    floor_ref = ctx.references.get((variant.dtype, layout), ref)
    outputs, row = _parallel_run(ctx.node, variant, layout, attention, sharding, args, hook=hook, fault=fault,
                                 lora_patches=ctx.lora_patches)
    if sharding == "replicated":
        twins[attention] = outputs
    per_output, worst = _dit_metrics(ref.outputs, outputs)
    n, forwards = args.npu_count, len(outputs)
    row.update({"component": "dit", "layout": layout, "dtype": variant.dtype, "lora": variant.lora,
                "attention_override": variant.override, "weights": args.weights, "transport": args.transport,
                "fault": fault if fault != "none" else None, "npu_count": n, "device_type": args.device_type,
                "seq_len": _seq_len(layout, args.seed, text_len(n)), "forwards": forwards, **worst,
                "outputs": per_output,
                "floor": floor_ref.floor, "seconds_single": round(ref.seconds, 4)})
    floor = max(floor_ref.floor.values()) if floor_ref.floor else 0.0
    row["gate"], limit = _gate(args.device_type, floor)
    within = row["max_abs"] == 0 if limit is None else row["max_rel"] <= limit
    # measured on each rank: every block of every forward ran there, and it received data
    row["split"] = (row["parallel_forwards"] == forwards > 0 and row["rank_forwards"] == [forwards] * n
                    and len(row["bytes_received"]) == n and all(b > 0 for b in row["bytes_received"]))
    plan = _plan_bytes(row, ctx.activation_bytes)
    row["bytes_received_plan"] = plan
    received = [b - w for b, w in zip(row["bytes_received"], row["weight_bytes_received"])]
    checks = [(row["split"], f"not split over every device (forwards per rank {row['rank_forwards']} of {forwards}, "
                             f"bytes received per rank {row['bytes_received']})"),
              (received == plan, f"bytes received per rank {received}, the plan's {plan}"),
              (within, f"{row['gate']} missed: max_abs {row['max_abs']:.3g}, max_rel {row['max_rel']:.3g} "
                       f"({row['worst']})")]
    if sharding == "sharded":
        twin = _dit_metrics(twins[attention], outputs)[1]
        row["max_abs_vs_replicated"] = twin["max_abs"]
        row["gate"] += ", max_abs == 0 against the replicated run"
        checks.append((twin["max_abs"] == 0, f"differs from the replicated run by max_abs {twin['max_abs']:.3g} "
                                             f"({twin['worst']})"))
        checks.append((row["weight_bytes"] > 0, "no weights were gathered"))
    reports = row.pop("rank_reports")
    if variant.lora:
        # each rank's own verdict in each forward: the worst one counts
        per_rank = [sorted({r[i] % 8 for r in reports}) for i in range(n)]
        row["lora_ranks"] = [LORA_CODES[c[-1]] if c else None for c in per_rank]
        checks.append((row["lora_ranks"] == ["once"] * n,
                       "LoRA per device: " + ", ".join(str(v) for v in row["lora_ranks"])))
    if variant.override:
        row["override_calls"] = [sum(r[i] // 8 for r in reports) for i in range(n)]
        expected = ref.override_calls * forwards
        checks.append((row["override_calls"] == [expected] * n and expected > 0,
                       f"attention override calls per rank {row['override_calls']}, one device's {expected}"))
    if args.weights == "int8":
        checks.append(_int8_check(row, ref.int8_calls, row.pop("int8_calls")))
    return common.judge(row, checks)


def _rows_of(ctx, variant, fault):
    """The rows of one variant in a pass: every layout (the first only for LoRA and override variants, which
    concern the device copies and the attention call, not the layout), both attention exchanges with replicated
    weights, and the default exchange with sharded weights."""
    args = ctx.args
    hook = ctx.hook
    rows = []
    for layout in (args.layouts[:1] if variant.lora or variant.override else args.layouts):
        twins = {}
        for attention in ("auto", "kv_gather"):
            for sharding in args.sharding:
                if sharding == "sharded" and attention != "auto":
                    continue  # where the weights live is independent of the attention exchange
                if not _reaches(fault, variant, attention, args.npu_count, args.transport, sharding):
                    continue
                if sharding == "sharded" and attention not in twins:
                    # its replicated twin, not a row in this pass (the fault does not reach it)
                    comfy_hook = _set_hook(_DitFault("none"))
                    twins[attention] = _parallel_run(ctx.node, variant, layout, attention, "replicated", args,
                                                     hook=comfy_hook)[0]
                    _set_hook(hook)
                rows.append(_dit_row(ctx, variant, layout, attention, sharding, fault, hook, twins))
    return rows


def _set_hook(hook):
    import comfy.multinpu_dit
    comfy.multinpu_dit.fault_hook = hook
    return hook


class _Context:
    pass


def _drop_unsupported(args, runtime) -> list[str]:
    """Take out of `args` the rows the process group cannot run; a note for each."""
    notes = []
    if runtime is not None and args.device_type == "cpu" and "bfloat16" in args.dtypes:
        # bf16 on a CPU needs _load_dit's loader patch, which the worker processes do not share
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"]
        notes.append("bf16 rows: thread transport only on cpu (they patch this process's loader)")
    if args.override:
        args.override = False
        notes.append("attention override rows: none (the ranks cannot run another node's override, a Python object "
                     "in the server: the node refuses it on both transports, tests/test_multinpu_node.py)")
    return notes


def run_dit(args):
    common.setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multidevice
    import comfy.multinpu_dit
    import comfy.sd

    node, error = common.node_or_error(args)
    if error:
        return error
    runtime = common.start_group(args)
    notes = _drop_unsupported(args, runtime)
    ctx = _Context()
    ctx.args, ctx.node = args, node
    variants, ctx.lora_patches, lora_keys, probe_lora, params = _variants(args)
    if args.weights == "int8":
        import comfy.npu_quant
        if comfy.npu_quant.kernels_for(variants[0].patcher.load_device) is None:
            return {"ok": False, "error": {"code": "int8_arm_unavailable", "message": (
                f"the NPU INT8 arm does not run on {variants[0].patcher.load_device.type} here (it needs torch_npu on "
                f"an npu, or the CPU simulation); {comfy.npu_quant.MODE_ENV}=reference runs its reference kernels on "
                "any device")}}
    # one-device references; the plain variants also measure the floor
    ctx.references = {}
    for v in variants:
        for layout in (args.layouts[:1] if v.lora or v.override else args.layouts):
            ctx.references[(v.name, layout)] = _Reference(v, layout, args, lora_keys,
                                                          measure_floor=not (v.lora or v.override))
    if probe_lora:  # the one device's LoRA'd weights, as the rows' ranks must hold them
        lora_ref = ctx.references[(next(v.name for v in variants if v.lora), args.layouts[0])]
        probe_lora = {k: (_digest(lora_ref.lora_weights[k]), probe_lora[k]) for k in lora_keys}
    rows = []
    for fault in args.faults:
        ctx.hook = _set_hook(_DitFault(fault, probe_lora))
        for v in variants:
            # the bytes of the activations the ranks exchange: the compute dtype's
            compute = v.patcher.model.get_dtype_inference() if args.weights == "int8" else getattr(torch, v.dtype)
            ctx.activation_bytes = torch.finfo(compute).bits // 8
            rows.extend(_rows_of(ctx, v, fault))
        _set_hook(None)
    floors = {f"{d}/{lay}": r.floor for (d, lay), r in ctx.references.items() if r.floor}
    config = {"dit": TINY, "params": params, "text_len": text_len(args.npu_count), "video_latent": VIDEO_SHAPE,
              "audio_latent": AUDIO_SHAPE, "dtypes": [v.dtype for v in variants if not (v.lora or v.override)],
              "weights": args.weights, "gate": GATES[args.device_type], "gate_margin": GATE_MARGIN,
              "floor": floors, "bf16_noise": {k.split("/")[1]: f for k, f in floors.items()
                                              if k.startswith("bfloat16/")} or None,
              "steps": args.steps, "cfg": 2.0,
              "lora": {"rank": common.LORA_RANK, "keys": len(lora_keys)} if lora_keys else None,
              "attention_override": args.override,
              "devices": [str(d) for d in comfy.multidevice.get_devices()[:args.npu_count]],
              "transport": args.transport, "notes": notes,
              "faults": {f: DIT_FAULTS[f] for f in args.faults if f != "none"}}
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _variants(args):
    """The model variants of the rows: (variants, the LoRA's patches, its weight keys, {key: digest of the base
    weight} for the rank probe, parameter count)."""
    import torch
    import comfy.sd
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    with common.models_dir() as tmp:
        ckpt = os.path.join(tmp, "tiny_h3_dit.safetensors")
        _tiny_checkpoint(ckpt, args.seed, args.weights)
        # INT8: one variant, the file as saved (upstream picks its compute dtype); else one per --dtypes
        bases = ({"int8": comfy.sd.load_diffusion_model(ckpt)} if args.weights == "int8" else
                 {name: _load_dit(ckpt, dtypes[name]) for name in args.dtypes})
    variants = [_Variant(name, patcher) for name, patcher in bases.items()]
    params = sum(t.numel() for t in variants[0].patcher.model.diffusion_model.state_dict().values()
                 if t.dtype != torch.uint8)  # not the INT8 layers' comfy_quant tags
    base32 = bases.get("float32")
    lora_patches, lora_keys, base_digests = None, [], {}
    if args.lora and base32 is not None:
        lora = common.lora_state_dict(base32.model.diffusion_model.state_dict(), "blocks.", "diffusion_model.",
                                      args.seed)
        patcher, lora_patches = _apply_lora(base32, lora)
        lora_keys = sorted(k[len("diffusion_model."):] for k in patcher.patches)
        # the weights as loaded, before any run patches them in place
        weights = dict(base32.model.diffusion_model.named_parameters())
        base_digests = {k: _digest(weights[k]) for k in lora_keys}
        variants.append(_Variant("float32", patcher, lora=True))
    if args.override and base32 is not None:
        variants.append(_Variant("float32", base32, override=True))
    return variants, lora_patches, lora_keys, base_digests, params


def _parallel_run(node, variant, layout, attention, sharding, args, hook=None, fault="none", lora_patches=None):
    """One sampling through the node on args.npu_count devices with the weights `sharding`: (the DiT's outputs of
    every forward, the row's measured fields: forwards per rank, bytes received per rank, weight gathers, resident
    bytes, what each rank reported...)."""
    import comfy.multinpu_dit
    fired_before = hook.fired if hook else 0
    m, capture, inputs = _prepare(variant.patcher, layout, args.seed, text_len(args.npu_count))
    if variant.override:
        m.model_options["transformer_options"]["optimized_attention_override"] = hook.attention
    # the node exactly as a workflow runs it; only the attention mode is forced per row
    m = node.execute(model=m, npu_count=args.npu_count, weights=sharding).args[0]
    w = comfy.multinpu_dit.get_wrapper(m)
    lora_fired = (_break_lora(w, fault, lora_patches)
                  if variant.lora and fault in ("lora-twice", "lora-missing") and w else 0)
    if w is not None:
        w.attention = attention
        w.timeout = args.timeout
        w.count_bytes = True  # processes: every rank's counts (bytes, forwards, fault strikes, reports) to rank 0
    calls = _int8_calls() if args.weights == "int8" else {}
    t0 = time.perf_counter()
    outputs = _run(m, capture, inputs, args.steps, args.seed)
    seconds = time.perf_counter() - t0
    if w is not None:
        w.runtime.release()  # a thread runtime is the row's own; the process group serves every row
    heads = TINY["num_attention_heads"]
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
           "rank_reports": [list(r) for r in w.rank_reports] if w else [],
           "fault_fired": (hook.fired - fired_before if hook else 0) + lora_fired,
           "seconds_parallel": round(seconds, 4)}
    if args.weights == "int8":
        row["int8_calls"] = _calls_since(calls)
    return outputs, row


def importable_fault_class():
    """_DitFault from h3kit.runtime.parity_dit, so that worker processes can unpickle the hook sent with each
    forward (this module is imported by its package name everywhere, parity_worker.py included)."""
    return _DitFault
