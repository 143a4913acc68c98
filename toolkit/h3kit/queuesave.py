"""Save ComfyUI's queue before a restart and submit it again to the new server.

A restart throws away ComfyUI's in-memory queue. `h3kit restart` and `h3kit watch` therefore read
`GET /queue` first and keep what it holds in `<runtime-root>/queue.json`; once the new server is healthy,
the pending prompts are posted again (`POST /prompt`) in their old order, with their prompt ids, client ids
and extra data, so a client waiting on its websocket (it reconnects with the same client id) sees them run.
The prompt that was running is only reported (its id, and the old log's first error), and re-queued first
when the caller asks for it (`--requeue-running`): it may be the prompt that killed the server.

`watch` refreshes the save on every healthy tick, so after a crash (no server left to ask) it restores the
last tick's save: prompts queued within the last tick are lost, and one that finished within it runs again.

What `GET /queue` does not show cannot be restored: ComfyUI keeps the sensitive extra data of a prompt
(`auth_token_comfy_org`, `api_key_comfy_org`) out of it, so a prompt that used a partner node's key fails
again after the restore until its client submits it with the key.

A planned stop (`h3kit stop --keep-queue`, which the systemd units run) keeps the queue in `queue.kept.json`; the
next `h3kit start` of that server queues it again, the running prompt first (h3kit.service.process).

After a restore the save becomes `queue.restored.json`, with each prompt's outcome, so a second restart
does not submit the same prompts twice and a prompt the new server refused can still be read and resent.

Counted (issue 47; `Restored.fates`, h3kit.monitoring): after a restart by watch or `h3kit restart`, each prompt of
the save is either queued again (`h3kit_prompts_requeued_total{state}`: posted by the restore, or already in the new
server's queue) or lost (`h3kit_prompts_lost_total{reason}`: the running prompt not queued again, "crash" when the
server had died and "dropped" when the restart stopped it; a prompt the new server refused, "refused"). What no save
held cannot be counted: prompts queued after the last save (at most one watch tick) that never finished, any queue
of a crash with no watch running and no save, and the queue of an agent (it serves no HTTP). A prompt that finished
after the last save and before the crash is taken as the save shows it: queued again and counted requeued though it
ran, or, when it was the running one and not queued again, counted lost though it finished (the new server has no
history of the old one to tell).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from h3kit import health

SAVE_NAME = "queue.json"
RESTORED_NAME = "queue.restored.json"
KEPT_NAME = "queue.kept.json"   # `h3kit stop --keep-queue`: the next `h3kit start` of that server queues it again
MAX_SAVE = 256 << 20          # a queue of a few hundred large workflows; anything larger is not ours
# ComfyUI adds these to extra_data itself when a prompt is posted; sending them back would be refused or
# duplicated
_SERVER_KEYS = ("client_id", "create_time")


@dataclass
class Item:
    """One queue entry: ComfyUI's (number, prompt_id, prompt, extra_data, outputs_to_execute)."""
    number: float
    prompt_id: str
    prompt: dict
    extra_data: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)

    @property
    def client_id(self) -> str | None:
        cid = self.extra_data.get("client_id")
        return cid if isinstance(cid, str) else None

    def to_dict(self) -> dict:
        return {"number": self.number, "prompt_id": self.prompt_id, "prompt": self.prompt,
                "extra_data": self.extra_data, "outputs": self.outputs}

    def body(self) -> dict:
        """The POST /prompt body that queues this prompt again, as it was."""
        out = {"prompt": self.prompt, "prompt_id": self.prompt_id,
               "extra_data": {k: v for k, v in self.extra_data.items() if k not in _SERVER_KEYS}}
        if self.client_id:
            out["client_id"] = self.client_id
        if self.outputs:
            out["partial_execution_targets"] = [str(o) for o in self.outputs]
        return out


