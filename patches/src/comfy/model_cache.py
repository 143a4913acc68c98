"""Process-wide cache of loaded models, keyed by the files they come from and the load options.

The node output caches forget a loader's result as soon as a prompt uses other inputs, and the RAM pressure
cache evicts loader outputs whenever available RAM is under min(128 GB, total RAM): a server that switches
between workflows reads tens of gigabytes of weights again on every switch. The loaders in comfy/sd.py
(load_diffusion_model, load_clip) and VAELoader ask this cache first: the same files with the same options
return the same object without reading the files again.

Every loaded object is also recorded with what its loader was asked (comfy.model_cache.source_of): the
processes of a multi-device group load the same files with the same options from that record
(comfy.multinpu_models).

A key holds the kind of loader, every file's real path, size and mtime (a replaced file loads again), and
the load options made hashable (lists to tuples, dicts to sorted items, devices and dtypes to strings).
The cache keeps at most COMFY_MODEL_CACHE_ENTRIES entries and COMFY_MODEL_CACHE_GB gigabytes of weights,
least recently used first out. unload_all_models() (POST /free with unload_models, the OOM handler,
--disable-smart-memory) empties it.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import os
import threading
import time
import weakref

import psutil
import torch

MAX_ENTRIES = int(os.environ.get("COMFY_MODEL_CACHE_ENTRIES", "8"))
# Default: 80% of host RAM, so a 1.5 TB Ascend host keeps the H3 DiT, text encoder and VAEs of several
# workflows resident while a small host still evicts before it swaps.
BUDGET_BYTES = int(float(os.environ.get("COMFY_MODEL_CACHE_GB", "0")) * (1024 ** 3)) or int(psutil.virtual_memory().total * 0.8)

_lock = threading.Lock()
_entries: collections.OrderedDict = collections.OrderedDict()
_stats = {"hits": 0, "misses": 0, "evictions": 0}
_sources = weakref.WeakKeyDictionary()  # loaded module -> the LoadSource it came from
_clear_listeners = []
load_listeners = []  # fn(kind, seconds) after each read of a model (a miss): GET /metrics' load times by kind
# what every cached load runs inside: comfy.multinpu_models sets its mapped_loads here when it is imported (the
# weights then map the file instead of a private copy beside the file's mapping)
load_context = contextlib.nullcontext


class LoadSource:
    """What a cached loader was asked: the kind of loader, the files' real paths and its arguments."""

    def __init__(self, kind, paths, args, kwargs):
        self.kind = kind
        self.paths = [os.path.realpath(p) for p in paths]
        self.args = tuple(args)
        self.kwargs = dict(kwargs)

    def __repr__(self):
        return f"LoadSource({self.kind!r}, {self.paths!r})"


def _modules(value):
    # the module each loader's result wraps: ModelPatcher.model, CLIP.cond_stage_model, VAE.first_stage_model
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _modules(v)
        return
    for attr in ("model", "cond_stage_model", "first_stage_model"):
        module = getattr(value, attr, None)
        if isinstance(module, torch.nn.Module):
            yield module


def source_of(module):
    """The LoadSource of a loaded model's module (ModelPatcher.model, CLIP.cond_stage_model or
    VAE.first_stage_model), or None when it did not come from a cached loader."""
    return _sources.get(module)


def add_clear_listener(fn):
    """fn() runs whenever clear() empties the cache (a multi-device group frees its workers' models too)."""
    _clear_listeners.append(fn)


class _Entry:
    def __init__(self, value, size, options):
        self.value = value
        self.size = size
        self.options = options  # keeps objects keyed by identity alive while the entry lives


def _freeze(value):
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_freeze(v)) for v in value)))
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"  # CLIPType and friends
    if isinstance(value, type):
        return f"class:{value.__module__}.{value.__qualname__}"
    # anything else (custom operations objects, hooks) is only the same option if it is the same object
    return ("object", type(value).__qualname__, id(value))


def _file_key(path):
    real = os.path.realpath(path)
    st = os.stat(real)
    return (real, st.st_size, st.st_mtime_ns)


def make_key(kind, paths, args=(), kwargs=None):
    return (kind, tuple(_file_key(p) for p in paths), _freeze(list(args)), _freeze(kwargs or {}))


def _size(value):
    if isinstance(value, (list, tuple)):
        return sum(_size(v) for v in value)
    if hasattr(value, "model_size"):
        return int(value.model_size())
    patcher = getattr(value, "patcher", None)
    if patcher is not None and hasattr(patcher, "model_size"):
        return int(patcher.model_size())
    return 0


def _evict(reserve):
    total = sum(e.size for e in _entries.values())
    while _entries and (len(_entries) >= MAX_ENTRIES or total + reserve > BUDGET_BYTES):
        key, entry = _entries.popitem(last=False)
        total -= entry.size
        _stats["evictions"] += 1
        logging.info(f"Model cache: evicted {key[0]} {os.path.basename(key[1][0][0]) if key[1] else ''} "
                     f"({entry.size / (1024 ** 3):.2f} GB)")


def load(kind, paths, loader, *args, **kwargs):
    """Return loader(*args, **kwargs), reusing the object from an earlier call with the same files and options.

    paths: the files the loader reads (their size and mtime are part of the key). An entry larger than the
    whole budget is returned without being cached.
    """
    key = make_key(kind, paths, args, kwargs)
    with _lock:
        entry = _entries.get(key)
        if entry is not None:
            _entries.move_to_end(key)
            _stats["hits"] += 1
            logging.info(f"Model cache: reusing {kind} {os.path.basename(paths[0]) if paths else ''}")
            return entry.value
        _stats["misses"] += 1
    # one line per file read, cached or not (a model over the budget is read and returned uncached)
    logging.info(f"Model cache: reading {kind} {os.path.basename(paths[0]) if paths else ''}")
    started = time.perf_counter()
    with load_context():
        value = loader(*args, **kwargs)
    for listener in load_listeners:
        try:
            listener(kind, time.perf_counter() - started)
        except Exception as e:  # monitoring never fails a load
            logging.warning(f"Model cache: a load listener failed: {e}")
    source = LoadSource(kind, paths, args, kwargs)
    for module in _modules(value):
        _sources[module] = source
    size = _size(value)
    with _lock:
        if size > BUDGET_BYTES:
            logging.warning(f"Model cache: {kind} of {size / (1024 ** 3):.1f} GB exceeds the budget of "
                            f"{BUDGET_BYTES / (1024 ** 3):.1f} GB, not cached")
            return value
        _evict(size)
        _entries[key] = _Entry(value, size, (args, kwargs))
        logging.info(f"Model cache: loaded {kind} {os.path.basename(paths[0]) if paths else ''} "
                     f"({size / (1024 ** 3):.2f} GB, {len(_entries)} cached)")
    return value


def clear():
    with _lock:
        if _entries:
            logging.info(f"Model cache: dropping {len(_entries)} cached models")
        _entries.clear()
    for fn in _clear_listeners:
        fn()


def stats():
    with _lock:
        return dict(_stats, entries=len(_entries), bytes=sum(e.size for e in _entries.values()),
                    budget_bytes=BUDGET_BYTES, max_entries=MAX_ENTRIES)
