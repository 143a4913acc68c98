"""A worker of the process group: its life (serve), its heartbeat, and the programs it runs (program(); install, drop
and free are the built-ins of both transports). `python -B -m comfy.multinpu_group` runs the agent of another host.
Design: docs/multinpu.md, "The process transport".
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed

import comfy.multinpu
import comfy.multinpu_clock as clock
import comfy.multinpu_links as links
from comfy.multinpu_wire import (END, GroupError, GroupSpec, POLL, RECYCLED_EXIT, REPORTED_EXIT,
                                 SharedMemoryFull, Signer, key_from_environment, pack, shm_read,
                                 shm_write, td, unflatten, unpack)
from comfy.multinpu_channel import ChannelClosed, Control, _store_gone, beat, connect_channel, connect_store
from comfy.multinpu_launch import agent_main, process_identity, watch_termination
from comfy.multinpu_runtime_base import MODEL_LOCK, unload



PROGRAMS = {}                        # name -> fn(context, comm, payload) run by the workers


def program(name: str):
    """Register fn(context, comm, payload) as the worker side of the command `name`; it may return After(fn) for
    work after the command's closing barrier."""
    def register(fn):
        PROGRAMS[name] = fn
        return fn
    return register


# ---- workers -----------------------------------------------------------------------------------------

class WorkerContext:
    """What a worker's programs share: its rank, device and the configurations it holds."""

    def __init__(self, spec: GroupSpec, rank: int, device):
        self.spec = spec
        self.rank = rank
        self.device = torch.device(device)
        self.configs = {}
        self.ctl = None
        self.link = None        # its connection to the driver's command channel (commands; rank 0: results)
        self.generation = None  # the generation this process joins or serves
        self.command = None     # the number of the last command it took (in its generation)
        self.comm = None        # its generation's ProcessComm (made at join, with its side group)
        self.free = None  # unloads this rank's models (set by comfy.multinpu_worker)

    def place(self, held):
        """The weights on this rank's device in the install, under the load bound, and waited for (a host sync), not
        in the first command (a late loader would hold its peers inside a collective)."""
        patcher = getattr(held, "patcher", None)
        if patcher is not None:
            import comfy.model_management as model_management  # ComfyUI's: not in the bare workers of the tests
            model_management.load_models_gpu([patcher])
        comfy.multinpu.synchronize(self.device)

    def loaded(self, config_id: str, held):
        """The built-in install's report of a configuration set up here (the driver reads ready/{id}/{rank})."""
        self.ctl.put(f"ready/{config_id}/{self.rank}", {"pid": os.getpid(), "digest": held.digest})

    def load_failed(self, config_id: str, exc: BaseException):
        """... and of one that failed: reported, then this process leaves (never reused after an error)."""
        self.ctl.put(f"ready/{config_id}/{self.rank}", {"pid": os.getpid(), "error": _error(exc)})
        _leave(REPORTED_EXIT)


class After:
    """What a program returns for work to run after the command's closing barrier (reading model files):
    it must not hold the group."""

    def __init__(self, fn):
        self.fn = fn


def _heartbeat(spec: GroupSpec, context: WorkerContext, stop: threading.Event):
    """Beat on this process's own channel connection (channel.beat); leave at once when the driver aborted this
    process's generation (it may be blocked in a collective that will not return)."""
    try:
        signer = Signer(key_from_environment())
        ctl = Control(connect_store(spec.master_addr, spec.master_port, spec.timeout), signer)

        def aborted():
            g = context.generation
            if g is not None and ctl.peek(f"abort/{g}") is not None:
                logging.warning(f"MultiNPU: rank {context.rank}: generation {g} was aborted; this process leaves")
                _leave(RECYCLED_EXIT)
        physical = comfy.multinpu.physical_device(context.rank % spec.local_size)  # the host tools' id (GET /metrics)
        beat(spec.channel_address(), signer, {"role": "beat", "rank": context.rank, "pid": os.getpid()}, stop,
             aborted, lambda: beat_news(context, physical))
    except Exception as e:
        # the store or the driver is gone: the main loop notices and exits
        logging.warning(f"MultiNPU: rank {context.rank}: the heartbeat stopped: {e}")


