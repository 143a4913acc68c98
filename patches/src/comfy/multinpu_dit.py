"""Sequence parallelism for the MiniMax H3 DiT across devices, through upstream's extension points only.

A forward on P devices (MiniMaxH3Model is not edited; comfy/ldm/minimax/model.py stays upstream's):
1. The DIFFUSION_MODEL wrapper (SequenceParallelDiT) hands the forward's inputs to the ranks' runtime, whose
   every rank runs MiniMaxH3Model._forward on its own copy of the DiT (the dit_forward program).
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

Weights: replicated (every rank holds the whole DiT, about 66 GB at BF16 for H3) or sharded
(comfy.multinpu_shard: every rank keeps 1/P of each block's weights, and a block's whole weights are
gathered just before it runs and dropped after it). Sequence parallelism splits the activations and the
attention work; sharding splits the weights too, at the cost of one all-gather of each block per forward.

One code path for every transport: the ranks are those of the runtime comfy.multinpu_process.runtime_for() gives
(worker processes of a torch.distributed group, or threads of this process), and either way they run the
programs below (dit_config, dit_forward, dit_empty_cache) through the same command path: worker rank 0
broadcasts each forward's inputs (latents, timestep, context, the payload with its packed layout), every rank
runs _forward on its own copy of the DiT (a structural copy over the weights the worker loaded from the same
file, with the server's weight patches, checked by digest: comfy.multinpu_models) and the same block
replacements and attention override run the collectives over the group. The server's copy stays on the host,
unpatched: it computes no DiT forward.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING

import torch

import comfy.ldm.minimax.model
import comfy.model_management
import comfy.model_patcher
import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group
import comfy.multinpu_models
import comfy.multinpu_process
import comfy.multinpu_runtime_base
import comfy.multinpu_shard
import comfy.multinpu_weights
import comfy.multinpu_wire
import comfy.patcher_extension
import comfy.sampler_helpers

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

RANK_KEY = "multinpu_rank"           # transformer_options: this rank's _RankState during a forward
KEY = "multinpu_sequence_parallel"   # the wrappers' and callbacks' key on the ModelPatcher
ATTENTION_MODES = ("auto", "ulysses", "kv_gather")
WEIGHTS_MODES = ("auto", "replicated", "sharded")

# Test seam for `h3kit parity --inject-fault`: None in normal runs. The parity worker sets a callable
# (stage, rank_state, tensor) -> tensor that corrupts one stage of the parallel path on purpose, to show
# that its gates catch it. Stages: "rope" (the full RoPE table, before the rank takes its rows), "ulysses"
# (q, k, v after the all-to-all, [3B, H/P, S, D]), "attention" (the rank's attention output, [B, s_r, H*D]),
# "gathered" (the final gather on rank 0, [S, hidden]); sharded weights: "shard" (a block's flat bytes on a rank
# before it takes its slice, [padded]), "weights" (a block's gathered bytes, [padded]); "rank" (the rank's own
# diffusion model as its forward starts, the return value ignored: the hook may register module hooks there and
# hand their removal to state.cleanup, which runs when the rank's forward ends). A hook with a report(rank) method
# has it called on each rank after each forward: the integers come back in SequenceParallelDiT.rank_reports (what
# each rank measured on itself, gathered over the group). The server's value travels to the ranks with every
# forward; a rank's program holds its copy in _rank_hook (per thread: rank threads share this module), so one rank
# ending its forward never takes the hook from another rank, nor from the server.
fault_hook = None
_rank_hook = threading.local()
_UNSET = object()


def current_fault_hook():
    """The fault hook of this rank's forward (its program's copy), else the module's."""
    hook = getattr(_rank_hook, "hook", _UNSET)
    return fault_hook if hook is _UNSET else hook


