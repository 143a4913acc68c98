"""Sequence parallelism for the MiniMax H3 DiT across devices, through upstream's extension points only.

A forward on P devices (MiniMaxH3Model is not edited; comfy/ldm/minimax/model.py stays upstream's):
1. The DIFFUSION_MODEL wrapper (SequenceParallelDiT) runs MiniMaxH3Model._forward on every rank:
   rank 0 in the calling thread on the model's device, ranks 1..P-1 in worker threads on replicas of
   the DiT (one per extra device, built in memory from the loaded model, never from the file).
2. Every rank embeds the whole packed sequence [text | cond or refs | audio | video] and builds the
   same RoPE table and adaLN rows; this is per-token work, cheap next to the blocks.
3. The block replacement for block 0 keeps the rank's contiguous shard of rows (shard_sizes: lengths
   differ by at most one, no padding rows), and re-bases the absolute slices for it once: the adaLN
   mod_segments and the RoPE rows. Every block then runs on the shard only.
4. Attention is the one place tokens meet. Through transformer_options["optimized_attention_override"]
   each rank either trades heads for sequence with two all-to-alls (Ulysses: H/P whole-sequence heads
   per rank, when P divides the heads; 56 heads: P = 2, 4, 7, 8) or gathers K and V along the
   sequence (any P). Attention itself is upstream's backend on the exact K/V, so the result is exact.
5. The last block's replacement gathers the shards onto rank 0 only, whose final layer sees the full
   sequence with its absolute video/audio slices; its output is the model's output. Ranks 1..P-1 stop
   after the last block (they have nothing left to compute).

Every rank holds the full DiT weights (about 66 GB at BF16 for H3): sequence parallelism splits the
activations and the attention work, not the weights.

Two transports run the same forward. Threads (above): the ranks are threads of this process. Processes
(comfy.multinpu_process): the ranks are the processes of a torch.distributed group; rank 0 broadcasts
each forward's inputs (latents, timestep, context, the payload with its packed layout), every rank runs
_forward on its own copy of the DiT (loaded by the worker from the same file, with the same weight
patches, checked by digest: comfy.multinpu_models) and the same block replacements and attention
override run the collectives over the group.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import TYPE_CHECKING

import torch

import comfy.ldm.minimax.model
import comfy.model_management
import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group
import comfy.multinpu_models
import comfy.multinpu_process
import comfy.multinpu_weights
import comfy.patcher_extension

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

RANK_KEY = "multinpu_rank"           # transformer_options: this rank's _RankState during a forward
KEY = "multinpu_sequence_parallel"   # wrapper key and additional-models key on the ModelPatcher
ATTENTION_MODES = ("auto", "ulysses", "kv_gather")

# Test seam for `h3kit parity --inject-fault`: None in normal runs. The parity worker sets a callable
# (stage, rank_state, tensor) -> tensor that corrupts one stage of the parallel path on purpose, to show
# that its gates catch it. Stages: "rope" (the full RoPE table, before the rank takes its rows), "ulysses"
# (q, k, v after the all-to-all, [3B, H/P, S, D]), "attention" (the rank's attention output, [B, s_r, H*D]),
# "gathered" (the final gather on rank 0, [S, hidden]).
fault_hook = None


def _fault(stage: str, state, t: torch.Tensor) -> torch.Tensor:
    return t if fault_hook is None else fault_hook(stage, state, t)


class _RankDone(BaseException):
    """Raised on ranks 1..P-1 after the last block, caught by SequenceParallelDiT: nothing left to compute
    there. A BaseException, so no `except Exception` between the block and the wrapper can take it for an error."""


def rebase_segments(segments, start: int, stop: int):
    """[(a, b, row)] over the full sequence -> the parts inside [start, stop), relative to start."""
    out = []
    for a, b, row in segments:
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            out.append((lo - start, hi - start, row))
    return out


class _RankState:
    """One rank's view of one forward: its communicator, its shard, and the block arguments re-based to it."""

    def __init__(self, comm, attention: str):
        self.comm = comm
        self.attention = attention
        self.sizes = None
        self.start = self.stop = 0
        self.mod_segments = None
        self.rope_freqs = None
        self.block_options = None

    def shard(self, args: dict) -> torch.Tensor:
        """At block 0: keep this rank's rows of h [S, hidden] -> [s_r, hidden], and re-base the block arguments."""
        h = args["img"]
        total = h.shape[0]
        self.sizes = comfy.multinpu.shard_sizes(total, self.comm.world_size)
        self.start = sum(self.sizes[:self.comm.rank])
        self.stop = self.start + self.sizes[self.comm.rank]
        self.mod_segments = rebase_segments(args["mod_segments"], self.start, self.stop)
        rope = _fault("rope", self, args["rope_freqs"])  # [1, S, 1, rot/2, 2, 2]
        if rope is None or rope.shape[1] != total:
            raise RuntimeError(f"MultiNPU: expected a RoPE table with {total} rows, got {None if rope is None else tuple(rope.shape)}")
        self.rope_freqs = rope[:, self.start:self.stop]
        options = args["transformer_options"].copy()
        options["optimized_attention_override"] = SequenceParallelAttention(self, options.get("optimized_attention_override"))
        self.block_options = options
        # a copy, so the full h (the rank's own) can be freed once _forward moves on
        return h[self.start:self.stop].clone()

    def use_ulysses(self, heads: int) -> bool:
        p = self.comm.world_size
        if self.attention == "kv_gather":
            return False
        if heads % p == 0:
            return True
        if self.attention == "ulysses":
            raise ValueError(f"MultiNPU: Ulysses attention needs the heads ({heads}) divisible by the device count ({p}); "
                             "use attention 'auto' or 'kv_gather'")
        return False


