"""GET /metrics: the server's prompts, their failures by cause, the process group's ranks, heartbeats and device
memory, in Prometheus' text format. Operator's guide: docs/service.md, "Monitoring".

A scrape reads only what is kept already: the counters below, updated at events (a prompt's end, a node's time, a
group replaced or ready), and plain attributes of the driver (its members, its state, the newest beat of each rank,
which carries the rank's device memory and host). It never takes the group's lock, never talks to a rank or the
store, so it answers during a failure or a group replacement. prometheus_client is imported at the first scrape:
without it the server runs and /metrics answers 503 naming the fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import socket
import sys
import threading
import time

import torch

import comfy.multinpu
import comfy.multinpu_members
import comfy.multinpu_process
import comfy.multinpu_wire

PROMPT_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 900, 1200, 1800, 2700, 3600)
STAGE_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
GC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
OUTCOMES = ("success", "error", "interrupted")
CAUSES = ("oom", "rank_died", "rank_hung", "shm_full", "timeout", "other")
REPLACEMENT_CAUSES = CAUSES + ("store", "join")
# node class -> stage, the first match wins (the words h3kit demo uses)
STAGES = (("load", ("Loader", "MultiNPUParallelConfig")), ("text_encode", ("TextEncode", "ToVideo", "ImageToVideo")),
          ("sample", ("Sampler", "Guider", "Scheduler", "RandomNoise")), ("decode", ("VAEDecode",)),
          ("save", ("Save", "CreateVideo")))
RESTARTS_FILE = os.path.join("metrics", "restarts.json")  # under the runtime root, written by h3kit watch / restart
RUNTIME_ROOT_ENV = "H3KIT_RUNTIME_ROOT"
RESTART_REASONS = ("died", "unhealthy", "manual")  # h3kit.monitoring.REASONS: each is exposed, 0 before the first
HOST = socket.gethostname()


class Histogram:
    """Cumulative bucket counts, a sum and a count, as Prometheus' histograms keep them."""

    def __init__(self, buckets):
        self.buckets = tuple(float(b) for b in buckets)
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


class Record:
    """What the server counted since it started. Updated by the prompt worker, the driver's threads and the event
    loop; a short lock of its own keeps each update whole (never the group's lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.prompts = dict.fromkeys(OUTCOMES, 0)
        self.failures = dict.fromkeys(CAUSES, 0)
        self.prompt_seconds = Histogram(PROMPT_BUCKETS)
        self.stage_seconds = {}              # stage -> Histogram
        self.replacements = dict.fromkeys(REPLACEMENT_CAUSES, 0)
        self.recovery_seconds = Histogram(RECOVERY_BUCKETS)
        self.down_since = None               # monotonic time of the first replacement since the group last served

    def prompt_done(self, outcome: str, cause, seconds: float):
        with self._lock:
            self.prompts[outcome] += 1
            if cause is not None:
                self.failures[cause] += 1
            self.prompt_seconds.observe(seconds)

    def node_done(self, stage: str, seconds: float):
        with self._lock:
            self.stage_seconds.setdefault(stage, Histogram(STAGE_BUCKETS)).observe(seconds)

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

    def copy(self) -> dict:
        """A consistent view for one scrape."""
        with self._lock:
            return {"prompts": dict(self.prompts), "failures": dict(self.failures),
                    "prompt_seconds": _frozen(self.prompt_seconds), "replacements": dict(self.replacements),
                    "stage_seconds": {s: _frozen(h) for s, h in self.stage_seconds.items()},
                    "recovery_seconds": _frozen(self.recovery_seconds)}


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
        RECORD.prompt_done(outcome, cause, seconds)
    except Exception as e:  # counting must never fail a prompt
        logging.warning(f"Metrics: could not count a prompt: {e}")


def node_done(dynprompt, node_id, seconds: float):
    """A node of a prompt ran (execution.py): its time, under its stage."""
    try:
        RECORD.node_done(stage_of(str(dynprompt.get_node(node_id).get("class_type", ""))), seconds)
    except Exception as e:
        logging.warning(f"Metrics: could not time node {node_id}: {e}")


def _group_state(state: str, why=None):
    try:
        RECORD.group_state(state, why)
    except Exception as e:
        logging.warning(f"Metrics: could not count the group's state {state}: {e}")


comfy.multinpu_members.LISTENERS.append(_group_state)


# ---- the scrape ------------------------------------------------------------------------------------------------

def group_view(runtime, now: float) -> dict:
    """The process group as the driver keeps it, read without its lock: {"world_size", "joined", "ranks": [{"rank",
    "host", "device", "age", "memory"}]} of the current members. Heartbeat and memory: each one's newest beat (the
    progress it carries, comfy.multinpu_group._heartbeat); host: the launcher's record or the worker's announcement."""
    members = dict(runtime.members)
    beats = dict(runtime._progress._beats)  # (rank, pid) -> (progress, monotonic time of the beat): the channel's
    ranks = []
    for rank, pid in sorted(members.items()):
        progress, at = beats.get((rank, pid), ({}, None))
        seen = runtime._local.info.get(rank) if runtime.spec.node_of(rank) == 0 else runtime._remote_seen.get(rank)
        ranks.append({"rank": rank, "host": str((seen or {}).get("host") or ""),
                      "device": runtime.spec.device_name(rank), "age": None if at is None else max(0.0, now - at),
                      "memory": progress.get("memory") or {}})
    joined = len(members) if runtime.state == "ready" else 0
    return {"world_size": runtime.world_size, "joined": joined, "ranks": ranks}


def local_view() -> dict:
    """Without a process group (threads, one device): the server's own devices, ranks as the threads number them."""
    from comfy import multidevice  # it imports comfy.model_management: only in the server, not in unit tests
    devices = multidevice.get_devices()
    stats = {}
    ranks = []
    for rank, device in enumerate(devices):
        if str(device) not in stats:
            stats[str(device)] = comfy.multinpu.memory_stats(device)
        ranks.append({"rank": rank, "host": HOST, "device": str(device), "age": None, "memory": stats[str(device)]})
    return {"world_size": len(devices), "joined": len(devices), "ranks": ranks}


