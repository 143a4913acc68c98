"""The thread transport as a runtime: the ranks are threads of this process, driven like the process group.

ThreadRuntime has the interface of comfy.multinpu_process.GroupRuntime that the runners use (run(name, payload,
configs), world_size, spec.backend, request_free), and runs the same worker programs (the functions registered
with @comfy.multinpu_group.program) through the same command path: the payload is packed with the wire code
(comfy.multinpu_wire.pack/flatten: tensors out of the pickle, into one host buffer, the twin of the /dev/shm
file), worker rank 0 broadcasts the buffer to the other ranks and every rank unpacks it (unflatten/unpack), runs
PROGRAMS[name](context, comm, payload) with its own WorkerContext and device, closes with a barrier, runs the
program's After callable, and rank 0's result comes back packed the same way. Configurations (RemoteConfig) are
installed on every rank first and their digests checked against the server's. The workers run in the caller's
grad and inference modes, as the process workers run in the driver's.

So a runner has one code path: the CPU tests (threads) run the code the NPU workers run, only the transport under
the programs differs (a ThreadComm over a ThreadGroup instead of a ProcessComm over torch.distributed).
Rank 0 runs in the calling thread, ranks 1..P-1 on persistent threads (comfy.multinpu.RankThreads), each having
set its device. A failure on any rank raises the rank's own exception in the caller (an OOM stays an OOM for
ComfyUI's handler), with a note naming the rank; a rank that stalls is abandoned after the timeout and the next
command starts fresh threads.

ComfyUI's model management is not thread-safe: the programs' loads and unloads take MODEL_LOCK (uncontended in a
worker process). What the ranks hold is let go of deterministically: a configuration dropped or freed, or every
configuration of a runtime shut down or gone, is unloaded from model management under the lock at a command's
start (never by the garbage collector in the middle of another thread's walk over ComfyUI's list of loaded models,
which upstream's finalizers would change under it).
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch

import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group as group
import comfy.multinpu_wire as wire

# Serialises what the ranks' programs do with ComfyUI's model management (load_models_gpu, unloads, the model
# cache, a configuration's load): it keeps module-level lists that two threads must not change at once.
MODEL_LOCK = threading.RLock()
_retired = []  # configurations held by thread runtimes that went away, unloaded at the next command (release_retired)


class ThreadSpec(wire.GroupSpec):
    """The group's settings as the runners read them, for P threads of one process (one node)."""

    backend = "threads"

    def __init__(self, devices, timeout: float):
        devices = [torch.device(d) for d in devices]
        kind = devices[0].type if devices[0].type in wire.BACKENDS else "cpu"
        super().__init__(local_size=len(devices), device_type=kind, timeout=timeout)
        self.rank_devices = devices

    def device_name(self, rank: int) -> str:
        return str(self.rank_devices[rank])