class SequenceParallelAttention:
    """optimized_attention_override for one rank inside the sharded blocks.

    Receives q, k, v as [B, H, s_r, D] (MiniMax H3 calls attention with skip_reshape=True) and returns
    [B, s_r, H*D] like the backend would for the full sequence. The local attention is the previous
    override when one was set (an attention-backend node), else upstream's function.
    """

    def __init__(self, state: _RankState, inner=None):
        self.state = state
        self.inner = inner

    def _local(self, func, q, k, v, heads, *args, **kwargs):
        if self.inner is not None:
            return self.inner(func, q, k, v, heads, *args, **kwargs)
        return func(q, k, v, heads, *args, **kwargs)

    def __call__(self, func, q, k, v, heads, *args, **kwargs):
        if not kwargs.get("skip_reshape", False) or kwargs.get("skip_output_reshape", False) or kwargs.get("mask") is not None:
            raise RuntimeError("MultiNPU: sequence-parallel attention expects MiniMax H3's call "
                               "(skip_reshape=True, no mask, reshaped output)")
        st = self.state
        comm = st.comm
        b, h, s, d = q.shape
        if st.use_ulysses(h):
            hp = h // comm.world_size
            qkv = torch.cat([q, k, v])                                             # [3B, H, s_r, D]
            qkv = comfy.multinpu.all_to_all_scatter_heads(qkv, comm, st.sizes)     # [3B, H/P, S, D]
            q, k, v = _fault("ulysses", st, qkv).chunk(3)
            out = self._local(func, q, k, v, hp, *args, **kwargs)                  # [B, S, H/P*D]
            out = out.reshape(b, -1, hp, d)                                        # [B, S, H/P, D]
            out = comfy.multinpu.all_to_all_gather_heads(out, comm, st.sizes)      # [B, s_r, H, D]
            return _fault("attention", st, out.reshape(b, s, h * d))               # [B, s_r, H*D]
        kv = torch.cat([k, v])                                                     # [2B, H, s_r, D]
        kv = comfy.multinpu.all_gather_v(kv, comm, sizes=st.sizes, dim=2)          # [2B, H, S, D]
        k, v = kv.chunk(2)
        return _fault("attention", st, self._local(func, q, k, v, h, *args, **kwargs))  # [B, s_r, H*D]