def _fault(stage: str, state, t: torch.Tensor) -> torch.Tensor:
    hook = current_fault_hook()
    return t if hook is None else hook(stage, state, t)


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
        self.weights = None  # comfy.multinpu_shard.WeightGather when the rank's DiT is sharded
        self.block_count = 0   # the DiT's blocks, and how many of them this rank ran in this forward
        self.blocks_run = 0
        self.cleanup = []      # callables run when the forward ends on this rank (fault_hook's module hooks)

    def ran_every_block(self) -> int:
        return int(self.block_count > 0 and self.blocks_run == self.block_count)

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
            # q, k, v in one all-to-all, packed straight into its send buffer: 3 x [B, H, s_r, D] -> 3 x [B, H/P, S, D]
            q, k, v = comfy.multinpu.all_to_all_scatter_heads((q, k, v), comm, st.sizes)
            if current_fault_hook() is not None:
                q, k, v = _fault("ulysses", st, torch.cat([q, k, v])).chunk(3)     # [3B, H/P, S, D]
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
        if state.weights is not None:
            state.weights.before(self.index)  # this block's weights gathered, the next block's gather issued
        try:
            out = extra["original_block"]({"img": h, "t_emb": args["t_emb"], "mod_segments": state.mod_segments,
                                           "rope_freqs": state.rope_freqs,
                                           "transformer_options": state.block_options})["img"]
        finally:
            if state.weights is not None:
                state.weights.after(self.index)
        state.blocks_run += 1
        comfy.multinpu.tick(state.comm, f"dit block {self.index}")  # the device advanced without a collective
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


class SequenceParallelDiT:
    """DIFFUSION_MODEL wrapper running MiniMaxH3Model._forward sequence-parallel on the ranks of `runtime`.

    runtime: a comfy.multinpu_runtime_base.Runtime (comfy.multinpu_process.runtime_for); it runs the dit_forward
    program on every rank, each on its own copy of the DiT described by `config` (what every rank loads, checked by digest).
    device: where the server's copy and the sampler's latents live (the host); rank_device: worker rank 0's
    device. `weights` is "replicated" or "sharded" (every rank's DiT is then sharded: comfy.multinpu_shard). One
    forward at a time per wrapper. forwards, rank_forwards (per rank), bytes_moved and bytes_received (per rank,
    everything the transport moved), weight_bytes_received (per rank, the sharded weights' gathers: part of the
    former) and resident_bytes (per rank, the weights it held during the last forward) count what ran, for logs
    and `h3kit parity` (the other ranks' figures reach rank 0 when count_bytes is set).
    memory_estimates holds ComfyUI's activation estimate per rank for the current sampling (RankMemory).
    """

    def __init__(self, runtime, config, attention: str = "auto", weights: str = "replicated", device=None,
                 rank_device=None):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"MultiNPU: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.runtime = runtime
        self.config = config
        self.attention = attention
        self.weights = weights
        self.device = torch.device(device if device is not None else "cpu")
        self.rank_device = torch.device(rank_device) if rank_device is not None else self.device
        self.count_bytes = False   # every forward also gathers the bytes each rank received
        self.rank_bytes = None     # ... into this list, for the last forward
        self.world = runtime.world_size
        self.forwards = 0
        self.rank_forwards = [0] * self.world
        self.bytes_moved = 0
        self.bytes_received = [0] * self.world
        self.weight_bytes_received = [0] * self.world
        self.resident_bytes = [0] * self.world
        self.memory_estimates = None      # [(memory_required, minimum_memory_required)] per rank
        self.memory_estimate_one = None   # ComfyUI's own estimate for the whole latent on one device
        self.memory_used = [0] * self.world  # the memory_required each rank's last load was sized with
        self.caches_emptied = [0] * self.world
        self.rank_reports = []  # per forward, while fault_hook has a report(): what it reported on every rank
        self._lock = threading.Lock()

    @property
    def timeout(self) -> float:
        """The bound of a collective on the ranks (a process group's is fixed when it starts)."""
        return self.runtime.timeout

    @timeout.setter
    def timeout(self, seconds: float):
        self.runtime.timeout = seconds

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
        if x[0].device != self.device:
            raise RuntimeError(f"MultiNPU: the model runs on {x[0].device} but its copy was set up on {self.device}")
        inner = executor.wrappers[executor.idx + 1:]
        if inner:
            # they would run in the server only, where no forward runs: the ranks' forwards would not have them
            raise RuntimeError(f"MultiNPU: {len(inner)} diffusion-model wrapper(s) were added after "
                               "MultiNPUParallelConfig; the node must come last in the model chain")
        if transformer_options.get("optimized_attention_override") is not None:
            raise RuntimeError("MultiNPU: another node set an attention override, which the ranks cannot run (it "
                               "exists only as a Python object in the server); remove it")
        # the fault hook (`h3kit parity --inject-fault`, None otherwise) runs on every rank
        payload = {"config": self.config.id, "attention": self.attention, "count_bytes": self.count_bytes,
                   "fault_hook": fault_hook, "memory": self.memory_estimates, "x": x, "timestep": timestep,
                   "context": context, "options": plain_options(transformer_options), "args": args, "kwargs": kwargs}

        t0 = time.perf_counter()
        with self._lock:
            # every rank is a worker; rank 0's returns the forward's output after the final gather
            out, counts = self.runtime.run("dit_forward", payload, configs=[self.config])
        out = _to(out, x[0].device)  # from the host buffer to where the sampler runs
        self.forwards += 1
        # what each rank counted itself (every rank's with count_bytes, else rank 0's alone)
        for r, c in enumerate(counts):
            self.rank_forwards[r] += c[5]
        if hasattr(fault_hook, "report"):
            self.rank_reports.append([c[6] for c in counts])
        self.rank_bytes = [c[0] for c in counts]
        self.bytes_received = [a + b for a, b in zip(self.bytes_received, self.rank_bytes + [0] * len(self.bytes_received))]
        self.bytes_moved += sum(self.rank_bytes)
        for r, c in enumerate(counts):
            self.weight_bytes_received[r] += c[2]
            self.resident_bytes[r] = c[3]
            self.memory_used[r] = c[4]
        if fault_hook is not None and hasattr(fault_hook, "fired"):
            fault_hook.fired += sum(c[1] for c in counts)  # the strikes on the ranks (each rank holds a copy)
        logging.debug(f"MultiNPU: DiT forward on {self.world} ranks ({self.runtime.spec.backend}) in "
                      f"{time.perf_counter() - t0:.3f} s, {sum(self.rank_bytes) / 2**20:.1f} MiB exchanged")
        return out

    def empty_caches(self):
        """Return every rank's reserved but unused device memory to the device (after sampling: the next stage,
        the VAE decode, would otherwise find it taken). Counts the calls per rank in caches_emptied."""
        try:
            counts = self.runtime.run("dit_empty_cache", None)
        except (comfy.multinpu_wire.GroupError, comfy.multinpu.CollectiveError) as e:
            # the sampling itself succeeded; a rank that failed since is named again by the next command
            logging.warning(f"MultiNPU: the ranks' caches were not emptied after sampling: {e}")
            return
        self.caches_emptied = [a + c[0] for a, c in zip(self.caches_emptied, counts)]


