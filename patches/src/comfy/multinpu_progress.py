"""Which rank holds a command, from the progress every worker sends with its heartbeat (comfy.multinpu_group).

A rank blocked in a kernel keeps beating (a device wait releases the GIL). Every rank enters the same collectives in
the same order: one whose own beats show it short of the collective its peers wait in for the progress bound is hung;
a slow rank moves with each collective it reaches and never is: by what its device completed (comfy.multinpu_clock).
"""

from __future__ import annotations

import threading

from comfy.multinpu_clock import device_view, device_words, position
from comfy.multinpu_wire import HEARTBEAT_INTERVAL, PROGRESS_ENV

SILENT = 1.5 * HEARTBEAT_INTERVAL  # a member whose newest beat is older has gone silent: the heartbeat's to judge


def _in_command(progress: dict, g: int, n: int) -> bool:
    return progress.get("g") == g and progress.get("n") == n


def describe(progress: dict, g: int, n: int) -> str:
    """Where a rank is, from its progress, in words."""
    if not _in_command(progress, g, n):
        return (f"it has not taken command {n}" + (f" (its last was command {progress.get('n')})"
                                                   if progress.get("n") is not None else ""))
    return device_words(progress)


class ProgressWatch:
    """The members' progress as their beats bring it (beat(), from the channel's threads) and the verdict on the
    command in flight (check(), from the driver's watch)."""

    def __init__(self, bound: float):
        self.bound = bound
        self._lock = threading.Lock()
        self._beats = {}          # (rank, pid) -> (progress, monotonic time of the newest beat)
        self._since = {}          # (rank, pid) -> (position, monotonic time of the first beat that showed it)
        self._command = None      # ((g, n), monotonic time the watch first saw it in flight)
        self._frontier = None     # (collective number the peers wait in, monotonic time first seen)

    def beat(self, rank: int, pid: int, progress, now: float):
        if not isinstance(progress, dict):
            return
        where = position(progress)
        with self._lock:
            self._beats[(rank, pid)] = (progress, now)
            seen = self._since.get((rank, pid))
            if seen is None or seen[0] != where:
                self._since[(rank, pid)] = (where, now)

    def forget(self, rank: int, pid: int):
        with self._lock:
            self._beats.pop((rank, pid), None)
            self._since.pop((rank, pid), None)

    def _reports(self, members: dict, g: int, n: int, now: float):
        """{rank: (progress, newest beat, position since)} of every member, or None while one has not beaten."""
        with self._lock:
            if self._command is None or self._command[0] != (g, n):
                self._command, self._frontier = ((g, n), now), None
            out = {}
            for r, pid in members.items():
                if (r, pid) not in self._beats or (r, pid) not in self._since:
                    return None
                out[r] = (self._beats[(r, pid)][0], self._beats[(r, pid)][1], self._since[(r, pid)][1])
            return out

    def check(self, members: dict, g: int, n: int, name: str, now: float):
        """(rank, why) of the member that holds command n of generation g, (None, why) of a collective every
        member is stuck in, or None. Where a rank is: what its device completed (device_view)."""
        reports = self._reports(members, g, n, now)
        # no verdict while a member is silent (stopped, lost): the peers it holds in a collective look stuck here
        if not reports or any(now - newest > SILENT for _, newest, _ in reports.values()):
            return None
        views = {r: device_view(p) for r, (p, _, _) in reports.items()}
        # how far each device got in this command: the collective it is inside or completed last (-1: not in it)
        far = {r: max(v.get("dev_in") or 0, v.get("dev_coll") or 0) if _in_command(reports[r][0], g, n) else -1
               for r, v in views.items()}
        waiting = {r: v for r, v in views.items() if far[r] >= 0 and v.get("dev_in") is not None}
        if not waiting:
            self._frontier = None
            return None  # every device computes (or waits for one peer): slow and hung look alike from here
        top = max(v["dev_in"] for v in waiting.values())
        if self._frontier is None or self._frontier[0] != top:
            self._frontier = (top, now)
        start = max(self._command[1], self._frontier[1])
        # how long each rank's own beats have shown its device at the same place since the peers began to wait
        stuck = {r: newest - max(start, since) for r, (_, newest, since) in reports.items()}
        peers = sorted(r for r, v in waiting.items() if v["dev_in"] == top)
        at = f"collective #{top} ({waiting[peers[0]].get('dev_in_op')})"
        hung = [r for r in reports if far[r] < top and stuck[r] > self.bound]
        if hung:
            # the furthest behind holds the others: a rank inside an earlier collective waits there for it
            r = min(hung, key=lambda r: (far[r], views[r].get("dev_in") is not None, -stuck[r], r))
            p = reports[r][0]
            missed = f"; its device did not complete {at}" if "dev_steps" in p and far[r] >= 0 else ""
            return r, (f"hung: no progress for {stuck[r]:.0f} s in command {n} ({name}): {describe(p, g, n)}{missed}, "
                       f"while rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))} "
                       f"wait{'' if len(peers) > 1 else 's'} in {at} (progress bound {self.bound:g} s, {PROGRESS_ENV})")
        if all(far[r] >= top for r in reports) and all(s > self.bound for s in stuck.values()):
            return None, (f"{at} of command {n} ({name}) made no progress for {min(stuck.values()):.0f} s: every "
                          f"rank is inside it on its device (a broken link, or a collective stuck on a device; "
                          f"progress bound {self.bound:g} s, {PROGRESS_ENV})")
        return None
