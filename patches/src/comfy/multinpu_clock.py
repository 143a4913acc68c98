"""What this process's device has finished, beside what its host has queued (docs/multinpu.md, "Progress: what the
device finished").

On HCCL and NCCL a collective returns when it is queued on the device's stream, not when it is done; only a host
sync (a barrier, .item(), .cpu(), synchronize) waits for the device (H3_FACTS 14). A count of the collectives the
host entered moves at enqueue speed, and a command's device time is spent where the host first syncs. So the process
comm records a marker before each collective (its device reached it: the work queued before it is done) and after it
(completed), and programs record ticks where the device advances without a collective (a DiT block, a VAE decoder
block, a text encoder layer). A marker is an event-like object with query():
- on npu/cuda, an event recorded on the current stream (torch.npu.Event / torch.cuda.Event), queried, never waited
  on (unmeasured on hardware);
- on plain gloo, done when made: gloo's calls return when their work is done, so the device is the host;
- under the twin (H3KIT_EMULATE_ASYNC_DEVICE=1), done when the rank's emulated stream reaches it.
One code path for every backend: only what completes when differs. The heartbeat reads the completed prefix
(snapshot(): queries only, never a sync, never the allocator).

The twin: one thread per process (its "stream") runs, in order, every collective but the host's syncs, the markers
and the device time of the `slow` fault; a collective returns to the host at enqueue. The host waits for the stream
at a barrier, at synchronize(), and where it reads a collective's result (on CPU the host is the compute unit: a
device would queue the kernel that reads it behind the collective instead). This module needs torch only.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import queue
import resource
import threading
import time

import torch

ASYNC_ENV = "H3KIT_EMULATE_ASYNC_DEVICE"  # test switch: "1" gives gloo the device's clock (the twin above)
P2P = ("send", "recv")  # point-to-point ops: a rank in one waits for one peer, not for the group
PENDING_LIMIT = 4096  # markers kept before the host itself reads the completed ones (the heartbeat does, each beat)


def twin() -> bool:
    return os.environ.get(ASYNC_ENV) == "1"


class FaultError(RuntimeError):
    """H3KIT_MULTINPU_FAULT names a fault this runtime does not know (comfy.multinpu_wire.GroupError is one)."""


# test and acceptance switch: PROGRAM:KIND:PATH[,...] while the file PATH exists (docs/multinpu.md, "Fault injection")
FAULT_ENV = "H3KIT_MULTINPU_FAULT"
FAULT_KINDS = ("oom", "raise", "hold", "hang", "slow=SECONDS", "stuck")


def parse_faults(text: str) -> list:
    """[(program, kind, seconds or None, path)] of H3KIT_MULTINPU_FAULT; GroupError naming the kinds for one it does
    not know (checked when the driver and each worker start: a misspelt fault would test nothing)."""
    faults = []
    for fault in filter(None, (f.strip() for f in (text or "").split(","))):
        program, _, rest = fault.partition(":")
        kind, _, path = rest.partition(":")
        name, eq, value = kind.partition("=")
        try:
            seconds = float(value) if name == "slow" and eq else None
        except ValueError:
            seconds = None
        known = (name == "slow" and seconds is not None and seconds > 0) or (not eq and kind in FAULT_KINDS)
        if not program or not path or not known:
            raise FaultError(f"MultiNPU: {FAULT_ENV} has {fault!r}: each fault is PROGRAM:KIND:PATH with KIND one of "
                             f"{', '.join(FAULT_KINDS)} (SECONDS > 0). Fix: correct it, or unset {FAULT_ENV}")
        faults.append((program, name, seconds, path))
    return faults


class Work:
    """One item of the twin's stream (or one done at once): query() without waiting, wait() for its value."""

    def __init__(self, fn=None):
        self.fn = fn
        self.value = self.error = None
        self._done = threading.Event()

    def run(self):
        try:
            if self.fn is not None:
                self.value = self.fn()
        except BaseException as e:  # handed to whoever waits for it
            self.error = e
        finally:
            self.fn = None
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None):
        if not self._done.wait(timeout):
            raise TimeoutError("the device's work did not complete in time")
        if self.error is not None:
            raise self.error
        return self.value