def rank_state(comm, attention: str, dm) -> _RankState:
    """A rank's state for one forward; a sharded DiT gathers its blocks' weights through it."""
    state = _RankState(comm, attention)
    state.block_count = len(dm.blocks)
    shards = comfy.multinpu_shard.of(dm)
    if shards is not None:
        state.weights = comfy.multinpu_shard.WeightGather(shards, comm, fault=_fault)
    _fault("rank", state, dm)
    return state


def finish_rank(state: _RankState) -> int:
    """After a rank's forward: the bytes its weight gathers received (0 when not sharded)."""
    while state.cleanup:
        state.cleanup.pop()()
    if state.weights is None:
        return 0
    state.weights.close()
    return state.weights.received


def _rank_counts(comm, values: list) -> list:
    """[values] of this forward for every rank, on every rank (one small all-gather of integers)."""
    local = torch.tensor(values, dtype=torch.int64, device=comm.device)
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
    """A rank's copy of the DiT for one configuration: a structural copy of its loaded model with the server's
    weight patches."""

    def __init__(self, patcher, digest: dict):
        self.patcher = patcher
        self.digest = digest
        count = len(patcher.model.diffusion_model.blocks)
        self.blocks = {("double_block", i): SequenceParallelBlock(i, i == count - 1) for i in range(count)}