def _item(raw) -> Item | None:
    """A queue entry from GET /queue (a list) or from a save (a dict); None when it is not one."""
    if isinstance(raw, dict):
        raw = [raw.get("number"), raw.get("prompt_id"), raw.get("prompt"), raw.get("extra_data"), raw.get("outputs")]
    if not isinstance(raw, (list, tuple)) or len(raw) < 3:
        return None
    number, prompt_id, prompt = raw[0], raw[1], raw[2]
    extra = raw[3] if len(raw) > 3 and isinstance(raw[3], dict) else {}
    outputs = raw[4] if len(raw) > 4 and isinstance(raw[4], list) else []
    if not isinstance(prompt_id, str) or not isinstance(prompt, dict):
        return None
    if type(number) not in (int, float):
        number = 0
    return Item(number, prompt_id, prompt, extra, outputs)


@dataclass
class Saved:
    """What a save holds: the server it was read from, when, and its running and pending prompts."""
    pid: int
    create_time: float
    url: str
    saved_at: str
    running: list[Item]
    pending: list[Item]

    def to_dict(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time, "url": self.url, "saved_at": self.saved_at,
                "running": [i.to_dict() for i in self.running], "pending": [i.to_dict() for i in self.pending]}

    def summary(self) -> dict:
        return {"saved_at": self.saved_at, "running": [i.prompt_id for i in self.running],
                "pending": [i.prompt_id for i in self.pending]}

    def is_of(self, pid: int, create_time: float) -> bool:
        return self.pid == pid and abs(self.create_time - create_time) < 1e-3


