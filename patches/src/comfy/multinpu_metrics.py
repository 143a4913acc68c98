"""GET /metrics: the server's prompts (their queue wait, end-to-end and running time, each stage's time per prompt,
failures by cause), the runtime's commands, the model cache, the process group's ranks (identity with the physical
device id, heartbeats, progress, memory as the device sees it), the limits in force, in Prometheus' text format.
Operator's guide: docs/service.md, "Monitoring".

A scrape reads only what is kept already: the counters below, updated at events (a prompt's start and end, a node's
time, a command's, a load's, a beat, a group replaced or ready), and plain attributes of the driver (its members, its
state, the newest beat of each rank, which carries the rank's memory, host and physical device). It never takes the
group's lock, never talks to a rank or the store, so it answers during a failure or a group replacement.
prometheus_client is imported at the first scrape: without it the server runs and /metrics answers 503 naming the fix.

Histogram buckets suit H3 on 8 NPUs (prompts of minutes: fine between 60 and 900 s); other hardware sets its own with
H3KIT_METRICS_BUCKETS_<NAME> (PROMPT, STAGE, QUEUE, COMMAND, LOAD: comma-separated seconds).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time

import torch

import comfy.model_cache
import comfy.multinpu
import comfy.multinpu_members
import comfy.multinpu_process
import comfy.multinpu_wire

BUCKETS_ENV = "H3KIT_METRICS_BUCKETS_"
DEFAULT_BUCKETS = {
    # a prompt: 10 s to 2 h, every 30 s from 60 s to 5 min, every minute to 10 min, then 12, 15 min
    "PROMPT": (10, 30, 60, 90, 120, 150, 180, 210, 240, 270, 300, 360, 420, 480, 540, 600, 720, 900, 1200, 1800,
               2700, 3600, 7200),
    "STAGE": (0.5, 1, 2, 5, 10, 20, 30, 60, 90, 120, 180, 240, 300, 420, 600, 900, 1800, 3600),
    "QUEUE": (1, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600, 7200, 14400),
    "COMMAND": (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
    "LOAD": (0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800),
}
RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
OUTCOMES = ("success", "error", "interrupted")
CAUSES = ("oom", "rank_died", "rank_hung", "shm_full", "timeout", "other")
REPLACEMENT_CAUSES = CAUSES + ("store", "join")
GROUP_STATES = ("starting", "forming", "ready", "broken", "failed")
# node class -> stage, the first match wins (the words h3kit demo uses)
STAGES = (("load", ("Loader", "MultiNPUParallelConfig")), ("text_encode", ("TextEncode", "ToVideo", "ImageToVideo")),
          ("sample", ("Sampler", "Guider", "Scheduler", "RandomNoise")), ("decode", ("VAEDecode",)),
          ("save", ("Save", "CreateVideo")))
SAMPLING_PROGRAM = "dit_forward"  # one per sampling step (and guidance pass): h3kit_sampling_steps_total
RESTARTS_FILE = os.path.join("metrics", "restarts.json")  # under the runtime root, written by h3kit watch / restart
RUNTIME_ROOT_ENV = "H3KIT_RUNTIME_ROOT"
VERSION_ENV = "H3KIT_VERSION"  # h3kit start sets it: the toolkit's version, on h3kit_build_info
RESTART_REASONS = ("died", "unhealthy", "manual")  # h3kit.monitoring.REASONS: each is exposed, 0 before the first
LOST_REASONS = ("crash", "dropped", "refused")  # h3kit.monitoring.LOST_REASONS: prompts of a restart's save not back
REQUEUED_STATES = ("running", "pending")        # h3kit.monitoring.REQUEUED_STATES: those queued again
# the alerts' bounds, exposed so that the rules compare against what this server runs with
STALL_ENV, STALL_DEFAULT = "H3KIT_STALL_ALERT_SECONDS", 1800.0  # a device without progress in a prompt (a read: LOAD_TIMEOUT)
STUCK_ENV, STUCK_DEFAULT = "H3KIT_PROMPT_STUCK_SECONDS", 7200.0        # a prompt running this long
HOST = socket.gethostname()


def buckets(name: str, environ=None) -> tuple:
    """The buckets of histogram `name`: H3KIT_METRICS_BUCKETS_<name> (comma-separated seconds, increasing), else the
    default; a bad value is named in the log and the default used (monitoring never stops the server)."""
    raw = (os.environ if environ is None else environ).get(BUCKETS_ENV + name, "").strip()
    if raw:
        try:
            values = tuple(float(x) for x in raw.split(","))
            if values and all(v > 0 for v in values) and list(values) == sorted(set(values)):
                return values
        except ValueError:
            pass
        logging.warning(f"Metrics: {BUCKETS_ENV + name}={raw!r} is not a list of increasing positive seconds "
                        f"(example: 60,120,300,600); using {DEFAULT_BUCKETS[name]}")
    return DEFAULT_BUCKETS[name]


def _bound(env: str, default: float) -> float:
    try:
        value = float(os.environ.get(env) or default)
        return value if value > 0 else default
    except ValueError:
        return default


class Histogram:
    """Cumulative bucket counts, a sum and a count, as Prometheus' histograms keep them."""

    def __init__(self, bounds):
        self.buckets = tuple(float(b) for b in bounds)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float):
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> list:
        """[(le, cumulative count)] ending with +Inf, as prometheus_client's HistogramMetricFamily takes them."""
        return [(str(b), c) for b, c in zip(self.buckets, self.counts)] + [("+Inf", self.count)]