@comfy.multinpu_group.program("dit_config")
def _load_on_worker(context, comm, payload):
    src, patches, weights = payload["source"], payload["patches"], payload["weights"]
    base = comfy.multinpu_models.load(src)
    # another configuration of the same file may be loaded with its patches applied to the shared host weights, or
    # moved to a device: unloaded, they are the file's on the host again (what the server does before it sets a
    # configuration up). Only those: the server's own copy (unpatched, on the host; in this process when the ranks
    # are threads) stays loaded
    comfy.multinpu_weights.restore_host_weights(base)
    comfy.multinpu_models.map_file_weights(base.model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(base.model)
    patcher = comfy.multinpu_models.patched_clone(base, patches)
    # the rank's own modules over the shared host weights: ranks that are threads of one process get the same base
    # from the model cache, and loading rank r's copy onto device r must not move rank q's
    if weights == "sharded":
        patcher = sharded_patcher(patcher, context.device, comm.rank, comm.world_size)
    else:
        patcher = _replica_patcher(patcher, context.device)
    return _WorkerDiT(patcher, comfy.multinpu_models.digest(src, base.model, patches, weights=weights))


@comfy.multinpu_group.program("dit_forward")
def _forward_on_worker(context, comm, payload):
    held = context.configs[payload["config"]]
    # this rank's copy of the hook, before the load (a sharded DiT builds its slices there)
    hook = _rank_hook.hook = payload["fault_hook"]
    try:
        return _forward_rank(comm, payload, held, hook)
    finally:
        del _rank_hook.hook


def _forward_rank(comm, payload, held, hook):
    fired = getattr(hook, "fired", 0)
    start = comm.bytes_received
    dm = held.patcher.model.diffusion_model
    dev = held.patcher.load_device
    options = dict(payload["options"], patches_replace={"dit": held.blocks})
    state = options[RANK_KEY] = rank_state(comm, payload["attention"], dm)
    # sized by this rank's activation estimate (its shard of the tokens)
    memory = payload["memory"][comm.rank] if payload["memory"] else (0, None)
    out = None
    try:
        with comfy.multinpu_runtime_base.MODEL_LOCK:  # model management is one per process, not thread-safe
            comfy.model_management.load_models_gpu([held.patcher], memory_required=memory[0],
                                                   minimum_memory_required=memory[1])
            shards = comfy.multinpu_shard.of(dm)
            if hook is not None and shards is not None:
                # h3kit parity's fault runs: the install loaded the slices before this forward's hook was known
                shards.build(held.patcher, fault=_fault, loaded_only=True, again=True)
        out = dm._forward(_to(payload["x"], dev), _to(payload["timestep"], dev), _to(payload["context"], dev),
                          options, *_to(payload["args"], dev), **_to(payload["kwargs"], dev))
    except _RankDone:
        pass  # the final gather took this rank's shard to rank 0: nothing left to compute here
    finally:
        weight_bytes = finish_rank(state)
    report = int(hook.report(comm.rank)) if hasattr(hook, "report") else 0
    counts = [comm.bytes_received - start, getattr(hook, "fired", 0) - fired, weight_bytes,
              comfy.multinpu_shard.resident_bytes(dm), int(memory[0]), state.ran_every_block(), report]
    counts = _rank_counts(comm, counts) if payload["count_bytes"] else [counts]
    # rank 0 holds the whole output after the final gather: the command's result
    return (out, counts) if comm.rank == 0 else None


@comfy.multinpu_group.program("dit_empty_cache")
def _empty_cache_on_worker(context, comm, payload):
    # empty_cache acts on the current device: the rank's own (each rank thread has set its device)
    with comfy.multinpu_runtime_base.MODEL_LOCK, comfy.multidevice.device_context(context.device):
        comfy.model_management.soft_empty_cache()
    return _rank_counts(comm, [1])


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
    # the source's load bookkeeping (ModelPatcher keeps it on the model and its modules: a loaded source, such as the
    # server's unpatched host copy, marks every module's weights as patched) does not describe the replica
    comfy.multinpu_weights.reset_load_state(replica)
    for m in replica.modules():
        if hasattr(m, "comfy_patched_weights"):
            del m.comfy_patched_weights
        comfy.model_patcher.wipe_lowvram_weight(m)
    return replica


def _replica_patcher(patcher: ModelPatcher, device: torch.device) -> ModelPatcher:
    n = patcher.clone(model_override=(_replica_model(patcher.model), ({}, {}, {}, set())))
    n.hook_backup = {}
    n.load_device = device
    if hasattr(n, "register_load_device"):
        n.register_load_device(device)
    n.is_multigpu_base_clone = False
    return n


def sharded_patcher(patcher: ModelPatcher, device: torch.device, rank: int, world: int) -> ModelPatcher:
    """A ModelPatcher like `patcher` over a structural copy of its model whose DiT keeps rank `rank`'s slice of
    every block (comfy.multinpu_shard). Its weight patches stay on it: the slices are built from them when it
    loads (ON_LOAD) and dropped when it unloads, so ComfyUI's memory manager places and counts them."""
    n = _replica_patcher(patcher, device)
    comfy.multinpu_shard.shard_module(n.model.diffusion_model, rank, world, device)
    n.size = 0  # the slices, not the whole blocks: measure again
    n.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_LOAD, KEY, _build_slices)
    n.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_DETACH, KEY, _free_slices)
    return n


