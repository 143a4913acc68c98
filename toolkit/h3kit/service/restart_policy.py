"""The service's restart policy: `restart` stops the recorded server (if still running) and starts it again with
the recorded settings, keeping its queue (h3kit.queuesave); `start_keeping_queue` hands a failed start's save on."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from h3kit import health, logscan, monitoring, queuesave
from h3kit.service.process import (StartResult, StopResult, _wait_port_or_name_holder, require_torch, start_locked,
                                   stop_locked, validated)
from h3kit.service.records import (DEFAULT_GRACE, DEFAULT_START_TIMEOUT, BadRecord, NotStarted, Progress, QueueBusy,
                                   Record, ServiceError, _noop, read_record, service_lock)


@dataclass
class RestartResult:
    previous_pid: int
    was_running: bool
    previous_error: dict | None
    queue: tuple[int, int] | None
    stop: StopResult | None
    start: StartResult
    phases: dict[str, float]
    restored: queuesave.Restored | None = None


def restart(root: Path, *, force: bool = False, requeue_running: bool = False, grace: float = DEFAULT_GRACE,
            timeout: float = DEFAULT_START_TIMEOUT, progress: Progress = _noop,
            comfy_home: str | os.PathLike | None = None) -> RestartResult:
    """Stop the recorded server (if still running) and start it again with the recorded settings, keeping
    its queue (h3kit.queuesave): the pending prompts are saved first and queued again once the new server
    is healthy.

    A running prompt makes it refuse (QueueBusy) unless `force` (the prompt is dropped, and reported) or
    `requeue_running` (it is queued again, first). Works when the server has already died: the record's
    settings are used, nothing is signalled, and the last save of that server (watch refreshes it every
    tick) is restored.
    """
    t_all = time.monotonic()
    rec = read_record(root, comfy_home)
    if rec is None:
        raise NotStarted(f"no server record under {root}", hint="start it once with h3kit start")
    spec = validated(rec.spec())  # the settings are checked as start checks them before anything is stopped
    require_torch(Path(spec.comfy_home), spec.python, spec.device_type, "ComfyUI")
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    alive = rec.verify().alive
    saved = _saved_queue(root, rec, alive, progress)
    queue = (len(saved.running), len(saved.pending)) if saved else None
    if alive and saved and saved.running and not (force or requeue_running):
        raise QueueBusy(f"prompt {saved.running[0].prompt_id} is running ({len(saved.pending)} pending prompt(s) "
                        "would be kept)", details={"running": queue[0], "pending": queue[1],
                                                   "running_ids": [i.prompt_id for i in saved.running]},
                        hint="wait for it; or --requeue-running (it runs again from the start after the restart), "
                             "or --force (it is dropped); pending prompts are queued again either way")
    blk = logscan.first_error(rec.log)
    previous_error = blk.to_dict() if blk else None
    phases["check"] = time.monotonic() - t0

    with service_lock(root, home=rec.comfy_home, progress=progress):
        saved, queue = _queue_under_lock(root, rec, alive, saved, queue, force or requeue_running, comfy_home)
        monitoring.count_restart(root, "manual")  # h3kit_service_restarts_total on the server's /metrics
        stopped, started, restored = _stop_start_restore(root, rec, alive, saved, blk, phases, grace=grace,
                                                         timeout=timeout, requeue_running=requeue_running,
                                                         progress=progress)
    phases["total"] = time.monotonic() - t_all
    return RestartResult(rec.pid, alive, previous_error, queue, stopped, started, phases, restored)


def _queue_under_lock(root: Path, rec: Record, alive: bool, saved, queue, drop_running: bool,
                      comfy_home: str | os.PathLike | None):
    """The queue read again under the locks, right before the stop (what was queued meanwhile is kept too), and
    saved before anything is stopped (a failed restart keeps it); (saved, queue). Refuses when the record changed
    meanwhile, or a prompt started running and `drop_running` is false."""
    current = read_record(root, comfy_home)
    if current is None or current.pid != rec.pid:
        raise ServiceError("the server record changed while restarting (another h3kit command ran)",
                           code="record_changed", hint="check h3kit status, then retry")
    if alive and not rec.group.is_agent:
        with contextlib.suppress(health.HttpError):
            saved = queuesave.read_queue(rec.url, rec.pid, rec.create_time)
            queue = (len(saved.running), len(saved.pending))
        if saved and saved.running and not drop_running:
            raise QueueBusy(f"prompt {saved.running[0].prompt_id} started meanwhile",
                            details={"running": queue[0], "pending": queue[1]},
                            hint="wait for it, or pass --requeue-running or --force")
    if saved and alive and (saved.running or saved.pending):
        queuesave.save(root, saved)
    return saved, queue


def _stop_start_restore(root: Path, rec: Record, alive: bool, saved, blk, phases: dict, *, grace: float,
                        timeout: float, requeue_running: bool, progress: Progress):
    """Stop `rec`'s server (when alive), wait for its port, start it again and queue the saved prompts, timing each
    phase into `phases`, and count what became of them; (StopResult or None, StartResult, Restored or None)."""
    stopped = None
    if alive:
        t0 = time.monotonic()
        stopped = stop_locked(root, rec, grace=grace, progress=progress, keep_record=True)
        phases["stop"] = time.monotonic() - t0
    t0 = time.monotonic()
    if not rec.group.is_agent:
        _wait_port_or_name_holder(rec.listen, rec.port)
    phases["port"] = time.monotonic() - t0
    t0 = time.monotonic()
    started = start_keeping_queue(root, rec, timeout=timeout, progress=progress)
    phases["start"] = time.monotonic() - t0
    restored = None
    if saved and (saved.running or saved.pending):
        t0 = time.monotonic()
        restored = queuesave.restore(root, started.record.url, saved, requeue_running=requeue_running,
                                     first_error=blk.summary if blk else None)
        phases["restore"] = time.monotonic() - t0
        # h3kit_prompts_lost_total / _requeued_total, beside the restart: what became of each prompt the save held
        monitoring.count_prompts(root, *restored.fates(died=not alive))
    return stopped, started, restored


def _saved_queue(root: Path, rec: Record, alive: bool, progress: Progress) -> queuesave.Saved | None:
    """The queue to keep across a restart of `rec`: read now from a server that answers, else the last save of
    that server (watch's, or a restart's that failed to start). An agent serves no HTTP: no queue."""
    if rec.group.is_agent:
        return None
    if alive:
        try:
            return queuesave.read_queue(rec.url, rec.pid, rec.create_time)
        except health.HttpError as e:
            progress(f"could not read the queue ({e}); restoring the last save, if any")
    saved = queuesave.load(root)
    if saved is not None and saved.is_of(rec.pid, rec.create_time):
        progress(f"the queue as saved at {saved.saved_at}: {len(saved.running)} running, "
                 f"{len(saved.pending)} pending")
        return saved
    return None


def start_keeping_queue(root: Path, rec: Record, *, timeout: float, progress: Progress) -> StartResult:
    """start_locked with `rec`'s settings; when the start fails, the save of `rec`'s server goes to the record
    the failed start left, so the next restart restores it."""
    try:
        return start_locked(root, rec.spec(), timeout=timeout, progress=progress, replacing=rec.pid)
    except BaseException:
        with contextlib.suppress(BadRecord, OSError):
            now = read_record(root)
            if now is not None and now.pid != rec.pid:
                queuesave.hand_over(root, rec.pid, rec.create_time, now.pid, now.create_time)
        raise
