"""The model on every rank: what a worker process loads to hold rank 0's model, and the proof that it does.

With the process transport (comfy.multinpu_process) every rank is a process with its own memory. For each
model configuration the node sets up, rank 0 tells the workers what to load: the loader and the real paths
and options its cached loader was called with (comfy.model_cache records them) and the weight patches
(LoRA and the like: the patch tensors travel over the group). Each worker loads the same files through
the same loader (its own model cache, so a second prompt loads nothing), applies the same patches, and
answers with a digest of what it holds: the files' identity (size, the safetensors header, the first and
last MiB), the load options, the dtypes the loader chose, and the patch keys, strengths and tensors. Rank
0 compares every digest with its own before the first forward: a mismatch is an error naming the rank.

Host memory: a safetensors file is memory-mapped by the loader (safetensors' safe_open), then copied into
the model's own tensors. map_file_weights points every weight that equals its tensor in the file back at
the file's mapping (private, copy-on-write), so the weights of every process on a host are the page cache's
one copy of each file, and the private copies are freed. A weight converted on load (another dtype) keeps
its own copy. The file must not be rewritten in place while a server maps it (replace it by renaming).
Where the weights are computed on the host (cpu), only a tensor whose mapped data is aligned as torch's own
allocations are (ALIGNMENT bytes) is mapped: a safetensors file aligns its tensors to 8 bytes only, and the CPU
kernels round differently on data at another alignment (a tiny DiT over 2 processes drifted 3.8e-7 from one
device), so a misaligned weight keeps its private copy there. On npu/cuda the weights are computed from
their device copies and every weight is mapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import sys
import threading
import uuid
import weakref

import safetensors
import torch

import comfy.model_cache

MAPPED_ATTR = "_multinpu_file_mapped"
_EDGE = 1 << 20  # bytes of tensor data hashed at each end of a file
ALIGNMENT = 64   # bytes: c10's alignment of every CPU allocation, which the CPU kernels' rounding assumes


def source(module, what: str):
    """The LoadSource of a loaded module; ValueError when it did not come from a cached loader (a worker
    could not load the same thing)."""
    src = comfy.model_cache.source_of(module)
    if src is None:
        raise ValueError(f"MultiNPU: the {what} was not loaded by UNETLoader, CLIPLoader or VAELoader (their "
                         "cached loaders record the files), so the worker processes cannot load it")
    return src


# source key -> the loaded object a server set up for its ranks (offered): ranks that are threads of that process
# (comfy.multinpu_threads) take it instead of loading, even when ComfyUI emptied the model cache meanwhile (POST
# /free), so they never read a second host copy of what the server holds. Empty in a worker process.
_offered = weakref.WeakValueDictionary()


def _key(src):
    return comfy.model_cache.make_key(src.kind, src.paths, src.args, src.kwargs)


def offer(src, loaded):
    """Let this process's ranks take `loaded` (an object a cached loader returned for `src`, or a clone of it)."""
    _offered[_key(src)] = loaded


def load(src):
    """Load what `src` records through the same loader as rank 0 did: what the server offered in this process, else
    this process's model cache first."""
    found = _offered.get(_key(src))
    if found is not None:
        return found
    import comfy.sd
    if src.kind == "diffusion_model":
        return comfy.sd.load_diffusion_model(src.paths[0], **src.kwargs)
    if src.kind == "clip":
        return comfy.sd.load_clip(list(src.paths), **src.kwargs)
    if src.kind == "vae":
        import folder_paths
        import nodes
        # VAELoader takes a name inside the vae folders: this process's only vae folder is the file's own
        folder = os.path.dirname(src.paths[0])
        exts = folder_paths.folder_names_and_paths["vae"][1]
        folder_paths.folder_names_and_paths["vae"] = ([folder], exts)
        return nodes.VAELoader().load_vae(os.path.basename(src.paths[0]))[0]
    raise ValueError(f"MultiNPU: no loader for {src.kind!r}")