class SequenceParallelBlock:
    """patches_replace["dit"][("double_block", index)]: run the block on this rank's shard.

    Block 0 takes the shard, the last block gathers the shards back into the full sequence on rank 0 (the
    other ranks stop there). Outside SequenceParallelDiT (no rank state in transformer_options) it runs the
    block unchanged.
    """

    def __init__(self, index: int, last: bool):
        self.index = index
        self.last = last

    def __call__(self, args: dict, extra: dict) -> dict:
        state = args["transformer_options"].get(RANK_KEY)
        if state is None:
            return extra["original_block"](args)
        h = state.shard(args) if self.index == 0 else args["img"]
        out = extra["original_block"]({"img": h, "t_emb": args["t_emb"], "mod_segments": state.mod_segments,
                                       "rope_freqs": state.rope_freqs,
                                       "transformer_options": state.block_options})["img"]
        if self.last:
            out = comfy.multinpu.gather_v(out, state.comm, sizes=state.sizes, dst=0)  # [s_r, hidden] -> [S, hidden] on rank 0
            if out is None:
                raise _RankDone()
            out = _fault("gathered", state, out)
        return {"img": out}


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def take_inputs(inputs: tuple, comm) -> tuple:
    """Rank comm.rank's own copy of the forward's inputs on its device (rank 0 runs on them as they are)."""
    return inputs if comm.rank == 0 else _to(inputs, comm.device)


