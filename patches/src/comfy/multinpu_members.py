"""The driver's membership and monitoring (GroupMonitor) and its generations (Generations), mixins of
comfy.multinpu_process.GroupRuntime. docs/multinpu.md, "Rendezvous and generations", "A failure costs one prompt".
"""

from __future__ import annotations

import collections
import logging
import time

import comfy.multinpu_launch as launch
import comfy.multinpu_wire as wire

WAITING_LOG = 10.0                   # while the group forms or loads, what it waits for is logged this often
LISTENERS = []  # fn(state, why) at each change of the group's state (_put_state): what monitoring counts; never raise


class GroupMonitor:
    """Who is alive, beating and making progress; a death or hang noted, the group replaced while idle."""

    def _monitor(self):
        # the local workers are started by this thread (PR_SET_PDEATHSIG follows the thread that forks)
        self._local.start()
        last_write = 0.0
        while not self._stop.is_set():
            try:
                self._watch()
                if self._should_form() and self._lock.acquire(blocking=False):
                    try:
                        if self._should_form():
                            self._form()
                    except wire.GroupError as e:
                        logging.error(str(e))
                    finally:
                        self._lock.release()
                now = time.monotonic()
                if self._ranks_changed or now - last_write > 10.0:
                    self._write_ranks()
                    last_write = now
            except Exception as e:  # the monitor must outlive any single bad read
                if self._stop.is_set():
                    break
                logging.exception(f"MultiNPU: monitor: {e}")
            self._stop.wait(0.1)

    def _should_form(self) -> bool:
        if self.state in ("starting", "broken"):
            return True
        # a group that could not form tries again once every rank is back (a host restarted), not in a loop
        return (self.state == "failed" and not self._local.failed and time.monotonic() - self._failed_at > 5.0
                and all(pid is not None for pid in self._announced().values()))

    def _watch(self):
        """Notice dead and hung ranks: local processes at once, the rest twice a second."""
        with self._watch_lock:
            if not self._store.alive() and not self._stop.is_set():
                self._restart_store()
            for rank, pid, reason in self._local.poll():
                self._note_death(rank, pid, reason)
            if self._local.failed and self.state != "failed":
                self._fail("; ".join(self._local.failed.values()))
            now = time.monotonic()
            if now - self._last_remote < 0.5:
                return
            self._last_remote = now
            for rank in range(self.world_size):
                self._check_heartbeat(rank, now)
                if self.spec.node_of(rank) != 0:
                    report = self._mon.peek(f"exit/{rank}")
                    if isinstance(report, dict) and report != self._remote_exits.get(rank):
                        self._remote_exits[rank] = report
                        self._note_death(rank, report.get("pid"), str(report.get("reason")))
            self._check_hosts()
            self._check_progress(now)

    def _check_heartbeat(self, rank: int, now: float):
        pid = self.members.get(rank)
        if pid is None:
            return  # not joined yet: a starting worker may take a while to import its modules
        last = self._hb.get(rank)
        if last is None or last[0] != pid:
            self._hb[rank] = (pid, 0, now)
            return
        # beats come on the worker's own authenticated channel connection (_on_link); only a newer one counts
        count = max(last[1], self._beats.get((rank, pid), last[1]))
        if count > last[1]:
            self._hb[rank] = (pid, count, now)
            return
        if now - last[2] <= wire.HEARTBEAT_STALE:
            return
        self._hb[rank] = (pid, count, now)
        self._kill_hung(rank, pid, f"no heartbeat for {now - last[2]:.0f} s (hung)")

    def _check_progress(self, now: float):
        """While a command runs: a member that holds it (beating, but not reaching the collective its peers wait in,
        past the progress bound) is killed and named; a collective every member is stuck in fails the command."""
        inflight, members = self.inflight, dict(self.members)
        if inflight is None or self.state != "ready" or not members or self.generation in self._stalled:
            return
        verdict = self._progress.check(members, self.generation, inflight[1], inflight[0], now)
        if verdict is None:
            return
        rank, why = verdict
        if rank is not None:
            self._kill_hung(rank, members[rank], why)
        else:
            logging.error(f"MultiNPU: {why}")
            self._stalled[self.generation] = why

    def _kill_hung(self, rank: int, pid, why: str):
        """A member found hung: killed (SIGKILL here, by its agent on another host) and noted dead with `why`."""
        if pid is None:
            return
        with self._watch_lock:
            if self.spec.node_of(rank) == 0:
                if self._local.pid(rank) == pid:  # never its replacement, which beats on the same key
                    self._local.kill(rank, why)
            else:
                try:
                    self._mon.put(f"kill/{rank}", {"pid": pid, "why": why})
                except Exception as e:
                    logging.warning(f"MultiNPU: could not ask node {self.spec.node_of(rank)} to kill rank {rank}: {e}")
            self._note_death(rank, pid, why)

    def _check_hosts(self):
        """Another host's members gone without an exit report: noted by their SIGTERM notes (launch.watch_termination),
        or by their agent's silence for HOST_STALE (the host is lost)."""
        for rank, pid in list(self.members.items()):
            if self.spec.node_of(rank) != 0:
                why = launch.termination_note(self._mon, rank, pid)
                if why:
                    self._note_death(rank, pid, why)
        for node in range(1, self.spec.nnodes):
            ranks = {r: pid for r, pid in self.members.items() if self.spec.node_of(r) == node}
            silent = self._agent_gone(node) if ranks else None
            if silent is not None:
                for r, pid in ranks.items():
                    self._note_death(r, pid, f"host lost: its agent has not been heard from for {silent:.0f} s")

    def _note_death(self, rank: int, pid, reason: str):
        self._ranks_changed = True
        if pid is not None and self.members.get(rank) != pid and self._aborted_members.get(rank) == pid:
            # a member of the generation just aborted (an idle abort, or one a load or command waits out), not one
            # h3kit killed to replace it: its death may be the root cause the abort's first death was an effect of
            # (a lost host's launcher takes its workers with it), so it is kept for naming the failure
            if not launch.recycled(reason):
                self.dead.setdefault(rank, f"pid {pid}: {reason}")
            return
        if pid is None or self.members.get(rank) != pid:
            return  # not a member of the current generation (a replacement, or one already given up on)
        self.dead.setdefault(rank, f"pid {pid}: {reason}")
        if self.inflight is None and self.state == "ready":
            # idle: replace the whole group now, so the next prompt finds it formed
            logging.error(f"MultiNPU: {self.spec.describe_rank(rank)} (pid {pid}) {reason} while idle")
            self._abort_generation(f"{self.spec.describe_rank(rank)} {reason}")

    def _where(self, rank: int) -> str:
        """A rank and its host, for messages."""
        host = (self._worker(rank) or {}).get("host")
        return f"{self.spec.describe_rank(rank)}" + (f", host {host}" if host else "")

    def _fail(self, message: str) -> wire.GroupError:
        """The group failed (state "failed"); the error to raise."""
        self.state = "failed"
        self.error = message
        self._failed_at = time.monotonic()
        self._ranks_changed = True
        self._put_state()
        return wire.GroupError(message)

    def _put_state(self, why: str = None):
        for listener in LISTENERS:
            listener(self.state, why)
        try:
            self._mon.put("state", {"state": self.state, "generation": self.generation, "error": self.error,
                                   "members": dict(self.members)})
        except Exception:
            pass

    def _announced(self) -> dict:
        """rank -> pid of the live, fresh worker announced for each rank (None where none is)."""
        out = {}
        for rank in range(self.world_size):
            if self.spec.node_of(rank) == 0:
                pid = self._local.pid(rank)
            else:
                info = self._worker(rank)
                exited = self._remote_exits.get(rank)
                pid = info.get("pid") if info else None
                if exited is not None and exited.get("pid") == pid:
                    pid = None
            out[rank] = None if pid is not None and self._identity(rank, pid) in self._retired else pid
        return out

    def _identity(self, rank: int, pid: int) -> tuple:
        """(pid, start time) of a rank's worker: what is retired after an abort (the OS may reuse a pid)."""
        info = self._worker(rank) or {}
        return (pid, info.get("create_time") if info.get("pid") == pid else None)

    def _worker(self, rank: int):
        """What is known of rank's worker ({"pid", "host", "create_time", ...}): this host's launcher's view, else the
        newest signed announcement of another host's worker. One gone from the store is no death (a store client can
        delete any key): the one seen last stands until a newer one replaces it, or an exit report or silence ends it."""
        if self.spec.node_of(rank) == 0:
            return self._local.info.get(rank)
        info = self._mon.peek(f"worker/{rank}")
        if isinstance(info, dict):
            self._remote_seen[rank] = info
        return self._remote_seen.get(rank)

    def _agent_gone(self, node: int):
        """Seconds since node's agent last beat, when it beat once and has been silent for HOST_STALE
        (the host or its agent is lost); else None."""
        heard = self._agent_heard.get(node)  # its newest beat (_on_link)
        silent = time.monotonic() - heard if heard is not None else 0.0
        return silent if silent > wire.HOST_STALE else None

    def ranks(self) -> list:
        out = []
        for rank in range(self.world_size):
            if self.spec.node_of(rank) == 0:
                info = dict(self._local.info[rank])
            else:
                info = {"rank": rank, "node": self.spec.node_of(rank), "local_rank": rank % self.spec.local_size,
                        "device": self.spec.device_name(rank)}
                announced = self._worker(rank) if self.ctl is not None else None
                if announced:
                    info.update({k: announced.get(k) for k in ("host", "pid", "create_time", "cmdline")})
                exited = self._remote_exits.get(rank)
                info["alive"] = bool(announced) and not (exited and exited.get("pid") == info.get("pid"))
                info["last_exit"] = exited.get("reason") if exited else None
            info["joined"] = self.state == "ready" and self.members.get(rank) == info.get("pid") is not None
            out.append(info)
        return out

    def _write_ranks(self):
        self._ranks_changed = False
        if not self.spec.runtime_root:
            return
        try:
            with self._watch_lock:
                ranks = self.ranks()
        except Exception as e:
            logging.debug(f"MultiNPU: ranks not readable now: {e}")
            return
        launch.write_ranks_file(self.spec, "driver", self.state, self.error, self.generation, ranks,
                                commands=self.commands, last_failure=self.last_failure)


