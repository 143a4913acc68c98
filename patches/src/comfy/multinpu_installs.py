"""The driver's installs, a mixin of comfy.multinpu_process.GroupRuntime: what every worker must hold before a
command uses it (a RemoteConfig), set up where missing and checked against the server's digest.
"""

from __future__ import annotations

import logging
import time

import comfy.multinpu_launch as launch
import comfy.multinpu_runtime_base as base
import comfy.multinpu_wire as wire
from comfy.multinpu_commands import ERROR_WAIT, _rank_exception
from comfy.multinpu_members import WAITING_LOG


class Installs:
    """Installs of what the workers hold, checked."""

    def _install(self, cfg):
        todo = [r for r in range(self.world_size) if cfg.installed.get(r) != self.members.get(r)]
        if not todo:
            return
        self._track(cfg)
        t0 = time.monotonic()
        self._execute("install", {"id": cfg.id, "program": cfg.program, "payload": cfg.payload, "ranks": todo})
        reports = self._wait_reports(f"ready/{cfg.id}", todo, wire.LOAD_TIMEOUT, f"loading {cfg.what}")
        failed = {r: rep for r, rep in reports.items() if "error" in rep}
        if failed:
            r = min(failed)
            exc = _rank_exception(self.spec, r, failed[r]["error"], f"loading {cfg.what}")
            self._abort_generation(str(exc)[:300])
            raise exc
        base.check_digests(self.spec, cfg, {r: rep["digest"] for r, rep in reports.items()})
        for r in todo:
            cfg.installed[r] = self.members[r]
        logging.info(f"MultiNPU: {cfg.what} loaded and checked on {len(todo)} worker(s) in "
                     f"{time.monotonic() - t0:.1f} s")

    def _wait_reports(self, prefix: str, ranks, timeout: float, what: str) -> dict:
        """{rank: report} of `prefix/{rank}` keys written by the current members; bounded, dead ranks named."""
        deadline = time.monotonic() + timeout
        members = dict(self.members)
        reports = {}
        said = time.monotonic()
        while True:
            if time.monotonic() - said >= WAITING_LOG:
                said = time.monotonic()
                logging.warning(f"MultiNPU: {what}: waiting for {prefix} of "
                                f"{', '.join(str(r) for r in ranks if r not in reports)} (members {members}, "
                                f"dead {self.dead}); {self._launcher_state()}")
            self._reports(prefix, {r: members.get(r) for r in ranks}, reports)
            if len(reports) == len(ranks) or any("error" in rep for rep in reports.values()):
                return reports
            self._watch()
            if self.dead or self.state != "ready" or self.members != members:
                # any member's death ends the load (the whole group is replaced: what the others loaded goes with
                # it), also one that reported its load before it died, or one the monitor's idle abort saw first
                raise self._load_failure(what, reports)
            if time.monotonic() >= deadline:
                late = [r for r in ranks if r not in reports]
                exc = wire.GroupError(f"MultiNPU: {', '.join(self.spec.describe_rank(r) for r in late)} did not "
                                       f"finish {what} within {timeout:g} s")
                self._abort_generation(str(exc)[:300])
                raise exc
            time.sleep(wire.POLL)

    def _load_failure(self, what: str, reports: dict) -> BaseException:
        """The first death of a failed load (the root cause before deaths a launcher caused after it, awaited up to
        ERROR_WAIT when only those are known yet), after which the whole generation is replaced."""
        deadline = time.monotonic() + ERROR_WAIT
        while (not self.dead or all(launch.secondary(why) for why in self.dead.values())) and \
                time.monotonic() < deadline:
            time.sleep(wire.POLL)
            self._watch()
        if self.dead:
            r = sorted(self.dead, key=lambda r: launch.secondary(self.dead[r]))[0]
            exc = wire.RankDied(f"MultiNPU: {self._where(r)} died while {what} ({self.dead[r]})")
        else:
            exc = wire.GroupError(f"MultiNPU: the process group broke while {what} ({self.error or 'aborted'})")
        self._abort_generation(str(exc)[:300])
        return exc

    def npu_count_error(self, npu_count: int):
        """None when a workflow's npu_count runs on this group (1, or its ranks), else what to change."""
        if npu_count in (1, self.world_size):
            return None
        spec = self.spec
        return (f"npu_count is {npu_count} but this ComfyUI server's process group has {self.world_size} ranks "
                f"({spec.nnodes} node(s) of {spec.local_size} {spec.device_type} device(s)). Fix: set npu_count to "
                f"{self.world_size}, or restart the service with {npu_count} devices.")