class ThreadRuntime:
    """P ranks as threads of this process, each with its own WorkerContext and device; one command at a time."""

    transport = "threads"

    def __init__(self, devices, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT):
        if len(devices) == 0:
            raise ValueError("MultiNPU: a thread runtime needs at least one device")
        self.spec = ThreadSpec(devices, timeout)
        self.devices = list(self.spec.rank_devices)
        self.world_size = len(self.devices)
        self.device = self.devices[0]
        self.timeout = float(timeout)
        self.state = "ready"
        self.commands = 0
        self.configs = weakref.WeakSet()  # RemoteConfigs the ranks were asked to hold
        self.contexts = [group.WorkerContext(self.spec, r, d) for r, d in enumerate(self.devices)]
        for c in self.contexts:
            c.ready = {}  # config id -> {"digest"} or {"error"}: what the process workers post as ready/{id}/{rank}
        self._drops = []
        self._free_pending = False
        self._lock = threading.RLock()
        self._threads = None
        # when the runtime goes away, what its ranks hold is unloaded at the next command, not in the collector
        weakref.finalize(self, _retire, self.contexts)

    @classmethod
    def on(cls, devices, primary, what: str, timeout: float):
        """The ranks as threads of this process on `devices`; rank 0 must be `primary`, the device of `what`
        (the model, text encoder or VAE whose copy rank 0 works with)."""
        devices = [torch.device(d) for d in devices or ()]
        if not devices or devices[0] != torch.device(primary):
            raise ValueError(f"MultiNPU: rank 0 must be the {what}'s device {primary}, got "
                             f"{devices[0] if devices else 'no device'}")
        return cls(devices, timeout)

    def _pool(self) -> comfy.multinpu.RankThreads:
        if self._threads is None or self._threads.broken:
            self._threads = comfy.multinpu.RankThreads(self.devices, set_device=comfy.multidevice.set_device,
                                                       name="multinpu-worker")
            # the threads outlive a command, not the runtime
            weakref.finalize(self, self._threads.shutdown)
        return self._threads

    def shutdown(self):
        """Stop the rank threads and let go of every configuration the ranks hold (unloaded now)."""
        if self._threads is not None:
            self._threads.shutdown()
        _retire(self.contexts)
        release_retired()

    def run(self, name: str, payload, configs=()):
        """Run command `name` on every rank (PROGRAMS[name](context, comm, payload) in each rank's thread) and
        return what rank 0's program returned. configs: RemoteConfigs every rank must hold first (installed and
        checked where missing). A rank's exception is raised here (its type kept, a note naming the rank);
        wire.ConfigMismatch when a rank holds something else than the server."""
        with self._lock:
            release_retired()
            self._housekeeping()
            for cfg in configs:
                self._install(cfg)
            return self._execute(name, payload)

    def _execute(self, name: str, payload, timeout: float = None):
        fn = _BUILTINS.get(name) or group.PROGRAMS.get(name)
        if fn is None:
            raise wire.GroupError(f"MultiNPU: no program {name!r}")
        self.commands += 1
        # the driver's side of the wire: a header and one host buffer (what the process driver writes into /dev/shm)
        data, tensors = wire.pack(payload)
        host, metas = wire.flatten(tensors, "cpu")
        nbytes = host.numel()

        def rank_main(comm):
            context = self.contexts[comm.rank]
            # worker rank 0 reads the buffer, the others receive it over the group, every rank unpacks its own copy
            buf = host.to(comm.device) if comm.rank == 0 else torch.empty(nbytes, dtype=torch.uint8, device=comm.device)
            if nbytes:
                buf = comm.broadcast(buf, 0)
            args = wire.unpack(data, wire.unflatten(buf, metas))
            group.inject_fault(context, name)
            result = fn(context, comm, args)
            after = None
            if isinstance(result, group.After):
                after, result = result.fn, None
            comm.barrier()
            if comm.rank == 0:
                # the result header and buffer, as worker rank 0 posts them
                rdata, rtensors = wire.pack(result)
                result = (rdata,) + wire.flatten(rtensors, "cpu")
            if after is not None:
                after()
            return result

        tg = comfy.multinpu.ThreadGroup(self.devices, timeout=self.timeout if timeout is None else timeout)
        rdata, rbuf, rmetas = tg.run(rank_main, self._pool())[0]
        return wire.unpack(rdata, wire.unflatten(rbuf, rmetas))

    # -- configurations --

    def _install(self, cfg):
        todo = [r for r in range(self.world_size) if cfg.id not in self.contexts[r].configs]
        if not todo:
            return
        if cfg not in self.configs:
            self.configs.add(cfg)
            weakref.finalize(cfg, self._drops.append, cfg.id)  # the ranks let go of it with the server
        # bounded as the process driver bounds a worker's load (the first read of the H3 weights takes minutes)
        self._execute("install", {"id": cfg.id, "program": cfg.program, "payload": cfg.payload, "ranks": todo},
                      timeout=max(self.timeout, wire.LOAD_TIMEOUT))
        reports = {r: self.contexts[r].ready.pop(cfg.id) for r in todo}
        failed = [r for r in todo if "error" in reports[r]]
        if failed:
            r = failed[0]
            exc = reports[r]["error"]
            if group.is_oom(exc):
                comfy.multinpu._add_note(exc, f"raised on {self.spec.describe_rank(r)} loading {cfg.what}")
                raise exc
            raise wire.RankFailed(f"MultiNPU: {self.spec.describe_rank(r)} failed in loading {cfg.what}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        mismatch = config_mismatch(self.spec, cfg, {r: reports[r]["digest"] for r in todo})
        if mismatch is not None:
            raise mismatch
        for r in todo:
            cfg.installed[r] = "thread"
        logging.info(f"MultiNPU: {cfg.what} set up and checked on {len(todo)} rank thread(s)")

    def _housekeeping(self):
        if self._free_pending:
            self._free_pending = False
            self._execute("free", None)
            for cfg in self.configs:
                cfg.installed = {}
        if self._drops:
            ids, self._drops = self._drops, []
            self._execute("drop", ids)

    def request_free(self):
        """The ranks let go of their configurations (POST /free, the OOM handler); done before the next command."""
        self._free_pending = True


def config_mismatch(spec, cfg, digests: dict):
    """wire.ConfigMismatch naming every rank whose digest differs from the server's, or None."""
    bad = {}
    for r, digest in digests.items():
        diff = [k for k in sorted(set(cfg.digest) | set(digest)) if cfg.digest.get(k) != digest.get(k)]
        if diff:
            bad[r] = diff
    if not bad:
        return None
    lines = [f"{spec.describe_rank(r)} differs in {', '.join(d)} ("
             + "; ".join(f"{k}: the server {cfg.digest.get(k)!s:.40}, rank {r} {digests[r].get(k)!s:.40}" for k in d)
             + ")" for r, d in sorted(bad.items())]
    return wire.ConfigMismatch(f"MultiNPU: the ranks do not hold the same {cfg.what}: " + "; ".join(lines)
                                + ". Fix: the same model files at the same paths on every host")


# ---- the built-in commands, as comfy.multinpu_group's workers run them -------------------------------

def _install(context, comm, payload):
    if context.rank not in payload["ranks"]:
        return None

    def load():
        # after the closing barrier, as a worker process loads; one rank at a time through model management
        try:
            with MODEL_LOCK:
                held = group.PROGRAMS[payload["program"]](context, comm, payload["payload"])
            context.configs[payload["id"]] = held
            context.ready[payload["id"]] = {"digest": held.digest}
        except Exception as e:
            logging.exception(f"MultiNPU: rank {context.rank} could not load {payload['program']}")
            context.ready[payload["id"]] = {"error": e}
    return group.After(load)


def _drop(context, comm, ids):
    for i in ids:
        unload(context.configs.pop(i, None))


def _free(context, comm, payload):
    configs = list(context.configs.values())
    context.configs.clear()
    for held in configs:
        unload(held)


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


def _retire(contexts):
    for c in contexts:
        _retired.extend(c.configs.values())
        c.configs.clear()


def release_retired():
    """Unload what thread runtimes that went away held (they are kept referenced until then)."""
    while _retired:
        unload(_retired.pop())


_BUILTINS = {"install": _install, "drop": _drop, "free": _free}


class ThreadTransport:
    """The thread transport as a whole, before any component makes its ThreadRuntime: its ranks are the devices
    this process sees."""

    def npu_count_error(self, npu_count: int):
        """None when a workflow's npu_count runs here (1, or the devices this process sees), else what to change."""
        devices = comfy.multidevice.get_devices()
        if npu_count in (1, len(devices)):
            return None
        if comfy.multidevice.device_kind() == "cpu":
            fix = (f"set npu_count to {len(devices)}, or restart the server simulating {npu_count} devices "
                   f"(h3kit start --device-type cpu --devices {','.join(str(i) for i in range(npu_count))}, "
                   f"which sets {comfy.multidevice.SIM_DEVICES_ENV}={npu_count})")
        else:
            fix = (f"set npu_count to {len(devices) if len(devices) in (1, 2, 4, 8) else 1}, or restart the server "
                   f"on {npu_count} devices (h3kit start --devices {','.join(str(i) for i in range(npu_count))})")
        return (f"npu_count is {npu_count} but this ComfyUI process sees "
                f"{comfy.multidevice.describe_devices(devices)}. Fix: {fix}.")


THREADS = ThreadTransport()


def describe_ranks(runtime) -> str:
    """For logs: "2 simulated cpu devices" (threads of this process), "4 processes (hccl)" (a process group)."""
    devices = getattr(runtime, "devices", None)
    if devices is not None:
        return comfy.multidevice.describe_devices(devices)
    return f"{runtime.world_size} processes ({runtime.spec.backend})"