class Generations:
    """Numbered generations of the group: formed with every rank (bounded by the join timeout), aborted after a failure."""

    def _missing(self, ranks) -> str:
        """Who is missing, by node where a whole node is."""
        parts, by_node = [], collections.defaultdict(list)
        for r in sorted(ranks):
            by_node[self.spec.node_of(r)].append(r)
        for node, rs in sorted(by_node.items()):
            if node != 0 and self._mon.peek(f"node/{node}") is None:
                parts.append(f"node {node} (ranks {', '.join(map(str, rs))}) never arrived: no agent connected "
                             f"to {self.spec.master_addr}:{self.port} (start it there with h3kit start "
                             f"--nnodes {self.spec.nnodes} --node-rank {node} ...)")
            else:
                parts.append(", ".join(self.spec.describe_rank(r) for r in rs) + " did not join")
        return "; ".join(parts)

    def _end_generation(self):
        """Shutdown: tell the workers of the current generation it is over (they leave)."""
        for link, _ in list(self._cmd_links.values()):
            try:
                link.send({"name": wire.END, "g": self.generation, "n": self.next_cmd}, timeout=1.0)
            except Exception:
                pass

    def _abort_generation(self, why: str):
        """Replace the whole group: the current generation's workers leave (remote ones when their heartbeat
        thread sees the abort, or are killed by their agent), this host's are SIGKILLed; all are replaced by
        fresh processes, and none of these pids is a member again."""
        g = self.generation
        self.state = "broken"
        self._ranks_changed = True
        if g in self._aborted:
            return
        self._aborted.add(g)
        members, self.members = dict(self.members), {}
        self._aborted_members = dict(members)
        links, self._cmd_links = self._cmd_links, {}
        for link, _ in links.values():
            link.close()  # a worker waiting for its next command leaves
        self._retired.update(self._identity(r, pid) for r, pid in members.items() if pid is not None)
        try:
            self.ctl.put(f"abort/{g}", {"why": why})
            for rank, pid in members.items():
                if self.spec.node_of(rank) != 0:
                    self._mon.put(f"kill/{rank}", {"pid": pid, "why": f"generation {g} aborted: {why}", "abort": True})
        except Exception as e:
            logging.warning(f"MultiNPU: could not post the abort of generation {g}: {e}")
        # this host's workers that had not joined yet are replaced too: fresh means after the failure
        self._retired.update(self._identity(r, self._local.pid(r)) for r in self._local.ranks
                             if self._local.pid(r) is not None)
        self._local.recycle(f"generation {g} aborted: {why}")
        self._put_state(why)
        logging.warning(f"MultiNPU: generation {g} aborted ({why}); every rank is replaced by a fresh process")

    def _form(self):
        """Form generation g+1 with every rank; bounded by join_timeout (wire.GroupError naming who is missing)."""
        self.state = "forming"
        self._ranks_changed = True
        self._put_state()
        deadline = time.monotonic() + self.spec.join_timeout
        while True:
            members = self._wait_members(deadline)
            g = self.generation + 1
            self.generation = g
            self.ctl.put(f"gen/{g}", {"members": members})
            self.ctl.put("gen", g)
            self._put_state()
            if not self._wait_keys("joined", g, members, deadline, "started but did not join"):
                continue  # a member died before go: the others wait for the next generation
            self.ctl.put(f"go/{g}", True)
            if (self._wait_keys("up", g, members, deadline, "joined but did not form the group")
                    and self._wait_link(g, members, deadline)):
                break
            # a member failed inside init_process_group or the warm-up: the others may be blocked there
            self.members = members
            self._abort_generation(f"generation {g} did not form")
            self.state = "forming"
        self.members = members
        self.next_cmd = 1
        self.dead = {}
        self._aborted_members = {}
        self.state = "ready"
        self.error = None
        self._ranks_changed = True
        self._put_state()
        for cfg in self.configs:
            cfg.installed = {r: pid for r, pid in cfg.installed.items() if self.members.get(r) == pid}
        logging.info(f"MultiNPU: process group generation {g} ready: {self.world_size} ranks "
                     f"(pids {', '.join(str(members[r]) for r in sorted(members))})")

    def _launcher_state(self) -> str:
        """Who runs on each host now, for the waiting log: the ranks announced."""
        try:
            return f"announced {self._announced()}"
        except Exception as e:
            return f"announced: unreadable ({e})"

    def _wait_members(self, deadline: float) -> dict:
        def attempt():
            if self._local.failed:
                raise wire.GroupError(f"MultiNPU: the process group failed: {self.error}")
            announced = self._announced()
            if all(pid is not None for pid in announced.values()):
                return announced
            for node in sorted({self.spec.node_of(r) for r, pid in announced.items() if pid is None} - {0}):
                failed = self._mon.peek(f"nodefail/{node}")
                if isinstance(failed, dict) and failed.get("message"):
                    raise self._fail(f"MultiNPU: node {node} cannot run its ranks: {failed['message']} (its agent, "
                                     f"pid {failed.get('pid')}, keeps trying; the group re-forms by itself)")
                silent = self._agent_gone(node)
                if silent is not None:
                    # fail now rather than hold the queue for the join timeout; the monitor forms the group by
                    # itself once the host's ranks are back
                    ranks = [r for r in range(self.world_size) if self.spec.node_of(r) == node]
                    raise self._fail(f"MultiNPU: node {node} (ranks {', '.join(map(str, ranks))}) is lost: its agent "
                                     f"has not been heard from for {silent:.0f} s. Fix: start it there again (h3kit "
                                     f"start --nnodes {self.spec.nnodes} --node-rank {node} ...); the group re-forms "
                                     "by itself")
            return None
        return self._poll(deadline, attempt,
                          lambda: self._missing([r for r, pid in self._announced().items() if pid is None]))

    def _wait_keys(self, what: str, g: int, members: dict, deadline: float, late: str) -> bool:
        """True once every member wrote what/{g}/{rank} with its pid; False when one died or reported an
        error meanwhile."""
        def waiting():
            return [r for r, pid in members.items() if self.ctl.peek(f"{what}/{g}/{r}") != pid]

        def attempt():
            if any(self._announced().get(r) != pid for r, pid in members.items()):
                return False
            for r in members:
                rep = self.ctl.peek(f"joinerr/{g}/{r}")
                if isinstance(rep, dict):
                    logging.error(f"MultiNPU: {self.spec.describe_rank(r)} could not join generation {g}: "
                                  f"{rep.get('type')}: {rep.get('message')}")
                    return False
            return True if not waiting() else None
        return self._poll(deadline, attempt,
                          lambda: f"{', '.join(self.spec.describe_rank(r) for r in waiting())} {late}")

    def _wait_link(self, g: int, members: dict, deadline: float) -> bool:
        """True once every member of generation g connected to the command channel (no command is sent before);
        False when a member died."""
        with self._links_lock:  # the channel's threads add connections meanwhile
            old = [self._links.pop(k) for k in list(self._links) if k[0] != g]
        for link, _ in old:  # connections of generations given up on
            link.close()

        def missing():
            with self._links_lock:
                return [r for r, pid in members.items() if (g, r, pid) not in self._links]

        def attempt():
            if any(self._announced().get(r) != pid for r, pid in members.items()):
                return False
            if missing():
                return None
            with self._links_lock:
                self._cmd_links = {r: self._links.pop((g, r, pid)) for r, pid in members.items()}
            return True

        def late():
            where = [f"{self.spec.describe_rank(r)} did not connect to the command channel "
                     + (self._channel.path if self.spec.node_of(r) == 0
                        else f"{self.spec.master_addr}:{self.port + wire.CHANNEL_PORT_OFFSET}") for r in missing()]
            return "; ".join(where)
        return self._poll(deadline, attempt, late)

    def _poll(self, deadline: float, attempt, late):
        """attempt() after each look at the ranks until it returns something other than None; past the deadline
        the group fails with late()'s words."""
        said = time.monotonic()
        while True:
            self._watch()
            result = attempt()
            if result is not None:
                return result
            if time.monotonic() - said >= WAITING_LOG:
                said = time.monotonic()
                logging.warning(f"MultiNPU: forming generation {self.generation + 1} (state {self.state}), "
                                f"{deadline - said:.0f} s left: {late()}; {self._launcher_state()}")
            if time.monotonic() >= deadline:
                raise self._fail(f"MultiNPU: the process group did not form within {self.spec.join_timeout:g} s: "
                                 f"{late()}")
            time.sleep(wire.POLL)
