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

    replicas[r] (r >= 1) is the BaseModel whose diffusion_model rank r runs; replicas[0] is None (rank 0
    is the wrapped model itself). One forward at a time per wrapper. forwards, rank_forwards (per rank),
    bytes_moved and bytes_received (per rank) count what ran, for logs and `h3kit parity`.
    """

    def __init__(self, devices, replicas, attention: str = "auto", timeout: float = comfy.multinpu.DEFAULT_TIMEOUT):
        if attention not in ATTENTION_MODES:
            raise ValueError(f"MultiNPU: attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.devices = list(devices)
        self.replicas = list(replicas)
        self.attention = attention
        self.timeout = timeout
        self.forwards = 0
        self.rank_forwards = [0] * len(self.devices)
        self.bytes_moved = 0
        self.bytes_received = [0] * len(self.devices)
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
                            timeout: float = comfy.multinpu.DEFAULT_TIMEOUT) -> ModelPatcher:
    """A clone of `patcher` whose MiniMax H3 DiT runs sequence-parallel on `devices` (rank 0 = devices[0]).

    Adds one replica ModelPatcher per extra device as additional models (so sampling loads each onto
    its device, with upstream's memory management), the DIFFUSION_MODEL wrapper and one block
    replacement per DiT block. Applying it again replaces the previous setup. Raises ValueError for a
    model that is not MiniMax H3 or whose blocks another node already replaces.
    """
    dm = patcher.model.diffusion_model
    if not isinstance(dm, comfy.ldm.minimax.model.MiniMaxH3Model):
        raise ValueError(f"MultiNPU: sequence parallelism supports the MiniMax H3 DiT, not {type(dm).__name__}")
    blocks = patcher.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    foreign = [k for k, v in blocks.items() if not isinstance(v, SequenceParallelBlock)]
    if foreign:
        raise ValueError(f"MultiNPU: DiT blocks {sorted(k[1] for k in foreign)} are already replaced by another node; "
                         "sequence parallelism needs every block")
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
    count = len(dm.blocks)
    for i in range(count):
        m.set_model_patch_replace(SequenceParallelBlock(i, i == count - 1), "dit", "double_block", i)
    size_gb = patcher.model_size() / 1e9
    logging.info(f"MultiNPU: MiniMax H3 DiT sequence-parallel on {comfy.multidevice.describe_devices(devices)}, "
                 f"attention {attention}; every device holds the full DiT weights ({size_gb:.1f} GB)")
    return m


def get_wrapper(patcher: ModelPatcher):
    """The SequenceParallelDiT of a patcher set up by apply_sequence_parallel, or None."""
    found = patcher.get_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, KEY)
    return found[0] if found else None