class Prompt:
    """The prompt the worker runs: when it was created (ComfyUI's create_time, wall clock) and started, its stages'
    time so far (cache hits not counted), each rank's memory peaks while it runs."""

    def __init__(self, prompt_id: str, created, started_wall: float, started: float):
        self.id, self.created, self.started_wall, self.started = prompt_id, created, started_wall, started
        self.stages = {}   # stage -> seconds of its nodes' real runs in this prompt
        self.peaks = {}    # rank -> {"allocated": bytes, "used": bytes}: the largest seen while it runs


class Record:
    """What the server counted since it started. Updated by the prompt worker, the driver's threads and the event
    loop; a short lock of its own keeps each update whole (never the group's lock)."""

    def __init__(self, environ=None):
        self._lock = threading.Lock()
        b = {name: buckets(name, environ) for name in DEFAULT_BUCKETS}
        self.buckets = b
        self.prompts = dict.fromkeys(OUTCOMES, 0)
        self.failures = dict.fromkeys(CAUSES, 0)
        self.prompt_seconds = {o: Histogram(b["PROMPT"]) for o in OUTCOMES}
        self.e2e_seconds = {o: Histogram(b["PROMPT"]) for o in OUTCOMES}
        self.queue_wait = Histogram(b["QUEUE"])
        self.stage_seconds = {}              # stage -> Histogram of its time per prompt
        self.commands = {}                   # program -> Histogram
        self.steps = 0
        self.loads = {}                      # kind -> Histogram
        self.replacements = dict.fromkeys(REPLACEMENT_CAUSES, 0)
        self.recovery_seconds = Histogram(RECOVERY_BUCKETS)
        self.down_since = None               # monotonic time of the first replacement since the group last served
        self.started = time.monotonic()
        self.unready_since = None            # since when the group has not served (None while ready, or not yet told)
        self.current = None                  # the Prompt running
        self.last_peaks = {}                 # the last finished prompt's peaks

    def prompt_started(self, prompt_id: str, created, now_wall: float, now: float):
        """The worker took a prompt: its wait in the queue from ComfyUI's create time (wall clock, seconds)."""
        with self._lock:
            self.current = Prompt(prompt_id, created, now_wall, now)
            if created is not None:
                self.queue_wait.observe(max(0.0, now_wall - created))

    def prompt_done(self, outcome: str, cause, seconds: float, now_wall: float):
        with self._lock:
            self.prompts[outcome] += 1
            if cause is not None:
                self.failures[cause] += 1
            self.prompt_seconds[outcome].observe(seconds)
            p, self.current = self.current, None
            if p is None:
                return
            if p.created is not None:
                self.e2e_seconds[outcome].observe(max(0.0, now_wall - p.created))
            for stage, total in p.stages.items():
                self.stage_seconds.setdefault(stage, Histogram(self.buckets["STAGE"])).observe(total)
            self.last_peaks = p.peaks

    def node_done(self, stage: str, seconds: float, cached: bool = False):
        """A node ran (or was re-run after a pending result): its time goes to its stage of the running prompt,
        observed once when the prompt ends. A cache hit is no work."""
        with self._lock:
            if self.current is not None and not cached:
                self.current.stages[stage] = self.current.stages.get(stage, 0.0) + seconds

    def command_done(self, program: str, seconds: float):
        with self._lock:
            self.commands.setdefault(program, Histogram(self.buckets["COMMAND"])).observe(seconds)
            if program == SAMPLING_PROGRAM:
                self.steps += 1

    def load_done(self, kind: str, seconds: float):
        with self._lock:
            self.loads.setdefault(kind, Histogram(self.buckets["LOAD"])).observe(seconds)

    def beat(self, rank: int, memory: dict):
        """A rank's beat while a prompt runs: its allocator's peak since its last beat and its device's use."""
        with self._lock:
            if self.current is None or not isinstance(memory, dict):
                return
            peaks = self.current.peaks.setdefault(rank, {})
            for kind, key in (("allocated", "peak"), ("used", "used")):
                if isinstance(memory.get(key), (int, float)):
                    peaks[kind] = max(peaks.get(kind, 0), memory[key])

    def peaks(self) -> dict:
        """{rank: {"allocated", "used"}}: the running prompt's peaks so far, else the last prompt's."""
        with self._lock:
            return {r: dict(v) for r, v in (self.current.peaks if self.current else self.last_peaks).items()}

    def running(self, now: float):
        with self._lock:
            return None if self.current is None else now - self.current.started

    def group_state(self, state: str, why=None, now: float = None):
        """The driver's group changed state (comfy.multinpu_members.LISTENERS): "broken" is a replacement (why),
        "ready" a generation serving."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if state == "broken":
                self.replacements[replacement_cause(why or "")] += 1
                self.down_since = now if self.down_since is None else self.down_since
            elif state == "ready" and self.down_since is not None:
                self.recovery_seconds.observe(now - self.down_since)
                self.down_since = None
            if state == "ready":
                self.unready_since = None
            elif self.unready_since is None:
                self.unready_since = now

    def copy(self) -> dict:
        """A consistent view for one scrape."""
        with self._lock:
            return {"prompts": dict(self.prompts), "failures": dict(self.failures),
                    "prompt_seconds": {o: _frozen(h) for o, h in self.prompt_seconds.items()},
                    "e2e_seconds": {o: _frozen(h) for o, h in self.e2e_seconds.items()},
                    "queue_wait": _frozen(self.queue_wait), "replacements": dict(self.replacements),
                    "stage_seconds": {s: _frozen(h) for s, h in self.stage_seconds.items()},
                    "commands": {p: _frozen(h) for p, h in self.commands.items()}, "steps": self.steps,
                    "loads": {k: _frozen(h) for k, h in self.loads.items()},
                    "recovery_seconds": _frozen(self.recovery_seconds),
                    "unready_since": self.started if self.unready_since is None else self.unready_since}


def _frozen(h: Histogram) -> tuple:
    return h.samples(), h.sum


RECORD = Record()


class GcPauses:
    """How long each pass of Python's garbage collector held the GIL (and with it every route of the server), by
    generation. A gc.callbacks entry: it runs inside the collector, which may have interrupted a thread holding any
    lock, so it takes none (the collector runs one pass at a time; a scrape reads the counts before the count)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.by_generation = {g: Histogram(GC_BUCKETS) for g in range(3)}
        self._started = None

    def __call__(self, phase: str, info: dict):
        if phase == "start":
            self._started = self.clock()
        elif self._started is not None:
            self.by_generation[info["generation"]].observe(self.clock() - self._started)
            self._started = None

    def copy(self) -> dict:
        return {g: _frozen(h) for g, h in self.by_generation.items()}