def file_identity(path: str) -> str:
    """size and a hash of the safetensors header and of the first and last MiB of tensor data (reading the
    whole file on every rank would cost minutes for the H3 weights)."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        h.update(head)
        if path.endswith((".safetensors", ".sft")) and len(head) == 8:
            h.update(f.read(int.from_bytes(head, "little")))
        start = f.tell()
        h.update(f.read(_EDGE))
        f.seek(max(start, size - _EDGE))
        h.update(f.read(_EDGE))
    return f"{os.path.basename(path)}:{size}:{h.hexdigest()[:16]}"


def _tensor_digest(h, t: torch.Tensor):
    t = t.detach().contiguous().cpu()
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def _walk(h, obj):
    # the structure, strengths and tensors of a weight patch (tuples of tensors, LoRA adapter objects)
    if isinstance(obj, torch.Tensor):
        _tensor_digest(h, obj)
    elif isinstance(obj, (list, tuple)):
        h.update(f"[{len(obj)}".encode())
        for o in obj:
            _walk(h, o)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _walk(h, obj[k])
    elif isinstance(obj, (set, frozenset)):
        # in a sorted order: a set's own order follows string hashing, which differs from process to process
        h.update(f"{{{len(obj)}".encode())
        for o in sorted(obj, key=repr):
            _walk(h, o)
    elif hasattr(obj, "__dict__") and not callable(obj):
        h.update(type(obj).__qualname__.encode())
        _walk(h, vars(obj))
    elif callable(obj):
        h.update(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}".encode())
    else:
        h.update(repr(obj).encode())


def patches_digest(patches: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(patches, key=str):
        h.update(str(key).encode())
        _walk(h, patches[key])
    return f"{len(patches)} keys:{h.hexdigest()[:16]}"


def digest(src, module: torch.nn.Module, patches=None, **extra) -> dict:
    """{component: short text}: what this rank holds, compared component by component across ranks."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in module.state_dict().values()})
    out = {"files": ", ".join(file_identity(p) for p in src.paths),
           "options": hashlib.sha256(repr(comfy.model_cache._freeze([src.kind, list(src.args[1:]), src.kwargs]))
                                     .encode()).hexdigest()[:16],
           "model": f"{type(module).__name__} {'/'.join(dtypes)}",
           "patches": patches_digest(patches or {})}
    out.update({k: str(v) for k, v in extra.items()})
    return out


def weight_patches(patcher, what: str) -> dict:
    """The weight patches a worker must apply to hold `patcher`'s weights ({key: [(strength_patch, value,
    strength_model, offset, function), ...]}, as ModelPatcher keeps them). ValueError for patches that exist
    only as Python objects in this process (hooks, object patches on the model's modules)."""
    if getattr(patcher, "hook_patches", None):
        raise ValueError(f"MultiNPU: the {what} carries hook patches, which the worker processes cannot apply")
    for name in getattr(patcher, "object_patches", {}):
        if name.startswith(("diffusion_model.", "first_stage_model.", "cond_stage_model.")):
            raise ValueError(f"MultiNPU: the {what} has its module {name} replaced by another node; the worker "
                             "processes cannot replace it the same way")
    return {k: list(v) for k, v in patcher.patches.items()}


def patched_clone(patcher, patches: dict):
    """A clone of a loaded ModelPatcher carrying exactly `patches` (received from rank 0)."""
    p = patcher.clone()
    p.patches = {k: list(v) for k, v in patches.items()}
    p.patches_uuid = uuid.uuid4()
    return p


