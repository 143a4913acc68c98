"""The front's loop: every tick it polls the servers, renews its leases, recovers jobs whose front died, follows
the jobs it holds, and hands queued jobs to idle servers.

- Dispatch: a server takes a job when it is up, its own queue is empty (no prompt from anyone) and no front of
  this database has a job running on it; the job's npu_count must equal the server's device count (None, from
  npu_count "auto", fits any: the front writes the server's count into the prompt). Users take turns
  (Store.claim). The prompt goes to the server under a fresh prompt id per attempt, with the front's /ws client
  id, so that the server's events for it reach the front (relay.py).
- Follow: a job the front holds is done when the server's /history has its attempt: its output files are
  copied into the front's data folder, then published under the job exactly once (Store.publish). A server
  down for `dead_after` seconds, hung (no answer) for `hang_after` seconds, or up but without the attempt in
  its queue or history (it restarted) has the job queued again (cause: server_died, server_hung,
  server_restarted), and the attempt it abandoned is deleted there once the server answers again.
- Recovery: a running job whose lease ran out (its front was killed -9 or hung) is taken over by one front
  and followed from where it is: still running on its server (adopted, not run again), finished there
  (published), or gone (queued again, cause front_lost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from h3kit.front import store as st
from h3kit.front.servers import DOWN, HUNG, UP, Pool, Server

log = logging.getLogger("h3kit.front")

OUTPUT_PREFIX = "h3front"          # subfolder prefix of the outputs the front publishes (GET /view)
CAUSES = ("new", "server_died", "server_hung", "server_restarted", "front_lost", "dispatch_failed")


@dataclass
class Timing:
    tick: float = 0.5          # seconds between loop turns
    lease: float = 30.0        # a running job's lease; another front takes it over once it ran out
    dead_after: float = 5.0    # a server refusing connections this long has its jobs moved
    hang_after: float = 60.0   # a server not answering this long has its jobs moved
    max_attempts: int = 3      # dispatches of one job before it fails


def owner_id() -> str:
    return f"{socket.gethostname()[:40]}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def prompt_for(job: st.Job, server: Server) -> dict:
    """The job's prompt as the server gets it: npu_count "auto" (None) becomes the server's device count."""
    prompt = json.loads(json.dumps(job.prompt))
    for node in prompt.values():
        if isinstance(node, dict) and node.get("class_type") == "MultiNPUParallelConfig":
            inputs = node.setdefault("inputs", {})
            if inputs.get("npu_count") in (None, "auto") and server.devices:
                inputs["npu_count"] = server.devices
    return prompt


def output_items(outputs: dict):
    """Every file entry ({filename, subfolder, type}) in a history entry's outputs."""
    for node_out in (outputs or {}).values():
        if not isinstance(node_out, dict):
            continue
        for items in node_out.values():
            for item in items if isinstance(items, list) else []:
                if isinstance(item, dict) and isinstance(item.get("filename"), str) and "type" in item:
                    yield item


def rewrite_outputs(outputs: dict, job_id: str, attempt: str) -> dict:
    """The outputs as the front shows them: every file under subfolder h3front/<job>/<attempt>[/<its own>]."""
    out = json.loads(json.dumps(outputs or {}))
    for item in output_items(out):
        sub = item.get("subfolder") or ""
        item["subfolder"] = f"{OUTPUT_PREFIX}/{job_id}/{attempt}" + (f"/{sub}" if sub else "")
    return out


def safe_rel(*parts: str) -> Path:
    rel = Path(*[p for p in parts if p])
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"unsafe path {rel}")
    return rel


def history_error(entry: dict) -> str:
    for kind, data in (entry.get("status") or {}).get("messages") or []:
        if kind == "execution_error" and isinstance(data, dict):
            return (f"node {data.get('node_id')} ({data.get('node_type')}): "
                    f"{data.get('exception_type', '')}: {str(data.get('exception_message', '')).strip()}")[:2000]
        if kind == "execution_interrupted":
            return "interrupted"
    return "the server reported an error"