def done(value=None) -> Work:
    work = Work()
    work.value = value
    work._done.set()
    return work


class TwinStream:
    """The twin's device: one thread that runs what the host queued, in order (started at its first item)."""

    def __init__(self):
        self._queue = queue.Queue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, fn) -> Work:
        work = Work(fn if fn is None else _in_modes_of_this_thread(fn))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="multinpu-twin-stream")
                self._thread.start()
        self._queue.put(work)
        return work

    def _loop(self):
        while True:
            self._queue.get().run()

    def synchronize(self):
        self.submit(None).wait()


def _in_modes_of_this_thread(fn):
    """fn to run on the stream in the grad and inference modes of the thread that queued it (they are per thread: a
    backend writing into an inference tensor outside inference mode is refused)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()
    return run


class Device:
    """Where this process's device work runs: the twin's stream, or at once (gloo, and the host's side of npu/cuda,
    whose kernels the backend queues itself)."""

    def __init__(self):
        self.stream = TwinStream() if twin() else None
        self.kind = "twin" if self.stream is not None else None
        self.stuck = None  # the `stuck` fault's trigger file: the device blocks before its next collective

    def before_collective(self):
        """The `stuck` fault, once armed: the device never reaches its next collective while the file exists (on
        the twin the host runs on and beats; on plain gloo the host is the device and blocks here)."""
        trigger, self.stuck = self.stuck, None
        if trigger is not None:
            self.run(lambda: _while_exists(trigger))

    def clock(self, device: torch.device) -> str:
        """How completion is observed: "twin", "event" (npu/cuda) or "sync" (plain gloo: a call returns when done)."""
        return self.kind or ("sync" if device.type == "cpu" else "event")

    def run(self, fn) -> Work:
        if self.stream is not None:
            return self.stream.submit(fn)
        work = Work(fn)
        work.run()
        return work

    def marker(self, device: torch.device):
        """An event-like object (query()) that completes when the device has done the work queued before it."""
        if self.stream is not None:
            return self.stream.submit(None)
        if device.type == "cpu":
            return done()
        event = torch.get_device_module(device).Event()
        event.record()
        return event

    def synchronize(self, device: torch.device):
        """A host sync: returns when everything this process queued on its device is done."""
        if self.stream is not None:
            self.stream.synchronize()
        elif device.type != "cpu":
            torch.get_device_module(device).synchronize(device)


def _while_exists(path: str):
    while os.path.exists(path):
        time.sleep(0.1)


DEVICE = Device()


def memory_stats(device: torch.device, reset_peak: bool = False) -> dict:
    """This process's memory on `device`, each figure its own key (GET /metrics, comfy.multinpu_metrics):
    "used" and "capacity": the device's own view (total minus free, and total: HCCL/NCCL buffers, workspaces and other
    processes on the card included); "allocated" and "reserved": its caching allocator's; "peak": the allocator's
    largest allocated since the last reset_peak call (then reset); "host_rss": this process's resident set on the host.
    On cpu the host is the device: used is its total minus available, allocated and reserved the resident set, peak the
    largest resident set since the last reset (Linux' VmHWM, reset through /proc/self/clear_refs). {} when unreadable.
    Called where the worker computes (CollectiveProgress.sample): the allocator's counters take its mutex, which a
    device sync during an OOM retry holds, so the heartbeat thread never calls this; it sends the last sample."""
    try:
        rss = _resident_bytes()
        if device.type == "cpu":
            total, available = _host_memory()
            peak = max(rss, _peak_resident_bytes())
            if reset_peak:
                _reset_peak_resident()
            return {"allocated": rss, "reserved": rss, "peak": peak, "used": total - available, "capacity": total,
                    "host_rss": rss}
        module = torch.get_device_module(device)
        free, total = module.mem_get_info(device)
        peak = module.max_memory_allocated(device)
        if reset_peak:
            module.reset_peak_memory_stats(device)
        return {"allocated": module.memory_allocated(device), "reserved": module.memory_reserved(device), "peak": peak,
                "used": total - free, "capacity": total, "host_rss": rss}
    except Exception:
        return {}


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_resident_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_resident():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set (Linux 4.0+)
    except OSError:
        pass


def _host_memory() -> tuple:
    """(total, available) bytes of the host, from /proc/meminfo."""
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])


class CollectiveProgress:
    """This process's progress for its heartbeat (comfy.multinpu_group).

    The host's side (what it queued): how many collectives it entered (every rank enters the same collectives in the
    same order), the last one's op, whether the host waits inside it now; send/recv counted apart (their number
    differs from rank to rank). The device's side (what completed, from the markers): the last collective completed
    (dev_coll, dev_op), the one the device is inside (dev_in, dev_in_op: reached, not completed), completed sends and
    receives (dev_p2p), every completion observed (dev_steps: collectives reached and completed, ticks), the last
    tick's label, and how long since the device last advanced as this process saw it (dev_idle, seconds)."""

    SAMPLE_EVERY = 1.0  # seconds between memory samples taken where the worker computes

    def __init__(self):
        self.seq = self.p2p = 0
        self.op = None
        self.inside = False
        self.memory = {}
        self._peak = 0  # the largest peak of the samples since the last beat took it (each sample resets the allocator's)
        self._sampled = 0.0
        self._lock = threading.Lock()
        self._pending = collections.deque()  # (marker, what it completes)
        self._dev = {"dev_coll": 0, "dev_op": None, "dev_in": None, "dev_in_op": None, "dev_p2p": 0,
                     "dev_steps": 0, "dev_tick": None}
        self._advanced = time.monotonic()
        self._clock = "sync"

    def enter(self, op: str) -> int:
        if op in P2P:
            self.p2p += 1
        else:
            self.seq += 1
        self.op, self.inside = op, True
        return self.seq

    def record(self, device: torch.device, what: tuple):
        """A marker after the work queued so far: ("reach", seq, op), ("done", seq, op) or ("tick", label)."""
        self._clock = DEVICE.clock(device)
        marker = DEVICE.marker(device)
        with self._lock:
            self._pending.append((marker, what))
            if len(self._pending) > PENDING_LIMIT:
                self._poll()

    def tick(self, device: torch.device, label: str):
        """The device advanced without a collective (a block, a layer): recorded after the work queued so far."""
        self.record(device, ("tick", label))
        self.sample(device)

    def sample(self, device: torch.device, force: bool = False):
        """The memory sample the heartbeat sends (taken here, on the thread that computes, at most once a second)."""
        now = time.monotonic()
        if force or now - self._sampled >= self.SAMPLE_EVERY:
            self._sampled = now
            self.memory = memory_stats(device, reset_peak=True)
            self._peak = max(self._peak, self.memory.get("peak", 0))

    def beat_memory(self) -> dict:
        """The last sample, its peak the largest since the previous beat (GET /metrics keeps a prompt's largest);
        read by the heartbeat thread, which never touches the allocator."""
        memory, peak, self._peak = self.memory, self._peak, 0
        return dict(memory, peak=max(peak, memory["peak"])) if "peak" in memory else memory

    def _poll(self):
        """Apply every marker completed so far, in the order recorded (a stream completes in order). Lock held."""
        while self._pending and self._pending[0][0].query():
            kind, *rest = self._pending.popleft()[1]
            d = self._dev
            if kind == "tick":
                d["dev_tick"] = rest[0]
            elif rest[1] in P2P:
                d["dev_p2p"] += kind == "done"
            elif kind == "reach":
                d["dev_in"], d["dev_in_op"] = rest
            else:
                d["dev_coll"], d["dev_op"], d["dev_in"], d["dev_in_op"] = rest[0], rest[1], None, None
            d["dev_steps"] += 1
            self._advanced = time.monotonic()

    def snapshot(self) -> dict:
        with self._lock:
            self._poll()
            device = dict(self._dev, dev_idle=round(time.monotonic() - self._advanced, 1), clock=self._clock)
        return {"coll": self.seq, "p2p": self.p2p, "op": self.op, "inside": self.inside, **device}


