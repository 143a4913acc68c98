"""What both transports' runtimes share (run, the frees and drops, check_digests, MODEL_LOCK and unload).
Design: docs/multinpu.md, "Which transport runs where, and why"."""

from __future__ import annotations

import logging
import threading
import weakref

import comfy.model_cache
import comfy.multinpu
import comfy.multinpu_wire as wire

# Serialises what the ranks' programs do with ComfyUI's model management (load_models_gpu, unloads, the model
# cache, a configuration's load): it keeps module-level lists that two threads must not change at once.
MODEL_LOCK = threading.RLock()

_LIVE = weakref.WeakSet()  # every runtime of this process, asked to free when ComfyUI frees its models


class Runtime:
    """The ranks of one group and the commands they run, one at a time. A transport provides _ensure_ready(name),
    _execute(name, payload), _install(cfg) and describe()."""
    SERVER_IS_RANK0 = True  # rank 0 computes in the server's process, under its memory manager (the threads)

    def __init__(self, spec: wire.GroupSpec):
        self.spec = spec
        self.world_size = spec.world_size
        self.commands = 0
        self.configs = weakref.WeakSet()  # RemoteConfigs the ranks were asked to hold
        self._drops = []
        self._free_pending = False
        self._lock = threading.RLock()
        _LIVE.add(self)

    @property
    def timeout(self) -> float:
        """The bound of a collective on these ranks."""
        return self.spec.timeout

    @timeout.setter
    def timeout(self, seconds: float):
        self._set_timeout(float(seconds))

    def _set_timeout(self, seconds: float):
        # a process group's bound is fixed when its workers start
        if seconds != self.spec.timeout:
            logging.warning(f"MultiNPU: the ranks' timeout stays {self.spec.timeout:g} s, set when the group started "
                            f"(asked for {seconds:g} s)")

    def describe(self) -> str:
        """Who the ranks are, for logs."""
        return f"{self.world_size} ranks ({self.spec.backend})"

    def runtime_for(self, devices, primary, what: str, timeout: float):
        """A running group serves every component of this server (the node checked npu_count against it)."""
        return self

    def release(self):
        """Done with this runtime: a component's own stops (ThreadRuntime); the server's process group stays."""

    def run(self, name: str, payload, configs=()):
        """Rank 0's result of PROGRAMS[name](context, comm, payload) on every rank, once every rank holds `configs`
        (RemoteConfigs). A rank's failure is raised naming it: a wire.GroupError, or torch.OutOfMemoryError."""
        with self._lock:
            self._ensure_ready(name)
            self._housekeeping()
            for cfg in configs:
                with comfy.multinpu.timed("install", cfg.installed):  # a weight install on the ranks, when one ran
                    self._install(cfg)
            with comfy.multinpu.timed(name):
                return self._execute(name, payload)

    def _track(self, cfg):
        """The ranks let go of `cfg` with the server (a drop before the next command once it is collected)."""
        if cfg not in self.configs:
            self.configs.add(cfg)
            weakref.finalize(cfg, self._drops.append, cfg.id)

    def _housekeeping(self):
        if self._free_pending:
            self._free_pending = False
            self._execute("free", None)
            logging.info(f"MultiNPU: the ranks on {self.describe()} let go of their models (POST /free or "
                         "ComfyUI's OOM handler)")
            for cfg in self.configs:
                cfg.installed = {}
        if self._drops:
            ids, self._drops = self._drops, []
            self._execute("drop", ids)

    def request_free(self):
        """The ranks let go of their configurations (POST /free, the OOM handler); done before the next command."""
        self._free_pending = True


def check_digests(spec: wire.GroupSpec, cfg, digests: dict):
    """Raise wire.ConfigMismatch naming every rank whose digest differs from the server's."""
    bad = {}
    for r, digest in digests.items():
        diff = [k for k in sorted(set(cfg.digest) | set(digest)) if cfg.digest.get(k) != digest.get(k)]
        if diff:
            bad[r] = diff
    if not bad:
        return
    lines = [f"{spec.describe_rank(r)} differs in {', '.join(d)} ("
             + "; ".join(f"{k}: the server {cfg.digest.get(k)!s:.40}, rank {r} {digests[r].get(k)!s:.40}" for k in d)
             + ")" for r, d in sorted(bad.items())]
    raise wire.ConfigMismatch(f"MultiNPU: the ranks do not hold the same {cfg.what}: " + "; ".join(lines)
                               + ". Fix: the same model files at the same paths on every host")


def unload(held):
    """Take a rank's model (held.patcher) out of ComfyUI's model management, under MODEL_LOCK."""
    patcher = getattr(held, "patcher", None)
    if patcher is None:
        return
    import comfy.model_management as mm
    with MODEL_LOCK:
        for i in range(len(mm.current_loaded_models) - 1, -1, -1):
            if mm.current_loaded_models[i].model is patcher:
                loaded = mm.current_loaded_models.pop(i)
                if loaded.model_finalizer is not None:
                    loaded.model_unload()


def _free_every_runtime():
    # comfy.model_management.unload_all_models (POST /free, the OOM handler, --disable-smart-memory) empties the
    # model cache: every runtime's ranks let go of theirs too, before their next command
    runtimes = list(_LIVE)
    if runtimes:
        logging.info("MultiNPU: ComfyUI freed its models; the ranks free theirs before their next command")
    for runtime in runtimes:
        runtime.request_free()


comfy.model_cache.add_clear_listener(_free_every_runtime)
