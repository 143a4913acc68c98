"""The service's health: whether the recorded server answers (and, with the process transport, its group is
ready: `check`), the wait for a starting server to become healthy (`wait_healthy`), and `status`, what runs, as
`h3kit status` reports it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable

from h3kit import group, health, logscan
from h3kit import devices as h3devices
from h3kit.service.records import POLL_ENV, PROGRESS_EVERY, Progress, Record, StartFailed, latest_log, read_record

def _poll_interval() -> float:
    try:
        return max(0.01, float(os.environ.get(POLL_ENV, "0.05")))
    except ValueError:
        return 0.05

def wait_healthy(child: subprocess.Popen, rec: Record, expected: int | None, t0: float, timeout: float,
                  progress: Progress, root: Path, on_poll: Callable[[], None] = lambda: None) -> health.Health:
    interval = _poll_interval()
    next_note = t0 + PROGRESS_EVERY
    last = health.Health(False, "not polled yet")
    while True:
        rc = child.poll()
        if rc is not None:
            blk = logscan.first_error(rec.log)
            why = f": {blk.summary}" if blk else ""
            raise StartFailed(f"the server exited with code {rc} before it was healthy{why}",
                              code="server_exited", hint=f"read the log: {rec.log}")
        on_poll()
        # a refused connection returns at once; the timeout only matters for a server that is busy
        last = check(rec, root, expected, timeout=2.0)
        if last.ok:
            return last
        if last.stats is not None and not last.reason.startswith("group:"):
            # it answers but shows the wrong devices: waiting will not change that
            raise StartFailed(f"the server does not see the requested devices: {last.reason}",
                              code="device_mismatch",
                              hint=f"check that devices {h3devices.format_device_list(rec.devices)} exist and "
                                   f"are free ({h3devices.VISIBLE_ENV[rec.device_type]} was set for it)")
        if last.reason.startswith("group: the process group failed"):
            raise StartFailed(f"the {'server' if rec.node_rank == 0 else 'agent'} is up but its {last.reason[7:]}",
                              code="group_failed",
                              hint=f"read the log ({rec.log}); every host of the group runs h3kit start with the "
                                   "same --nnodes, --master-addr, --master-port and device count")
        now = time.monotonic()
        if now - t0 >= timeout:
            raise StartFailed(f"the server was not healthy after {timeout:.0f} s ({last.reason}); stopped it",
                              code="start_timeout",
                              hint=f"read the log ({rec.log}); raise --timeout if the first model load is slow")
        if now >= next_note:
            progress(f"waiting for {rec.url if rec.node_rank == 0 else 'the group'} ({now - t0:.0f} s): {last.reason}")
            next_note = now + PROGRESS_EVERY
        time.sleep(interval)


def check(rec: Record, root: Path, expected: int | None = None, timeout: float = 2.0) -> health.Health:
    """Healthy means: the server answers /system_stats (with `expected` devices when given) and, with the
    process transport, every rank of the group is alive and joined (an agent: its own ranks). A group
    problem's reason starts with "group:"."""
    if rec.group.is_agent:
        got = health.Health(True, "healthy")
    else:
        got = health.check_health(rec.url, expected, timeout=timeout)
        if not got.ok or not rec.group.is_process:
            return got
    ok, why = group.ready(group.ranks_view(root, rec.pid, rec.node_rank, rec.comfy_home), rec.node_rank)
    return got if ok else health.Health(False, f"group: {why}", got.stats)


def status(root: Path, *, timeout: float = 3.0, comfy_home: str | os.PathLike | None = None) -> dict:
    """What runs, as a JSON-ready dict; `running` is about the process, not the record file."""
    rec = read_record(root, comfy_home)
    out: dict = {"running": False, "healthy": False, "runtime_root": str(root), "record": rec is not None}
    if rec is not None:
        verdict = rec.verify()
        out.update(running=verdict.alive, pid=rec.pid, port=rec.port, listen=rec.listen, url=rec.url,
                   device_type=rec.device_type, requested_devices=rec.devices, started_at=rec.started_at,
                   python=rec.python, comfy_home=rec.comfy_home, extra_args=rec.extra_args,
                   transport=rec.transport)
        if rec.group.is_process:
            out["group"] = {**rec.group.as_dict(), **group.ranks_view(root, rec.pid, rec.node_rank, rec.comfy_home)}
        if verdict.alive:
            out["uptime_s"] = round(time.time() - rec.create_time, 1)
            got = check(rec, root, timeout=timeout)
            out["healthy"] = got.ok
            out["health"] = got.reason
            out["devices"] = got.devices
            if rec.group.is_agent:
                out["queue"] = None
                out["queue_error"] = "an agent of a multi-host group: the queue is on node 0"
                return _with_log(out, rec, root)
            try:
                running, pending = health.queue_counts(rec.url, timeout=timeout)
                out["queue"] = {"running": running, "pending": pending}
            except health.HttpError as e:
                out["queue"] = None
                out["queue_error"] = str(e)
        else:
            out["stale"] = verdict.reason
    return _with_log(out, rec, root)


def status_code(st: dict) -> int:
    """status's exit code: 0 running (and, with the process transport, its group able to run prompts), 1 not
    running, 4 running while its group cannot run prompts (failed, re-forming, a rank down)."""
    if not st["running"]:
        return 1
    if st.get("group") is not None and not group.ready(st["group"], st["group"].get("node_rank") or 0)[0]:
        return 4
    return 0


def _with_log(out: dict, rec: Record | None, root: Path) -> dict:
    log = Path(rec.log) if rec else latest_log(root)
    out["log"] = str(log.resolve()) if log.exists() else None
    blk = logscan.first_error(log) if log.exists() else None
    out["first_error"] = blk.to_dict() if blk else None
    return out
