"""Sharded DiT weights (FSDP-style): each rank keeps 1/P of every DiT block's weights on its device.

MiniMax H3's 50 DiT blocks hold 32.3 B of its 33.1 B parameters (64.5 GB at BF16). A rank of a sharded model
keeps everything outside the blocks as it is (embeddings, the token refiner, the time embedder, the final
layer) and, for each block, one slice of the block's weights: 1/P of their bytes. Just before a block runs,
its weights are gathered from the P slices (one all-gather of equal sizes, every backend's) into one buffer
that the block's modules then view; right after it ran they are dropped. Block i+1's gather is issued
before block i computes, on a process group of its own (comm.side(): a backend runs one group's collectives
in issue order, so a gather on the attention's group would wait behind the block's all-to-alls): on npu and
cuda on a second stream (torch.get_device_module(device).Stream), so the copy overlaps the block; on cpu the
process transport issues it as gloo's asynchronous collective and waits for it at block i+1, the threads
gather in order. At most two blocks are whole at a time.

The flat layout of a block: its parameters in module order (a quantized weight, comfy-kitchen's
QuantizedTensor, is its int8 data followed by each tensor of its layout parameters, the per-channel scales),
each in a slot of its bytes rounded up to ALIGN plus one ALIGN, the total padded to a multiple of P x ALIGN
and cut into P equal slices. Rank r keeps slice r, so the int8 data and the scales of an INT8 weight are
sharded by the same cut. Inside its slot a tensor starts where its bytes are as aligned as the weight a
replicated load holds (a fresh device allocation: the slot's start; on the cpu simulation the host tensor
itself, which may sit at any offset of a mapped file): some CPU kernels round the last bit differently for
a differently aligned operand.

Exact by construction. A rank builds its slices from the host weights through its own
ModelPatcher.patch_weight_to_device(key, device, return_weight=True): upstream's function that applies
LoRA and every other weight patch when a model is loaded, on the rank's device and with upstream's
rounding. The gathered block is therefore, byte for byte, the weights the replicated load puts on a
device. Patches apply to whole weights, never to slices: a slice cuts a weight anywhere, and upstream's
stochastic rounding draws its noise over the whole tensor from a per-key seed, so patching slices would not
be the same computation.

ComfyUI's memory manager sees the slices: they are the parameters of the ShardedBlocks module inside the
rank's DiT (the blocks' own parameters are taken out of the module tree), so model_size() and
load_models_gpu count exactly the slices, and loading or unloading the model places or frees them. The
host copy of the weights stays the one the loader made (anchored, comfy.multinpu_weights); nothing of it
is copied on the host.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING

import torch

import comfy.multinpu

if TYPE_CHECKING:
    from comfy.model_patcher import ModelPatcher

ALIGN = 512              # bytes: a device allocator's alignment; every slot of a gathered block starts on it
CPU_ALIGN = 64           # bytes: torch's cpu allocator's alignment
ATTR = "multinpu_shards"  # the ShardedBlocks child of a sharded DiT


def _is_quantized(t) -> bool:
    return hasattr(t, "_qdata") and hasattr(t, "_layout_cls") and hasattr(t, "_params")


def _parts(t) -> list:
    """The tensors that hold a weight's bytes: itself, or a QuantizedTensor's data and its layout's tensors."""
    if _is_quantized(t):
        return [t._qdata] + [getattr(t._params, f) for f in t._params._tensor_fields()]
    return [t]


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def slot_bytes(nbytes: int) -> int:
    """The bytes a tensor of `nbytes` takes in a block's flat layout (room to start at any alignment)."""
    return aligned(nbytes) + ALIGN


class _Slot:
    """One parameter of a block: its module, its key in the model, its host tensor, and where its parts lie."""

    __slots__ = ("module", "name", "key", "host", "parts")

    def __init__(self, module, name, key, host, parts):
        self.module = module
        self.name = name
        self.key = key
        self.host = host
        self.parts = parts  # [(shape, dtype, slot offset, nbytes)]