class SequenceParallelDiT:
    """DIFFUSION_MODEL wrapper running MiniMaxH3Model._forward sequence-parallel on `devices`.

    Threads: replicas[r] (r >= 1) is the BaseModel whose diffusion_model rank r runs; replicas[0] is None
    (rank 0 is the wrapped model itself). Processes: `runtime` is rank 0's comfy.multinpu_process
    runtime, devices is [rank 0's device] and `config` what every worker loads. One forward at a time per
    wrapper. forwards, rank_forwards (per rank), bytes_moved and bytes_received (per rank) count what ran,
    for logs and `h3kit parity` (with processes the other ranks' bytes reach rank 0 when count_bytes is set).
    """

    def __init__(self, devices, replicas, attention: str = "auto", timeout: float = comfy.multinpu.DEFAULT_TIMEOUT,
                 runtime=None, config=None):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"MultiNPU: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.devices = list(devices)
        self.replicas = list(replicas)
        self.attention = attention
        self.timeout = timeout
        self.runtime = runtime
        self.config = config
        self.count_bytes = False   # processes: every forward also gathers the bytes each rank received
        self.rank_bytes = None     # ... into this list, for the last forward
        world = runtime.world_size if runtime is not None else len(self.devices)
        self.forwards = 0
        self.rank_forwards = [0] * world
        self.bytes_moved = 0
        self.bytes_received = [0] * world
        self._threads = None
        self._lock = threading.Lock()

    def _pool(self):
        if self._threads is None or self._threads.broken:
            self._threads = comfy.multinpu.RankThreads(self.devices, set_device=comfy.multidevice.set_device)
            # the workers outlive a forward, not the model: stop them when this wrapper goes away
            weakref.finalize(self, self._threads.shutdown)
        return self._threads

    def _check_blocks(self, dm, transformer_options):
        blocks = transformer_options.get("patches_replace", {}).get("dit", {})
        for i in range(len(dm.blocks)):
            if not isinstance(blocks.get(("double_block", i)), SequenceParallelBlock):
                raise RuntimeError(f"MultiNPU: DiT block {i} is no longer replaced by the sequence-parallel block "
                                   "(another node replaced it after MultiNPUParallelConfig); put "
                                   "MultiNPUParallelConfig last in the model chain")

    def __call__(self, executor, x, timestep, context, transformer_options, *args, **kwargs):
        dm = executor.class_obj
        self._check_blocks(dm, transformer_options)
        if x[0].device != self.devices[0]:
            raise RuntimeError(f"MultiNPU: the model runs on {x[0].device} but rank 0 was set up for {self.devices[0]}")
        if self.runtime is not None:
            return self._call_processes(executor, x, timestep, context, transformer_options, args, kwargs)
        group = comfy.multinpu.ThreadGroup(self.devices, timeout=self.timeout)

        def rank_forward(comm):
            options = transformer_options.copy()
            options[RANK_KEY] = _RankState(comm, self.attention)
            run = executor
            if comm.rank > 0:
                # the rest of the wrapper chain, ending in the replica's own _forward
                replica = self.replicas[comm.rank].diffusion_model
                run = comfy.patcher_extension.WrapperExecutor.new_class_executor(
                    replica._forward, replica, executor.wrappers, idx=executor.idx + 1).execute
            inputs = take_inputs((x, timestep, context, args, kwargs), comm)
            # the workers copy their inputs from rank 0's device before rank 0 queues its own work there,
            # where their copies would otherwise wait behind it
            comfy.multinpu.barrier(comm)
            self.rank_forwards[comm.rank] += 1
            x_r, timestep_r, context_r, args_r, kwargs_r = inputs
            try:
                return run(x_r, timestep_r, context_r, options, *args_r, **kwargs_r)
            except _RankDone:
                return None

        t0 = time.perf_counter()
        with self._lock:
            out = group.run(rank_forward, self._pool())[0]
        self.forwards += 1
        self.bytes_moved += group.bytes_moved
        self.bytes_received = [a + b for a, b in zip(self.bytes_received, group.bytes_received)]
        logging.debug(f"MultiNPU: DiT forward on {len(self.devices)} devices in {time.perf_counter() - t0:.3f} s, "
                      f"{group.bytes_moved / 2**20:.1f} MiB exchanged")
        return out


    def _call_processes(self, executor, x, timestep, context, transformer_options, args, kwargs):
        inner = executor.wrappers[executor.idx + 1:]
        if inner:
            # they would run on rank 0 only: the other ranks' forwards would differ from rank 0's
            raise RuntimeError(f"MultiNPU: {len(inner)} diffusion-model wrapper(s) were added after "
                               "MultiNPUParallelConfig; with the process transport the node must come last")
        if transformer_options.get("optimized_attention_override") is not None:
            raise RuntimeError("MultiNPU: another node set an attention override, which cannot run in the worker "
                               "processes; remove it or start the server with --transport threads")
        # the fault hook (`h3kit parity --inject-fault`, None otherwise) runs on every rank, as with threads
        payload = {"config": self.config.id, "attention": self.attention, "count_bytes": self.count_bytes,
                   "fault_hook": fault_hook, "x": x, "timestep": timestep, "context": context,
                   "options": plain_options(transformer_options), "args": args, "kwargs": kwargs}

        def rank0(comm):
            start = comm.bytes_moved
            options = transformer_options.copy()
            options[RANK_KEY] = _RankState(comm, self.attention)
            out = executor(x, timestep, context, options, *args, **kwargs)
            moved = comm.bytes_moved - start
            return out, _rank_counts(comm, moved, 0) if self.count_bytes else [(moved, 0)]

        t0 = time.perf_counter()
        with self._lock:
            out, counts = self.runtime.run("dit_forward", payload, rank0, configs=[self.config])
        self.forwards += 1
        self.rank_forwards = [n + 1 for n in self.rank_forwards]  # the command completed on every rank
        self.rank_bytes = [moved for moved, _ in counts]
        self.bytes_received = [a + b for a, b in zip(self.bytes_received, self.rank_bytes + [0] * len(self.bytes_received))]
        self.bytes_moved += sum(self.rank_bytes)
        if fault_hook is not None and hasattr(fault_hook, "fired"):
            fault_hook.fired += sum(fired for _, fired in counts[1:])  # the strikes on the other ranks
        logging.debug(f"MultiNPU: DiT forward on {self.runtime.world_size} processes in {time.perf_counter() - t0:.3f} s, "
                      f"{sum(self.rank_bytes) / 2**20:.1f} MiB exchanged")
        return out


def _rank_counts(comm, moved: int, fired: int) -> list:
    """[(bytes received, fault strikes)] of this forward for every rank, on every rank (one small all-gather)."""
    local = torch.tensor([moved, fired], dtype=torch.int64, device=comm.device)
    return [tuple(int(v) for v in t.tolist()) for t in comm.all_gather(local)]