def beat_news(context: WorkerContext, physical: str = None) -> dict:
    """A beat: its progress (command; what its host queued, what its device completed), the memory sample taken where
    it computes (never the allocator, whose mutex a device sync during an OOM retry holds: comfy.multinpu_clock) and
    its physical device (comfy.multinpu_metrics)."""
    return {"progress": {"g": context.generation, "n": context.command, "memory": comfy.multinpu.PROGRESS.beat_memory(),
                         "physical_device": physical, **comfy.multinpu.PROGRESS.snapshot()}}


def _error(exc: BaseException) -> dict:
    """A rank's error as the driver names it (comfy.multinpu_commands._rank_exception)."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "type": type(exc).__name__, "message": str(exc)[:2000],
            "oom": is_oom(exc)}


def _report(ctl: Control, key: str, exc: BaseException, collective: bool):
    try:
        ctl.put(key, {**_error(exc), "collective": collective, "time": time.time()})
    except Exception:
        pass


def is_oom(exc: BaseException) -> bool:
    """Out of memory on a device (torch's OOM type, or an accelerator error saying so) or on the host
    (the CPU allocator's "can't allocate memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return "out of memory" in text or "can't allocate memory" in text


def _leave(code: int):
    """End this worker now: a process that saw an error is never reused (its communicator, and on Ascend its
    stream, may be wedged), and interpreter teardown can hang in a broken process group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(context: WorkerContext):
    """A worker's life: join the next generation that lists it and run its commands until the driver ends it (END)
    or is gone. A worker whose command or join fails reports it and exits."""
    spec, rank = context.spec, context.rank
    watch_termination(spec, rank)
    clock.parse_faults(os.environ.get(clock.FAULT_ENV, ""))  # a fault this worker does not know is refused
    comfy.multinpu.PROGRESS.sample(context.device, force=True)
    signer = Signer(key_from_environment())
    deadline = time.monotonic() + spec.join_timeout
    base = connect_store(spec.master_addr, spec.master_port, spec.timeout, deadline)
    ctl = Control(base, signer)
    context.ctl = ctl
    layout = ctl.wait("layout", spec.join_timeout)
    if layout != spec.layout():
        raise GroupError(f"MultiNPU: rank {rank} was started for {spec.layout()}, the driver runs {layout}")
    ctl.put(f"worker/{rank}", {"pid": os.getpid(), "host": socket.gethostname(), "device": str(context.device),
                               **process_identity(os.getpid())})
    stop = threading.Event()
    threading.Thread(target=_heartbeat, args=(spec, context, stop), daemon=True, name="multinpu-heartbeat").start()
    logging.info(f"MultiNPU: rank {rank} ({context.device}) pid {os.getpid()} waiting for the group")
    done = 0
    try:
        while True:
            g = _next_generation(ctl, rank, done)
            done = context.generation = g
            if _join(ctl, base, spec, context, g):
                _commands(ctl, context, g)
                return
    except BaseException as e:
        if _store_gone(e) or isinstance(e, (torch.distributed.DistStoreError, ChannelClosed)):
            logging.info(f"MultiNPU: rank {rank}: the driver is gone; exiting")
            return
        raise
    finally:
        stop.set()


def _next_generation(ctl: Control, rank: int, after: int) -> int:
    """The newest generation after `after` that lists this process."""
    pid = os.getpid()
    while True:
        g = ctl.peek("gen")
        if isinstance(g, int) and g > after:
            gen = ctl.peek(f"gen/{g}")
            if isinstance(gen, dict) and gen.get("members", {}).get(rank) == pid:
                return g
        time.sleep(POLL)


def _join(ctl: Control, base, spec: GroupSpec, context: WorkerContext, g: int) -> bool:
    """Join generation g: announce, wait for the driver's go, form the process group and prove it with a
    warm-up all_reduce ("up" means the communicator works). False when the driver gave up on g."""
    rank = context.rank
    ctl.put(f"joined/{g}/{rank}", os.getpid())
    while ctl.peek(f"go/{g}") is None:
        if ctl.peek("gen") != g:
            return False  # the driver gave up on g (a member died): wait for the next one
        time.sleep(POLL)
    try:
        os.environ.update(links.hccl_environment(spec, g))  # its own HCCL ports, timeouts in order (read at connect)
        sizes = links.buffer_sizes()
        _init_group(spec, torch.distributed.PrefixStore(f"pg{g}", base), rank, context.device,
                    links.group_options(spec.backend, sizes["group"]))
        comm = comfy.multinpu.ProcessComm(device=context.device, timeout=spec.timeout)
        # every link the programs use, formed and proven here (HCCL connects a group at its first collective and a
        # send/recv pair at its first use): the group's collectives and pairs, the side group's (weight gathers)
        links.warm(comm, links.program_pairs(spec.world_size))
        if spec.world_size > 1:
            links.warm(comm.side(links.group_options(spec.backend, sizes["side"])))
        context.comm = comm
    except Exception as e:
        logging.exception(f"MultiNPU: rank {rank} could not join generation {g}")
        _report(ctl, f"joinerr/{g}/{rank}", e, isinstance(e, comfy.multinpu.CollectiveError))
        _leave(REPORTED_EXIT)
    ctl.put(f"up/{g}/{rank}", os.getpid())
    return True


def _init_group(spec: GroupSpec, store, rank: int, device: torch.device, options=None):
    """init_process_group with the device bound (device_id: the communicator is created now, on this rank's
    device, instead of lazily at the first collective; unmeasured on Ascend and CUDA hardware) and its pg_options."""
    kwargs = dict(store=store, rank=rank, world_size=spec.world_size, timeout=td(spec.timeout))
    if options is not None:
        kwargs["pg_options"] = options
    if device.type != "cpu":
        try:
            torch.distributed.init_process_group(spec.backend, device_id=device, **kwargs)
            return
        except TypeError:  # a torch (or torch_npu backend) without device_id
            pass
    torch.distributed.init_process_group(spec.backend, **kwargs)


def _commands(ctl: Control, context: WorkerContext, g: int):
    comm = context.comm  # made at join, with its side group
    # every rank takes the commands from the driver on its own authenticated connection to the command channel
    # (this host's Unix socket, or its TCP listener from another host): none passes through the store, where any
    # client could delete it
    context.link = connect_channel(context.spec.channel_address(), ctl.signer,
                                   {"role": "command", "rank": context.rank, "pid": os.getpid(), "generation": g})
    n = 1
    while True:
        header = _next_command(context, g, n)
        context.command = n
        comfy.multinpu.PROGRESS.sample(context.device, force=True)
        name = header["name"]
        if name == END:
            try:
                torch.distributed.destroy_process_group()
            except Exception as e:
                logging.debug(f"MultiNPU: destroy_process_group: {e}")
            return
        after = None
        try:
            result, after = run_command(context, comm, header, lambda: shm_read(header["shm"], header["nbytes"]))
            if comm.rank == 0:
                _post_result(context, header, g, n, result)
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                raise
            collective = isinstance(e, comfy.multinpu.CollectiveError)
            if not collective:
                logging.exception(f"MultiNPU: rank {context.rank} failed in {name}")
            else:
                logging.error(f"MultiNPU: rank {context.rank}: {name}: {e}")
            _report(ctl, f"err/{g}/{n}/{context.rank}", e, collective)
            try:
                ctl.counter(f"failed/{g}", 1)
            except Exception:
                pass
            _leave(REPORTED_EXIT)  # never reused: the driver replaces the whole group
        if after is not None:
            with torch.inference_mode(header.get("inference", True)), torch.set_grad_enabled(header.get("grad", False)):
                after()
        n += 1


def run_command(context: WorkerContext, comm, header: dict, rank0_bytes):
    """Command `header` on this rank, as both transports run it: worker rank 0's bytes (rank0_bytes(), on the host)
    broadcast to the others and unpacked, the program run in the driver's grad and inference modes (ComfyUI executes
    prompts in inference mode), the closing barrier. Returns (result, the After callable or None)."""
    name, nbytes = header["name"], header["nbytes"]
    if comm.rank == 0:
        buf = rank0_bytes().to(comm.device)
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=comm.device)
    if nbytes:
        buf = comm.broadcast(buf, 0)
    payload = unpack(header["data"], unflatten(buf, header["metas"]))
    fn = BUILTINS.get(name) or PROGRAMS.get(name)
    if fn is None:
        raise GroupError(f"MultiNPU: rank {context.rank} has no program {name!r}")
    clock.inject_faults(name, context.rank, context.device)
    with torch.inference_mode(header.get("inference", True)), torch.set_grad_enabled(header.get("grad", False)):
        result = fn(context, comm, payload)
    after = None
    if isinstance(result, After):
        after, result = result.fn, None
    comm.barrier()
    return result, after


def _next_command(context: WorkerContext, g: int, n: int) -> dict:
    """Command n of generation g from the driver's channel (every rank has its own connection; they wait there,
    in no collective, while the server is idle). A frame that is not that command is dropped with a log line; a
    connection the driver closed (it aborted this generation, or it is gone) ends this process."""
    while True:
        try:
            header = context.link.recv()
        except ChannelClosed:
            logging.warning(f"MultiNPU: rank {context.rank}: the driver closed the command channel of generation {g} "
                            "(aborted, or the driver is gone); this process leaves")
            _leave(RECYCLED_EXIT)
        if isinstance(header, dict) and header.get("g") == g and header.get("n") == n:
            return header
        logging.warning(f"MultiNPU: rank {context.rank}: dropped a command that is not command {n} of generation {g}")


def _post_result(context: WorkerContext, header: dict, g: int, n: int, result):
    """Rank 0: the command's result to the driver on the channel, its tensors through shared memory (header["out"])."""
    data, tensors = pack(result)
    try:
        metas, nbytes = shm_write(header["out"], tensors, f"the result of {header['name']}")
    except SharedMemoryFull as e:
        # every rank is past the command's closing barrier, in step: only this command fails (in the driver)
        logging.error(f"MultiNPU: rank 0: {e}")
        context.link.send({"g": g, "n": n, "pid": os.getpid(), "shm_full": str(e)})
        return
    context.link.send({"g": g, "n": n, "pid": os.getpid(), "data": data, "metas": metas, "nbytes": nbytes})