def _build_slices(patcher, device_to, lowvram_model_memory, force_patch_weights, full_load):
    shards = comfy.multinpu_shard.of(patcher.model.diffusion_model)
    if shards is None:
        return
    shards.loaded_by(patcher)
    shards.fault = _fault
    # the slices ComfyUI loaded (it had room for their modules); the others are built per block on use
    shards.build(patcher, fault=_fault, loaded_only=True)


def _free_slices(patcher, unpatch_all):
    shards = comfy.multinpu_shard.of(patcher.model.diffusion_model)
    if shards is not None and unpatch_all:
        shards.free()


def choose_weights(weights: str, patcher: ModelPatcher, devices) -> str:
    """"replicated" or "sharded" for the node's `weights`: auto is sharded when a whole replica and ComfyUI's
    minimum inference memory would not fit the free memory of the fullest of `devices` (on a cpu simulation,
    H3KIT_SIM_DEVICE_MEMORY sets each device's size: comfy.multidevice.free_memory). The activations of a
    sampling are known only then: RankMemory warns if the choice made here is short for them."""
    if weights not in WEIGHTS_MODES:
        raise ValueError(f"MultiNPU: weights must be one of {WEIGHTS_MODES}, got {weights!r}")
    if weights != "auto":
        return weights
    need = patcher.model_size() + comfy.model_management.minimum_inference_memory()
    free = min(comfy.multidevice.free_memory(d) for d in devices)
    chosen = "sharded" if need > free else "replicated"
    logging.info(f"MultiNPU: weights auto: a DiT replica needs {need / 1e9:.1f} GB with ComfyUI's minimum inference "
                 f"memory, {free / 1e9:.1f} GB are free per device: {chosen}")
    return chosen


def apply_sequence_parallel(patcher: ModelPatcher, devices=None, attention: str = "auto",
                            timeout: float = comfy.multinpu.DEFAULT_TIMEOUT,
                            weights: str = "replicated") -> ModelPatcher:
    """A clone of `patcher` whose MiniMax H3 DiT runs sequence-parallel on the ranks of this server's runtime.

    The ranks are comfy.multinpu_process.runtime_for(devices, the model's load device, ...): the server's process
    group, or threads of this process on `devices` (rank 0 = devices[0], the model's load device; collectives
    bounded by `timeout`). Either way every rank loads the same file with the server's weight patches (its own
    structural copy over the host weights; sharded the same way), checked before the first forward, and the
    server's copy stays on the host, unpatched (it computes no DiT forward).
    weights "replicated": every rank holds the whole DiT; "sharded": every rank holds 1/P of each block's weights
    (comfy.multinpu_shard); "auto": choose_weights. Installs the DIFFUSION_MODEL wrapper, one block replacement
    per DiT block, and the sampling wrappers that size each rank's load by its own activations and empty every
    rank's cache after sampling. Applying it again replaces the previous setup. Raises ValueError for a model
    that is not MiniMax H3, whose blocks another node already replaces, that no cached loader loaded, or whose
    patches a rank cannot apply the same way.
    """
    dm = patcher.model.diffusion_model
    _check_applicable(patcher, dm)
    runtime = comfy.multinpu_process.runtime_for(devices, patcher.load_device, "model", timeout)
    config, weights = _rank_config(patcher, weights)
    # The server computes no DiT forward (worker rank 0 does, on device 0): its copy stays on the host, mapped from
    # the file, and the sampler's latents with it, so device 0 holds one DiT, worker rank 0's, not two. The copy
    # keeps rank 0's structure (its slices when sharded), which ComfyUI sizes rank 0's load and estimate by.
    device, host = patcher.load_device, patcher.offload_device
    m = _server_copy(patcher, weights, host, runtime.world_size)
    _install_wrappers(m, SequenceParallelDiT(runtime, config, attention, weights=weights, device=host,
                                             rank_device=device))
    _replace_blocks(m, len(dm.blocks))
    logging.info(f"MultiNPU: MiniMax H3 DiT sequence-parallel on {runtime.describe()}, attention {attention}; "
                 f"{_weights_line(weights, patcher, runtime.world_size)}, "
                 f"{len(config.payload['patches'])} weight patch(es) sent to the ranks")
    return m