GC_PAUSES = GcPauses()


def watch_gc():
    """Time the collector's passes from now on (once per process)."""
    if GC_PAUSES not in gc.callbacks:
        gc.callbacks.append(GC_PAUSES)


def failure_cause(exception_type: str, message: str) -> str:
    """The cause of a failed prompt, from its execution_error: its exception's type (full name) and message."""
    text = f"{exception_type} {message}".lower()
    if "outofmemory" in text or "out of memory" in text or "can't allocate memory" in text:
        return "oom"
    for cause, needle in (("rank_hung", "rankhung"), ("rank_died", "rankdied"), ("shm_full", "sharedmemoryfull")):
        if needle in text:
            return cause
    return "timeout" if "timeout" in text or "timed out" in text else "other"


def replacement_cause(why: str) -> str:
    """The cause of a group replacement, from the reason the driver gave (comfy.multinpu_members._abort_generation):
    a command's first error, a death or hang noticed while idle, the store, a generation that did not form."""
    text = why.lower()
    if "out of memory" in text:
        return "oom"
    if "hung" in text or "no heartbeat" in text:
        return "rank_hung"
    if "store" in text:
        return "store"
    if "did not form" in text:
        return "join"
    if any(w in text for w in ("died", "killed", "exited", "signal", "closed the command channel", "host lost")):
        return "rank_died"
    return "other"


def stage_of(class_type: str):
    for stage, needles in STAGES:
        if any(n in class_type for n in needles):
            return stage
    return "other"


def prompt_started(prompt_id, extra_data):
    """The prompt worker took a prompt (main.py): ComfyUI's create_time (ms, set when it was queued) starts its queue
    wait and its end-to-end time."""
    try:
        created = (extra_data or {}).get("create_time")
        created = float(created) / 1000.0 if isinstance(created, (int, float)) else None
        RECORD.prompt_started(str(prompt_id), created, time.time(), time.monotonic())
        _reset_local_peaks()
    except Exception as e:  # counting must never fail a prompt
        logging.warning(f"Metrics: could not count a prompt's start: {e}")


