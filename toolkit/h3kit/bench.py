"""h3kit bench: time a workflow on the running service the way a user judges it, cold then warm.

End to end is measured by this client, from POST /prompt to the execution_success event (not the server's
"Prompt executed" figure); stage times come from the server's node events on /ws; models loaded are read
from the server log written during the run (`Model cache: reading ...`, one per weight file read, which
global-model-cache.patch logs, and upstream's `Requested to load ...`, one per move onto a device); peak device memory comes from polling
/system_stats while the run lasts. The first run is cold: POST /free empties the models (and the node
cache) before it.
"""

from __future__ import annotations

import json
import secrets
import statistics
import threading
import time
from pathlib import Path

from h3kit import health, logscan, service
from h3kit.demo import run_prompt, stage_seconds
from h3kit.errors import H3kitError, UsageError

FREE_SETTLE = 3.0      # seconds for the prompt worker to act on POST /free's flags (it polls every second)
POLL_MEMORY = 0.25     # seconds between /system_stats samples during a run


class BenchError(H3kitError):
    code = "bench_failed"


def load_api_workflow(path: Path) -> dict:
    from h3kit.workflow import load

    raw = load.read_capped(str(path), load.MAX_FILE_BYTES, "workflow")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):
        data = data["prompt"]
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise UsageError(f"{path} is a UI-format workflow; bench submits API-format prompts",
                         hint="in the ComfyUI frontend use Export (API), or pass a /prompt body")
    if not isinstance(data, dict) or not data or not all(isinstance(v, dict) and "class_type" in v
                                                         for v in data.values()):
        raise UsageError(f"{path} is not an API-format workflow ({{id: {{class_type, inputs}}}})")
    for node in data.values():
        node.pop("_meta", None)
    return data


