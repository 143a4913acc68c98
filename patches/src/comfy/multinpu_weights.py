"""Weights read once: every device's copy of a loaded model comes from one read-only host copy.

Upstream's multi-device clones (ModelPatcher.deepclone_multigpu) run the loader again for every device,
so N devices read and parse the model file N times and keep N host copies. A multi-device run here
starts from the model the loader already returned (comfy.model_cache keeps it across prompts):

- share_module(module) is the structural copy a rank runs: module objects of its own (its own device
  moves, hooks and per-load state) whose parameters and buffers share the source's storage. No file is
  read and no weight is copied; a tensor-parallel shard swaps in slices (views) of the same storage.
- anchor_host_copy(module) makes the host tensors a module holds now its host copy. ModelPatcher loads
  a module onto its device with module.to(device), a device copy made from the host tensors, and
  unloads it with module.to(offload_device). Upstream's move back allocates a new host tensor for every
  weight, so after one unload cycle the host held one copy per device. An anchored module's move back
  to the host re-points every weight at its anchor instead: nothing is allocated or copied, and host
  memory stays one model whatever the device count, through any number of load and unload cycles.

The anchors are read-only by convention. ComfyUI merges weight patches (LoRA) into the device copy, or
into a copy it backs up and restores on the host; hook patches write in place (copy_to_param), which on
host-resident shared storage would reach every rank at once. A parallel text encoder therefore refuses
patches added after MultiNPUParallelConfig (multinpu_te), and the node runs a text encoder that already
carries them on one device.
"""

from __future__ import annotations

import copy
import itertools
import logging
import types

import torch

ANCHOR_ATTR = "_multinpu_host_copy"


class _HostCopy:
    """The anchors of one module: {parameter or buffer name: host tensor}.

    Shared, not copied, when a module is deep-copied (share_module): a structural copy's weights share
    the same host storage, so they return to the same anchors.
    """

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def __deepcopy__(self, memo):
        return self

    def repoint(self, module: torch.nn.Module, fn):
        for name, host in self.tensors.items():
            if name in module._parameters:
                current = module._parameters[name]
            elif name in module._buffers:
                current = module._buffers[name]
            else:
                continue
            if current is None or current.device == host.device or current.shape != host.shape or current.dtype != host.dtype:
                continue
            if not _moves_to(fn, host):
                continue
            if not isinstance(current, torch.nn.Parameter):
                module._buffers[name] = host
            elif not _is_quantized(current) and torch._has_compatible_shallow_copy_type(current, host):
                current.data = host
            else:  # what Module._apply itself does for such a pair (a meta, backend or quantized tensor)
                module._parameters[name] = torch.nn.Parameter(host, requires_grad=current.requires_grad)


def _moves_to(fn, host: torch.Tensor) -> bool:
    """Does `fn` (what Module._apply applies) move a tensor onto `host`'s device, keeping its dtype?

    A dtype-only call (.float(), .to(torch.float32)) keeps a tensor on its device and must not bring the
    weights to the host. Asked first with an empty meta tensor: a call that keeps the device returns one,
    a call that moves to any device cannot copy out of meta and raises; only then is the target read off
    an empty host tensor.
    """
    try:
        if fn(torch.empty(0, dtype=host.dtype, device="meta")).device.type == "meta":
            return False
    except (NotImplementedError, RuntimeError):
        pass
    target = fn(torch.empty(0, dtype=host.dtype, device=host.device))
    return target.device == host.device and target.dtype == host.dtype


def _anchored_apply(self, fn, recurse=True):
    # runs first for this module only; the class's own _apply (quantized layers have one) does the rest
    # and recurses, reaching each anchored child's _anchored_apply in turn
    self.__dict__[ANCHOR_ATTR].repoint(self, fn)
    return type(self)._apply(self, fn, recurse)


def _is_plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def _is_quantized(t) -> bool:
    """A comfy-kitchen QuantizedTensor (INT8, FP8 ... weights): its data lives in t._qdata, its scales in t._params."""
    return hasattr(t, "_qdata") and hasattr(t, "_layout_cls") and hasattr(t, "_params")


def _host_handle(t):
    """What an anchor keeps for a host tensor: a view of a plain one; for a quantized one a tensor of its class
    over the same int8 data and scales (detach() would clone the scales)."""
    return type(t)(t._qdata, t._layout_cls, t._params) if _is_quantized(t) else t.detach()


def _data(t) -> torch.Tensor:
    return t._qdata if _is_quantized(t) else t


def _nbytes(t) -> int:
    if _is_quantized(t):
        scale = getattr(t._params, "scale", None)
        return t._qdata.numel() * t._qdata.element_size() + (scale.numel() * scale.element_size() if scale is not None else 0)
    return t.numel() * t.element_size()