class BlockLayout:
    """Where every parameter of one block lies in the block's flat bytes, and the size of one slice."""

    def __init__(self, block: torch.nn.Module, prefix: str, world: int):
        self.slots = []
        offset = 0
        for mod_name, module in block.named_modules():
            for name, param in module._parameters.items():
                if param is None:
                    continue
                parts = []
                for t in _parts(param):
                    n = t.numel() * t.element_size()
                    parts.append((tuple(t.shape), t.dtype, offset, n))
                    offset += slot_bytes(n)
                key = f"{prefix}{mod_name}.{name}" if mod_name else f"{prefix}{name}"
                self.slots.append(_Slot(module, name, key, param, parts))
        self.nbytes = sum(n for s in self.slots for _, _, _, n in s.parts)  # the weights themselves
        unit = world * ALIGN
        self.padded = -(-offset // unit) * unit
        self.shard = self.padded // world
        # where each tensor starts inside its slot (build() sets them, install() reads them), slot by slot
        self.shifts = [[0] * len(s.parts) for s in self.slots]


def _target_device(fn):
    """The device a Module._apply function moves tensors to, or None when it keeps them where they are (a dtype
    change). Asked with an empty meta tensor first: a call that keeps the device returns one."""
    try:
        if fn(torch.empty(0, dtype=torch.uint8, device="meta")).device.type == "meta":
            return None
    except (NotImplementedError, RuntimeError):
        pass
    return fn(torch.empty(0, dtype=torch.uint8)).device


class BlockSlice(torch.nn.Module):
    """One rank's slice of one DiT block: parameter s, uint8 [slice bytes], a meta placeholder until it is built.

    Each block's slice is a module of its own, so ComfyUI's loader places or offloads it on its own: a card short
    of memory keeps the slices that fit and builds only the others on use (a slope, not a cliff). A move away
    from `device` (ModelPatcher offloading it) frees the slice, never copies it.
    """

    def __init__(self, nbytes: int, device: torch.device):
        super().__init__()
        self.nbytes = nbytes
        self.slice_device = device
        self.built_for = None     # patches_uuid of the patcher the slice was built with
        self.free()

    def set(self, t: torch.Tensor, built_for):
        self._parameters["s"] = torch.nn.Parameter(t, requires_grad=False)
        self.built_for = built_for

    def free(self):
        self.set(torch.empty(self.nbytes, dtype=torch.uint8, device="meta"), None)

    def _apply(self, fn, recurse=True):
        target = _target_device(fn)
        if self.built_for is not None and target is not None and target != self.slice_device:
            self.free()
        return self


class ShardedBlocks(torch.nn.Module):
    """One rank's slices of every DiT block: child modules b0 .. b{n-1} (BlockSlice), one per block.

    Created on a structural copy of the DiT (its own module objects: comfy.multinpu_weights.share_module),
    it takes the blocks' parameters out of their modules, keeping the host tensors. The slices are meta
    placeholders until build() makes those ComfyUI loaded on `device` (an ON_LOAD callback of the rank's
    ModelPatcher); resident(i) builds one on use when ComfyUI left it off the device. install(i, flat) puts
    block i's parameters back as views of its gathered bytes, uninstall(i) takes them out again.
    """

    def __init__(self, dm: torch.nn.Module, rank: int, world: int, device, prefix: str = "diffusion_model.blocks."):
        super().__init__()
        self.rank = rank
        self.world = world
        self.device = torch.device(device)
        self.layouts = [BlockLayout(block, f"{prefix}{i}.", world) for i, block in enumerate(dm.blocks)]
        self.fault = None         # the fault hook of `h3kit parity --inject-fault` (None in normal runs)
        self.rebuilt = 0          # slices built on use, because ComfyUI did not load their module
        self.h2d_bytes = 0        # host bytes this rank copied to its device to build slices (load and on use)
        self._patcher = None
        self._gather_stream = None
        for i, lay in enumerate(self.layouts):
            for s in lay.slots:
                s.module._parameters[s.name] = None
            self.add_module(f"b{i}", BlockSlice(lay.shard, self.device))

    def gather_stream(self):
        """The side stream this rank's weight gathers run on, made once (None on cpu). A stream per forward would
        put each forward's gathered buffers in another stream's share of the caching allocator, so none would
        be reused and reserved memory would grow forward after forward."""
        if self.device.type == "cpu":
            return None
        if self._gather_stream is None:
            self._gather_stream = torch.get_device_module(self.device).Stream(self.device)
        return self._gather_stream

    def slices(self) -> list:
        return [self._modules[f"b{i}"] for i in range(len(self.layouts))]

    def shard(self, i: int) -> torch.Tensor:
        return self._modules[f"b{i}"].s

    @property
    def built(self) -> bool:
        """Every block's slice is on the device."""
        return all(b.built_for is not None for b in self.slices())

    def free(self):
        for b in self.slices():
            b.free()

    def loaded_by(self, patcher: ModelPatcher):
        """The ModelPatcher that loaded the model last: slices built on use take its weight patches."""
        self._patcher = weakref.ref(patcher)

    def build(self, patcher: ModelPatcher, fault=None, loaded_only: bool = False, again: bool = False):
        """Make the slices on the device from the host weights with `patcher`'s weight patches: every block's,
        or (loaded_only) those ComfyUI's loader placed on the device (comfy_patched_weights on their module);
        again: also those built already (a fault run's hook)."""
        self.loaded_by(patcher)
        for i, b in enumerate(self.slices()):
            if loaded_only and not getattr(b, "comfy_patched_weights", False):
                continue
            if again or b.built_for != patcher.patches_uuid:
                b.set(self.build_block(i, patcher, fault), patcher.patches_uuid)

    def build_block(self, i: int, patcher: ModelPatcher, fault=None) -> torch.Tensor:
        """This rank's slice of block i: the bytes [rank x slice, (rank + 1) x slice) of the block's flat layout
        holding its weights as one device loads them (patches applied). Only those bytes move to the device: a
        weight without patches is copied from its host tensor where it overlaps the slice; a patched weight is
        patched whole on the device (upstream's function, its rounding and stochastic-rounding seed are per whole
        weight) and then cut."""
        lay = self.layouts[i]
        start, stop = self.rank * lay.shard, (self.rank + 1) * lay.shard
        out = torch.zeros(lay.shard, dtype=torch.uint8, device=self.device)
        for j, s in enumerate(lay.slots):
            patched = s.key in patcher.patches
            if not patched:
                got = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in _parts(s.host)]
            elif any(offset + slot_bytes(n) > start and offset < stop for _, _, offset, n in s.parts):
                # upstream reads the weight from the model: put the host tensor back for the call
                s.module._parameters[s.name] = s.host
                try:
                    got = [t.detach().to(self.device).contiguous()
                           for t in _parts(patcher.patch_weight_to_device(s.key, device_to=self.device, return_weight=True))]
                finally:
                    s.module._parameters[s.name] = None
                if [(tuple(t.shape), t.dtype) for t in got] != [(shape, dtype) for shape, dtype, _, _ in s.parts]:
                    raise RuntimeError(f"MultiNPU: the weight patches of {s.key} changed its layout "
                                       f"({[(tuple(t.shape), t.dtype) for t in got]}); it cannot be sharded")
                self.h2d_bytes += sum(t.numel() * t.element_size() for t in _parts(s.host))
            else:
                got = [None] * len(s.parts)  # patched and outside this slice: nothing to build
            for k, (t, (_, _, offset, n)) in enumerate(zip(got, s.parts)):
                # the alignment a replicated load's weight has: on the cpu simulation an unpatched weight is the
                # host tensor itself, which may sit at any offset of a mapped file; a device copy, or a patched
                # weight (a fresh tensor), starts aligned. Every rank computes the same shifts
                shift = t.data_ptr() % CPU_ALIGN if (self.device.type == "cpu" and not patched) else 0
                lay.shifts[j][k] = shift
                lo, hi = max(offset + shift, start), min(offset + shift + n, stop)
                if lo >= hi:
                    continue
                src = t.reshape(-1).view(torch.uint8)[lo - offset - shift:hi - offset - shift]
                if not patched:
                    self.h2d_bytes += hi - lo
                out[lo - start:hi - start].copy_(src)
        if fault is not None:
            out = fault("shard", _Where(self, i), out)
        return out

    def resident(self, i: int) -> torch.Tensor:
        """Block i's slice on the device; built now (and dropped after use) when ComfyUI did not load it."""
        t = self.shard(i)
        if t.device.type != "meta":
            return t
        patcher = self._patcher() if self._patcher is not None else None
        if patcher is None:
            raise RuntimeError("MultiNPU: the sharded DiT runs without having been loaded by its ModelPatcher")
        if self.rebuilt % 1000 == 0:
            logging.warning(f"MultiNPU: the DiT's weight slices are not loaded on {self.device} (not enough free "
                            "memory); each block's slice is rebuilt from the host weights on every forward, which "
                            "is slow. Fix: free memory on the device, use INT8 weights or more devices")
        self.rebuilt += 1
        return self.build_block(i, patcher, self.fault)

    def install(self, i: int, flat: torch.Tensor):
        """Block i's parameters become views of its gathered bytes `flat` [padded]."""
        lay = self.layouts[i]
        for s, shifts in zip(lay.slots, lay.shifts):
            views = [flat[o + d:o + d + n].view(dtype).view(shape) for (shape, dtype, o, n), d in zip(s.parts, shifts)]
            if _is_quantized(s.host):
                params = s.host._params
                fields = dict(zip(params._tensor_fields(), views[1:]))
                t = type(s.host)(views[0], s.host._layout_cls, dataclasses.replace(params, **fields))
            else:
                t = views[0]
            s.module._parameters[s.name] = torch.nn.Parameter(t, requires_grad=False)
            _drop_lowvram_patch(s)

    def uninstall(self, i: int):
        for s in self.layouts[i].slots:
            s.module._parameters[s.name] = None