def _check_applicable(patcher: ModelPatcher, dm):
    """ValueError for a model apply_sequence_parallel cannot set up."""
    if not isinstance(dm, comfy.ldm.minimax.model.MiniMaxH3Model):
        raise ValueError(f"MultiNPU: sequence parallelism supports the MiniMax H3 DiT, not {type(dm).__name__}")
    if comfy.multinpu_shard.of(dm) is not None:
        # its blocks hold one rank's slices, not weights a new setup could start from
        raise ValueError("MultiNPU: this DiT's weights are already sharded by MultiNPUParallelConfig; apply the node "
                         "once, to the loader's model")
    blocks = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    foreign = [k for k, v in blocks.items() if not isinstance(v, SequenceParallelBlock)]
    if foreign:
        raise ValueError(f"MultiNPU: DiT blocks {sorted(k[1] for k in foreign)} are already replaced by another node; "
                         "sequence parallelism needs every block")


def _rank_config(patcher: ModelPatcher, weights: str):
    """(the RemoteConfig every rank loads its DiT from, the weights mode chosen); the host weights become the
    file's mapped copy."""
    src = comfy.multinpu_models.source(patcher.model, "diffusion model")
    patches = comfy.multinpu_models.weight_patches(patcher, "diffusion model")
    # ranks that are threads of this process load nothing: they take this model (their patches are the config's)
    comfy.multinpu_models.offer(src, patcher)
    # a loaded model's modules carry per-load state (cast flags, lowvram hooks) and, with weight patches, patched
    # weights: unloaded, they are the file's again
    comfy.model_management.unload_model_and_clones(patcher)
    # every rank runs a device like rank 0's
    weights = choose_weights(weights, patcher, [patcher.load_device])
    # the host weights become the file's page-cache copy, the one every rank of this host maps
    comfy.multinpu_models.map_file_weights(patcher.model, src.paths)
    comfy.multinpu_weights.anchor_host_copy(patcher.model)
    config = comfy.multinpu_process.RemoteConfig(
        "dit_config", {"source": src, "patches": patches, "weights": weights},
        comfy.multinpu_models.digest(src, patcher.model, patches, weights=weights), f"DiT {src.paths[0]}")
    return config, weights


def _server_copy(patcher: ModelPatcher, weights: str, host, world: int) -> ModelPatcher:
    """The server's clone of the model: on the host, without weight patches, rank 0's structure."""
    if weights == "sharded":
        m = sharded_patcher(patcher, host, 0, world)
        # its slices would only be built to sit on the host unused: the ranks build their own
        m.remove_callbacks_with_key(comfy.patcher_extension.CallbacksMP.ON_LOAD, KEY)
    else:
        m = patcher.clone()
    m.load_device = host
    if hasattr(m, "register_load_device"):
        m.register_load_device(host)
    # the weight patches travel to the ranks in the configuration; applied to the host copy they would compute
    # every LoRA'd weight on the CPU into a private copy no forward reads
    m.patches = {}
    m.patches_uuid = uuid.uuid4()
    return m


def _weights_line(weights: str, patcher: ModelPatcher, world: int) -> str:
    size_gb = patcher.model_size() / 1e9
    if weights == "sharded":
        return f"every device keeps 1/{world} of each DiT block's weights (the whole DiT: {size_gb:.1f} GB)"
    return f"every device holds the full DiT weights ({size_gb:.1f} GB)"


def _install_wrappers(m: ModelPatcher, wrapper: SequenceParallelDiT):
    for kind, obj in ((comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, wrapper),
                      (comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, RankMemory(wrapper)),
                      (comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, EmptyCacheAfterSampling(wrapper))):
        m.remove_wrappers_with_key(kind, KEY)
        m.add_wrapper_with_key(kind, KEY, obj)


def _replace_blocks(m, count: int):
    for i in range(count):
        m.set_model_patch_replace(SequenceParallelBlock(i, i == count - 1), "dit", "double_block", i)


