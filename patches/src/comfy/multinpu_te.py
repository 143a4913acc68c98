"""Tensor parallelism for the MiniMax H3 text encoder (Qwen3-VL) across devices, built from the loaded model.

The H3 conditioning encoder is upstream's Llama2_ decoder stack (comfy/text_encoders/llama.py) inside
MiniMaxQwen3VL (comfy/text_encoders/minimax.py): 50 layers of attention (64 query heads over 8 key/value
heads of 128) and a SwiGLU MLP (25600), no final norm. CLIP.encode_from_tokens runs the tokenizer output
through the embeddings and the vision tower (images and video blocks become embeddings plus DeepStack
features), then Llama2_.forward. No upstream file is edited: apply_tensor_parallel(clip, devices) returns
a CLIP whose Llama2_ runs on P ranks, and every rank runs upstream's Llama2_.forward on its own shard.

The ranks run the worker programs te_config (a rank sets up its shard) and te_forward (one forward) through the
runtime comfy.multinpu_process.runtime_for() gives: the server's process group (one process per device) or threads
of this process (one per device, the same programs through the same command path). Either way the server computes only what is not parallel, the token embeddings
and the vision tower (images and video blocks of the prompt), so its copy holds only those: the decoder's layers
are left out of it (server_decoder) and of what it loads onto device 0; every rank holds its shard of the layers
and no embeddings (rank 0 receives the server's inputs, the others the same without the vision inputs), so device
0 holds each weight once.

Tensor parallel (the device count P divides the query heads; H3's 64: P = 2, 4, 8):
- q, k and v projections are column-parallel by heads: rank r holds query heads r*H/P .. (r+1)*H/P - 1
  and the key/value heads those queries read (grouped-query attention: H/KV query heads share one
  key/value head; when a rank's queries cover only part of a group, the rank holds that key/value head
  too, so one head can sit on several ranks). Attention runs locally on the rank's heads.
- the o projection is row-parallel (the matching input columns): each rank's output is a partial sum,
  and one all-reduce per attention sub-layer adds them.
- MLP gate and up are column-parallel (the intermediate split), down is row-parallel: one all-reduce per
  MLP sub-layer.
- norms, residuals, RoPE, the causal mask and the DeepStack injection run on the full hidden states on
  every rank; the all-reduce sums in rank order, so the hidden states stay bit-identical on every rank.
  Embeddings and the vision tower run once, on the server (which alone holds them), and every rank starts
  from the same embeddings.
Layer split (any other P): rank r holds a contiguous range of layers, the hidden states go from each rank
to the next and the last rank broadcasts the final ones. Every layer runs unchanged on one device, so the
result is exactly the one-device result; it splits the weights, not the time.

Weights: each rank's modules are structural copies of the loaded ones whose weights are views (slices)
of the one host copy (comfy.multinpu_weights), anchored so that unloading returns them to it.

With the process transport every worker loads the same text encoder file; with threads every rank takes the
server's loaded text encoder (comfy.multinpu_models.offer/load: one object for all) and builds its own shard
modules over its host weights, so nothing is read twice and no rank moves another's weights.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

import comfy.model_management
import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group
import comfy.multinpu_models
import comfy.multinpu_process
import comfy.multinpu_runtime_base
import comfy.patcher_extension
import comfy.multinpu_weights
import comfy.text_encoders.llama

if TYPE_CHECKING:
    from comfy.sd import CLIP

MODES = ("auto", "tensor", "layers")

# A test hook (h3kit parity --inject-fault): fault_hook(stage, x, comm) -> x at each exchange of the split, "reduce"
# (a row-parallel partial sum before its all-reduce), "broadcast" (the final hidden states a layer split's last
# rank broadcast, as received) and "copy" (the hidden states handed to the next rank, as received). It travels with
# every forward to the ranks (so it must pickle: a module-level class or function); a rank's program holds its copy
# in _rank_hook (per thread: rank threads share this module), never in fault_hook, which stays the server's.
fault_hook = None
_rank_hook = threading.local()


def _fault(stage: str, x, comm):
    hook = getattr(_rank_hook, "hook", None)
    return x if hook is None else hook(stage, x, comm)


class _RankContext:
    """What one rank's modules need during a parallel forward: the communicator (None outside one).

    The communicator is per thread: a rank thread abandoned after a timeout keeps its own (broken) group
    and fails, instead of joining the next forward's group or clearing it.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self._local = threading.local()

    @property
    def comm(self):
        return getattr(self._local, "comm", None)

    @comm.setter
    def comm(self, value):
        self._local.comm = value

    def get(self):
        if self.comm is None:
            raise RuntimeError("MultiNPU: a text-encoder shard ran outside its parallel forward")
        return self.comm