class Dispatcher:
    """One front's loop over the shared queue."""

    def __init__(self, store: st.Store, pool: Pool, data_dir: Path, *, timing: Timing | None = None,
                 metrics=None, relay=None):
        self.store, self.pool, self.data_dir = store, pool, Path(data_dir)
        self.timing = timing or Timing()
        self.metrics, self.relay = metrics, relay
        self.owner = owner_id()
        self.stale: dict[str, set] = {}      # server -> attempts it no longer owns, deleted when it answers
        self.session = None
        self.inputs_dir = self.data_dir / "inputs"
        self.outputs_dir = self.data_dir / "outputs"
        self._stopping = False
        self._wake: asyncio.Event | None = None

    async def run(self, session) -> None:
        self.session = session
        self._wake = asyncio.Event()
        while not self._stopping:
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # one bad turn (the database restarting, say) must not end the front
                log.exception("front: dispatch turn failed; next turn in %.1f s", self.timing.tick)
            try:
                await asyncio.wait_for(self._wake.wait(), self.timing.tick)
            except asyncio.TimeoutError:
                pass

    def poke(self) -> None:
        """Take the next turn now (a job was accepted, a server reported a prompt's end), not at the next tick."""
        if self._wake is not None:
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self.poke()

    async def tick(self) -> None:
        await self.pool.poll(self.session)
        await asyncio.to_thread(self.store.renew, self.owner, self.timing.lease)
        for job in await asyncio.to_thread(self.store.expired):
            await self._adopt(job)
        running = await asyncio.to_thread(self.store.list, states=(st.RUNNING,))
        for job in running:
            if job.lease_owner == self.owner:
                await self.follow(job)
        await self._clean_stale()
        await self.dispatch_idle()

    async def _adopt(self, job: st.Job) -> None:
        if job.server and job.server not in self.pool.servers:
            self.pool.servers[job.server] = Server(job.server, "job")  # another front's server: poll it too
            await self.pool.poll(self.session)
        if await asyncio.to_thread(self.store.take_over, job, self.owner, self.timing.lease):
            log.info("front: took over job %s (its front's lease ran out)", job.id)
            job.lease_owner = self.owner
            if self.relay:
                self.relay.watch(job)
            await self.follow(job, adopted=True)

    # ------------------------------------------------------------------------------------------- follow

    async def follow(self, job: st.Job, adopted: bool = False) -> None:
        server = self.pool.servers.get(job.server)
        pid = job.server_prompt_id
        if server is None or not server.polled:
            return
        since = time.monotonic() - server.since
        if server.state == DOWN and (since >= self.timing.dead_after or adopted):
            return await self.requeue(job, "server_died")
        if server.state == HUNG and since >= self.timing.hang_after:
            return await self.requeue(job, "server_hung")
        if server.state != UP:
            return
        if pid in server.running_ids or pid in server.pending_ids:
            if job.cancel:
                await self._interrupt(server, pid)
            return
        entry = await self._history(server, pid)
        if entry is None:
            return  # the server stopped answering between the two reads: the next turn judges it
        if not entry:
            return await self.requeue(job, "front_lost" if adopted else "server_restarted")
        await self.finish(job, server, entry)

    async def _history(self, server: Server, pid: str) -> dict | None:
        try:
            async with self.session.get(f"{server.url}/history/{pid}") as r:
                data = await r.json(content_type=None) if r.status == 200 else None
        except Exception:
            return None
        if not isinstance(data, dict):
            return None
        return data.get(pid) or {}

    async def requeue(self, job: st.Job, cause: str) -> None:
        state = await asyncio.to_thread(self.store.requeue, job.id, self.owner, job.server_prompt_id, cause,
                                        max_attempts=self.timing.max_attempts)
        if state is None:
            return
        log.warning("front: job %s left %s (%s): now %s", job.id, job.server, cause, state)
        self.stale.setdefault(job.server, set()).add(job.server_prompt_id)
        if state == st.QUEUED and self.metrics:
            self.metrics.redispatch(cause)
        if self.relay and state != st.QUEUED:
            self.relay.front_error(job, f"job {state}: {cause}")

    async def finish(self, job: st.Job, server: Server, entry: dict) -> None:
        status = entry.get("status") or {}
        ok = status.get("status_str") == "success" or (status.get("completed") and status.get("status_str") != "error")
        attempt_dir = self.outputs_dir / job.id / job.server_prompt_id
        error = None
        try:
            if ok:
                await self._download(server, entry.get("outputs") or {}, attempt_dir)
        except Exception as e:  # the server went away while we copied: the next turn decides
            log.warning("front: copying the outputs of job %s from %s failed: %s", job.id, server.url, e)
            shutil.rmtree(attempt_dir, ignore_errors=True)
            return
        if not ok:
            error = history_error(entry)
        state = st.DONE if ok else (st.CANCELLED if job.cancel else st.FAILED)
        outputs = rewrite_outputs(entry.get("outputs") or {}, job.id, job.server_prompt_id)
        published = await asyncio.to_thread(self.store.publish, job.id, self.owner, job.server_prompt_id,
                                            state=state, outputs=outputs, status=status, error=error)
        if not published:
            shutil.rmtree(attempt_dir, ignore_errors=True)  # another front published this job
            return
        log.info("front: job %s %s on %s", job.id, state, server.url)
        if self.relay:
            self.relay.forget(job.server_prompt_id)

    async def _download(self, server: Server, outputs: dict, attempt_dir: Path) -> None:
        import aiohttp

        for item in output_items(outputs):
            if item.get("type") != "output":
                continue
            rel = safe_rel(item.get("subfolder") or "", item["filename"])
            dest = attempt_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            params = {"filename": item["filename"], "subfolder": item.get("subfolder") or "", "type": "output"}
            tmp = dest.with_name(dest.name + ".part")
            async with self.session.get(server.url + "/view", params=params,
                                        timeout=aiohttp.ClientTimeout(total=600)) as r:
                if r.status != 200:
                    raise OSError(f"/view answered {r.status} for {rel}")
                with open(tmp, "wb") as f:
                    async for chunk in r.content.iter_chunked(1 << 20):
                        f.write(chunk)
            os.replace(tmp, dest)

    async def _interrupt(self, server: Server, pid: str) -> None:
        for path, body in (("/interrupt", {"prompt_id": pid}), ("/queue", {"delete": [pid]})):
            try:
                async with self.session.post(server.url + path, json=body) as r:
                    await r.read()
            except Exception:
                pass

    async def _clean_stale(self) -> None:
        for url, pids in list(self.stale.items()):
            server = self.pool.servers.get(url)
            if server is None or server.state != UP:
                continue
            for pid in list(pids):
                if pid in server.running_ids or pid in server.pending_ids:
                    await self._interrupt(server, pid)
            del self.stale[url]

    # ----------------------------------------------------------------------------------------- dispatch

    async def dispatch_idle(self) -> None:
        busy = await asyncio.to_thread(self.store.busy_servers)
        for server in self.pool.servers.values():
            if server.state != UP or not server.fresh or server.queue or busy.get(server.url) or \
                    server.url in self.stale:
                continue
            job = await asyncio.to_thread(self.store.claim, server=server.url, devices=server.devices,
                                          owner=self.owner, lease=self.timing.lease)
            if job is not None:
                server.queue += 1  # until the next poll reads it from the server
                await self.submit(job, server)

    async def submit(self, job: st.Job, server: Server) -> None:
        import aiohttp

        prompt = prompt_for(job, server)
        body = {"prompt": prompt, "prompt_id": job.server_prompt_id,
                "client_id": self.relay.client_id if self.relay else "h3front",
                "extra_data": job.extra.get("extra_data") or {}}
        if self.relay:
            self.relay.watch(job)
        try:
            await self._upload_inputs(server, prompt)
            if not await asyncio.to_thread(self.store.holds, job.id, self.owner, job.server_prompt_id):
                return
            async with self.session.post(server.url + "/prompt", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timing.lease / 3)) as r:
                answer = await r.json(content_type=None)
                status = r.status
        except Exception as e:
            log.warning("front: dispatching job %s to %s failed: %s", job.id, server.url, e)
            return await self.requeue(job, "dispatch_failed")
        if status != 200:
            return await self._refused(job, answer)
        if self.metrics:
            self.metrics.dispatched(job)
        log.info("front: job %s (user %s) -> %s (%s)", job.id, job.user, server.url, job.cause or "new")

    async def _refused(self, job: st.Job, answer) -> None:
        """The server refused the prompt (HTTP 400: invalid): the job fails, with ComfyUI's own message."""
        error = answer.get("error") if isinstance(answer, dict) else None
        message = (error or {}).get("message") if isinstance(error, dict) else str(answer)[:500]
        details = json.dumps(answer.get("node_errors") if isinstance(answer, dict) else None)[:4000]
        text = f"the server refused the prompt: {message}; node errors: {details}"
        if await asyncio.to_thread(self.store.publish, job.id, self.owner, job.server_prompt_id, state=st.FAILED,
                                   outputs=None, status={"status_str": "error", "completed": False,
                                                         "messages": []}, error=text):
            if self.relay:
                self.relay.front_error(job, text)

    async def _upload_inputs(self, server: Server, prompt: dict) -> None:
        """Files the client uploaded to the front (POST /upload/image) that the prompt names go to the server
        that runs it first."""
        import aiohttp

        for name, path in named_uploads(prompt, self.inputs_dir):
            sub, _, fname = name.rpartition("/")
            form = aiohttp.FormData()
            form.add_field("image", path.read_bytes(), filename=fname)
            form.add_field("subfolder", sub)
            form.add_field("overwrite", "true")
            async with self.session.post(server.url + "/upload/image", data=form) as r:
                if r.status != 200:
                    raise OSError(f"uploading {name} answered {r.status}")


def named_uploads(prompt: dict, inputs_dir: Path) -> list[tuple[str, Path]]:
    """(name, file) of every upload in the front's inputs folder that a string input of the prompt names; a name
    that leaves the folder (absolute, "..") names nothing: a prompt must not send the front's own files."""
    out = []
    for name in _string_inputs(prompt):
        try:
            rel = safe_rel(name)
        except ValueError:
            continue
        path = inputs_dir / rel
        if name and path.is_file() and not path.is_symlink() and (name, path) not in out:
            out.append((name, path))
    return out


def _string_inputs(prompt: dict):
    for node in prompt.values():
        for v in (node.get("inputs") or {}).values() if isinstance(node, dict) else ():
            if isinstance(v, str) and len(v) < 512:
                yield v.removesuffix(" [input]")