# The built-in commands, the same functions for every runtime (comfy.multinpu_runtime_base): what differs between a
# worker process and a rank thread is the context's (how a load is reported, what freeing memory means).

def _install(context: WorkerContext, comm, payload):
    if context.rank not in payload["ranks"]:
        return None

    def load():
        # after the closing barrier (reading model files must not hold the group); one rank at a time through
        # model management (uncontended in a worker process)
        try:
            clock.inject_faults(payload["program"], context.rank, context.device)
            with MODEL_LOCK:
                held = PROGRAMS[payload["program"]](context, comm, payload["payload"])
                context.place(held)
            context.configs[payload["id"]] = held
            context.loaded(payload["id"], held)
        except Exception as e:
            logging.exception(f"MultiNPU: rank {context.rank} could not load {payload['program']}")
            context.load_failed(payload["id"], e)
    return After(load)


def _drop(context: WorkerContext, comm, ids):
    for i in ids:
        unload(context.configs.pop(i, None))


def _free(context: WorkerContext, comm, payload):
    held = list(context.configs.values())
    context.configs.clear()
    for h in held:
        unload(h)
    if context.free is not None:
        try:
            context.free()
        except Exception as e:
            logging.warning(f"MultiNPU: rank {context.rank}: freeing memory failed: {e}")


BUILTINS = {"install": _install, "drop": _drop, "free": _free}


if __name__ == "__main__":
    sys.exit(agent_main())