def plain_options(options: dict) -> dict:
    """The entries of transformer_options a worker process can hold: numbers, strings, tensors and
    containers of them (the sigma shifts, sigmas...); hooks, patches and wrappers stay on rank 0."""
    def plain(v):
        if v is None or isinstance(v, (bool, int, float, str, torch.Tensor, torch.dtype)):
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(i) for i in v)
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(i) for k, i in v.items())
        return False
    return {k: v for k, v in options.items() if k not in ("patches", "patches_replace", "wrappers", "callbacks")
            and plain(v)}


class _WorkerDiT:
    """A worker's copy of the DiT for one configuration: its loaded model with rank 0's weight patches."""

    def __init__(self, patcher, digest: dict):
        self.patcher = patcher
        self.digest = digest
        count = len(patcher.model.diffusion_model.blocks)
        self.blocks = {("double_block", i): SequenceParallelBlock(i, i == count - 1) for i in range(count)}


@comfy.multinpu_group.program("dit_config")
def _load_on_worker(context, comm, payload):
    src, patches = payload["source"], payload["patches"]
    base = comfy.multinpu_models.load(src)
    comfy.multinpu_models.map_file_weights(base.model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(base.model)
    patcher = comfy.multinpu_models.patched_clone(base, patches)
    return _WorkerDiT(patcher, comfy.multinpu_models.digest(src, base.model, patches))


@comfy.multinpu_group.program("dit_forward")
def _forward_on_worker(context, comm, payload):
    held = context.configs[payload["config"]]
    comfy.model_management.load_models_gpu([held.patcher])
    dm = held.patcher.model.diffusion_model
    dev = held.patcher.load_device
    options = dict(payload["options"], patches_replace={"dit": held.blocks})
    options[RANK_KEY] = _RankState(comm, payload["attention"])
    start = comm.bytes_moved
    global fault_hook
    hook = fault_hook = payload["fault_hook"]
    fired = getattr(hook, "fired", 0)
    try:
        dm._forward(_to(payload["x"], dev), _to(payload["timestep"], dev), _to(payload["context"], dev), options,
                    *_to(payload["args"], dev), **_to(payload["kwargs"], dev))
    except _RankDone:
        pass  # the final gather took this rank's shard to rank 0: nothing left to compute here
    finally:
        fault_hook = None
    if payload["count_bytes"]:
        _rank_counts(comm, comm.bytes_moved - start, getattr(hook, "fired", 0) - fired)


def _replica_model(model):
    """A structural copy of a BaseModel whose parameters and buffers share the source's storage.

    No file is read and no weight is copied here: the replica's weights become its own only when
    ModelPatcher loads it onto its device (which writes new tensors into the replica's own Parameter
    objects, never into the shared storage). The source's host anchors carry over, so unloading the
    replica returns its weights to the one host copy (comfy.multinpu_weights).
    """
    patcher = getattr(model, "current_patcher", None)
    # shared, not copied: the config answers every unknown attribute (deepcopy's probes included) with None
    replica = comfy.multinpu_weights.share_module(model, shared=[model.model_config],
                                                  dropped=[patcher] if patcher is not None else [])
    # the source's load bookkeeping (ModelPatcher keeps it on the model) does not describe the replica
    comfy.multinpu_weights.reset_load_state(replica)
    return replica


def _replica_patcher(patcher: ModelPatcher, device: torch.device) -> ModelPatcher:
    n = patcher.clone(model_override=(_replica_model(patcher.model), ({}, {}, {}, set())))
    n.hook_backup = {}
    n.load_device = device
    if hasattr(n, "register_load_device"):
        n.register_load_device(device)
    n.remove_additional_models(KEY)
    n.is_multigpu_base_clone = False
    return n


def apply_sequence_parallel(patcher: ModelPatcher, devices, attention: str = "auto",
                            timeout: float = comfy.multinpu.DEFAULT_TIMEOUT, runtime=None) -> ModelPatcher:
    """A clone of `patcher` whose MiniMax H3 DiT runs sequence-parallel on `devices` (rank 0 = devices[0]).

    Threads: adds one replica ModelPatcher per extra device as additional models (so sampling loads each
    onto its device, with upstream's memory management). Processes (`runtime`, devices ignored): every
    worker of the group loads the same file with rank 0's weight patches, checked before the first
    forward. Either way: the DIFFUSION_MODEL wrapper and one block replacement per DiT block. Applying it
    again replaces the previous setup. Raises ValueError for a model that is not MiniMax H3, whose blocks
    another node already replaces, or (processes) that a worker cannot load the same way.
    """
    dm = patcher.model.diffusion_model
    if not isinstance(dm, comfy.ldm.minimax.model.MiniMaxH3Model):
        raise ValueError(f"MultiNPU: sequence parallelism supports the MiniMax H3 DiT, not {type(dm).__name__}")
    blocks = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    foreign = [k for k, v in blocks.items() if not isinstance(v, SequenceParallelBlock)]
    if foreign:
        raise ValueError(f"MultiNPU: DiT blocks {sorted(k[1] for k in foreign)} are already replaced by another node; "
                         "sequence parallelism needs every block")
    if runtime is not None:
        return _apply_processes(patcher, attention, timeout, runtime)
    devices = [torch.device(d) for d in devices]
    if devices[0] != patcher.load_device:
        raise ValueError(f"MultiNPU: rank 0 must be the model's load device {patcher.load_device}, got {devices[0]}")
    # a loaded model's modules carry per-load state (cast flags, lowvram hooks) a replica must not copy
    comfy.model_management.unload_model_and_clones(patcher)
    # the loaded weights, now on the host, are the one host copy every device loads from and returns to
    comfy.multinpu_weights.anchor_host_copy(patcher.model)
    m = patcher.clone()
    m.remove_additional_models(KEY)
    replicas = [_replica_patcher(patcher, d) for d in devices[1:]]
    m.set_additional_models(KEY, replicas)
    m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY,
                           SequenceParallelDiT(devices, [None] + [r.model for r in replicas], attention, timeout))
    _replace_blocks(m, len(dm.blocks))
    size_gb = patcher.model_size() / 1e9
    logging.info(f"MultiNPU: MiniMax H3 DiT sequence-parallel on {comfy.multidevice.describe_devices(devices)}, "
                 f"attention {attention}; every device holds the full DiT weights ({size_gb:.1f} GB)")
    return m