def restarts(root) -> dict:
    """{reason: count} of the restarts h3kit watch and restart made, from the runtime root's record."""
    if not root:
        return {}
    try:
        with open(os.path.join(root, RESTARTS_FILE)) as f:
            data = json.load(f)
        return {str(k): int(v) for k, v in data.get("restarts", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def shm_free() -> int:
    try:
        st = os.statvfs(comfy.multinpu_wire.shm_dir())
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


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
        _BUILD = {"version": comfy_version, "pin": _pin(), "torch": torch.__version__, **versions, "cann": _cann()}
    return _BUILD


def _pin() -> str:
    """The commit the tree was installed at (h3kit install's state file), else ''."""
    try:
        home = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ComfyUI tree this module is in
        with open(os.path.join(home, ".h3kit", "state.json")) as f:
            return str(json.load(f).get("pin") or "")
    except (OSError, ValueError, AttributeError):
        return ""


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

class Collector:
    """A prometheus_client collector: every family built at each scrape from RECORD, the driver and the queue."""

    def __init__(self, server=None, root=None):
        self.server = server
        self.root = root if root is not None else os.environ.get(RUNTIME_ROOT_ENV)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        seen = RECORD.copy()
        prompts = CounterMetricFamily("h3kit_prompts", "Prompts the server finished, by outcome.", labels=["outcome"])
        for outcome, n in seen["prompts"].items():
            prompts.add_metric([outcome], n)
        failures = CounterMetricFamily("h3kit_prompt_failures", "Prompts that failed, by cause.", labels=["cause"])
        for cause, n in seen["failures"].items():
            failures.add_metric([cause], n)
        seconds = HistogramMetricFamily("h3kit_prompt_seconds", "A prompt's time in the prompt worker, seconds.")
        seconds.add_metric([], *seen["prompt_seconds"])
        stages = HistogramMetricFamily("h3kit_stage_seconds", "Time in the nodes of each stage of a prompt, seconds.",
                                       labels=["stage"])
        for stage, (buckets, total) in sorted(seen["stage_seconds"].items()):
            stages.add_metric([stage], buckets, total)
        replaced = CounterMetricFamily("h3kit_group_replacements", "Times the process group was replaced by fresh "
                                       "processes, by cause.", labels=["cause"])
        for cause, n in seen["replacements"].items():
            replaced.add_metric([cause], n)
        recovery = HistogramMetricFamily("h3kit_group_recovery_seconds", "From a group replacement to the new "
                                         "generation serving, seconds.")
        recovery.add_metric([], *seen["recovery_seconds"])
        pauses = HistogramMetricFamily("h3kit_gc_pause_seconds", "Passes of the server's garbage collector, each "
                                       "holding every route, seconds, by generation.", labels=["generation"])
        for generation, (buckets, total) in GC_PAUSES.copy().items():
            pauses.add_metric([str(generation)], buckets, total)
        yield from (prompts, failures, seconds, stages, replaced, recovery, pauses)
        yield from self._group(GaugeMetricFamily)
        yield from self._service(CounterMetricFamily, GaugeMetricFamily)

    def _group(self, gauge):
        runtime = comfy.multinpu_process.get_runtime()
        view = group_view(runtime, time.monotonic()) if runtime is not None else local_view()
        ranks = gauge("h3kit_group_ranks", "Ranks of the process group, joined or missing.", labels=["state"])
        ranks.add_metric(["joined"], view["joined"])
        ranks.add_metric(["missing"], view["world_size"] - view["joined"])
        age = gauge("h3kit_rank_heartbeat_age_seconds", "Seconds since each rank's newest heartbeat.",
                    labels=["rank", "host"])
        memory = gauge("h3kit_device_memory_bytes", "Device memory of each rank: its allocator's allocated, reserved "
                       "and peak bytes and the device's total (cpu: resident set and host memory).",
                       labels=["rank", "device", "kind"])
        for r in view["ranks"]:
            if r["age"] is not None:
                age.add_metric([str(r["rank"]), r["host"]], r["age"])
            for kind in ("allocated", "reserved", "peak", "total"):
                if kind in r["memory"]:
                    memory.add_metric([str(r["rank"]), r["device"], kind], r["memory"][kind])
        yield from (ranks, age, memory)

    def _service(self, counter, gauge):
        queue = getattr(self.server, "prompt_queue", None)
        pending = gauge("h3kit_queue_pending", "Prompts waiting in the queue.")
        pending.add_metric([], len(getattr(queue, "queue", ())))
        running = gauge("h3kit_queue_running", "Prompts running.")
        running.add_metric([], len(getattr(queue, "currently_running", {})))
        shm = gauge("h3kit_shm_free_bytes", "Free bytes in the /dev/shm hand-off folder (H3KIT_SHM_DIR).")
        shm.add_metric([], shm_free())
        restarted = counter("h3kit_service_restarts", "Restarts of this service by h3kit watch and h3kit restart, by "
                            "reason (the runtime root's metrics/restarts.json).", labels=["reason"])
        for reason, n in sorted({**dict.fromkeys(RESTART_REASONS, 0), **restarts(self.root)}.items()):
            restarted.add_metric([reason], n)
        info = build_info()
        build = gauge("h3kit_build_info", "1, with the versions this server runs as labels.", labels=list(info))
        build.add_metric(list(info.values()), 1)
        yield from (pending, running, shm, restarted, build)


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