def anchor_host_copy(module: torch.nn.Module) -> int:
    """Make the host tensors `module` holds now the ones its moves back to the host return to.

    Every submodule with parameters or buffers on the host (cpu) gets an anchor per tensor, quantized
    weights (comfy-kitchen's QuantizedTensor: an INT8 checkpoint's linears) included: their int8 data comes
    back to the anchor; upstream's _quantized_apply re-wraps them on every move, which copies only the
    per-channel scales (1/K of the weight). Tensors on a device and other tensor subclasses are left to
    upstream's path. Anchoring again replaces the anchors (a tensor-parallel shard anchors its slices).
    Returns the bytes anchored.
    """
    total = 0
    for m in module.modules():
        tensors = {}
        for name, t in itertools.chain(m._parameters.items(), m._buffers.items()):
            if t is not None and (_is_plain(t) or _is_quantized(t)) and t.device.type == "cpu":
                tensors[name] = _host_handle(t)
                total += _nbytes(t)
        if tensors:
            m.__dict__[ANCHOR_ATTR] = _HostCopy(tensors)
            m.__dict__["_apply"] = types.MethodType(_anchored_apply, m)
        else:
            m.__dict__.pop(ANCHOR_ATTR, None)
            m.__dict__.pop("_apply", None)
    return total


def is_anchored(module: torch.nn.Module) -> bool:
    return ANCHOR_ATTR in module.__dict__


def host_storages(module: torch.nn.Module) -> set:
    """data_ptr()s of the host storages the module's anchors point into (tests and benchmarks)."""
    out = set()
    for m in module.modules():
        anchors = m.__dict__.get(ANCHOR_ATTR)
        if anchors is not None:
            out.update(_data(t).untyped_storage().data_ptr() for t in anchors.tensors.values())
    return out


def share_module(module: torch.nn.Module, shared=(), dropped=(), replace=()):
    """A structural copy of `module` whose parameters and buffers share the source's storage.

    shared: objects the copy refers to as they are (a model config); dropped: objects the copy refers
    to as None (a ModelPatcher the source points back to); replace: (old, new) pairs, the copy holds new
    where the source holds old (a submodule built separately). Anchors carry over (same storage, same
    anchors). Nothing is read from a file and no weight is copied.
    """
    memo = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        memo[id(t)] = torch.nn.Parameter(t.data, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else t
    for o in shared:
        memo[id(o)] = o
    for o in dropped:
        memo[id(o)] = None
    for old, new in replace:
        memo[id(old)] = new
    return copy.deepcopy(module, memo)


# what ModelPatcher records on the model it loads; a copy of a loaded model must not inherit it
_LOAD_STATE = {"model_loaded_weight_memory": 0, "lowvram_patch_counter": 0, "model_lowvram": False,
               "current_weight_patches_uuid": None, "model_offload_buffer_memory": 0}


def restore_host_weights(patcher):
    """Unload the loaded clones of `patcher` (ModelPatchers over the same model) that patched its weights or hold
    them off the host: a rank's copy views the host weights (with threads, another clone of the same model may be
    loaded meanwhile)."""
    import comfy.model_management as mm  # the module itself imports no ComfyUI module at load time
    for i in range(len(mm.current_loaded_models) - 1, -1, -1):
        clone = mm.current_loaded_models[i].model
        if clone is not None and clone.is_clone(patcher) and (
                clone.patches or clone.current_loaded_device() != clone.offload_device):
            mm.current_loaded_models.pop(i).model_unload()


def reset_load_state(module: torch.nn.Module):
    for name, value in _LOAD_STATE.items():
        if hasattr(module, name):
            setattr(module, name, value)


def slice_parameter(param: torch.Tensor, dim: int, start: int, stop: int) -> torch.nn.Parameter:
    """Rows (dim 0) or columns (dim 1) start..stop-1 of a weight, as a Parameter viewing the same storage."""
    return torch.nn.Parameter(param.detach().narrow(dim, start, stop - start), requires_grad=False)


def select_rows(param: torch.Tensor, rows) -> torch.nn.Parameter:
    """Arbitrary rows of a weight: a view when they are contiguous, else a copy (logged)."""
    rows = list(rows)
    if rows == list(range(rows[0], rows[-1] + 1)):
        return slice_parameter(param, 0, rows[0], rows[-1] + 1)
    logging.debug(f"MultiNPU: {len(rows)} rows of a {tuple(param.shape)} weight are not contiguous; copying them")
    return torch.nn.Parameter(param.detach()[rows].clone(), requires_grad=False)


def device_patcher(patcher, model, device):
    """A ModelPatcher like `patcher` (its class, cast options, hooks) over `model`, loading onto `device`."""
    p = patcher.clone(model_override=(model, ({}, {}, {}, set())))
    p.size = 0  # a shard is smaller than the source: measure it
    p.load_device = device
    if hasattr(p, "register_load_device"):
        p.register_load_device(device)
    p.is_multigpu_base_clone = False
    return p
