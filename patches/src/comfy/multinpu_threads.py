"""The thread transport: the ranks are threads of this process running the process workers' programs through the
same wire code, on a ThreadComm (docs/multinpu.md, "Which transport runs where, and why"). What they hold is unloaded
at a command's start under MODEL_LOCK (release_retired), never by the garbage collector mid-walk of ComfyUI's list.
"""

from __future__ import annotations

import logging
import weakref

import torch

import comfy.multidevice
import comfy.multinpu
import comfy.multinpu_group as group
import comfy.multinpu_runtime_base as base
import comfy.multinpu_wire as wire

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


class ThreadContext(group.WorkerContext):
    """A rank thread's context: its load reports stay in this process, read by ThreadRuntime._install."""

    def __init__(self, spec, rank: int, device):
        super().__init__(spec, rank, device)
        self.ready = {}  # config id -> {"digest"} or {"error"}: what the process workers post as ready/{id}/{rank}

    def place(self, held):
        """Nothing: rank threads share the server's model management, which loads in the forward."""

    def loaded(self, config_id: str, held):
        self.ready[config_id] = {"digest": held.digest}

    def load_failed(self, config_id: str, exc: BaseException):
        self.ready[config_id] = {"error": exc}


class ThreadRuntime(base.Runtime):
    """P ranks as threads of this process, each with its own context and device; one command at a time."""

    def __init__(self, devices, timeout: float = comfy.multinpu.DEFAULT_TIMEOUT):
        if len(devices) == 0:
            raise ValueError("MultiNPU: a thread runtime needs at least one device")
        super().__init__(ThreadSpec(devices, timeout))
        self.devices = list(self.spec.rank_devices)
        self.contexts = [ThreadContext(self.spec, r, d) for r, d in enumerate(self.devices)]
        self._threads = None
        # when the runtime goes away, what its ranks hold is unloaded at the next command, not in the collector
        weakref.finalize(self, _retire, self.contexts)

    def describe(self) -> str:
        return comfy.multidevice.describe_devices(self.devices)

    def _set_timeout(self, seconds: float):
        # the bound of the next command's collectives (a ThreadGroup per command)
        self.spec.timeout = seconds

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

    release = shutdown  # a component's own runtime: nobody else uses it

    def _ensure_ready(self, name: str):
        release_retired()

    def _execute(self, name: str, payload, timeout: float = None):
        if name not in group.BUILTINS and name not in group.PROGRAMS:
            raise wire.GroupError(f"MultiNPU: no program {name!r}")
        self.commands += 1
        # the driver's side of the wire: a header and one host buffer (what the process driver writes into /dev/shm)
        data, tensors = wire.pack(payload)
        host, metas = wire.flatten(tensors, "cpu")
        header = {"name": name, "data": data, "metas": metas, "nbytes": host.numel(), "grad": torch.is_grad_enabled(),
                  "inference": torch.is_inference_mode_enabled()}

        def rank_main(comm):
            result, after = group.run_command(self.contexts[comm.rank], comm, header, lambda: host)
            if comm.rank == 0:  # the result header and buffer, as worker rank 0 posts them
                rdata, rtensors = wire.pack(result)
                result = (rdata,) + wire.flatten(rtensors, "cpu")
            if after is not None:
                after()
            return result

        tg = comfy.multinpu.ThreadGroup(self.devices, timeout=self.timeout if timeout is None else timeout)
        rdata, rbuf, rmetas = tg.run(rank_main, self._pool())[0]
        return wire.unpack(rdata, wire.unflatten(rbuf, rmetas))

    def _install(self, cfg):
        todo = [r for r in range(self.world_size) if cfg.id not in self.contexts[r].configs]
        if not todo:
            return
        self._track(cfg)
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
        base.check_digests(self.spec, cfg, {r: reports[r]["digest"] for r in todo})
        for r in todo:
            cfg.installed[r] = "thread"
        logging.info(f"MultiNPU: {cfg.what} set up and checked on {len(todo)} rank thread(s)")


def _retire(contexts):
    for c in contexts:
        _retired.extend(c.configs.values())
        c.configs.clear()


def release_retired():
    """Unload what thread runtimes that went away held (they are kept referenced until then)."""
    while _retired:
        base.unload(_retired.pop())


class ThreadTransport:
    """The thread transport as a whole, before any component makes its ThreadRuntime."""

    def runtime_for(self, devices, primary, what: str, timeout: float) -> ThreadRuntime:
        """A runtime of its own for one component: threads on `devices`; rank 0 must be `primary`, the device of `what`."""
        devices = [torch.device(d) for d in devices or ()]
        if not devices or devices[0] != torch.device(primary):
            raise ValueError(f"MultiNPU: rank 0 must be the {what}'s device {primary}, got "
                             f"{devices[0] if devices else 'no device'}")
        return ThreadRuntime(devices, timeout)

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
