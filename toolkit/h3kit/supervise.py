"""Keep the server up: the loop behind `h3kit watch`.

Each tick reads the record, checks that its process is alive and that /system_stats answers, and looks
for new out-of-memory errors (in the log since the last tick, and in /history execution errors).

- An OOM the server survived is answered with POST /free (unload models, free memory): the cheapest
  remedy, and it keeps the queue. Nothing harsher happens unless the process then dies or stops answering.
- A dead process, or `failures` failed health checks in a row, leads to a restart with the recorded
  settings after a capped exponential backoff (backoff, 2x, 4x ... up to backoff_max). The backoff
  resets once the server has stayed healthy for `stable_after` seconds.
- More than `crash_limit` restarts within `crash_window` seconds is a crash loop: watch stops the server
  if it still runs, leaves the record for `status`, and ends with the reason and the log's first error.
- The queue survives a restart (h3kit.queuesave): every healthy tick saves GET /queue under the runtime
  root; a restart reads it once more from a server that still answers (else uses the last tick's save:
  at most one tick of new prompts is lost) and queues the pending prompts again once the new server is
  healthy. The prompt that was running is reported, and queued again only with `requeue_running`. What became of
  each saved prompt, queued again or lost, is counted for /metrics (h3kit.monitoring.count_prompts).
- `h3kit stop` removes the record, and watch ends quietly when it sees that. A restart made by someone
  else (a new pid in the record) is adopted. Watch takes the service lock only while it restarts.

Every wait is bounded by the policy; `max_seconds` bounds the whole loop (scripts and tests).
"""

from __future__ import annotations

import collections
import datetime
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from h3kit import health, locks, logscan, monitoring, queuesave, service
from h3kit.errors import H3kitError


class CrashLoop(service.ServiceError):
    code = "crash_loop"


@dataclass
class WatchPolicy:
    interval: float = 5.0
    failures: int = 3
    backoff: float = 2.0
    backoff_max: float = 60.0
    crash_limit: int = 5
    crash_window: float = 600.0
    stable_after: float = 120.0
    health_timeout: float = 5.0
    grace: float = service.DEFAULT_GRACE
    start_timeout: float = service.DEFAULT_START_TIMEOUT
    max_seconds: float | None = None
    requeue_running: bool = False   # queue the prompt that was running again after a restart
    # ComfyUI reports one OOM twice: in its log while the prompt fails, then in /history when it ends.
    # Reports this soon after a POST /free are taken as the same event.
    oom_cooldown: float = 10.0


@dataclass
class WatchOutcome:
    reason: str                    # "stopped", "time_limit" or "interrupted"
    message: str
    restarts: int = 0
    frees: int = 0
    restored: int = 0               # prompts queued again after restarts
    events: list[dict] = field(default_factory=list)


class _OomWatch:
    """New OOM reports since the last look, from the server's log and its /history."""

    def __init__(self, rec: service.Record, *, fresh: bool):
        self.log = Path(rec.log)
        self.url = rec.url
        # A fresh server is read from the start of its log; an adopted one from now on, so an OOM that
        # happened before watch started does not trigger anything.
        self.offset = 0 if fresh or not self.log.exists() else self.log.stat().st_size
        self.partial = b""
        self.scanner = logscan.ErrorScanner(merge_oom=True)
        self.answered: set[int] = set()   # log lines of the OOM blocks already reported
        self.seen: set[str] = set()
        if not fresh:
            try:
                self.seen = set(health.history_errors(self.url))
            except health.HttpError:
                pass

    def poll(self) -> str | None:
        found = None
        # the block before may have become an OOM since it was read: the "Got an OOM" line follows the
        # traceback and is merged into it
        blocks = self._new_log_blocks() + ([self.scanner.last] if self.scanner.last else [])
        for blk in blocks:
            if blk.oom and blk.line not in self.answered:
                self.answered.add(blk.line)
                found = found or f"log line {blk.line}: {blk.summary}"
        try:
            errors = health.history_errors(self.url)
        except health.HttpError:
            errors = {}
        for prompt_id, data in errors.items():
            if prompt_id in self.seen:
                continue
            self.seen.add(prompt_id)
            if health.is_oom_error(data) and found is None:
                message = str(data.get("exception_message") or "").strip().splitlines()
                found = (f"prompt {prompt_id}: {data.get('exception_type', 'error')}: "
                         f"{message[0] if message else ''}")
        return found

    def _new_log_blocks(self) -> list[logscan.ErrorBlock]:
        data, self.offset = logscan.read_since(self.log, self.offset)
        data = self.partial + data
        complete, sep, self.partial = data.rpartition(b"\n")
        if not sep:
            return []
        blocks: list[logscan.ErrorBlock] = []
        for line in complete.decode("utf-8", errors="replace").split("\n"):
            blocks.extend(self.scanner.feed(line))
        # a one-line block (the "Got an OOM" line) is complete as soon as it is read
        if self.scanner.current is not None and not self.scanner.in_traceback:
            blocks.extend(self.scanner.finish())
        return blocks