def _file_tensors(path: str) -> dict:
    with safetensors.safe_open(path, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # views of one private mapping of the file


def _match(name: str, keys_by_suffix: dict):
    parts = name.split(".")
    for i in range(len(parts)):
        found = keys_by_suffix.get(".".join(parts[i:]))
        if found is not None:
            return found
    return None


def computes_on_host() -> bool:
    """Whether this process computes its models on the CPU (then a mapped weight must be ALIGNMENT-aligned)."""
    import comfy.model_management
    return comfy.model_management.get_torch_device().type == "cpu"


def map_file_weights(module: torch.nn.Module, paths, aligned_only=None) -> int:
    """Point every host weight of `module` that equals its tensor in one of the safetensors `paths` at the
    file's mapping, freeing the private copy; returns the bytes now shared. Each candidate is found by name
    (the longest common dotted suffix) and taken only when shape, dtype and every byte are equal, so a
    converted, renamed or patched weight keeps its own copy; with aligned_only (default: computes_on_host())
    only when its mapped data is ALIGNMENT-aligned too, so that the CPU computes on it exactly as on the copy."""
    if getattr(module, MAPPED_ATTR, False):
        return 0
    files = {}
    for p in paths:
        if p.endswith((".safetensors", ".sft")):
            files.update(_file_tensors(p))
    # a suffix that names two file tensors is ambiguous: never used
    by_suffix, ambiguous = {}, set()
    for key, t in files.items():
        parts = key.split(".")
        for i in range(len(parts)):
            suffix = ".".join(parts[i:])
            if suffix in by_suffix and by_suffix[suffix] is not t:
                ambiguous.add(suffix)
            by_suffix[suffix] = t
    for suffix in ambiguous:
        del by_suffix[suffix]
    if aligned_only is None:
        aligned_only = computes_on_host()
    shared = kept = 0
    with torch.no_grad():
        for name, owner, attr, t in _host_tensors(module):
            if getattr(owner, MAPPED_ATTR, False):
                continue  # loaded by mapped_loads: already the file's mapping where it can be
            f = _match(name, by_suffix)
            if f is None or f.shape != t.shape or f.dtype != t.dtype or not torch.equal(f, t):
                continue
            if aligned_only and f.data_ptr() % ALIGNMENT:
                kept += t.numel() * t.element_size()
                continue
            if isinstance(t, torch.nn.Parameter):
                t.data = f
            else:
                owner._buffers[attr] = f
            shared += t.numel() * t.element_size()
    module.__dict__[MAPPED_ATTR] = True
    _release_freed_memory()
    logging.info(f"MultiNPU: {shared / 2**20:.1f} MiB of weights now map {', '.join(map(os.path.basename, paths))} "
                 "(one copy per host)" + (f"; {kept / 2**20:.1f} MiB stay private copies, their data in the file not "
                                          f"{ALIGNMENT}-byte aligned for the CPU kernels" if kept else ""))
    return shared


_loading = threading.local()   # .mapped: this thread's loads keep the file's mapped tensors (mapped_loads)
_real_load_state_dict = None


@contextlib.contextmanager
def mapped_loads():
    """While active, upstream's loaders in this thread keep the safetensors file's mapped tensors as the model's
    host weights instead of copying them into fresh ones: load_state_dict(assign=True) with every tensor whose
    shape and dtype the module holds (on a process that computes on its CPU, only those ALIGNMENT-aligned in the
    file, the rule of map_file_weights); a tensor the module holds in another dtype is converted, as upstream's
    copy would. So a load never holds a private copy of the weights beside the file's mapping, which every
    process of a host shares: P ranks loading the H3 DiT hold one 66 GB mapping, not P copies (upstream does the
    same in its dynamic mode). A module loaded so is marked: map_file_weights has nothing left to do there."""
    global _real_load_state_dict
    if _real_load_state_dict is None:
        _real_load_state_dict = torch.nn.Module.load_state_dict
        torch.nn.Module.load_state_dict = _load_state_dict
    before = getattr(_loading, "mapped", False)
    _loading.mapped = True
    try:
        yield
    finally:
        _loading.mapped = before


def _load_state_dict(self, state_dict, strict=True, assign=False):
    if assign or not getattr(_loading, "mapped", False):
        return _real_load_state_dict(self, state_dict, strict=strict, assign=assign)
    own = dict(self.named_parameters())
    own.update(self.named_buffers())
    aligned_only = computes_on_host()
    sd, kept = {}, 0
    for key, t in state_dict.items():
        cur = own.get(key)
        if (cur is None or not isinstance(t, torch.Tensor) or t.shape != cur.shape or t.device.type != "cpu"
                or cur.device.type not in ("cpu", "meta")):
            sd[key] = t
        elif t.dtype == cur.dtype and not (aligned_only and t.data_ptr() % ALIGNMENT):
            sd[key] = t   # the file's mapping itself
        else:
            sd[key] = t.to(dtype=cur.dtype, copy=True)
            kept += sd[key].numel() * sd[key].element_size()
    with torch.no_grad():
        result = _real_load_state_dict(self, sd, strict=strict, assign=True)
    for m in self.modules():
        m.__dict__[MAPPED_ATTR] = True
    if kept:
        logging.info(f"MultiNPU: {kept / 2**20:.1f} MiB of weights loaded as private copies (converted, or not "
                     f"{ALIGNMENT}-byte aligned in the file for the CPU kernels); the rest map the file")
    return result


comfy.model_cache.load_context = mapped_loads


def _release_freed_memory():
    # the private copies just freed sit in the C allocator's heap, still counted in this process's memory,
    # until it is trimmed (glibc keeps large freed blocks for reuse)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def _host_tensors(module: torch.nn.Module):
    for mod_name, m in module.named_modules():
        for attr, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu":
                yield (f"{mod_name}.{attr}" if mod_name else attr), m, attr, t