class _AllReduceOutput:
    """Forward hook of a row-parallel projection: its output is this rank's partial sum; return the total."""

    def __init__(self, ctx: _RankContext):
        self.ctx = ctx

    def __call__(self, module, args, output):
        comm = self.ctx.get()
        return comfy.multinpu.all_reduce(_fault("reduce", output, comm), comm)


def head_split(heads: int, kv_heads: int, world_size: int, rank: int):
    """(query heads, key/value heads) that rank `rank` of `world_size` holds, as lists of head indices.

    Query heads are a contiguous block of heads / world_size. Key/value heads are the ones those queries
    read, in the order grouped-query attention pairs them (local query i reads local key/value head
    i // (local queries / local key/value heads)); where the block covers groups unevenly, each query
    gets its own copy of its key/value head, which is still exact.
    """
    if heads % world_size:
        raise ValueError(f"MultiNPU: {heads} query heads do not split over {world_size} devices")
    per = heads // world_size
    group = heads // kv_heads
    queries = list(range(rank * per, (rank + 1) * per))
    used = [q // group for q in queries]
    kv = sorted(set(used))
    if per % len(kv) == 0 and all(used[i] == kv[i // (per // len(kv))] for i in range(per)):
        return queries, kv
    return queries, used


def _rows(heads, head_dim):
    return [h * head_dim + i for h in heads for i in range(head_dim)]


def _column(linear, rows):
    linear.weight = comfy.multinpu_weights.select_rows(linear.weight, rows)
    if linear.bias is not None:
        linear.bias = comfy.multinpu_weights.select_rows(linear.bias, rows)
    linear.out_features = len(rows)


def _row(linear, start: int, stop: int, ctx: _RankContext):
    linear.weight = comfy.multinpu_weights.slice_parameter(linear.weight, 1, start, stop)
    linear.in_features = stop - start
    if linear.bias is not None and ctx.rank != 0:
        linear.bias = None  # added once, by rank 0, before the sum
    linear.register_forward_hook(_AllReduceOutput(ctx))


def _shard_attention(attn, ctx: _RankContext):
    a = comfy.multinpu_weights.share_module(attn)
    queries, kv = head_split(attn.num_heads, attn.num_kv_heads, ctx.world_size, ctx.rank)
    d = attn.head_dim
    _column(a.q_proj, _rows(queries, d))
    _column(a.k_proj, _rows(kv, d))
    _column(a.v_proj, _rows(kv, d))
    _row(a.o_proj, queries[0] * d, (queries[-1] + 1) * d, ctx)
    a.num_heads = len(queries)
    a.num_kv_heads = len(kv)
    a.inner_size = len(queries) * d
    return a


def _shard_mlp(mlp, ctx: _RankContext):
    m = comfy.multinpu_weights.share_module(mlp)
    sizes = comfy.multinpu.shard_sizes(mlp.gate_proj.weight.shape[0], ctx.world_size)
    start = sum(sizes[:ctx.rank])
    stop = start + sizes[ctx.rank]
    _column(m.gate_proj, range(start, stop))
    _column(m.up_proj, range(start, stop))
    _row(m.down_proj, start, stop, ctx)
    return m


class _Relay(torch.nn.Module):
    """In a layer split, a layer another rank holds: the hidden states pass through, except at the two
    places this rank takes them over (from the previous rank before its first layer, from the last rank
    after the last layer)."""

    def __init__(self, ctx: _RankContext, source=None):
        super().__init__()
        self.ctx = ctx
        self.source = source  # None: pass through; a rank: receive from it; "broadcast": the final states

    def forward(self, x, attention_mask=None, freqs_cis=None, optimized_attention=None, past_key_value=None, **kwargs):
        if self.source is None:
            return x, None
        comm = self.ctx.get()
        if self.source == "broadcast":
            return _fault("broadcast", comfy.multinpu.broadcast(x, comm, src=comm.world_size - 1), comm), None
        received = comfy.multinpu.peer_copy(torch.empty_like(x), comm, src=self.source, dst=comm.rank)
        return _fault("copy", received, comm), None


class _Tick:
    """Forward hook on each layer a rank runs: the device advanced (comfy.multinpu_clock; the layer split's last rank
    waits for the others' layers without completing a collective of its own)."""

    def __init__(self, ctx: _RankContext, index: int):
        self.ctx = ctx
        self.index = index

    def __call__(self, module, args, output):
        comfy.multinpu.tick(self.ctx.get(), f"te layer {self.index}")


class _HandOver:
    """Forward hook on the last layer a rank holds in a layer split: pass its output on (the last rank
    broadcasts the final hidden states to every rank)."""

    def __init__(self, ctx: _RankContext, dst):
        self.ctx = ctx
        self.dst = dst

    def __call__(self, module, args, output):
        comm = self.ctx.get()
        if self.dst == "broadcast":
            return (comfy.multinpu.broadcast(output[0], comm, src=comm.rank),) + tuple(output[1:])
        comfy.multinpu.peer_copy(output[0], comm, src=comm.rank, dst=self.dst)
        return output


def layer_ranges(layers: int, world_size: int) -> list:
    """[(start, stop)] of the layers each rank holds in a layer split (sizes differ by at most one)."""
    sizes = comfy.multinpu.shard_sizes(layers, world_size)
    return [(sum(sizes[:r]), sum(sizes[:r + 1])) for r in range(world_size)]


def _shard_decoder(llama, ctx: _RankContext, mode: str):
    """Rank ctx.rank's copy of a Llama2_: its shard of every layer (tensor) or its layers (layers)."""
    dec = comfy.multinpu_weights.share_module(llama)
    if mode == "tensor":
        for i, (layer, source) in enumerate(zip(dec.layers, llama.layers)):
            layer.self_attn = _shard_attention(source.self_attn, ctx)
            layer.mlp = _shard_mlp(source.mlp, ctx)
            layer.register_forward_hook(_Tick(ctx, i))
    else:
        count = len(llama.layers)
        start, stop = layer_ranges(count, ctx.world_size)[ctx.rank]
        last = ctx.rank == ctx.world_size - 1
        relays = []
        for i in range(count):
            if start <= i < stop:
                dec.layers[i].register_forward_hook(_Tick(ctx, i))
                relays.append(dec.layers[i])
            elif i == start - 1:
                relays.append(_Relay(ctx, source=ctx.rank - 1))
            elif i == count - 1:
                relays.append(_Relay(ctx, source="broadcast"))
            else:
                relays.append(_Relay(ctx))
        dec.layers = torch.nn.ModuleList(relays)
        dec.layers[stop - 1].register_forward_hook(_HandOver(ctx, "broadcast" if last else ctx.rank + 1))
    if ctx.rank != 0:
        del dec.embed_tokens  # rank 0 embeds; the others receive its embeddings
    comfy.multinpu_weights.anchor_host_copy(dec)
    return dec


def _copy_to(obj, device, moved: list):
    """obj with every tensor copied to `device`; copy=True because the ranks write into their inputs
    (Llama2_ adds the DeepStack features in place), so two ranks on one device must not share them."""
    if isinstance(obj, torch.Tensor):
        moved.append(obj.numel() * obj.element_size())
        return obj.to(device, copy=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_copy_to(o, device, moved) for o in obj)
    if isinstance(obj, dict):
        return {k: _copy_to(v, device, moved) for k, v in obj.items()}
    return obj


class TextEncoderParallel:
    """Runs a Llama2_ forward on every rank of `runtime` (program te_forward): the server's decoder (ParallelLlama)
    embeds the tokens, the ranks run the layers on their shards, and rank 0's output is the forward's.

    forwards, bytes_moved count what ran (logs, h3kit parity); with keep_rank_outputs set, rank_outputs
    holds every rank's final hidden states of the last forward (the parity check compares them).
    """

    def __init__(self, runtime, config, mode: str, layers: int = 0):
        self.runtime = runtime    # a comfy.multinpu_runtime_base.Runtime (comfy.multinpu_process.runtime_for)
        self.config = config      # the RemoteConfig every rank sets its shard up from (te_config)
        self.mode = mode
        self.world_size = runtime.world_size
        self.layers = layers
        self.layer_ranges = layer_ranges(layers, self.world_size) if mode == "layers" else None
        self.forwards = 0
        self.bytes_moved = 0
        self.keep_rank_outputs = False
        self.rank_outputs = None
        self._lock = threading.Lock()

    def __call__(self, decoder0, x, **kwargs):
        if kwargs.get("past_key_values") is not None:
            raise RuntimeError("MultiNPU: the parallel text encoder runs without a KV cache (no generation); "
                               "use npu_count 1 to generate text")
        intermediate = kwargs.get("intermediate_output")
        if self.mode == "layers" and intermediate is not None and not isinstance(intermediate, int):
            raise RuntimeError("MultiNPU: the layer-split text encoder returns one hidden layer, not a list")
        if kwargs.get("embeds") is None:
            kwargs["embeds"] = decoder0.embed_tokens(x, out_dtype=kwargs.get("dtype"))
        others = dict(kwargs, embeds_info=[])  # the other ranks need no vision inputs: the embeddings carry them
        # rank 0 runs on the server's inputs (vision embeddings included), the others on theirs; rank 0's output is
        # the command's result
        payload = {"config": self.config.id, "kwargs0": kwargs, "kwargs": others,
                   "return_output": self.keep_rank_outputs, "fault_hook": fault_hook}
        t0 = time.perf_counter()
        with self._lock:
            out, outs, moved = self.runtime.run("te_forward", payload, configs=[self.config])
        device = kwargs["embeds"].device
        out = tuple(o.to(device) if isinstance(o, torch.Tensor) else o for o in out)
        self.forwards += 1
        self.bytes_moved += moved
        if outs is not None:
            self.rank_outputs = [o.detach().cpu() for o in outs]
        logging.debug(f"MultiNPU: text encoder forward ({self.mode}) on {self.runtime.describe()} in "
                      f"{time.perf_counter() - t0:.3f} s")
        return out


class _WorkerTE:
    """A rank's shard of the text encoder for one configuration."""

    def __init__(self, ctx, decoder, patcher, digest, mode: str):
        self.ctx = ctx
        self.decoder = decoder
        self.patcher = patcher
        self.digest = digest
        self.mode = mode


@comfy.multinpu_group.program("te_config")
def _load_on_worker(context, comm, payload):
    src, mode = payload["source"], payload["mode"]
    # a worker process loads the file; a rank thread takes the server's loaded text encoder (one object for every
    # rank), so it builds its own shard modules over the host weights and never moves the shared ones
    clip = comfy.multinpu_models.load(src)
    comfy.multinpu_weights.restore_host_weights(clip.patcher)
    comfy.multinpu_models.map_file_weights(clip.cond_stage_model, src.paths)
    ctx = _RankContext(context.rank, context.spec.world_size)
    decoder = _shard_decoder(find_decoder(clip.cond_stage_model), ctx, mode)
    if hasattr(decoder, "embed_tokens"):
        del decoder.embed_tokens  # the server embeds (its copy holds the embeddings): rank 0 receives them too
    comfy.multinpu_weights.reset_load_state(decoder)
    patcher = comfy.multinpu_weights.device_patcher(clip.patcher, decoder, context.device)
    return _WorkerTE(ctx, decoder, patcher, comfy.multinpu_models.digest(src, clip.cond_stage_model, mode=mode), mode)


@comfy.multinpu_group.program("te_forward")
def _forward_on_worker(context, comm, payload):
    # this rank's copy of the server's hook, for this forward (None but in h3kit parity's fault runs)
    _rank_hook.hook = payload.get("fault_hook")
    try:
        return _forward_rank(context, comm, payload)
    finally:
        del _rank_hook.hook


def _forward_rank(context, comm, payload):
    held = context.configs[payload["config"]]
    with comfy.multinpu_runtime_base.MODEL_LOCK:  # model management is one per process, not thread-safe
        comfy.model_management.load_models_gpu([held.patcher])
    start = comm.bytes_received
    held.ctx.comm = comm
    inputs = payload["kwargs0"] if comm.rank == 0 else payload["kwargs"]
    try:
        out = held.decoder(None, **_copy_to(inputs, held.patcher.load_device, []))
    finally:
        held.ctx.comm = None
    intermediate = inputs.get("intermediate_output")
    if held.mode == "layers" and isinstance(intermediate, int) and out[1] is not None:
        # only the rank holding that layer saw it: it hands its copy to rank 0
        index = intermediate % len(held.decoder.layers)
        owner = next(r for r, (a, b) in enumerate(layer_ranges(len(held.decoder.layers), comm.world_size))
                     if a <= index < b)
        if owner != 0 and comm.rank == owner:
            comm.send(out[1].contiguous(), 0)
        elif owner != 0 and comm.rank == 0:
            out = (out[0], comm.recv(torch.empty_like(out[1]), owner)) + tuple(out[2:])
    if comm.rank != 0:
        if payload["return_output"]:
            comm.send(out[0].contiguous(), 0)
        return None
    outs = None
    if payload["return_output"]:
        outs = [out[0]] + [comm.recv(torch.empty_like(out[0]), r) for r in range(1, comm.world_size)]
    return tuple(out), outs, comm.bytes_received - start


# Llama2_.forward's arguments after x, for callers that pass some positionally
_FORWARD_ARGS = list(inspect.signature(comfy.text_encoders.llama.Llama2_.forward).parameters)[2:]


class ParallelLlama(comfy.text_encoders.llama.Llama2_):
    """Rank 0's decoder in a parallel text encoder: a forward runs all ranks (TextEncoderParallel)."""

    def forward(self, x, *args, **kwargs):
        kwargs.update(zip(_FORWARD_ARGS, args))
        return self.multinpu(self, x, **kwargs)


def server_decoder(llama):
    """The server's decoder with the process transport: the token embeddings alone, the one part of the decoder the
    server computes (the layers, and a final norm or head where a model has one, run in the workers). A structural
    copy that shares the embeddings' host weights; its forward is ParallelLlama's, which runs the workers."""
    dropped = [m for m in (getattr(llama, "norm", None), getattr(llama, "lm_head", None)) if m is not None]
    dec = comfy.multinpu_weights.share_module(llama, dropped=dropped, replace=[(llama.layers, torch.nn.ModuleList())])
    if hasattr(dec, "lm_head"):
        del dec.lm_head
    return dec


def find_decoder(cond_stage_model):
    """The one upstream Llama2_ inside a text encoder, or None."""
    found = [m for m in cond_stage_model.modules() if isinstance(m, comfy.text_encoders.llama.Llama2_)]
    return found[0] if len(found) == 1 else None


def choose_mode(decoder, world_size: int, mode: str = "auto") -> str:
    if mode not in MODES:
        raise ValueError(f"MultiNPU: text-encoder mode must be one of {MODES}, got {mode!r}")
    heads = decoder.config.num_attention_heads
    standard = all(isinstance(layer.self_attn, comfy.text_encoders.llama.Attention)
                   and isinstance(layer.mlp, comfy.text_encoders.llama.MLP) for layer in decoder.layers)
    if mode == "tensor" and (heads % world_size or not standard):
        raise ValueError(f"MultiNPU: tensor parallelism needs the query heads ({heads}) divisible by the device "
                         f"count ({world_size}); use mode 'auto' or 'layers'")
    if mode == "auto":
        mode = "tensor" if heads % world_size == 0 and standard else "layers"
    if mode == "layers" and len(decoder.layers) < world_size:
        raise ValueError(f"MultiNPU: {len(decoder.layers)} layers do not split over {world_size} devices")
    return mode


def _refuse_weight_patches(patcher, *args):
    # a LoRA or hook added to this CLIP after the node names weights that are now split across devices:
    # applying it would merge into rank 0's slices only (or not at all) and the ranks would diverge
    if patcher.patches or patcher.hook_patches:
        raise RuntimeError("MultiNPU: a LoRA or hook was applied to the text encoder after "
                           "MultiNPUParallelConfig, whose weights are split across devices; apply it before "
                           "the node (which then runs that text encoder on one device)")


def _name_rank_weights(model0, full):
    """The server's copy names the weights the ranks hold in its state_dict, as meta tensors (no memory): a
    text-encoder LoRA applied after the node then maps onto them (comfy.lora.model_lora_keys_clip reads these
    names, ModelPatcher.add_patches keeps a patch whose key is there) and its load is refused
    (_refuse_weight_patches) instead of the LoRA being left out with a "lora key not loaded" per weight. The
    patcher's size is measured before (model_size above), so the names cost nothing in memory planning."""
    held = set(model0.state_dict())
    absent = {k: (t.shape, t.dtype) for k, t in full.state_dict().items() if k not in held}

    def names(module, state_dict, prefix, local_metadata):
        for k, (shape, dtype) in absent.items():
            state_dict[prefix + k] = torch.empty(shape, dtype=dtype, device="meta")
    model0.register_state_dict_post_hook(names)


def apply_tensor_parallel(clip: CLIP, devices, mode: str = "auto",
                          timeout: float = comfy.multinpu.DEFAULT_TIMEOUT) -> CLIP:
    """A clone of `clip` whose text encoder's layers run on the ranks of this server's runtime.

    The ranks are comfy.multinpu_process.runtime_for(devices, the CLIP's load device, ...): the server's process
    group, or threads of this process on `devices` (rank 0 = devices[0], the CLIP's load device; collectives
    bounded by `timeout`). Either way every rank sets up its shard of the layers (program te_config, checked against the
    server's digest before the first forward) and the clone, which loads onto the CLIP's device, holds only the
    embeddings and the vision tower.

    mode "auto" picks tensor parallelism when the rank count divides the query heads, else the exact layer split;
    "tensor" and "layers" force one. Raises ValueError for a text encoder that is not a Llama2_ decoder (or already
    parallel), that no cached loader loaded, or one with weight patches (a text-encoder LoRA: its keys name the
    unsplit weights).
    """
    decoder = find_decoder(clip.cond_stage_model)
    if decoder is None:
        raise ValueError(f"MultiNPU: {type(clip.cond_stage_model).__name__} has no single Llama2_ decoder to split")
    if type(decoder) is not comfy.text_encoders.llama.Llama2_:
        raise ValueError("MultiNPU: this text encoder is already split across devices")
    if clip.patcher.patches:
        raise ValueError(f"MultiNPU: the text encoder carries {len(clip.patcher.patches)} weight patches (a LoRA); "
                         "tensor parallelism splits the weights they name")
    src = comfy.multinpu_models.source(clip.cond_stage_model, "text encoder")
    # threads: they start with the runtime's first command
    runtime = comfy.multinpu_process.runtime_for(devices, clip.patcher.load_device, "text encoder", timeout)
    mode = choose_mode(decoder, runtime.world_size, mode)
    # ranks that are threads of this process load nothing: they take this text encoder
    comfy.multinpu_models.offer(src, clip)
    # the loaded weights, back on the host, are the one host copy every rank's shard views
    comfy.model_management.unload_model_and_clones(clip.patcher, all_devices=True)
    comfy.multinpu_models.map_file_weights(clip.cond_stage_model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(clip.cond_stage_model)

    config = comfy.multinpu_process.RemoteConfig(
        "te_config", {"source": src, "mode": mode},
        comfy.multinpu_models.digest(src, clip.cond_stage_model, mode=mode), f"text encoder {src.paths[0]}")
    runner = TextEncoderParallel(runtime, config, mode, len(decoder.layers))
    # the server's copy leaves the layers to the ranks (device 0 holds rank 0's shard)
    decoder0 = server_decoder(decoder)
    decoder0.__class__ = ParallelLlama
    decoder0.multinpu = runner

    model0 = comfy.multinpu_weights.share_module(clip.cond_stage_model, replace=[(decoder, decoder0)])
    comfy.multinpu_weights.reset_load_state(model0)
    n = clip.clone()
    n.cond_stage_model = model0
    n.patcher = comfy.multinpu_weights.device_patcher(clip.patcher, model0, clip.patcher.load_device)
    n.patcher.model_size()  # what the copy holds, measured before it names the ranks' weights
    _name_rank_weights(model0, clip.cond_stage_model)
    n.patcher.add_callback(comfy.patcher_extension.CallbacksMP.ON_LOAD, _refuse_weight_patches)
    logging.info(f"MultiNPU: text encoder {'tensor-parallel' if mode == 'tensor' else 'split by layers'} on "
                 f"{runtime.describe()}; the server holds the embeddings and vision tower, "
                 f"{n.patcher.model_size() / 2**30:.2f} GiB, the ranks the layers")
    return n


def get_runner(clip: CLIP):
    """The TextEncoderParallel of a CLIP set up by apply_tensor_parallel, or None."""
    decoder = find_decoder(clip.cond_stage_model)
    return getattr(decoder, "multinpu", None) if isinstance(decoder, ParallelLlama) else None