def watch(root: Path, policy: WatchPolicy, *, on_event: Callable[[dict], None] = lambda e: None,
          clock: Callable[[], float] = time.monotonic, comfy_home: str | None = None) -> WatchOutcome:
    """Run the supervision loop until the record disappears, `max_seconds` pass or Ctrl-C/SIGTERM.

    Raises NotStarted when there is no record to watch, CrashLoop when the restart limit is hit, BadRecord
    when the record is not one h3kit wrote (or, with `comfy_home`, names another tree).
    """
    rec = service.read_record(root, comfy_home)
    if rec is None:
        raise service.NotStarted(f"nothing to watch: no server record under {root}",
                                 hint="start the server with h3kit start first")
    loop = _Watch(root, policy, on_event, clock, comfy_home, rec)
    loop.emit("watching", f"pid {rec.pid} on {rec.url}, every {policy.interval:g} s")
    return loop.run()


_RECOVERING = object()  # a tick's verdict: the process group re-forms on its own, nothing to do but wait


class _Watch:
    """The state of one watch: the pid watched, failed checks in a row, the restarts in the crash window and the
    backoff streak, the OOM watch, and the outcome reported at the end."""

    def __init__(self, root: Path, policy: WatchPolicy, on_event: Callable[[dict], None],
                 clock: Callable[[], float], comfy_home: str | None, rec: service.Record):
        self.root, self.policy, self.on_event, self.clock, self.comfy_home = root, policy, on_event, clock, comfy_home
        self.outcome = WatchOutcome("interrupted", "")
        self.t_begin = clock()
        self.watched = rec.pid
        self.fails = 0
        self.restarts: collections.deque[float] = collections.deque()
        self.streak = 0                      # restarts since the server was last stable; sets the backoff
        self.healthy_since: float | None = None
        self.last_free = float("-inf")
        self.oom = _OomWatch(rec, fresh=False)
        self.group_down_since = None         # when the process group was last seen re-forming (it replaces workers)

    def emit(self, event: str, message: str, **extra) -> None:
        item = {"time": datetime.datetime.now().isoformat(timespec="seconds"), "event": event,
                "message": message, **extra}
        self.outcome.events.append(item)
        self.on_event(item)

    def time_left(self) -> float:
        return float("inf") if self.policy.max_seconds is None else self.policy.max_seconds - (self.clock() - self.t_begin)

    def pause(self, seconds: float) -> bool:
        """Sleep, but not past max_seconds; False when the time limit is reached."""
        seconds = min(seconds, max(0.0, self.time_left()))
        time.sleep(seconds)
        return self.time_left() > 0

    def run(self) -> WatchOutcome:
        try:
            while True:
                rec = self._current()
                if rec is None:
                    return self.outcome
                problem = self._problem(rec)
                if problem is _RECOVERING:
                    continue
                if problem is None:
                    self.pause(self.policy.interval)
                    continue
                self._recover(rec, problem)
        except KeyboardInterrupt:
            self.outcome.reason = "interrupted"
            self.outcome.message = "interrupted: watch ends, a running server keeps running"
            return self.outcome

    def _current(self) -> service.Record | None:
        """The record to check this tick (a new pid in it is adopted); None when watching ends (the outcome says
        why)."""
        if self.time_left() <= 0:
            self.outcome.reason = "time_limit"
            self.outcome.message = f"stopped watching after {self.policy.max_seconds:g} s"
            return None
        rec = service.read_record(self.root, self.comfy_home)
        if rec is None:
            self.outcome.reason = "stopped"
            self.outcome.message = "the server record is gone (h3kit stop ran): nothing left to watch"
            return None
        if rec.pid != self.watched:
            self.emit("adopted", f"the record now names pid {rec.pid} (restarted by another command)")
            self.watched, self.fails, self.healthy_since = rec.pid, 0, None
            self.oom = _OomWatch(rec, fresh=False)
        return rec

    def _problem(self, rec: service.Record):
        """What calls for a restart (a dead process, `failures` failed checks in a row), None when nothing does,
        _RECOVERING when the group re-forms (the pause already taken). Answers an OOM with POST /free."""
        verdict = rec.verify()
        if not verdict.alive:
            return f"the server is not running: {verdict.reason}"
        problem = self._health(rec)
        if problem is None and not rec.group.is_agent:
            self._oom(rec)
        return problem

    def _health(self, rec: service.Record):
        policy = self.policy
        # with the process transport: every rank alive and joined too (the runtime replaces a dead
        # worker itself; a group that stays broken for `failures` checks is restarted whole)
        got = service.check(rec, self.root, timeout=policy.health_timeout)
        now = self.clock()
        recovering = got.reason.startswith("group:") and "failed" not in got.reason
        if recovering and (self.group_down_since is None or now - self.group_down_since <= rec.join_timeout):
            # a worker died and is being replaced: the runtime re-forms the group on its own
            self.group_down_since = now if self.group_down_since is None else self.group_down_since
            self.emit("group_recovering", got.reason)
            self.pause(policy.interval)
            return _RECOVERING
        self.group_down_since = None if not recovering else self.group_down_since
        if got.ok:
            if not rec.group.is_agent:
                _save_queue(self.root, rec, policy)
            if self.fails:
                self.emit("recovered", f"healthy again after {self.fails} failed check(s)")
            self.fails = 0
            self.healthy_since = now if self.healthy_since is None else self.healthy_since
            if self.streak and now - self.healthy_since >= policy.stable_after:
                self.streak = 0
            return None
        self.fails += 1
        self.healthy_since = None
        self.emit("health_failed", f"check {self.fails}/{policy.failures} failed: {got.reason}")
        if self.fails >= policy.failures:
            return f"{self.fails} failed health checks in a row ({got.reason})"
        return None

    def _oom(self, rec: service.Record) -> None:
        found = self.oom.poll()
        if found and self.clock() - self.last_free < self.policy.oom_cooldown:
            self.emit("oom", f"out of memory reported again, memory was just freed: {found}")
        elif found:
            self.emit("oom", f"out of memory reported: {found}")
            try:
                health.free_memory(rec.url)
                self.last_free = self.clock()
                self.outcome.frees += 1
                self.emit("free", "asked the server to unload models and free memory (POST /free)")
            except health.HttpError as e:
                self.emit("free_failed", f"POST /free failed: {e}")

    def _recover(self, rec: service.Record, problem: str) -> None:
        """Restart after the backoff, or raise CrashLoop when the crash window is full."""
        policy, restarts = self.policy, self.restarts
        now = self.clock()
        while restarts and now - restarts[0] > policy.crash_window:
            restarts.popleft()
        if len(restarts) >= policy.crash_limit:
            raise _crash_loop(self.root, rec, problem, len(restarts), policy, self.emit)
        delay = min(policy.backoff * (2 ** self.streak), policy.backoff_max)
        self.emit("restart", f"{problem}; restarting in {delay:g} s "
                             f"({len(restarts) + 1} of {policy.crash_limit} allowed in {policy.crash_window:g} s)")
        if not self.pause(delay):
            return
        reason = "died" if problem.startswith("the server is not running") else "unhealthy"
        new = _restart_once(self.root, rec, policy, self.emit, self.outcome, reason)
        if new is None:  # the record vanished under the lock (h3kit stop ended it): no restart was made
            return
        restarts.append(self.clock())
        self.streak += 1
        self.watched, self.fails, self.healthy_since = new.pid, 0, None
        self.oom = _OomWatch(new, fresh=new.pid != rec.pid)
        self.pause(policy.interval)