def _replace_blocks(m, count: int):
    for i in range(count):
        m.set_model_patch_replace(SequenceParallelBlock(i, i == count - 1), "dit", "double_block", i)


def _apply_processes(patcher: ModelPatcher, attention: str, timeout: float, runtime) -> ModelPatcher:
    src = comfy.multinpu_models.source(patcher.model, "diffusion model")
    patches = comfy.multinpu_models.weight_patches(patcher, "diffusion model")
    comfy.model_management.unload_model_and_clones(patcher)
    # the host weights become the file's page-cache copy, the one every process of this host maps
    comfy.multinpu_models.map_file_weights(patcher.model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(patcher.model)
    config = comfy.multinpu_process.RemoteConfig(
        "dit_config", {"source": src, "patches": patches},
        comfy.multinpu_models.digest(src, patcher.model, patches), f"DiT {src.paths[0]}")
    m = patcher.clone()
    m.remove_additional_models(KEY)
    m.remove_wrappers_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY,
                           SequenceParallelDiT([patcher.load_device], [None], attention, timeout, runtime, config))
    _replace_blocks(m, len(patcher.model.diffusion_model.blocks))
    logging.info(f"MultiNPU: MiniMax H3 DiT sequence-parallel on {runtime.world_size} processes "
                 f"({runtime.spec.backend}), attention {attention}; every rank holds the full DiT weights "
                 f"({patcher.model_size() / 1e9:.1f} GB), {len(patches)} weight patch(es) sent to the workers")
    return m


def get_wrapper(patcher: ModelPatcher):
    """The SequenceParallelDiT of a patcher set up by apply_sequence_parallel, or None."""
    found = patcher.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    return found[0] if found else None
