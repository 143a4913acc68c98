"""Monitoring on the toolkit's side (issue 39; the server's GET /metrics is comfy/multinpu_metrics.py of the series):
the restarts `h3kit watch` and `h3kit restart` make, counted by reason in the runtime root where the server reads them
(`h3kit_service_restarts_total` on /metrics), also written as a node_exporter textfile; and what `h3kit doctor` says
about prometheus_client in ComfyUI's interpreter. docs/service.md, "Monitoring". Never imports prometheus_client.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

METRICS_DIR = "metrics"                  # under the runtime root
RESTARTS_FILE = "restarts.json"          # {"restarts": {reason: count}}: the server's /metrics reads it
TEXTFILE = "h3kit_service.prom"          # the same counts for node_exporter's textfile collector
REASONS = ("died", "unhealthy", "manual")
RUNTIME_ROOT_ENV = "H3KIT_RUNTIME_ROOT"  # set for the server by h3kit start: where its /metrics reads the counts
DEVICES_ENV = "H3KIT_DEVICES"            # set by h3kit start: its --devices list (the physical ids on /metrics)
VERSION_ENV = "H3KIT_VERSION"            # set by h3kit start: h3kit's version (h3kit_build_info)
# what the server's interpreter needs for /metrics, as toolkit/requirements/comfy-runtime-cpu.txt pins it
PROMETHEUS_CLIENT = "prometheus-client==0.26.0"


def restarts(root: Path) -> dict:
    """{reason: count} recorded under `root`; {} when none or unreadable."""
    try:
        data = json.loads((Path(root) / METRICS_DIR / RESTARTS_FILE).read_text())
        return {str(k): int(v) for k, v in data["restarts"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def count_restart(root: Path, reason: str) -> dict:
    """Count one restart of the service under `root` ("died": watch found it gone; "unhealthy": watch's health
    checks failed; "manual": h3kit restart). Never fails the restart: an unwritable root is skipped. The counts."""
    if reason not in REASONS:
        raise ValueError(f"restart reason {reason!r} is not one of {REASONS}")
    folder = Path(root) / METRICS_DIR
    try:
        folder.mkdir(mode=0o755, exist_ok=True)
        with open(folder / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # watch and restart may count at once
            counts = restarts(root)
            counts[reason] = counts.get(reason, 0) + 1
            _replace(folder / RESTARTS_FILE, json.dumps({"restarts": counts}, sort_keys=True) + "\n")
            _replace(folder / TEXTFILE, textfile(counts))
        return counts
    except OSError:
        return restarts(root)


def textfile(counts: dict, now: float | None = None) -> str:
    """The counts in Prometheus' text format, for node_exporter's --collector.textfile.directory: every reason, 0
    before its first (so that the first restart is an increase H3kitCrashLoop sees), and when the last was counted.
    node_exporter serves it while the server cannot be scraped (a crash loop)."""
    lines = ["# HELP h3kit_service_restarts_total Restarts of this service by h3kit watch and restart, by reason.",
             "# TYPE h3kit_service_restarts_total counter"]
    lines += [f'h3kit_service_restarts_total{{reason="{r}"}} {n}'
              for r, n in sorted({**dict.fromkeys(REASONS, 0), **counts}.items())]
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
