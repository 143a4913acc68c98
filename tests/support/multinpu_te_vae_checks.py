"""Checks of the text-encoder split, the VAE decode across devices and weights-read-once, inside a patched tree.

    H3KIT_SIM_DEVICES=4 python multinpu_te_vae_checks.py --comfy-home TREE --out FILE [--only a,b]

Runs in the ComfyUI interpreter (comfy imports need the tree on sys.path and --cpu set first), with 4
simulated devices so the node's npu_count 4 runs. Each check records what it observed, {"ok": true,
"value": ...} or {"ok": false, "error", "traceback"}; tests/test_multinpu_te_vae.py asserts on the values.
Every weight-file read of the whole run is counted (h3kit.runtime.reads), and the tiny checkpoints come from h3kit's
tiny_models (H3KIT_TOOLKIT on sys.path).
"""

from __future__ import annotations

import collections
import os

import checks_runner  # tests/support, beside this script (its folder is on sys.path)

CHECKS = {}
_CACHE = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


def _path(name):
    return os.path.join(os.environ["H3KIT_CHECK_TMP"], name)


def _tiny(component, name, dims=None, seed=0):
    from h3kit import tiny_models
    path = _path(name)
    if not os.path.exists(path):
        tiny_models.write(component, path, seed, dims=dims)
    return path


def _clip(dims=None, name="te.safetensors"):
    import comfy.sd
    key = ("clip", name)
    if key not in _CACHE:
        _CACHE[key] = comfy.sd.load_clip([_tiny("te", name, dims)], clip_type=comfy.sd.CLIPType.MINIMAX)
    return _CACHE[key]


def _vae(name="video_vae.safetensors", component="video_vae"):
    import comfy.sd
    import comfy.utils
    key = ("vae", name)
    if key not in _CACHE:
        sd, metadata = comfy.utils.load_torch_file(_tiny(component, name), return_metadata=True)
        _CACHE[key] = comfy.sd.VAE(sd=sd, metadata=metadata)
    return _CACHE[key]


def _vae_through_loader(name):
    """A video VAE loaded by VAELoader (its cached loader records the file, as the process transport needs), from a
    folder of its own."""
    import shutil
    import folder_paths
    import nodes
    folder = _path(name + ".d")
    if not os.path.exists(os.path.join(folder, name)):
        os.makedirs(folder, exist_ok=True)
        shutil.move(_tiny("video_vae", name), os.path.join(folder, name))
    exts = folder_paths.folder_names_and_paths["vae"][1]
    folder_paths.folder_names_and_paths["vae"] = ([folder], exts)
    return nodes.VAELoader().load_vae(name)[0]


def _dit():
    import torch
    import comfy.sd
    if "dit" not in _CACHE:
        _CACHE["dit"] = comfy.sd.load_diffusion_model(_tiny("dit", "dit.safetensors"), model_options={"dtype": torch.float32})
    return _CACHE["dit"]


def _encode(clip, image=True):
    import torch
    kwargs = {"images": [torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(3))]} if image else {}
    out = clip.encode_from_tokens_scheduled(clip.tokenize("a fox in the snow", **kwargs))
    return out[0][0]


def _storages(module):
    import itertools
    return {t.untyped_storage().data_ptr() for t in itertools.chain(module.parameters(), module.buffers())}


def _bytes(module):
    import itertools
    return sum(t.numel() * t.element_size() for t in itertools.chain(module.parameters(), module.buffers()))