PROGRESS = CollectiveProgress()


# ---- what the driver reads in a beat (comfy.multinpu_progress) ------------------------------------------------------

def device_view(progress: dict) -> dict:
    """The device's side of a beat's progress: {"dev_coll", "dev_op", "dev_in", "dev_in_op", "dev_steps"}; a beat
    without it is a synchronous device's (its host's positions are its device's)."""
    if "dev_steps" in progress:
        return progress
    coll, op = progress.get("coll") or 0, progress.get("op")
    inside = bool(progress.get("inside")) and op not in P2P
    return {"dev_coll": coll - 1 if inside else coll, "dev_op": None, "dev_in": coll if inside else None,
            "dev_in_op": op if inside else None, "dev_steps": None}


def position(progress: dict) -> tuple:
    """What moves when the rank makes progress: its command and what its device completed (its host's positions
    for a beat without the device's)."""
    if "dev_steps" not in progress:
        return tuple(progress.get(k) for k in ("g", "n", "coll", "p2p", "inside"))
    return tuple(progress.get(k) for k in ("g", "n", "dev_steps", "dev_coll", "dev_in", "dev_p2p"))


def _host_words(progress: dict) -> str:
    coll, op = progress.get("coll") or 0, progress.get("op")
    if not coll and not progress.get("p2p"):
        return "its host has queued no collective"
    if progress.get("inside") and op in P2P:
        return f"its host waits in {op}, after collective #{coll}"
    if progress.get("inside"):
        return f"its host queued collective #{coll} ({op}) and waits for it"
    return f"its host queued collective #{coll} ({op}) last"