def _save_queue(root: Path, rec: service.Record, policy: WatchPolicy) -> queuesave.Saved | None:
    """Refresh the queue's save from a server that answers (every healthy tick, and before a restart), so a
    crash loses at most the prompts queued within one tick. None when the server does not answer."""
    try:
        saved = queuesave.read_queue(rec.url, rec.pid, rec.create_time, timeout=policy.health_timeout)
        queuesave.save(root, saved, unless_same=True)
        return saved
    except (health.HttpError, OSError):
        return None


def _restart_once(root: Path, rec: service.Record, policy: WatchPolicy, emit, outcome: WatchOutcome, reason: str
                  ) -> service.Record | None:
    """Stop (if needed) and start again under the locks. Returns the record now in force, or None."""
    try:
        with service.service_lock(root, wait=max(service.LOCK_WAIT, policy.grace + 30), home=rec.comfy_home):
            return _restart_locked(root, rec, policy, emit, outcome, reason)
    except (locks.TreeBusy, service.LockBusy) as e:  # an install or a start holds the tree: try again later
        emit("busy", f"not restarting now: {e.message}")
        return rec


def _restart_locked(root: Path, rec: service.Record, policy: WatchPolicy, emit, outcome: WatchOutcome, reason: str
                    ) -> service.Record | None:
    cur = service.read_record(root)
    if cur is None:
        return None
    alive = cur.verify().alive
    if cur.pid != rec.pid and alive:
        emit("adopted", f"pid {cur.pid} was started meanwhile by another command")
        return cur
    # counted here, under the lock, once the restart is certain: a server that `h3kit stop` killed just before it
    # removed the record looked dead to the tick before, and is no restart
    monitoring.count_restart(root, reason)
    outcome.restarts += 1
    saved = None
    if not cur.group.is_agent:
        # a server that still answers is asked once more; else the save of the last healthy tick is used
        saved, how = (_save_queue(root, cur, policy) if alive else None), "read just now"
        if saved is None:
            saved, how = queuesave.load(root), "saved by the last healthy check; prompts queued since are lost"
        if saved is not None and not (saved.is_of(cur.pid, cur.create_time) and (saved.running or saved.pending)):
            saved = None  # another server's save, or an empty queue: nothing to restore
        if saved is not None:
            emit("queue_saved", f"{len(saved.running)} running, {len(saved.pending)} pending prompt(s) "
                                f"({how}, {saved.saved_at})")
    try:
        if alive:
            service.stop_locked(root, cur, grace=policy.grace, progress=lambda m: None, keep_record=True)
        res = service.start_keeping_queue(root, cur, timeout=policy.start_timeout, progress=lambda m: None)
    except H3kitError as e:
        emit("start_failed", f"restart failed: {e.message}")
        return service.read_record(root) or cur
    emit("started", f"pid {res.record.pid} healthy after {res.seconds:.1f} s", pid=res.record.pid)
    if saved is not None:
        blk = logscan.first_error(cur.log)
        got = queuesave.restore(root, res.record.url, saved, requeue_running=policy.requeue_running,
                                first_error=blk.summary if blk else None)
        outcome.restored += len(got.restored)
        # h3kit_prompts_lost_total / _requeued_total: what became of each prompt the save held
        monitoring.count_prompts(root, *got.fates(died=not alive))
        emit("restored", "; ".join(got.lines()), restored=got.to_dict())
    return res.record


def _crash_loop(root: Path, rec: service.Record, problem: str, count: int, policy: WatchPolicy, emit
                ) -> CrashLoop:
    stopped = ""
    with service.service_lock(root, wait=max(service.LOCK_WAIT, policy.grace + 30), home=rec.comfy_home):
        cur = service.read_record(root)
        if cur is not None and cur.verify().alive:
            # a server that keeps failing its health checks still holds the devices: release them
            service.stop_locked(root, cur, grace=policy.grace, progress=lambda m: None, keep_record=True)
            stopped = f"; stopped pid {cur.pid}"
    blk = logscan.first_error(rec.log)
    first = f"; first error in {rec.log}: {blk.summary}" + (" (out of memory)" if blk.oom else "") if blk else ""
    message = (f"crash loop: {count} restarts within {policy.crash_window:g} s and the server failed again "
               f"({problem}){stopped}{first}")
    emit("crash_loop", message)
    return CrashLoop(message, details={"restarts": count, "problem": problem,
                                       "first_error": blk.to_dict() if blk else None},
                     hint="read `h3kit logs --errors`, fix the cause, then `h3kit restart`")