def _drop_lowvram_patch(s: _Slot):
    # A partial load (ComfyUI short of memory) hands a module whose weights it did not load a LowVramPatch, which
    # applies the weight patches when the weight is cast for use; the slices carry them already, and applying
    # them twice would be wrong, so a gathered weight is used as it is
    attr = f"{s.name}_function"
    fns = getattr(s.module, attr, None)
    if fns and any(getattr(f, "key", None) == s.key and getattr(f, "is_lowvram_patch", False) for f in fns):
        setattr(s.module, attr, [f for f in fns if not (getattr(f, "key", None) == s.key
                                                         and getattr(f, "is_lowvram_patch", False))])


class _Where:
    """What a fault hook is told about a slice: the rank (as `comm`), the block and the slice size."""

    def __init__(self, shards: ShardedBlocks, block: int):
        self.comm = _RankInfo(shards.rank, shards.world)
        self.block = block
        self.shard = shards.layouts[block].shard


class _RankInfo:
    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world_size = world


def shard_module(dm: torch.nn.Module, rank: int, world: int, device) -> ShardedBlocks:
    """Shard `dm`'s blocks for `rank` of `world` (dm must be this rank's own structural copy)."""
    shards = ShardedBlocks(dm, rank, world, device)
    dm.add_module(ATTR, shards)
    return shards