def rank_shapes(noise_shape, world: int) -> list:
    """Each rank's share of a latent's shape for ComfyUI's memory estimate: the last dimension (the packed
    latent's elements: [B, 1, N] for H3's video and audio) cut as the tokens are, the first ranks one longer.
    ComfyUI's estimate is linear in that dimension, so a rank's estimate is its shard's."""
    shape = list(noise_shape)
    return [shape[:-1] + [n] for n in comfy.multinpu.shard_sizes(shape[-1], world)]


class RankMemory:
    """WrappersMP.PREPARE_SAMPLING: ComfyUI sizes the model loads by each rank's own activations.

    Upstream's estimate (model_base.memory_required, through sampler_helpers.estimate_memory) is for the whole
    latent on one device; a rank computes its shard of the tokens: each rank loads with its own estimate
    (memory_estimates, sent with every forward), and the sampler's step with rank 0's (the longest shard). Logs a warning with the fix when a rank's
    weights and activations exceed its device's free memory (ComfyUI then streams part of the weights).
    """

    def __init__(self, dit: SequenceParallelDiT):
        self.dit = dit

    def __call__(self, executor, model, noise_shape, conds, *args, **kwargs):
        free_server_share(self.dit.runtime, self.dit.rank_device)
        shapes = rank_shapes(noise_shape, self.dit.world)
        self.dit.memory_estimates = [comfy.sampler_helpers.estimate_memory(model, s, conds) for s in shapes]
        self.dit.memory_estimate_one = comfy.sampler_helpers.estimate_memory(model, list(noise_shape), conds)
        self.dit.memory_used = [e[0] for e in self.dit.memory_estimates]
        self._check_fit(model)
        return executor(model, shapes[0], conds, *args, **kwargs)

    def _check_fit(self, model):
        # the server's copy has rank 0's structure (its slices when sharded) and stands for every rank's; each rank of
        # this host is asked about its own device, whose weights it holds from the last forward count as free
        spec = self.dit.runtime.spec
        for r in range(self.dit.world):
            if spec.node_of(r) != 0:
                continue
            p = model
            need = p.model_size() + self.dit.memory_estimates[r][0]
            device = self.dit.rank_device if r == 0 else torch.device(spec.device_name(r))
            free = comfy.multidevice.free_memory(device) + self.dit.resident_bytes[r]
            if need <= free:
                continue
            fix = ("weights sharded on MultiNPUParallelConfig, INT8 weights" if self.dit.weights == "replicated"
                   else "INT8 weights")
            logging.warning(f"MultiNPU: {device} (rank {r}) needs {need / 1e9:.3g} GB for the DiT "
                            f"({self.dit.weights} weights {p.model_size() / 1e9:.3g} GB, activations "
                            f"{self.dit.memory_estimates[r][0] / 1e9:.3g} GB) and has {free / 1e9:.3g} GB free: "
                            f"ComfyUI loads part of the weights and streams the rest every step. Fix: {fix}, a "
                            "smaller or shorter video, or more devices (h3kit plan --device-memory shows each tier)")


def free_server_share(runtime, device):
    """One device, two users (issue 45 item 5): with the process transport device 0 has two memory managers, the
    server's (its text encoder's embeddings and vision tower, its VAE encoder, loaded there for its own encodes) and
    worker rank 0's, each sizing its loads without the other. Before sampling, the server's models on device 0 are
    unloaded (ComfyUI loads them again for the next encode); h3kit plan reserves their share in device 0's memory for
    the encodes. Not on a CPU (no device is shared there); unmeasured on hardware."""
    if device.type == "cpu" or runtime.SERVER_IS_RANK0:  # one memory manager: the server's is rank 0's
        return
    comfy.model_management.free_memory(1e30, device)


class EmptyCacheAfterSampling:
    """WrappersMP.OUTER_SAMPLE: after sampling, every rank gives its reserved but unused device memory back
    (torch's caching allocator keeps it otherwise, and the next stage, the VAE decode, runs out of memory with
    most of the device reserved and free)."""

    def __init__(self, dit: SequenceParallelDiT):
        self.dit = dit

    def __call__(self, executor, *args, **kwargs):
        out = executor(*args, **kwargs)
        self.dit.empty_caches()
        return out


def get_wrapper(patcher: ModelPatcher):
    """The SequenceParallelDiT of a patcher set up by apply_sequence_parallel, or None."""
    found = patcher.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    return found[0] if found else None