def _device_side(progress: dict) -> str:
    if progress.get("dev_in") is not None:
        words = f"its device is inside collective #{progress['dev_in']} ({progress.get('dev_in_op')})"
    elif progress.get("dev_coll"):
        words = f"its device last completed collective #{progress['dev_coll']} ({progress.get('dev_op')})"
    else:
        words = "its device has completed no collective"
    tick = progress.get("dev_tick")
    return words + (f", its last tick {tick}" if tick else "")


def device_words(progress: dict) -> str:
    """Where a rank is in a command, in words: what its host queued, what its device completed (never "completed"
    for what was only queued); a beat without the device's fields is a synchronous device's, its host's words."""
    if "dev_steps" in progress:
        return f"{_host_words(progress)}; {_device_side(progress)}"
    op, coll = progress.get("op"), progress.get("coll")
    if progress.get("inside") and op in P2P:
        return f"it waits in {op}, after collective #{coll}"
    if progress.get("inside"):
        return f"it is inside collective #{coll} ({op})"
    return f"it last completed collective #{coll} ({op}) and has entered none since"


def inject_faults(name: str, rank: int, device: torch.device):
    """The faults of H3KIT_MULTINPU_FAULT for program `name` whose file exists (docs/multinpu.md, "Fault injection")."""
    for program, kind, seconds, trigger in parse_faults(os.environ.get(FAULT_ENV, "")):
        trigger = trigger.replace("{rank}", str(rank))  # one rank of a host faulted: its own file
        if program != name or not os.path.exists(trigger):
            continue
        fault = f"{FAULT_ENV}={program}:{kind}{'' if seconds is None else f'={seconds:g}'}:{trigger}"
        logging.warning(f"MultiNPU: rank {rank}: {fault}: {FAULT_DOES[kind]} in {name}")
        if kind == "oom":
            torch.empty(1 << 62, dtype=torch.uint8, device=device)
        if kind == "raise":
            raise RuntimeError(f"{fault}: injected failure in {name} on rank {rank}")
        if kind in ("hold", "hang"):  # a slow disk, or a rank blocked in a kernel (the GIL released, beating on)
            _while_exists(trigger)
        if kind == "slow":
            spend(device, seconds, f"{name} slow")
        if kind == "stuck":
            DEVICE.stuck = trigger


FAULT_DOES = {"oom": "allocating what no host has", "raise": "raising", "hold": "holding", "hang": "hanging",
              "slow": "more device time, each second of it completing (a slow device, not a stuck one)",
              "stuck": "the device sticks before its next collective (its host runs on and beats)"}


def spend(device: torch.device, seconds: float, label: str):
    """`seconds` more device time in steps of at most one second, each completing (a tick): a device that is slow,
    not stuck (the `slow` fault)."""
    steps = max(1, math.ceil(seconds))
    for i in range(steps):
        DEVICE.run(lambda: time.sleep(seconds / steps))
        PROGRESS.tick(device, f"{label} {i + 1}/{steps}")


def synchronize(device: torch.device):
    DEVICE.synchronize(device)