def of(dm: torch.nn.Module):
    """The ShardedBlocks of a sharded DiT, or None for a DiT that holds its whole weights."""
    return dm._modules.get(ATTR)


class WeightGather:
    """One forward's gathers on one rank: block i's weights just before it runs, block i+1's issued meanwhile.

    before(i): waits for block i's gather (issuing it first at block 0), puts its parameters in place and
    issues block i+1's; after(i): takes them out and drops the buffer. On npu and cuda the gathers run on a
    second stream, and the block's stream waits for them through an event (the buffer is recorded on that
    stream, so the allocator does not reuse it before the block is done); on cpu the processes' gathers are
    asynchronous collectives awaited in before(), the threads' run in order. Every
    rank issues the same gathers in the same order. `received` counts the bytes this rank received for them.
    """

    def __init__(self, shards: ShardedBlocks, comm, fault=None):
        self.shards = shards
        self.comm = comm.side()  # a group of their own: the gathers do not queue behind the attention exchanges
        self.fault = fault
        self.device = shards.device
        self.module = None if self.device.type == "cpu" else torch.get_device_module(self.device)
        self.stream = shards.gather_stream()
        self.pending = {}
        self.received = 0
        self.gathers = 0

    def _issue(self, i: int):
        if i >= len(self.shards.layouts) or i in self.pending:
            return
        shard = self.shards.resident(i)
        before = self.comm.bytes_received
        if self.stream is None:
            # cpu: processes gather asynchronously (the block before computes meanwhile), threads at once
            flat, event = comfy.multinpu.all_gather_flat_start(shard, self.comm), None
        else:
            # the gather may read the slice only once the block's stream has written it (a slice built on the fly)
            self.stream.wait_stream(self.module.current_stream(self.device))
            with self.module.stream(self.stream):
                flat = comfy.multinpu.all_gather_flat(shard, self.comm)
                event = self.stream.record_event()
            # a slice built on the fly was allocated on the block stream and is dropped when this returns: the
            # allocator must not hand its memory to the block stream while the gather may still read it
            shard.record_stream(self.stream)
        self.received += self.comm.bytes_received - before
        self.gathers += 1
        self.pending[i] = (flat, event)

    def before(self, i: int):
        self._issue(i)
        flat, event = self.pending[i]
        if callable(flat):
            flat = flat()
        if event is not None:
            stream = self.module.current_stream(self.device)
            stream.wait_event(event)
            flat.record_stream(stream)
        if self.fault is not None:
            flat = self.fault("weights", _Where(self.shards, i), flat)
        self.shards.install(i, flat)
        self._issue(i + 1)

    def after(self, i: int):
        self.shards.uninstall(i)
        self.pending.pop(i, None)

    def close(self):
        """After a forward that stopped early (an error): every block's parameters out, every buffer dropped."""
        for i in list(self.pending):
            self.after(i)


def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of the weights a module holds now (parameters and buffers, a quantized weight's data and scales;
    placeholders on "meta" excluded): what a rank keeps resident between forwards."""
    total = 0
    seen = set()
    for t in list(module.parameters()) + list(module.buffers()):
        for p in _parts(t):
            if p.device.type == "meta" or (p.untyped_storage().data_ptr(), p.storage_offset()) in seen:
                continue
            seen.add((p.untyped_storage().data_ptr(), p.storage_offset()))
            total += p.numel() * p.element_size()
    return total