def read_queue(url: str, pid: int, create_time: float, timeout: float = 5.0) -> Saved:
    """GET /queue as a Saved, pending prompts in the order the server runs them. Raises HttpError."""
    q = health.request_json(f"{url}/queue", timeout=timeout)
    if not isinstance(q, dict):
        raise health.HttpError(f"GET {url}/queue: unexpected answer")

    def items(key):
        return [i for i in map(_item, q.get(key) or []) if i is not None]

    pending = sorted(items("queue_pending"), key=lambda i: i.number)
    return Saved(pid, create_time, url, _now(), items("queue_running"), pending)


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def save(root: Path, saved: Saved, *, unless_same: bool = False, name: str = SAVE_NAME) -> Path:
    """Write the save atomically, readable by its owner only (prompts are the users' work). With
    `unless_same` (watch, every few seconds) a save that already holds the same server and prompt ids is
    left as it is: a queue of large workflows is not rewritten every tick, and its saved_at stays the time
    the queue was last seen to change."""
    path = root / name
    if unless_same and path.is_file():
        now = load(root, name)
        if now is not None and now.is_of(saved.pid, saved.create_time) and now.summary() | {"saved_at": 0} == \
                saved.summary() | {"saved_at": 0}:
            return path
    tmp = path.with_name(f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(saved.to_dict(), f)
        f.write("\n")
    os.replace(tmp, path)
    return path


def load(root: Path, name: str = SAVE_NAME) -> Saved | None:
    """The save under `root`, or None when there is none or it is not one h3kit wrote (then it is left
    alone for the operator to read; a restart never posts what it cannot vouch for)."""
    path = root / name
    try:
        if not path.is_file() or path.stat().st_size > MAX_SAVE:
            return None
        data = json.loads(path.read_text())
        running = [_item(i) for i in data["running"]]
        pending = [_item(i) for i in data["pending"]]
        if None in running or None in pending:
            return None
        return Saved(int(data["pid"]), float(data["create_time"]), str(data["url"]), str(data["saved_at"]),
                     running, pending)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def discard(root: Path, name: str = SAVE_NAME) -> None:
    with contextlib.suppress(FileNotFoundError):
        (root / name).unlink()


@dataclass
class Restored:
    """The outcome of a restore, JSON-ready through to_dict."""
    saved_at: str
    restored: list[str] = field(default_factory=list)               # prompt ids queued again, in order
    renamed: dict[str, str] = field(default_factory=dict)           # old id -> the id the server gave
    failed: list[dict] = field(default_factory=list)                # {"prompt_id", "error"}
    running: list[str] = field(default_factory=list)                # what ran when the server went down
    requeued_running: bool = False
    running_error: str | None = None                                # the previous log's first error
    present: list[str] = field(default_factory=list)                # already in the new server's queue: not posted

    def to_dict(self) -> dict:
        return {"saved_at": self.saved_at, "restored": self.restored, "renamed": self.renamed,
                "failed": self.failed, "running": self.running, "requeued_running": self.requeued_running,
                "running_error": self.running_error, "present": self.present}

    def fates(self, *, died: bool) -> tuple[dict, dict]:
        """({reason: n} lost, {state: n} queued again) of the saved prompts (h3kit.monitoring.LOST_REASONS and
        REQUEUED_STATES): queued again when the restore posted it or the new server already held it; the running
        prompt not asked for is lost, "crash" when the server had `died`, else "dropped" (the restart stopped it);
        a prompt the new server refused is lost, "refused". Only what the save held: docstring of the module."""
        back = set(self.restored) | set(self.present)
        refused = {f["prompt_id"] for f in self.failed}
        lost, requeued = {}, {}

        def add(counts, key):
            counts[key] = counts.get(key, 0) + 1
        for pid in self.running:
            if pid in back:
                add(requeued, "running")
            elif pid in refused:
                add(lost, "refused")
            else:
                add(lost, "crash" if died else "dropped")
        for pid in (back | refused) - set(self.running):
            if pid in back:
                add(requeued, "pending")
            else:
                add(lost, "refused")
        return lost, requeued

    def lines(self) -> list[str]:
        out = []
        for pid in self.running:
            what = "queued again first (--requeue-running)" if self.requeued_running else \
                "not queued again (--requeue-running would)"
            out.append(f"running when the server went down: prompt {pid}"
                       + (f" (first error: {self.running_error})" if self.running_error else "") + f"; {what}")
        n = len(self.restored) - (len(self.running) if self.requeued_running else 0)
        out.append(f"queue restored from the save of {self.saved_at}: {n} pending prompt(s) queued again"
                   + (f" ({', '.join(self.restored)})" if self.restored else ""))
        for old, new in self.renamed.items():
            out.append(f"  prompt {old} is now {new} (this server does not take client prompt ids)")
        for f in self.failed:
            out.append(f"  NOT restored: prompt {f['prompt_id']}: {f['error']} (the prompt is kept in {RESTORED_NAME})")
        return out


def restore(root: Path, url: str, saved: Saved, *, requeue_running: bool = False, first_error: str | None = None,
            timeout: float = 30.0, name: str = SAVE_NAME) -> Restored:
    """Post the saved prompts to the server at `url` in order (the running one first, when asked), skip any
    the server already holds, then keep the save, with the outcome, as queue.restored.json."""
    out = Restored(saved.saved_at, running=[i.prompt_id for i in saved.running], requeued_running=requeue_running,
                   running_error=first_error if saved.running else None)
    items = (saved.running if requeue_running else []) + saved.pending
    try:
        now = read_queue(url, 0, 0.0, timeout=timeout)
        present = {i.prompt_id for i in now.running + now.pending}
    except health.HttpError:
        present = set()
    for item in items:
        if item.prompt_id in present:  # queued again already (by a client that resubmitted it)
            out.present.append(item.prompt_id)
            continue
        try:
            got = health.request_json(f"{url}/prompt", method="POST", body=item.body(), timeout=timeout)
        except health.HttpError as e:
            why = e.body.get("error") if isinstance(e.body, dict) else None
            why = why.get("message") if isinstance(why, dict) else why
            out.failed.append({"prompt_id": item.prompt_id, "error": f"{e}" + (f": {why}" if why else "")})
            continue
        new_id = got.get("prompt_id") if isinstance(got, dict) else None
        out.restored.append(item.prompt_id)
        if isinstance(new_id, str) and new_id != item.prompt_id:
            out.renamed[item.prompt_id] = new_id
    path = root / RESTORED_NAME
    tmp = path.with_name(f".{RESTORED_NAME}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({**saved.to_dict(), "outcome": out.to_dict()}, f)
        f.write("\n")
    os.replace(tmp, path)
    discard(root, name)
    return out


def hand_over(root: Path, old_pid: int, old_create_time: float, new_pid: int, new_create_time: float) -> None:
    """A restart whose start failed leaves a record naming the new (dead) process: the save of the server
    it replaced moves to that record, so the next restart still restores it."""
    saved = load(root)
    if saved is not None and saved.is_of(old_pid, old_create_time):
        saved.pid, saved.create_time = new_pid, new_create_time
        save(root, saved)