def prompt_done(success: bool, status_messages: list, seconds: float):
    """The prompt worker finished a prompt (main.py): its outcome, the cause of an error, its time."""
    try:
        events = dict((m[0], m[1]) for m in status_messages if isinstance(m, (list, tuple)) and len(m) == 2)
        if "execution_interrupted" in events:
            outcome, cause = "interrupted", None
        elif success:
            outcome, cause = "success", None
        else:
            error = events.get("execution_error") or {}
            outcome = "error"
            cause = failure_cause(str(error.get("exception_type", "")), str(error.get("exception_message", "")))
        RECORD.prompt_done(outcome, cause, seconds, time.time())
    except Exception as e:  # counting must never fail a prompt
        logging.warning(f"Metrics: could not count a prompt: {e}")


def node_done(dynprompt, node_id, seconds: float, cached: bool = False):
    """A node of a prompt ran (execution.py): its time, under its stage of the running prompt; `cached`: ComfyUI
    served it from its cache (no work)."""
    try:
        RECORD.node_done(stage_of(str(dynprompt.get_node(node_id).get("class_type", ""))), seconds, cached)
    except Exception as e:
        logging.warning(f"Metrics: could not time node {node_id}: {e}")


def _group_state(state: str, why=None):
    try:
        RECORD.group_state(state, why)
    except Exception as e:
        logging.warning(f"Metrics: could not count the group's state {state}: {e}")


def _beat(rank, progress):
    try:
        if isinstance(progress, dict):
            RECORD.beat(int(rank), progress.get("memory"))
    except Exception as e:
        logging.warning(f"Metrics: could not read rank {rank}'s beat: {e}")


def _reset_local_peaks():
    """Without a process group the server's own devices compute: their peaks start again with each prompt."""
    if comfy.multinpu_process.get_runtime() is None:
        from comfy import multidevice
        for device in dict.fromkeys(multidevice.get_devices()):
            comfy.multinpu.memory_stats(device, reset_peak=True)


comfy.multinpu_members.LISTENERS.append(_group_state)
comfy.multinpu.BEAT_LISTENERS.append(_beat)
comfy.multinpu.COMMAND_LISTENERS.append(lambda program, seconds: RECORD.command_done(program, seconds))
comfy.model_cache.load_listeners.append(lambda kind, seconds: RECORD.load_done(kind, seconds))


# ---- the scrape ------------------------------------------------------------------------------------------------

def group_view(runtime, now: float) -> dict:
    """The process group as the driver keeps it, read without its lock: {"world_size", "joined", "generation", "state",
    "limits", "ranks": [{"rank", "host", "device", "physical_device", "pid", "age", "progress_age", "memory"}]} of the
    current members. From each one's newest beat (comfy.multinpu_group._heartbeat): its memory and physical device;
    heartbeat age: since that beat; progress age: since its beats' progress position last changed (the progress
    watch's own record: the seconds since its device last advanced); host: the launcher's record or the worker's."""
    members = dict(runtime.members)
    watch = runtime._progress
    beats = dict(watch._beats)  # (rank, pid) -> (progress, monotonic time of the beat): the channel's
    since = dict(getattr(watch, "_since", {}))  # (rank, pid) -> (position, monotonic time it was first seen)
    ranks = []
    for rank, pid in sorted(members.items()):
        progress, at = beats.get((rank, pid), ({}, None))
        moved = since.get((rank, pid), (None, None))[1]
        seen = runtime._local.info.get(rank) if runtime.spec.node_of(rank) == 0 else runtime._remote_seen.get(rank)
        ranks.append({"rank": rank, "host": str((seen or {}).get("host") or ""), "pid": pid,
                      "device": runtime.spec.device_name(rank),
                      "physical_device": str(progress.get("physical_device") or ""),
                      "age": None if at is None else max(0.0, now - at),
                      "progress_age": None if moved is None else max(0.0, now - moved),
                      "memory": progress.get("memory") or {}})
    joined = len(members) if runtime.state == "ready" else 0
    limits = {"join": runtime.spec.join_timeout, "heartbeat": comfy.multinpu_wire.HEARTBEAT_STALE,
              "progress": watch.bound, "group": runtime.spec.timeout}
    return {"world_size": runtime.world_size, "joined": joined, "ranks": ranks, "generation": runtime.generation,
            "state": runtime.state, "limits": limits}


def local_view() -> dict:
    """Without a process group (threads, one device): the server's own devices, ranks as the threads number them."""
    from comfy import multidevice  # it imports comfy.model_management: only in the server, not in unit tests
    devices = multidevice.get_devices()
    stats = {}
    ranks = []
    for rank, device in enumerate(devices):
        if str(device) not in stats:
            stats[str(device)] = comfy.multinpu.memory_stats(device)
        index = device.index if device.index is not None else rank
        ranks.append({"rank": rank, "host": HOST, "device": str(device), "pid": os.getpid(), "age": None,
                      "physical_device": comfy.multinpu.physical_device(index), "progress_age": None,
                      "memory": stats[str(device)]})
    return {"world_size": len(devices), "joined": len(devices), "ranks": ranks, "generation": None, "state": None,
            "limits": {}}


