"""The driver's command path (CommandPath), a mixin of comfy.multinpu_process.GroupRuntime: docs/multinpu.md, "A
failure costs one prompt"."""

from __future__ import annotations

import logging
import queue
import time

import torch

import comfy.multinpu_channel as channel
import comfy.multinpu_launch as launch
import comfy.multinpu_wire as wire

ERROR_WAIT = 3.0                     # after a failure, for the other ranks' reports and deaths to arrive
DEATH_WAIT = 0.5                     # ... once a dead rank is known


class CommandPath:
    """Sending a command, awaiting its result, naming the first cause of a failure."""

    def _ensure_ready(self, what: str):
        self._watch()
        if self.state == "failed":
            raise wire.GroupError(f"MultiNPU: the process group failed: {self.error}")
        if self.state != "ready":
            logging.info(f"MultiNPU: forming the process group before {what}")
            self._form()

    def _send_all(self, header: dict):
        """The command to every rank on its own connection, each send bounded (channel.SEND_TIMEOUT without a byte
        taken): a rank that stopped reading its commands (stopped, or hung with its heartbeat beating) is named
        and killed, and cannot hold the run lock."""
        name, n = header["name"], header["n"]
        for r, (link, _) in sorted(dict(self._cmd_links).items()):
            try:
                link.send(header)
            except channel.SendTimeout as e:
                pid = self.members.get(r)
                self._kill_hung(r, pid, f"hung: it took no byte of command {n} ({name}) for "
                                        f"{channel.SEND_TIMEOUT:g} s (it stopped reading its command connection)")
                logging.error(f"MultiNPU: could not send {name} to worker rank {r}: {e}")
            except (OSError, channel.ChannelClosed) as e:
                logging.warning(f"MultiNPU: could not send {name} to worker rank {r}: {e}")  # _await names why

    def _await(self, name: str, g: int, n: int) -> dict:
        """Worker rank 0's result header of command n, from its channel connection; the root cause of a failure,
        raised, otherwise. Waits at most 0.1 s at a time and watches every rank in between, and every rank's
        command connection: one that ends is a death about to be seen, or named here."""
        links = dict(self._cmd_links)  # empty when the generation was aborted meanwhile (an idle death)
        messages = links[0][1] if 0 in links else None
        t0 = time.monotonic()
        hint = 0
        closed = {} if messages is not None else {0: t0}  # rank -> when its command connection ended
        while True:
            if 0 in closed:
                time.sleep(0.1)
                rep = False
            else:
                try:
                    rep = messages.get(timeout=0.1)
                except queue.Empty:
                    rep = False
            if rep is None:  # rank 0's connection ended: its death is about to be seen, or it is named here
                closed[0] = time.monotonic()
            elif rep is not False:
                if isinstance(rep, dict) and rep.get("g") == g and rep.get("n") == n and rep.get("pid") == self.members.get(0):
                    return rep
                logging.warning(f"MultiNPU: dropped a message of worker rank 0 that is not the result of command {n}")
            for r, (_, q) in links.items():
                while r != 0 and r not in closed:  # the other ranks send nothing on it: only its end matters
                    try:
                        if q.get_nowait() is None:
                            closed[r] = time.monotonic()
                    except queue.Empty:
                        break
            try:
                self._watch()
                for r, at in sorted(closed.items(), key=lambda item: item[1]):
                    if time.monotonic() - at > 2.0 and not self.dead:
                        self._note_death(r, self.members.get(r), "closed the command channel")
                failed = self.dead or self.state != "ready" or g in self._stalled
                if not failed:
                    count = self.ctl.counter(f"failed/{g}")
                    # the counter only says where to look (anyone reaching the store can add to it): a failure
                    # is a signed report from a member
                    failed = count != hint and bool(self._reports(f"err/{g}/{n}", self.members))
                    hint = count
            except Exception as e:
                if not self._store_ended_now(e):
                    raise
                failed = True
            if failed:
                raise self._failure(name, g, n, t0)

    def _store_ended_now(self, e: BaseException) -> bool:
        """True when `e` is the store's process gone (its connection reset): the store is started again and the
        generation aborted (_watch), and the command in flight fails naming the store."""
        if not channel._store_gone(e):
            return False
        deadline = time.monotonic() + 5.0
        while self._store.alive() and time.monotonic() < deadline:
            time.sleep(wire.POLL)
        if self._store.alive():
            return False
        self._watch()
        return True

    def _reports(self, prefix: str, members: dict, reports: dict = None) -> dict:
        """{rank: the signed report at prefix/{rank} written by that member itself}, added to `reports`."""
        reports = {} if reports is None else reports
        for r, pid in members.items():
            rep = self.ctl.peek(f"{prefix}/{r}") if r not in reports else None
            if isinstance(rep, dict) and rep.get("pid") == pid:
                reports[r] = rep
        return reports

    def _failure(self, name: str, g: int, n: int, t0: float) -> BaseException:
        """The first error of a failed command (a rank's own exception before a death, a death before the
        collective errors it caused), after which the whole generation is replaced."""
        members = dict(self.members)
        reports = {}
        first_seen = time.monotonic()
        deadline = first_seen + ERROR_WAIT
        while True:
            self._reports(f"err/{g}/{n}", members, reports)
            self._watch()
            if any(not rep.get("collective") for rep in reports.values()) or g in self._store_ended or (
                    g in self._stalled and not self.dead):
                break  # (a stuck collective: every rank is in it, none reports)
            if any(r not in reports and not launch.secondary(self.dead[r]) for r in self.dead):
                # a death is a root cause by itself (unless its launcher caused it: then the death that made the
                # launcher act is awaited); a report explaining it is written before its exit
                deadline = min(deadline, first_seen + DEATH_WAIT)
            if time.monotonic() >= deadline:
                break
            time.sleep(wire.POLL)
        primary = {r: rep for r, rep in reports.items() if not rep.get("collective")}
        # in the order they were seen, the first death first; deaths a launcher caused after another rank's last
        dead = sorted((r for r in self.dead if r not in reports), key=lambda r: launch.secondary(self.dead[r]))
        if g in self._store_ended and not primary:
            exc = wire.GroupError(f"MultiNPU: {self._store_ended[g]} during {name}; every rank lost its connection "
                                  "to it")
        elif primary:
            r = min(primary, key=lambda r: (primary[r].get("time") or 0, r))
            exc = _rank_exception(self.spec, r, primary[r], name)
        elif dead:
            r = dead[0]
            hung = "hung: " in self.dead[r]
            exc = (wire.RankHung if hung else wire.RankDied)(
                f"MultiNPU: {self._where(r)} {'hung' if hung else 'died'} during {name} ({self.dead[r]})")
        elif g in self._stalled:
            exc = wire.GroupError(f"MultiNPU: {self._stalled[g]}; the group is replaced")
        elif reports:
            r = min(reports)
            exc = _rank_exception(self.spec, r, reports[r], name)
        else:
            exc = wire.GroupError(f"MultiNPU: the process group broke during {name} ({self.error or 'no report'})")
        self._abort_generation(str(exc).splitlines()[0][:300])
        self.last_failure = {"message": str(exc), "seconds_to_error": time.monotonic() - t0}
        logging.error(f"{exc}; the next command runs on a fresh group ({time.monotonic() - t0:.2f} s after the "
                      "command started)")
        return exc


def _rank_exception(spec: wire.GroupSpec, rank: int, report: dict, what: str) -> BaseException:
    host = f", host {report['host']}" if report.get("host") else ""
    where = f"{spec.describe_rank(rank)}{host}, pid {report.get('pid')}"
    message = f"MultiNPU: {where} failed in {what}: {report.get('type')}: {report.get('message')}"
    if report.get("oom"):
        # torch's own OOM type, so ComfyUI's handler unloads the models and the user can retry
        return torch.OutOfMemoryError(f"MultiNPU: {where} ran out of memory in {what}: {report.get('message')}")
    return wire.RankFailed(message)