@check
def anchors():
    """anchor_host_copy: a move back to the host re-points at the anchors, through ModelPatcher too."""
    import torch
    import comfy.model_patcher
    import comfy.multinpu_weights as weights
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    m.register_buffer("steps", torch.arange(3.0))
    ptr = {n: t.data_ptr() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    values = {n: t.detach().clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    anchored_bytes = weights.anchor_host_copy(m)
    r = weights.share_module(m)

    def same(mod):
        items = list(mod.named_parameters()) + list(mod.named_buffers())
        return all(t.device.type == "cpu" and t.data_ptr() == ptr[n] and torch.equal(t, values[n]) for n, t in items)

    out = {"bytes": anchored_bytes, "shared_at_copy": same(r), "copy_anchored": weights.is_anchored(r[0])}
    # "meta" stands in for an accelerator: moving back from it cannot copy anything, only re-point
    r.to("meta")
    out["on_meta"] = all(t.device.type == "meta" for t in r.parameters())
    r.to("cpu")
    out["back_by_to"] = same(r)
    p = comfy.model_patcher.ModelPatcher(r, load_device=torch.device("meta"), offload_device=torch.device("cpu"))
    p.load(torch.device("meta"), full_load=True)
    out["loaded_meta"] = all(t.device.type == "meta" for t in r.parameters())
    p.detach()
    out["back_by_detach"] = same(r)
    r[0].to("meta")  # ModelPatcher's partial unload moves single modules
    r[0].to("cpu")
    out["back_by_module"] = same(r)
    # a host-side dtype round trip is not a move back from a device: upstream's path, a new tensor
    r.to(torch.float64)
    r.to(torch.float32)
    out["dtype_roundtrip_repoints"] = same(r)
    control = torch.nn.Linear(4, 4).to("meta")
    try:
        control.to("cpu")
        out["unanchored_back_from_meta"] = "copied"
    except NotImplementedError:
        out["unanchored_back_from_meta"] = "fails"
    return out


@check
def head_split():
    import comfy.multinpu_te as te
    cases = [(64, 8, 2), (64, 8, 4), (4, 2, 2), (4, 2, 4), (6, 2, 2), (6, 3, 2)]
    out = {f"{h}/{kv}/{p}": [te.head_split(h, kv, p, r) for r in range(p)] for h, kv, p in cases}
    try:
        te.head_split(4, 2, 3, 0)
        out["4/2/3"] = "split"
    except ValueError as e:
        out["4/2/3"] = str(e)
    return out


def _te_ranks(par):
    """Every rank's shard (te_config's _WorkerTE) of a parallel CLIP, set up by a real command."""
    import comfy.multinpu_te as te
    runner = te.get_runner(par)
    _encode(par, image=False)  # every rank sets its shard up (the configuration) and runs one forward
    return [c.configs[runner.config.id] for c in runner.runtime.contexts]


@check
def te_weights_shared():
    """Every rank's shard is a view into the loaded TE's host storage: one host copy for 4 ranks; the server's copy
    holds the embeddings and the vision tower, no layer."""
    import comfy.multinpu_te as te
    import comfy.multinpu_weights as weights
    clip = _clip()
    par = te.apply_tensor_parallel(clip, ["cpu"] * 4)
    held = _te_ranks(par)
    source = _storages(clip.cond_stage_model)
    decoders = [h.decoder for h in held]
    attn = [d.layers[0].self_attn for d in decoders]

    def kinds(decoder):
        out = collections.Counter()
        for name, t in decoder.layers.named_parameters():
            kind = "kv" if (".k_proj." in name or ".v_proj." in name) else "norm" if "norm" in name else "split"
            out[kind] += t.numel() * t.element_size()
        return out

    split = {k: [kinds(te.find_decoder(clip.cond_stage_model))[k], sum(kinds(d)[k] for d in decoders)]
             for k in ("split", "kv", "norm")}
    server = te.find_decoder(par.cond_stage_model)
    return {"mode": te.get_runner(par).mode, "ranks": len(held), "runtime": type(te.get_runner(par).runtime).__name__,
            "load_devices": [str(h.patcher.load_device) for h in held], "layer_bytes": split,
            "all_in_source": all(_storages(m) <= source for m in [par.cond_stage_model] + decoders),
            "own_modules": len({id(d) for d in decoders} | {id(server)}) == 5,
            "anchored": all(weights.is_anchored(d.layers[0].mlp.down_proj) for d in decoders),
            "source_bytes": _bytes(clip.cond_stage_model), "rank_bytes": [_bytes(d) for d in decoders],
            "patcher_sizes": [h.patcher.model_size() for h in held],
            "heads": [[a.num_heads, a.num_kv_heads, a.q_proj.weight.shape[0], a.k_proj.weight.shape[0],
                       a.o_proj.weight.shape[1]] for a in attn],
            "embeddings": [hasattr(d, "embed_tokens") for d in decoders],
            "server_layers": len(server.layers), "server_embeddings": hasattr(server, "embed_tokens"),
            "vision_on_server": hasattr(par.cond_stage_model.qwen3vl_32b.transformer, "visual")}


def _max_abs(a, b):
    return (a.float() - b.float()).abs().max().item()


@check
def te_same_programs():
    """The thread transport runs the text encoder's worker programs of the process transport (comfy.multinpu_group.
    PROGRAMS, by name), each rank with its own context: every te program is counted per rank over a setup and two
    encodes, whose result is compared with one device's. And multinpu_te.py has one code path."""
    import inspect
    import torch
    import comfy.multinpu_te as te
    names = ("te_config", "te_forward")
    clip = _clip({"num_attention_heads": 6, "num_key_value_heads": 2}, name="te6.safetensors")
    with checks_runner.counted_programs(names) as counted:
        ref = _encode(clip)
        par = te.apply_tensor_parallel(clip, ["cpu"] * 3)  # 6 heads over 3 ranks: tensor parallel
        first, second = _encode(par), _encode(par, image=False)
    registered, calls = counted["registered"], counted["calls"]
    runner = te.get_runner(par)
    source = inspect.getsource(te)
    return {"registered": registered, "runtime": type(runner.runtime).__module__ + "." + type(runner.runtime).__name__,
            "mode": runner.mode, "max_rel": _max_abs(first, ref) / ref.abs().max().item(),
            "second_shape": list(second.shape),
            "calls": {n: sorted(r for r, _ in c) for n, c in calls.items()},
            "contexts": {n: len({i for _, i in c}) for n, c in calls.items()},
            "rank_contexts": [id(c) for c in runner.runtime.contexts] == [i for _, i in sorted(calls["te_config"])],
            "runtime_is_none": source.count("runtime is None"),
            "thread_only": [s for s in ("ThreadGroup", "RankThreads", "attach_device_models", "device_models(",
                                        "take_inputs", "_call_processes") if s in source]}


@check
def te_fallback_split():
    """Device counts that do not divide the query heads fall back to the exact layer split."""
    import torch
    import comfy.multinpu_te as te
    out = {}
    six = _clip({"num_attention_heads": 6, "num_key_value_heads": 2}, name="te6.safetensors")
    ref = _encode(six)
    par = te.apply_tensor_parallel(six, ["cpu"] * 4)  # auto: 6 heads over 4 devices
    runner = te.get_runner(par)
    out["six_heads_4"] = {"mode": runner.mode, "ranges": runner.layer_ranges, "max_abs": _max_abs(_encode(par), ref)}
    four = _clip()
    ref = _encode(four)
    par = te.apply_tensor_parallel(four, ["cpu"] * 3)
    runner = te.get_runner(par)
    out["four_heads_3"] = {"mode": runner.mode, "ranges": runner.layer_ranges, "max_abs": _max_abs(_encode(par), ref),
                           "bytes": runner.bytes_moved}
    try:
        te.apply_tensor_parallel(four, ["cpu"] * 3, mode="tensor")
        out["forced_tensor_3"] = "applied"
    except ValueError as e:
        out["forced_tensor_3"] = str(e)
    # the intermediate layer a CLIPSetLastLayer asks for comes from the rank that holds it
    dec = te.find_decoder(four.cond_stage_model)
    embeds = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # a copy each: since 0.33.0 a block writes its result into its input (torch.add(out=x))
        single = dec(None, embeds=embeds.clone(), intermediate_output=-20, dtype=torch.float32)
        parallel = te.find_decoder(par.cond_stage_model)(None, embeds=embeds.clone(), intermediate_output=-20,
                                                         dtype=torch.float32)
        out["intermediate_max_abs"] = _max_abs(parallel[1], single[1])
        out["last_max_abs"] = _max_abs(parallel[0], single[0])
        try:
            te.find_decoder(par.cond_stage_model)(None, embeds=embeds, intermediate_output=[3, 7], dtype=torch.float32)
            out["intermediate_list"] = "returned"
        except RuntimeError as e:
            out["intermediate_list"] = str(e)
    return out


@check
def te_gqa_uneven_groups():
    """6 query heads over 3 key/value heads on 2 devices: rank 0's queries read kv 0, 0, 1 (expanded)."""
    import torch
    import comfy.multinpu_te as te
    clip = _clip({"num_attention_heads": 6, "num_key_value_heads": 3}, name="te6kv3.safetensors")
    ref = _encode(clip)
    par = te.apply_tensor_parallel(clip, ["cpu"] * 2)
    out = _encode(par)
    runner = te.get_runner(par)
    a = runner.runtime.contexts[0].configs[runner.config.id].decoder.layers[0].self_attn  # rank 0's shard
    cos = torch.nn.functional.cosine_similarity(out.flatten().double(), ref.flatten().double(), dim=0).item()
    return {"mode": te.get_runner(par).mode, "rank0": [a.num_heads, a.num_kv_heads], "cos": cos,
            "max_rel": _max_abs(out, ref) / ref.abs().max().item(), "tokens": int(ref.shape[1]),
            "rel_rms": ((out - ref).double().pow(2).mean().sqrt() / ref.double().pow(2).mean().sqrt()).item()}


@check
def te_rank_failure():
    """A rank that raises inside the split text encoder surfaces as its own error, naming the rank; the next
    encode on the same text encoder gives the result it gave before, bit for bit."""
    import torch
    import comfy.multinpu
    import comfy.multinpu_te as te
    par = te.apply_tensor_parallel(_clip(), ["cpu"] * 4, timeout=5)
    before = _encode(par)
    real = comfy.multinpu.all_reduce

    def failing(x, comm):
        if comm.rank == 2:
            raise MemoryError("simulated out of memory on rank 2")
        return real(x, comm)

    comfy.multinpu.all_reduce = failing
    try:
        _encode(par)
        out = {"raised": None}
    except MemoryError as e:
        out = {"raised": type(e).__name__, "notes": getattr(e, "__notes__", [])}
    finally:
        comfy.multinpu.all_reduce = real
    out["recovered"] = torch.equal(_encode(par), before)
    return out


def _rank0_starts_after_copies(slow_module, name, run, start_module, is_copy=lambda *args: True):
    """Slow every worker's input copy (slow_module.name, where is_copy(*args)) by 0.3 s and tell whether rank 0's
    first op (a forward pre-hook on start_module) came after all of them: the workers must copy their inputs off
    rank 0's device before rank 0 queues its own work there, where their copies would wait behind it."""
    import time
    real = getattr(slow_module, name)
    copied, started = [], []

    def slow(*args, **kwargs):
        if not is_copy(*args):
            return real(*args, **kwargs)
        time.sleep(0.3)
        out = real(*args, **kwargs)
        copied.append(time.monotonic())
        return out

    hook = start_module.register_forward_pre_hook(lambda mod, args: started.append(time.monotonic()))
    setattr(slow_module, name, slow)
    try:
        run()
    finally:
        setattr(slow_module, name, real)
        hook.remove()
    return {"copies": len(copied), "rank0_started_after": bool(copied) and bool(started) and min(started) >= max(copied)}


@check
def te_inputs_copied_before_rank0_works():
    """The command's buffer reaches the other ranks in rank 0's broadcast, which returns on rank 0 once every rank
    copied it: rank 0's first op (on its own shard) comes after every slowed-down copy."""
    import threading
    import torch
    import comfy.multinpu
    import comfy.multinpu_te as te
    par = te.apply_tensor_parallel(_clip(), ["cpu"] * 4, timeout=30)
    rank0 = _te_ranks(par)[0].decoder
    return _rank0_starts_after_copies(
        comfy.multinpu.ThreadComm, "_copy_in", lambda: _encode(par, image=False), rank0.layers[0],
        is_copy=lambda comm, t: threading.current_thread() is not threading.main_thread() and t.dtype == torch.uint8)


@check
def vae_inputs_copied_before_rank0_works():
    import torch
    import comfy.multinpu
    import comfy.multinpu_vae as mv
    par = mv.apply_decode_parallel(_vae_through_loader("video_vae_copies.safetensors"), ["cpu"] * 4, timeout=30)
    runner = mv.get_runner(par)
    runner.runtime.run("vae_decode", {"config": runner.config.id, "chunks": []}, configs=[runner.config])  # set up
    start = runner.runtime.contexts[0].configs[runner.config.id].model.post_quant_conv  # worker rank 0's own copy
    z = torch.randn(1, 24, 22, 2, 2, generator=torch.Generator().manual_seed(2))  # 4 chunks: one per rank
    # ranks 1-3 copy the command's latents (the broadcast host buffer) before worker rank 0 starts decoding
    return _rank0_starts_after_copies(comfy.multinpu.ThreadComm, "_copy_in", lambda: par.decode(z), start,
                                      is_copy=lambda comm, t: comm.rank > 0)


@check
def te_patch_after_node_refused():
    """A LoRA added to the parallel CLIP (after the node) names split weights: its load is refused, clearly."""
    import torch
    import comfy.multinpu_te as te
    clip = _clip()
    full = {k: t.shape for k, t in clip.cond_stage_model.state_dict().items()}
    par = te.apply_tensor_parallel(clip, ["cpu"] * 2, timeout=5)
    lora = par.clone()
    key = next(k for k in lora.patcher.model.state_dict() if k.endswith("embed_tokens.weight"))
    w = lora.patcher.model.state_dict()[key]
    lora.patcher.add_patches({key: ("diff", (torch.zeros_like(w),))}, 1.0)
    out = {"patched": len(lora.patcher.patches)}
    try:
        _encode(lora, image=False)
        out["raised"] = None
    except RuntimeError as e:
        out["raised"] = str(e)
    # a LoRA file's text-encoder keys name the ranks' layers: through upstream's loader they map onto the names the
    # server's copy keeps (no memory), and the load is refused, not the LoRA left out
    import comfy.sd
    sd = par.cond_stage_model.state_dict()
    layer = next(k for k in full if ".layers.0." in k and k.endswith("q_proj.weight"))
    held = sum(t.nbytes for t in sd.values() if t.device.type != "meta")
    out.update(layer_meta=layer in sd and sd[layer].device.type == "meta", size_is_held=par.patcher.model_size() == held)
    _, with_lora = comfy.sd.load_lora_for_models(
        None, par, {f"text_encoders.{layer[:-len('.weight')]}.diff": torch.zeros(full[layer])}, 0, 1.0)
    out["lora_patched"] = sorted(with_lora.patcher.patches)
    try:
        _encode(with_lora, image=False)
        out["lora_raised"] = None
    except RuntimeError as e:
        out["lora_raised"] = str(e)
    out["plain_still_runs"] = list(_encode(par, image=False).shape)
    return out


@check
def loads_with_rank0():
    """CLIP.load_model and VAE.decode load every rank's copy (load_models_gpu via the patches entry)."""
    import torch
    import comfy.model_management as mm
    import comfy.multinpu_te as te
    import comfy.multinpu_vae as mv
    import comfy.multinpu_weights as weights
    par = te.apply_tensor_parallel(_clip(), ["cpu"] * 4)
    shards = [h.patcher for h in _te_ranks(par)]  # each rank loads its own shard in its forward
    loaded = [lm.model for lm in mm.current_loaded_models]
    vae = mv.apply_decode_parallel(_vae_through_loader("video_vae_loads.safetensors"), ["cpu"] * 4)
    vae.decode(torch.randn(1, 24, 12, 2, 2))
    loaded_after = [lm.model for lm in mm.current_loaded_models]
    runner = mv.get_runner(vae)
    ranks = [c.configs[runner.config.id].patcher for c in runner.runtime.contexts]  # each rank's own decoder
    return {"te": [any(p is m for m in loaded) for p in [par.patcher] + shards],
            "vae": [any(p is m for m in loaded_after) for p in ranks]}


@check
def vae_weights_shared():
    """The VAE copies of ranks 1-3 (replicas) share the loaded host copy and return to it after a load/unload
    cycle."""
    import torch
    import comfy.multinpu_vae as mv
    vae = _vae_through_loader("video_vae_shared.safetensors")
    par = mv.apply_decode_parallel(vae, ["cpu"] * 4)
    runner = mv.get_runner(par)
    runner.runtime.run("vae_decode", {"config": runner.config.id, "chunks": []}, configs=[runner.config])  # set up
    replicas = [c.configs[runner.config.id].patcher for c in runner.runtime.contexts[1:]]
    source = _storages(vae.first_stage_model)
    out = {"replicas": len(replicas), "load_devices": [str(p.load_device) for p in replicas],
           "all_in_source": all(_storages(m) <= source for m in [par.first_stage_model] + [p.model for p in replicas])}
    for p in replicas:  # what a real device does to the host side: load away, unload back
        p.load(torch.device("meta"), full_load=True)
    out["loaded_away"] = all(next(p.model.parameters()).device.type == "meta" for p in replicas)
    for p in replicas:
        p.detach()
    out["back_in_source"] = all(_storages(p.model) <= source for p in replicas)
    z = torch.randn(1, 24, 12, 2, 3, generator=torch.Generator().manual_seed(1))
    out["decode_max_abs"] = _max_abs(par.decode(z), vae.decode(z))
    return out


@check
def vae_same_programs():
    """The thread transport runs the VAE's worker programs of the process transport (comfy.multinpu_group.PROGRAMS,
    by name), each rank with its own context and its own copy of the decoder: counted per rank over a setup, a
    decode of 2 chunks and a single-frame decode, both equal to one device's. And multinpu_vae.py has one code path
    (no thread-only branch left)."""
    import inspect
    import torch
    import comfy.multinpu_vae as mv
    names = ("vae_config", "vae_decode")
    vae = _vae_through_loader("video_vae_programs.safetensors")
    z = torch.randn(1, 24, 12, 2, 3, generator=torch.Generator().manual_seed(7))  # 2 chunks
    with checks_runner.counted_programs(names) as counted:
        par = mv.apply_decode_parallel(vae, ["cpu"] * 3, timeout=60)
        runner = mv.get_runner(par)
        max_abs = [_max_abs(par.decode(z), vae.decode(z)), _max_abs(par.decode(z[:, :, :1]), vae.decode(z[:, :, :1]))]
    registered, calls = counted["registered"], counted["calls"]
    held = [c.configs[runner.config.id] for c in runner.runtime.contexts]
    source = inspect.getsource(mv)
    return {"registered": registered, "runtime": type(runner.runtime).__module__ + "." + type(runner.runtime).__name__,
            "calls": {n: sorted(r for r, _ in c) for n, c in calls.items()},
            "contexts": {n: len({i for _, i in c}) for n, c in calls.items()}, "max_abs": max_abs,
            "counts": {"chunks": runner.chunks, "single_frames": runner.single_frames,
                       "chunk_ranks": runner.chunk_ranks},
            "own_copies": len({id(h.model) for h in held} | {id(vae.first_stage_model), id(par.first_stage_model)}),
            "own_patchers": len({id(h.patcher) for h in held}),
            "load_devices": [str(h.patcher.load_device) for h in held],
            "runtime_is_none": source.count("runtime is None"),
            "thread_only": [s for s in ("ThreadGroup", "RankThreads", "replicas", "decode_wave", "_pool")
                            if s in source]}


@check
def dit_weights_shared():
    """The DiT copies of ranks 1-3 (replicas) share the loaded host copy and return to it after a load/unload cycle
    (issue 5's gap)."""
    import torch
    import comfy.multinpu_dit as sp
    patcher = _dit()
    m = sp.apply_sequence_parallel(patcher, [torch.device("cpu")] * 4)
    w = sp.get_wrapper(m)
    w.runtime.run("dit_empty_cache", None, configs=[w.config])  # every rank sets up its own copy (a real command)
    replicas = [c.configs[w.config.id].patcher for c in w.runtime.contexts[1:]]
    source = _storages(patcher.model)
    out = {"replicas": len(replicas), "all_in_source": all(_storages(r.model) <= source for r in replicas)}
    for r in replicas:
        r.load(torch.device("meta"), full_load=True)
    out["loaded_away"] = all(next(r.model.parameters()).device.type == "meta" for r in replicas)
    for r in replicas:
        r.detach()
    out["back_in_source"] = all(_storages(r.model) <= source for r in replicas)
    return out


class _StandInRuntime:
    """The process transport's runtime as apply_tensor_parallel / apply_decode_parallel use it, in this process:
    each command computes what the workers would, on the host from the plain (unsplit) models, as one device does,
    and is recorded."""

    def __init__(self, clip=None, vae=None):
        import types
        self.world_size = 2
        self.spec = types.SimpleNamespace(backend="hccl")
        self.clip, self.vae, self.calls = clip, vae, []

    def runtime_for(self, devices, primary, what, timeout):
        return self

    def describe(self):
        return "2 processes (hccl)"

    def run(self, name, payload, configs):
        import torch
        import comfy.ldm.minimax.vae
        import comfy.multinpu_te as te
        import comfy.text_encoders.llama
        self.calls.append(name)
        if name == "te_forward":
            decoder = te.find_decoder(self.clip.cond_stage_model)
            inputs = te._copy_to(payload["kwargs0"], torch.device("cpu"), [])  # a worker computes on its own copy
            return tuple(comfy.text_encoders.llama.Llama2_.forward(decoder, None, **inputs)), None, 0
        assert name == "vae_decode", name
        model = self.vae.first_stage_model
        return [comfy.ldm.minimax.vae.MiniMaxH3VideoVAE._adaptive_decode(model, c).cpu() for c in payload["chunks"]]


def _parts(names, depth):
    """Parameter and buffer names cut to their part (the first `depth` components, fewer before a layer index)."""
    parts = set()
    for n in names:
        cut = []
        for c in n.split(".")[:depth]:
            if c.isdigit():
                break
            cut.append(c)
        parts.add(".".join(cut))
    return sorted(parts)


def _on_device(module, device):
    import itertools
    return [n for n, t in itertools.chain(module.named_parameters(), module.named_buffers()) if t.device == device]


class _StandInAccelerator:
    """"meta" stands in for device 0 as the load device of the server's copies: every load ComfyUI makes of one
    of them during a command places it there for real (load_models_gpu, upstream's loader), and what it placed is
    recorded; then the copy goes back to its host weights (anchored: a move back from a device re-points) and the
    command computes on the host, where the stand-in runtime's results can be compared with one device's."""

    def __init__(self, patchers):
        import torch
        self.meta, self.host = torch.device("meta"), torch.device("cpu")
        self.patchers = patchers
        self.placed = []

    def __enter__(self):
        import comfy.model_management as mm
        self.real_load, self.real_free = mm.load_models_gpu, mm.get_free_memory

        def free(dev=None, torch_free_too=False):
            if dev is not None and dev.type == "meta":
                return (2**40, 2**40) if torch_free_too else 2**40
            return self.real_free(dev, torch_free_too)

        def unload(p):  # upstream's unload frees the real devices only
            for i in reversed(range(len(mm.current_loaded_models))):
                if mm.current_loaded_models[i].model is p:
                    mm.current_loaded_models.pop(i).model_unload()

        def load(models, *args, **kwargs):
            for p in models:
                if any(p is q for q in self.patchers):
                    unload(p)
                    p.load_device = self.meta
                    self.real_load([p], *args, **kwargs)
                    self.placed += _on_device(p.model, self.meta)
                    unload(p)
                    p.load_device = self.host
            return self.real_load(models, *args, **kwargs)

        mm.load_models_gpu, mm.get_free_memory = load, free
        return self

    def __exit__(self, *exc):
        import comfy.model_management as mm
        mm.load_models_gpu, mm.get_free_memory = self.real_load, self.real_free


@check
def process_transport_server_copies():
    """With the process transport the server runs only the non-parallel parts of the text encoder (the embeddings
    and the vision tower) and of the video VAE (the encoder): what its copies place on the device during an encode
    with and without an image, a decode of several chunks, of a single frame and an encode, and what worker rank 0
    holds (its configuration loaded here, with a stand-in context)."""
    import types
    import torch
    import comfy.model_management as mm
    import comfy.multinpu_te as te
    import comfy.multinpu_vae as mv
    out = {}
    clip = _clip(name="te_proc.safetensors")
    one_no_image, one_image = _encode(clip, image=False), _encode(clip, image=True)
    mm.unload_model_and_clones(clip.patcher, all_devices=True)
    runtime = _StandInRuntime(clip=clip)
    with checks_runner.serving(runtime):
        par = te.apply_tensor_parallel(clip, None)
    for image in (False, True):
        with _StandInAccelerator([par.patcher]) as acc:
            cond = _encode(par, image=image)
        out[f"te_image_{image}"] = {"parts": _parts(acc.placed, 4), "layers": sum(".layers." in n for n in acc.placed),
                                    "max_abs": _max_abs(cond, one_image if image else one_no_image)}
    out["te_calls"] = list(runtime.calls)
    out["te_server_parts"] = _parts([n for n, _ in par.cond_stage_model.named_parameters()], 4)
    context = types.SimpleNamespace(rank=0, spec=types.SimpleNamespace(world_size=2), device=torch.device("cpu"))
    held = te._load_on_worker(context, None, te.get_runner(par).config.payload)
    out["te_worker0_parts"] = _parts([n for n, _ in held.patcher.model.named_parameters()], 2)
    mm.unload_all_models()

    vae = _vae_through_loader("video_vae_proc.safetensors")
    z = torch.randn(1, 24, 12, 2, 3, generator=torch.Generator().manual_seed(4))  # 2 chunks
    image = torch.rand(1, 32, 48, 3, generator=torch.Generator().manual_seed(5))
    video = torch.rand(9, 32, 48, 3, generator=torch.Generator().manual_seed(6))
    ones = [vae.decode(z), vae.decode(z[:, :, :1]), vae.encode(image), vae.encode(video)]
    mm.unload_model_and_clones(vae.patcher, all_devices=True)
    runtime = _StandInRuntime(vae=vae)
    with checks_runner.serving(runtime):
        pv = mv.apply_decode_parallel(vae, None)
    for name, run, ref in (("decode", lambda: pv.decode(z), ones[0]),
                           ("decode_1", lambda: pv.decode(z[:, :, :1]), ones[1]),
                           ("encode_image", lambda: pv.encode(image), ones[2]),
                           ("encode_video", lambda: pv.encode(video), ones[3])):
        with _StandInAccelerator([pv.patcher]) as acc:
            result = run()
        out[f"vae_{name}"] = {"parts": _parts(acc.placed, 1), "max_abs": _max_abs(result, ref)}
    out["vae_calls"] = list(runtime.calls)
    runner = mv.get_runner(pv)
    out["vae_counts"] = {"chunks": runner.chunks, "single_frames": getattr(runner, "single_frames", None)}
    held = mv._load_on_worker(types.SimpleNamespace(rank=0, device=torch.device("cpu")), None, runner.config.payload)
    patcher = held.patcher if hasattr(held, "patcher") else held.vae.patcher  # before: the whole VAE's
    out["vae_worker0_parts"] = _parts(_on_device(patcher.model, torch.device("cpu")), 1)
    mm.unload_all_models()
    return out


@check
def node_wiring():
    import torch
    import comfy.multinpu_te as te
    import comfy.multinpu_vae as mv
    import comfy_extras.nodes_multinpu as nodes_multinpu
    node = nodes_multinpu.MultiNPUParallelConfigNode
    clip, audio = _clip(), _vae("audio_vae.safetensors", "audio_vae")
    vae = _vae_through_loader("video_vae_node.safetensors")  # the ranks load what a cached loader loaded
    one = node.execute(model=_dit(), npu_count=1, clip=clip, vae=vae, audio_vae=audio).args
    four = node.execute(model=_dit(), npu_count=4, clip=clip, vae=vae, audio_vae=audio).args
    lora = clip.clone()
    key = next(k for k in lora.cond_stage_model.state_dict() if k.endswith("layers.0.mlp.up_proj.weight"))
    lora.add_patches({key: (torch.zeros(32, 16),)}, 1.0)
    swapped = node.execute(model=_dit(), npu_count=4, clip=lora, vae=audio, audio_vae=vae).args
    again = node.execute(model=_dit(), npu_count=4, clip=four[1], vae=four[2]).args
    return {"one_passes_through": one[1] is clip and one[2] is vae and one[3] is audio,
            "four": {"te": te.get_runner(four[1]).mode if te.get_runner(four[1]) else None,
                     "vae_devices": mv.get_runner(four[2]).world_size if mv.get_runner(four[2]) else None,
                     "audio_same": four[3] is audio, "audio_dtype": str(four[3].vae_dtype)},
            "lora_clip_passes_through": swapped[1] is lora,
            "audio_in_vae_slot_passes_through": swapped[2] is audio and swapped[3] is vae,
            "already_split_passes_through": again[1] is four[1] and again[2] is four[2],
            "inputs_untouched": te.get_runner(clip) is None and mv.get_runner(vae) is None}


def main(argv=None):
    args = checks_runner.boot_comfy(argv)
    import comfy.utils
    from h3kit.runtime import reads
    counts = reads.count(comfy.utils)
    return checks_runner.run_checks(CHECKS, args.only, args.out,
                                    extra=lambda: {"reads": {os.path.basename(k): n for k, n in counts.items()}})


if __name__ == "__main__":
    checks_runner.exit_without_teardown(main())