class _MemoryPoller(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.stop_event = threading.Event()
        self.peak: dict[str, int] = {}

    def run(self):
        while not self.stop_event.is_set():
            try:
                stats = health.request_json(self.url + "/system_stats", timeout=2)
                for d in stats.get("devices", []):
                    used = int(d.get("vram_total", 0)) - int(d.get("vram_free", 0))
                    name = d.get("name", "?")
                    self.peak[name] = max(self.peak.get(name, 0), used)
            except (health.HttpError, ValueError, TypeError):
                pass
            self.stop_event.wait(POLL_MEMORY)


SEED_INPUTS = ("seed", "noise_seed")
SEED_LIMIT = 1 << 64    # ComfyUI's seeds run from 0 to 0xffffffffffffffff


def new_seed_offset() -> int:
    """A fresh offset for every bench invocation: run 1 of this bench must not repeat run 1 of the last one,
    whose outputs ComfyUI's node cache still holds (that run would measure the cache: "warm 0.01 s")."""
    return secrets.randbelow(1 << 31) + 1


def vary_seed(prompt: dict, run: int, offset: int = 0) -> tuple[dict, list[str]]:
    """A copy of `prompt` whose seed inputs are moved by `offset + run`: a new generation, as a user's next
    prompt is (an identical prompt would be served whole from ComfyUI's node cache and measure nothing)."""
    out = json.loads(json.dumps(prompt))
    changed = []
    for nid, node in out.items():
        for name in SEED_INPUTS:
            value = node.get("inputs", {}).get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                node["inputs"][name] = (value + offset + run) % SEED_LIMIT
                changed.append(f"{nid}.{name}")
    return out, changed


NOTHING_EXECUTED = "no node executed: ComfyUI served the whole prompt from its cache, so this time measures nothing"


def summarize(results: list[dict]) -> dict:
    """cold and warm figures over the runs that executed something; a run that executed no node is flagged
    (its `flag`) and left out, never reported as a cold or warm time."""
    for r in results:
        if r["executed_nodes"] == 0:
            r["flag"] = NOTHING_EXECUTED
    measured = [r for r in results if "flag" not in r]
    warm = [r for r in measured if r["kind"] == "warm"]
    return {"cold_s": next((r["end_to_end_s"] for r in measured if r["kind"] == "cold"), None),
            "warm_median_s": statistics.median(r["end_to_end_s"] for r in warm) if warm else None,
            "warm_models_loaded": sum(r["models_loaded"] for r in warm) if warm else None,
            "flagged_runs": [r["run"] for r in results if "flag" in r]}


def _one_run(rec: service.Record, prompt: dict, timeout: float, log) -> dict:
    offset = Path(rec.log).stat().st_size if Path(rec.log).is_file() else 0
    poller = _MemoryPoller(rec.url)
    poller.start()
    try:
        trace, _ = run_prompt(rec, prompt, timeout, log)
    except OSError as e:
        raise BenchError(f"lost the server at {rec.url}: {e}", code="server_unreachable",
                         hint="h3kit status shows whether it still runs, and its log's first error") from None
    finally:
        poller.stop_event.set()
        poller.join(5)
    time.sleep(0.2)  # the log lines of the last node reach the file a moment after its event
    data, _ = logscan.read_since(rec.log, offset)
    lines = data.decode("utf-8", "replace").splitlines()
    return {"end_to_end_s": round(trace.finished - trace.submitted, 3),
            "stages": stage_seconds(trace),
            "models_loaded": sum("Model cache: reading" in ln for ln in lines),
            "device_loads": sum("Requested to load" in ln for ln in lines),
            "cached_nodes": len(trace.cached), "executed_nodes": len(trace.nodes),
            "peak_device_memory": poller.peak}


def set_npu_count(prompt: dict, npu_count: int) -> int:
    """Set every MultiNPUParallelConfig's npu_count; returns how many nodes were set."""
    n = 0
    for node in prompt.values():
        if node.get("class_type") == "MultiNPUParallelConfig":
            node.setdefault("inputs", {})["npu_count"] = npu_count
            n += 1
    return n


def run_bench(comfy_home: str | None, runtime_root: str | None, workflow: Path, runs: int = 3,
              switch: Path | None = None, cold: bool = True, timeout: float = 3600.0, npu_count: int | None = None,
              log=lambda m: None) -> dict:
    if runs < 1:
        raise UsageError("--runs must be at least 1")
    prompt = load_api_workflow(workflow)
    other = load_api_workflow(switch) if switch else None
    if npu_count is not None:
        for p in (prompt, other):
            if p is not None and not set_npu_count(p, npu_count):
                raise UsageError("--npu-count: the workflow has no MultiNPUParallelConfig node to set")
    root = service.pick(service.runtime_root(comfy_home, runtime_root), None, comfy_home)  # several: refused
    rec = service.read_record(root)
    if rec is None or not rec.verify().alive:
        raise BenchError(f"no running h3kit server under {root}", code="not_running",
                         hint="start one: h3kit start --comfy-home DIR --devices 0,1,2,3")
    if cold:
        health.free_memory(rec.url)
        time.sleep(FREE_SETTLE)
    results = []
    offset = new_seed_offset()
    _, seeds = vary_seed(prompt, 0)
    if not seeds:
        log("warning: the workflow has no seed input; warm runs are served from the node cache")
    for i in range(runs):
        if other is not None and i > 0:
            log(f"switch run (model switch) before run {i + 1} ...")
            row = _one_run(rec, vary_seed(other, i, offset)[0], timeout, log)
            results.append({"run": f"switch-{i}", "kind": "switch", "workflow": str(switch), **row})
        log(f"run {i + 1}/{runs} ({'cold' if i == 0 and cold else 'warm'}) ...")
        row = _one_run(rec, vary_seed(prompt, i, offset)[0], timeout, log)
        results.append({"run": i + 1, "kind": "cold" if i == 0 and cold else "warm", "workflow": str(workflow), **row})
        log(f"run {i + 1}: {row['end_to_end_s']} s, {row['models_loaded']} model file(s) read"
            + ("" if row["executed_nodes"] else f"; {NOTHING_EXECUTED}"))
    summary = summarize(results)
    return {"url": rec.url, "devices": rec.devices, "device_type": rec.device_type, "workflow": str(workflow),
            "varied_inputs": seeds, "seed_offset": offset if seeds else 0, "runs": results, "summary": summary}
