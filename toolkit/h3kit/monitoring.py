"""Monitoring on the toolkit's side (issue 39; the server's GET /metrics is comfy/multinpu_metrics.py of the series):
the restarts `h3kit watch` and `h3kit restart` make, counted by reason in the runtime root where the server reads them
(`h3kit_service_restarts_total` on /metrics), also written as a node_exporter textfile; the prompts of the queue those
restarts saved, lost or queued again (issue 47: `h3kit_prompts_lost_total{reason}`, `h3kit_prompts_requeued_total
{state}`, in the same record and textfile); and what `h3kit doctor` says about prometheus_client in ComfyUI's
interpreter. docs/service.md, "Monitoring". Never imports prometheus_client.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

METRICS_DIR = "metrics"                  # under the runtime root
RESTARTS_FILE = "restarts.json"          # {"restarts": {reason: n}, "prompts_lost": {reason: n},
#                                          "prompts_requeued": {state: n}, "last_restart": unix time}: /metrics reads it
TEXTFILE = "h3kit_service.prom"          # the same counts for node_exporter's textfile collector
REASONS = ("died", "unhealthy", "manual")
# why a prompt of the saved queue was not queued again after a restart (queuesave.Restored.fates): "crash" it was
# running when the server died; "dropped" it was running and the restart stopped the server that still ran it
# (watch after failed health checks, `h3kit restart --force`); "refused" the new server refused its POST /prompt
LOST_REASONS = ("crash", "dropped", "refused")
REQUEUED_STATES = ("running", "pending")  # what a prompt queued again by the restore was in the saved queue
RUNTIME_ROOT_ENV = "H3KIT_RUNTIME_ROOT"  # set for the server by h3kit start: where its /metrics reads the counts
DEVICES_ENV = "H3KIT_DEVICES"            # set by h3kit start: its --devices list (the physical ids on /metrics)
VERSION_ENV = "H3KIT_VERSION"            # set by h3kit start: h3kit's version (h3kit_build_info)
# what the server's interpreter needs for /metrics, as toolkit/requirements/comfy-runtime-cpu.txt pins it
PROMETHEUS_CLIENT = "prometheus-client==0.26.0"


def restarts(root: Path) -> dict:
    """{reason: count} recorded under `root`; {} when none or unreadable."""
    return record(root)["restarts"]


def record(root: Path) -> dict:
    """The whole record under `root`: {"restarts", "prompts_lost", "prompts_requeued": {label: count}, "last_restart":
    Unix time or None}; a section that is missing or unreadable is empty (a record of before issue 47 has restarts
    only)."""
    try:
        data = json.loads((Path(root) / METRICS_DIR / RESTARTS_FILE).read_text())
    except (OSError, ValueError):
        data = {}
    out = {}
    for key in ("restarts", "prompts_lost", "prompts_requeued"):
        try:
            out[key] = {str(k): int(v) for k, v in data[key].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            out[key] = {}
    last = data.get("last_restart") if isinstance(data, dict) else None
    out["last_restart"] = float(last) if isinstance(last, (int, float)) and not isinstance(last, bool) else None
    return out


def count_restart(root: Path, reason: str) -> dict:
    """Count one restart of the service under `root` ("died": watch found it gone; "unhealthy": watch's health
    checks failed; "manual": h3kit restart). Never fails the restart: an unwritable root is skipped. The counts."""
    if reason not in REASONS:
        raise ValueError(f"restart reason {reason!r} is not one of {REASONS}")

    def add(rec):
        rec["restarts"][reason] = rec["restarts"].get(reason, 0) + 1
        rec["last_restart"] = time.time()
    return _update(root, add)["restarts"]


def count_prompts(root: Path, lost: dict, requeued: dict) -> dict:
    """Count the fates of a restored queue's prompts (queuesave.Restored.fates: {reason: n} lost, {state: n} queued
    again) under `root`, beside the restarts; like count_restart it never fails the restart. The whole record."""
    bad = set(lost) - set(LOST_REASONS) | set(requeued) - set(REQUEUED_STATES)
    if bad:
        raise ValueError(f"prompt fates {sorted(bad)} are not among {LOST_REASONS} or {REQUEUED_STATES}")

    def add(rec):
        for key, counts in (("prompts_lost", lost), ("prompts_requeued", requeued)):
            for label, n in counts.items():
                rec[key][label] = rec[key].get(label, 0) + int(n)
    return _update(root, add)


def _update(root: Path, change) -> dict:
    """Read the record, `change` it and write it and the textfile back under the metrics folder's lock (watch and
    restart may count at once); an unwritable root is skipped. The record as it now stands."""
    folder = Path(root) / METRICS_DIR
    try:
        folder.mkdir(mode=0o755, exist_ok=True)
        with open(folder / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            rec = record(root)
            change(rec)
            _replace(folder / RESTARTS_FILE, json.dumps({k: v for k, v in rec.items() if v is not None},
                                                        sort_keys=True) + "\n")
            _replace(folder / TEXTFILE, textfile(rec["restarts"], rec["last_restart"], rec))
        return rec
    except OSError:
        return record(root)


def _family(name: str, kind: str, help_: str, label: str, counts: dict, every: tuple) -> list:
    """One family's lines, every label value in `every` from 0 (so that the first count is an increase an alert
    sees: a series born at 1 is none)."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"] + \
        [f'{name}{{{label}="{v}"}} {n}' for v, n in sorted({**dict.fromkeys(every, 0), **counts}.items())]


def textfile(counts: dict, now: float | None = None, rec: dict | None = None) -> str:
    """The counts in Prometheus' text format, for node_exporter's --collector.textfile.directory: every reason, 0
    before its first (so that the first restart is an increase H3kitCrashLoop sees), when the last restart was counted
    (`now`, else this moment), and the prompts of `rec` lost and queued again. node_exporter serves it while the
    server cannot be scraped (a crash loop)."""
    rec = rec or {}
    lines = _family("h3kit_service_restarts_total", "counter", "Restarts of this service by h3kit watch and restart, "
                    "by reason.", "reason", counts, REASONS)
    lines += _family("h3kit_prompts_lost_total", "counter", "Prompts of the queue saved before a restart that the "
                     "restore did not queue again, by reason (crash, dropped, refused).", "reason",
                     rec.get("prompts_lost") or {}, LOST_REASONS)
    lines += _family("h3kit_prompts_requeued_total", "counter", "Prompts of the queue saved before a restart that the "
                     "restore queued again, by what they were (running: it runs again from the start; pending).",
                     "state", rec.get("prompts_requeued") or {}, REQUEUED_STATES)
    lines += ["# HELP h3kit_service_last_restart_timestamp_seconds When h3kit watch or restart last restarted this "
              "service, Unix time.", "# TYPE h3kit_service_last_restart_timestamp_seconds gauge",
              f"h3kit_service_last_restart_timestamp_seconds {time.time() if now is None else now:.3f}"]
    return "\n".join(lines) + "\n"


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def doctor_finding(info: dict, python: str) -> tuple:
    """(severity, message, fix) of prometheus_client in ComfyUI's interpreter, from envprobe's report."""
    version = info.get("prometheus_client")
    if version:
        return "ok", f"prometheus_client {version}: the server answers GET /metrics", None
    return ("warning", f"prometheus_client is not installed in {python}: the server runs, but GET /metrics answers "
            "503 and Prometheus sees nothing", f"{python} -m pip install {PROMETHEUS_CLIENT}, then h3kit restart")