def restarts(root, key: str = "restarts") -> dict:
    """{label: count} of the runtime root's record, written by h3kit watch and restart: `key` "restarts" (by reason),
    "prompts_lost" (by reason) or "prompts_requeued" (by state)."""
    if not root:
        return {}
    try:
        with open(os.path.join(root, RESTARTS_FILE)) as f:
            data = json.load(f)
        return {str(k): int(v) for k, v in data.get(key, {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def shm_space() -> tuple:
    """(free, capacity) bytes of the /dev/shm hand-off folder; (0, 0) when unreadable."""
    try:
        st = os.statvfs(comfy.multinpu_wire.shm_dir())
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        return 0, 0


def shm_free() -> int:
    return shm_space()[0]


def pending_ages(queue, now_wall: float) -> list:
    """Seconds each pending prompt has waited (ComfyUI's create_time, set when it was queued), read without the
    queue's lock (a copy of its list: the worst is a prompt taken meanwhile, counted once more)."""
    ages = []
    for item in list(getattr(queue, "queue", ()) or ()):
        try:
            created = item[3].get("create_time")
            if isinstance(created, (int, float)):
                ages.append(max(0.0, now_wall - created / 1000.0))
        except (IndexError, AttributeError, TypeError):
            continue
    return ages


_BUILD = None


def build_info() -> dict:
    global _BUILD
    if _BUILD is None:
        import importlib.metadata
        versions = {}
        for key, dist in (("torch_npu", "torch-npu"),):
            try:
                versions[key] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                versions[key] = ""
        try:
            import comfyui_version
            comfy_version = comfyui_version.__version__
        except Exception:
            comfy_version = ""
        state = _state()
        _BUILD = {"version": comfy_version, "pin": str(state.get("pin") or ""), "torch": torch.__version__, **versions,
                  "cann": _cann(), "h3kit": os.environ.get(VERSION_ENV, ""), "series": series_digest(state)}
    return _BUILD


def _state() -> dict:
    """h3kit install's state file of the tree this module is in, else {}."""
    try:
        home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with open(os.path.join(home, ".h3kit", "state.json")) as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def series_digest(state: dict) -> str:
    """The first 12 hex digits of sha256 over the installed patches' names and checksums, in series order: two
    servers with the same digest run the same series; '' when the tree was not installed by h3kit."""
    patches = state.get("patches")
    if not isinstance(patches, list) or not patches:
        return ""
    text = "\n".join(f"{p.get('name')} {p.get('sha256')}" for p in patches if isinstance(p, dict))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _cann() -> str:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or ""
    try:
        with open(os.path.join(home, f"{os.uname().machine}-linux", "ascend_toolkit_install.info")) as f:
            for line in f:
                if line.startswith("version="):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return ""


# ---- the families and the route --------------------------------------------------------------------------------

MEMORY = (  # family, the beat's key, help
    ("h3kit_device_memory_used_bytes", "used", "Device memory in use as the device reports it (total minus free: "
     "the allocator's pool, HCCL/NCCL buffers, workspaces, other processes; cpu: the host's total minus available)."),
    ("h3kit_device_memory_capacity_bytes", "capacity", "Device memory in all (cpu: the host's)."),
    ("h3kit_device_memory_allocated_bytes", "allocated", "Bytes the rank's caching allocator has handed out (cpu: "
     "its resident set)."),
    ("h3kit_device_memory_reserved_bytes", "reserved", "Bytes the rank's caching allocator holds from the device, "
     "kept after a prompt (cpu: its resident set)."),
    ("h3kit_worker_resident_memory_bytes", "host_rss", "Host memory (resident set) of each rank's process."),
)


class Collector:
    """A prometheus_client collector: every family built at each scrape from RECORD, the driver and the queue."""

    def __init__(self, server=None, root=None):
        self.server = server
        self.root = root if root is not None else os.environ.get(RUNTIME_ROOT_ENV)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        seen = RECORD.copy()
        yield from self._prompts(seen, CounterMetricFamily, HistogramMetricFamily)
        yield from self._work(seen, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)
        yield from self._recovery(seen, CounterMetricFamily, HistogramMetricFamily)
        runtime = comfy.multinpu_process.get_runtime()
        view = group_view(runtime, time.monotonic()) if runtime is not None else local_view()
        yield from self._group(view, seen, GaugeMetricFamily)
        yield from self._ranks(view, GaugeMetricFamily)
        yield from self._queue(GaugeMetricFamily)
        yield from self._service(CounterMetricFamily, GaugeMetricFamily)

    @staticmethod
    def _prompts(seen, counter, histogram):
        prompts = counter("h3kit_prompts", "Prompts the server finished, by outcome.", labels=["outcome"])
        for outcome, n in seen["prompts"].items():
            prompts.add_metric([outcome], n)
        failures = counter("h3kit_prompt_failures", "Prompts that failed, by cause (oom, rank_died, rank_hung, "
                           "shm_full: the infrastructure's; timeout, other: mostly the prompt's).", labels=["cause"])
        for cause, n in seen["failures"].items():
            failures.add_metric([cause], n)
        seconds = histogram("h3kit_prompt_seconds", "A prompt's time in the prompt worker, seconds, by outcome.",
                            labels=["outcome"])
        e2e = histogram("h3kit_prompt_e2e_seconds", "From a prompt's queueing (ComfyUI's create_time) to its end, "
                        "seconds, by outcome.", labels=["outcome"])
        for outcome in OUTCOMES:
            seconds.add_metric([outcome], *seen["prompt_seconds"][outcome])
            e2e.add_metric([outcome], *seen["e2e_seconds"][outcome])
        wait = histogram("h3kit_prompt_queue_wait_seconds", "From a prompt's queueing to the worker taking it, "
                         "seconds.")
        wait.add_metric([], *seen["queue_wait"])
        stages = histogram("h3kit_stage_seconds", "Each stage's time in one prompt (its nodes' runs summed, cache hits "
                           "not counted), seconds: one observation per prompt that ran the stage.", labels=["stage"])
        for stage, (b, total) in sorted(seen["stage_seconds"].items()):
            stages.add_metric([stage], b, total)
        yield from (prompts, failures, seconds, e2e, wait, stages)

    @staticmethod
    def _work(seen, counter, gauge, histogram):
        commands = histogram("h3kit_command_seconds", "The runtime's commands to its ranks, seconds, by program "
                             "(dit_forward: one sampling step; te_forward, vae_decode; install: a weight install on "
                             "the ranks).", labels=["program"])
        for program, (b, total) in sorted(seen["commands"].items()):
            commands.add_metric([program], b, total)
        steps = counter("h3kit_sampling_steps", "DiT forwards the ranks ran (one per sampling step and guidance pass).")
        steps.add_metric([], seen["steps"])
        loads = histogram("h3kit_model_load_seconds", "Reads of a model by the server (a model cache miss), seconds, "
                          "by kind (diffusion_model, clip, vae).", labels=["kind"])
        for kind, (b, total) in sorted(seen["loads"].items()):
            loads.add_metric([kind], b, total)
        cache = comfy.model_cache.stats()
        out = [commands, steps, loads]
        for name, key, doc in (("hits", "hits", "Loads the model cache answered without reading a file."),
                               ("misses", "misses", "Loads that read the model's files."),
                               ("evictions", "evictions", "Models the cache let go to stay in its bounds.")):
            family = counter(f"h3kit_model_cache_{name}", doc)
            family.add_metric([], cache.get(key, 0))
            out.append(family)
        for name, key, doc in (("entries", "entries", "Models the cache holds."),
                               ("max_entries", "max_entries", "Models the cache may hold (COMFY_MODEL_CACHE_ENTRIES)."),
                               ("size_bytes", "bytes", "Bytes of the models the cache holds."),
                               ("budget_bytes", "budget_bytes", "Bytes the cache may hold (COMFY_MODEL_CACHE_GB).")):
            family = gauge(f"h3kit_model_cache_{name}", doc)
            family.add_metric([], cache.get(key, 0))
            out.append(family)
        yield from out

    @staticmethod
    def _recovery(seen, counter, histogram):
        replaced = counter("h3kit_group_replacements", "Times the process group was replaced by fresh processes, by "
                           "cause.", labels=["cause"])
        for cause, n in seen["replacements"].items():
            replaced.add_metric([cause], n)
        recovery = histogram("h3kit_group_recovery_seconds", "From a group replacement to the new generation serving, "
                             "seconds.")
        recovery.add_metric([], *seen["recovery_seconds"])
        pauses = histogram("h3kit_gc_pause_seconds", "Passes of the server's garbage collector, each holding every "
                           "route, seconds, by generation.", labels=["generation"])
        for generation, (b, total) in GC_PAUSES.copy().items():
            pauses.add_metric([str(generation)], b, total)
        yield from (replaced, recovery, pauses)

    @staticmethod
    def _group(view, seen, gauge):
        ranks = gauge("h3kit_group_ranks", "Ranks of the process group, joined or missing.", labels=["state"])
        ranks.add_metric(["joined"], view["joined"])
        ranks.add_metric(["missing"], view["world_size"] - view["joined"])
        out = [ranks]
        if view["state"] is not None:
            state = gauge("h3kit_group_state", "1 for the process group's state.", labels=["state"])
            for s in GROUP_STATES:
                state.add_metric([s], 1 if view["state"] == s else 0)
            generation = gauge("h3kit_group_generation", "The process group's generation (one more per replacement).")
            generation.add_metric([], view["generation"] or 0)
            since = seen["unready_since"]
            unready = gauge("h3kit_group_unready_seconds", "Seconds since the group last served (0 while it serves).")
            unready.add_metric([], 0 if since is None or view["state"] == "ready" else time.monotonic() - since)
            out += [state, generation, unready]
        for name, key, doc in (("join_timeout", "join", "--join-timeout: a generation's ranks join within it."),
                               ("heartbeat_timeout", "heartbeat", "H3KIT_HEARTBEAT_TIMEOUT: a rank silent this long "
                                "is replaced."),
                               ("progress_bound", "progress", "H3KIT_PROGRESS_TIMEOUT: a rank short of its peers' "
                                "collective this long is replaced."),
                               ("collective_timeout", "group", "--group-timeout: every collective's last resort, "
                                "behind the detectors above (HCCL's own timeouts in order below it).")):
            if key in view["limits"]:
                family = gauge(f"h3kit_group_{name}_seconds", doc)
                family.add_metric([], view["limits"][key])
                out.append(family)
        yield from out

    @staticmethod
    def _ranks(view, gauge):
        info = gauge("h3kit_rank_info", "1 for each rank: its host, device as it sees it, the host's id of that device "
                     "(npu-exporter's and npu-smi's id) and pid.", labels=["rank", "host", "device",
                                                                           "physical_device", "pid"])
        age = gauge("h3kit_rank_heartbeat_age_seconds", "Seconds since each rank's newest heartbeat.",
                    labels=["rank", "host"])
        progress = gauge("h3kit_rank_progress_age_seconds", "Seconds since each rank's device last advanced (its "
                         "beats' progress position last changed; idle between prompts).", labels=["rank", "host"])
        memory = {name: gauge(name, doc, labels=["rank", "device", "physical_device"]) for name, _, doc in MEMORY}
        peak = gauge("h3kit_device_memory_prompt_peak_bytes", "The largest device memory of each rank during the "
                     "running prompt, else the last one (allocated: the allocator's exact peak; used: the device's "
                     "use at each heartbeat).", labels=["rank", "device", "physical_device", "source"])
        peaks = RECORD.peaks()
        for r in view["ranks"]:
            rank, host = str(r["rank"]), r["host"]
            where = [rank, r["device"], r["physical_device"]]
            info.add_metric([rank, host, r["device"], r["physical_device"], str(r["pid"])], 1)
            if r["age"] is not None:
                age.add_metric([rank, host], r["age"])
            if r["progress_age"] is not None:
                progress.add_metric([rank, host], r["progress_age"])
            for name, key, _ in MEMORY:
                if isinstance(r["memory"].get(key), (int, float)):
                    memory[name].add_metric(where, r["memory"][key])
            local = {"allocated": r["memory"].get("peak")} if not view["limits"] else {}
            for source, value in {**local, **peaks.get(r["rank"], {})}.items():
                if isinstance(value, (int, float)):
                    peak.add_metric(where + [source], value)
        yield from (info, age, progress, *memory.values(), peak)

    def _queue(self, gauge):
        queue = getattr(self.server, "prompt_queue", None)
        pending = gauge("h3kit_queue_pending", "Prompts waiting in the queue.")
        pending.add_metric([], len(getattr(queue, "queue", ())))
        running = gauge("h3kit_queue_running", "Prompts running.")
        running.add_metric([], len(getattr(queue, "currently_running", {})))
        oldest = gauge("h3kit_queue_oldest_pending_age_seconds", "Seconds the oldest waiting prompt has been queued "
                       "(0 when none waits).")
        oldest.add_metric([], max(pending_ages(queue, time.time()), default=0.0))
        ran = RECORD.running(time.monotonic())
        run_for = gauge("h3kit_prompt_running_seconds", "Seconds the running prompt has run (0 when none runs).")
        run_for.add_metric([], ran or 0.0)
        stall = gauge("h3kit_rank_stall_bound_seconds", f"{STALL_ENV}: a rank's device without progress this long "
                      "while a prompt runs is stuck (H3kitPromptStuck).")
        stall.add_metric([], _bound(STALL_ENV, STALL_DEFAULT))
        stuck = gauge("h3kit_prompt_stuck_bound_seconds", f"{STUCK_ENV}: a prompt running this long is stuck "
                      "(H3kitPromptStuck).")
        stuck.add_metric([], _bound(STUCK_ENV, STUCK_DEFAULT))
        yield from (pending, running, oldest, run_for, stall, stuck)

    def _service(self, counter, gauge):
        free, capacity = shm_space()
        shm = gauge("h3kit_shm_free_bytes", "Free bytes in the /dev/shm hand-off folder (H3KIT_SHM_DIR).")
        shm.add_metric([], free)
        shm_size = gauge("h3kit_shm_capacity_bytes", "Size of the /dev/shm hand-off folder's file system.")
        shm_size.add_metric([], capacity)
        restarted = counter("h3kit_service_restarts", "Restarts of this service by h3kit watch and h3kit restart, by "
                            "reason (the runtime root's metrics/restarts.json).", labels=["reason"])
        for reason, n in sorted({**dict.fromkeys(RESTART_REASONS, 0), **restarts(self.root)}.items()):
            restarted.add_metric([reason], n)
        lost = counter("h3kit_prompts_lost", "Prompts of the queue saved before a restart by h3kit watch or restart "
                       "that the restore did not queue again, by reason: crash (running when the server died), "
                       "dropped (running when the restart stopped the server), refused (the new server refused it). "
                       "Prompts no save held are not counted.", labels=["reason"])
        requeued = counter("h3kit_prompts_requeued", "Prompts of the queue saved before a restart that the restore "
                           "queued again, by what they were (running: it runs again from the start; pending).",
                           labels=["state"])
        for family, key, every in ((lost, "prompts_lost", LOST_REASONS), (requeued, "prompts_requeued",
                                                                          REQUEUED_STATES)):
            for label, n in sorted({**dict.fromkeys(every, 0), **restarts(self.root, key)}.items()):
                family.add_metric([label], n)
        info = build_info()
        build = gauge("h3kit_build_info", "1, with the versions this server runs as labels (h3kit: the toolkit's "
                      "version; series: the installed patch series' digest).", labels=list(info))
        build.add_metric(list(info.values()), 1)
        yield from (shm, shm_size, restarted, lost, requeued, build)


_REGISTRY = None
# a scrape within this many seconds of the last one gets the same text: a storm of scrapes costs the server (whose
# CPU the prompts share) one rendering per interval, while Prometheus (1 s or more apart) sees every change
MIN_INTERVAL = 0.5
_LAST = {}  # content type -> (monotonic time it was rendered, body)


def exposition(server=None, accept: str = "") -> tuple:
    """(HTTP status, content type, body) of GET /metrics in the format the scraper's Accept header asks for (Prometheus'
    text format, or OpenMetrics); 503 naming the fix when prometheus_client is missing."""
    global _REGISTRY
    try:
        import prometheus_client
        import prometheus_client.exposition
    except ImportError as e:
        return 503, "text/plain; charset=utf-8", (
            f"h3kit: /metrics needs prometheus_client, which {sys.executable} cannot import ({e}). Fix: "
            f"{sys.executable} -m pip install prometheus-client (h3kit doctor names the version), then restart "
            "the server\n").encode()
    if _REGISTRY is None:
        registry = prometheus_client.CollectorRegistry()
        registry.register(Collector(server))
        prometheus_client.ProcessCollector(registry=registry)
        _REGISTRY = registry
    encoder, content_type = prometheus_client.exposition.choose_encoder(accept)
    now = time.monotonic()
    rendered, body = _LAST.get(content_type, (None, b""))
    if rendered is None or now - rendered >= MIN_INTERVAL:
        body = encoder(_REGISTRY)
        _LAST[content_type] = (now, body)
    return 200, content_type, body


class Pacer:
    """One answer of GET /metrics per `every` seconds, whoever asks, in the order asked (asyncio.Lock wakes its waiters
    first in, first out). Rank 0 computes in the server's process, so every request the event loop serves takes a
    share of the GIL the prompt needs (0.2-0.3 ms a scrape, docs/performance.md "Monitoring"). A local client that
    scrapes as fast as it is answered then costs the prompt `1 / every` requests a second however many threads it
    runs; the wait itself is a timer, no CPU. Prometheus (1 s or more apart) never waits; a scrape that arrives
    behind K others waits at most K * every."""

    def __init__(self, every: float, clock=time.monotonic):
        self.every, self.clock = every, clock
        self._last = None  # when the last answer was given
        self._lock = None  # made in the event loop that first uses it

    @contextlib.asynccontextmanager
    async def turn(self):
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._last is not None:
                wait = self._last + self.every - self.clock()
                if wait > 0:
                    await asyncio.sleep(wait)
            try:
                yield
            finally:
                self._last = self.clock()


PACE = 0.25  # seconds between two answers of GET /metrics: 4 a second at most, 60x Prometheus' default rate


def add_routes(server):
    """GET /metrics on the server's own address and port (main.py, before the routes are registered)."""
    from aiohttp import web
    watch_gc()
    pacer = Pacer(PACE)

    @server.routes.get("/metrics")
    async def get_metrics(request):
        async with pacer.turn():
            try:
                status, content_type, body = exposition(server, request.headers.get("Accept", ""))
            except Exception as e:
                logging.exception("Metrics: a scrape failed")
                status, content_type, body = (500, "text/plain; charset=utf-8",
                                              f"h3kit: the scrape failed: {e}\n".encode())
        return web.Response(status=status, body=body, headers={"Content-Type": content_type})
