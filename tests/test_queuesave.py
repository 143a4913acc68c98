"""h3kit.queuesave without a server: what a save holds, what a restore posts, and a save that is not h3kit's.

Expected orders are written out by hand (never computed with the sort under test); the server is a stand-in
for health.request_json that answers GET /queue as ComfyUI does (its heap, not sorted) and records each POST.
"""

from __future__ import annotations

import json
import os

import pytest

from h3kit import health, queuesave

ITEM = [3, "5e2f5a36-5d54-4a4c-9a8e-7d7a2c5f0b11", {"1": {"class_type": "X", "inputs": {}}},
        {"client_id": "browser-1", "create_time": 1764583000000, "extra_pnginfo": {"workflow": {}}}, ["1"]]


def entry(number, prompt_id):
    return [number, prompt_id, {"1": {"class_type": "X", "inputs": {"n": prompt_id}}}, {}, []]


class Server:
    """health.request_json for one fake ComfyUI: GET /queue answers `queue`; POST /prompt records the body and
    answers `answers.get(prompt_id)` (an HttpError to raise, or the answer; default: the same prompt id)."""

    def __init__(self, monkeypatch, queue=None, answers=None):
        self.queue = queue if queue is not None else {"queue_running": [], "queue_pending": []}
        self.answers = answers or {}
        self.posted = []
        monkeypatch.setattr(health, "request_json", self)

    def __call__(self, url, *, method="GET", body=None, timeout=3.0):
        if method == "GET":
            assert url.endswith("/queue"), url
            if isinstance(self.queue, Exception):
                raise self.queue
            return self.queue
        assert method == "POST" and url.endswith("/prompt"), (method, url)
        self.posted.append(body)
        got = self.answers.get(body["prompt_id"], {"prompt_id": body["prompt_id"], "number": len(self.posted)})
        if isinstance(got, Exception):
            raise got
        return got


def save_of(running, pending, saved_at="2026-12-01T10:00:00+00:00", pid=4242, create_time=1.5):
    items = lambda raw: [queuesave._item(i) for i in raw]  # noqa: E731
    return queuesave.Saved(pid, create_time, "http://127.0.0.1:1", saved_at, items(running), items(pending))


def test_the_body_queues_the_prompt_again_as_it_was():
    item = queuesave._item(ITEM)
    assert item.body() == {"prompt": ITEM[2], "prompt_id": ITEM[1], "client_id": "browser-1",
                           "extra_data": {"extra_pnginfo": {"workflow": {}}}, "partial_execution_targets": ["1"]}
    assert queuesave._item([1, None, {}]) is None and queuesave._item("junk") is None
    # a saved entry (a dict) reads back the same; a number that is not one becomes 0
    assert queuesave._item(item.to_dict()) == item
    assert queuesave._item(["7", "p", {}]).number == 0 and queuesave._item([2.5, "p", {}]).number == 2.5
    bare = queuesave._item([1, "p", {}, "not a dict", "not a list"])
    assert bare.extra_data == {} and bare.outputs == [] and bare.client_id is None
    assert bare.body() == {"prompt": {}, "prompt_id": "p", "extra_data": {}}


def test_the_pending_queue_is_read_in_the_order_the_server_runs_it_not_its_heap_order(monkeypatch):
    """ComfyUI's GET /queue lists its heap as it lies in memory; a prompt queued to the front has a negative
    number. The save holds them in the order they will run: lowest number first."""
    heap = [entry(-2, "front"), entry(4, "d"), entry(1, "a"), entry(9, "e"), entry(5, "c2"), entry(3, "b")]
    Server(monkeypatch, {"queue_running": [entry(0, "run")], "queue_pending": heap + ["junk", [1, None, {}]]})
    saved = queuesave.read_queue("http://127.0.0.1:1", 4242, 1.5)
    assert [i.prompt_id for i in saved.pending] == ["front", "a", "b", "d", "c2", "e"]
    assert [i.prompt_id for i in saved.running] == ["run"]
    assert saved.pid == 4242 and saved.create_time == 1.5 and saved.url == "http://127.0.0.1:1"


def test_a_queue_answer_that_is_not_a_queue_is_an_http_error(monkeypatch):
    Server(monkeypatch, ["not", "a", "dict"])
    with pytest.raises(health.HttpError, match="unexpected answer"):
        queuesave.read_queue("http://127.0.0.1:1", 1, 1.0)


def test_a_save_is_private_round_trips_and_is_not_rewritten_when_unchanged(tmp_path):
    saved = save_of([], [ITEM, [5, "p2", {"1": {}}, {}, []]])
    path = queuesave.save(tmp_path, saved)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    back = queuesave.load(tmp_path)
    assert back.to_dict() == saved.to_dict()
    assert back.is_of(4242, 1.5) and back.is_of(4242, 1.5 + 1e-4)
    assert not back.is_of(4242, 2.0) and not back.is_of(4243, 1.5)
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before - 10**9, before - 10**9))
    again = save_of([], [ITEM, [5, "p2", {"1": {}}, {}, []]], saved_at="2026-12-01T10:00:05+00:00")
    queuesave.save(tmp_path, again, unless_same=True)
    assert path.stat().st_mtime_ns == before - 10**9  # same prompts: left as it was
    assert json.loads(path.read_text())["saved_at"] == "2026-12-01T10:00:00+00:00"
    again.pending = again.pending[:1]
    queuesave.save(tmp_path, again, unless_same=True)
    assert [i["prompt_id"] for i in json.loads(path.read_text())["pending"]] == [ITEM[1]]


def test_a_save_is_rewritten_when_a_prompt_finished_and_another_came_between_two_ticks(tmp_path):
    """Same number of prompts, other prompts: `watch`'s next tick must write them, or a crash after it loses
    the new prompt and runs the finished one again."""
    queuesave.save(tmp_path, save_of([entry(1, "a")], [entry(2, "b"), entry(3, "c")]), unless_same=True)
    queuesave.save(tmp_path, save_of([entry(2, "b")], [entry(3, "c"), entry(4, "d")],
                                     saved_at="2026-12-01T10:00:05+00:00"), unless_same=True)
    now = queuesave.load(tmp_path)
    assert [i.prompt_id for i in now.running] == ["b"] and [i.prompt_id for i in now.pending] == ["c", "d"]
    assert now.saved_at == "2026-12-01T10:00:05+00:00"
    # only the running prompt changed (it finished, the next one has not started): rewritten too
    queuesave.save(tmp_path, save_of([], [entry(3, "c"), entry(4, "d")], saved_at="t3"), unless_same=True)
    assert queuesave.load(tmp_path).running == []
    # the same prompts in another order (one moved to the front): rewritten
    queuesave.save(tmp_path, save_of([], [entry(-1, "d"), entry(3, "c")], saved_at="t4"), unless_same=True)
    assert [i.prompt_id for i in queuesave.load(tmp_path).pending] == ["d", "c"]
    # the same prompts of another server (a restart between two ticks): rewritten for the new one
    queuesave.save(tmp_path, save_of([], [entry(-1, "d"), entry(3, "c")], saved_at="t5", pid=99), unless_same=True)
    assert queuesave.load(tmp_path).pid == 99


def test_a_save_h3kit_did_not_write_is_never_restored(tmp_path):
    assert queuesave.load(tmp_path) is None
    for text in ("not json", json.dumps({"pid": 1}), json.dumps({"pid": 1, "create_time": 1, "url": "u",
                                                                  "saved_at": "t", "running": [], "pending": [5]}),
                 json.dumps({"pid": 1, "create_time": 1, "url": "u", "saved_at": "t", "running": [7],
                             "pending": []})):
        (tmp_path / queuesave.SAVE_NAME).write_text(text)
        assert queuesave.load(tmp_path) is None
    (tmp_path / queuesave.SAVE_NAME).write_text(json.dumps(save_of([], [entry(1, "a")]).to_dict()))
    assert queuesave.load(tmp_path) is not None
    (tmp_path / queuesave.SAVE_NAME).write_text(" " * (queuesave.MAX_SAVE + 1))
    assert queuesave.load(tmp_path) is None  # larger than any save h3kit writes: not read at all


def test_a_restore_posts_the_pending_prompts_in_the_saved_order_and_keeps_the_outcome(tmp_path, monkeypatch):
    saved = save_of([entry(0, "run")], [entry(1, "a"), entry(2, "held"), entry(3, "bad"), entry(4, "renamed"),
                                        entry(5, "z")])
    queuesave.save(tmp_path, saved)
    refused = health.HttpError("POST /prompt: HTTP 400", status=400,
                               body={"error": {"message": "Prompt outputs failed validation"}})
    server = Server(monkeypatch, {"queue_running": [], "queue_pending": [entry(1, "held")]},
                    {"bad": refused, "renamed": {"prompt_id": "fresh"}})
    out = queuesave.restore(tmp_path, "http://127.0.0.1:2", saved)
    assert [b["prompt_id"] for b in server.posted] == ["a", "bad", "renamed", "z"]  # "held": already there
    assert out.restored == ["a", "renamed", "z"] and out.renamed == {"renamed": "fresh"}
    assert out.failed == [{"prompt_id": "bad", "error": "POST /prompt: HTTP 400: Prompt outputs failed validation"}]
    assert out.running == ["run"] and not out.requeued_running and out.running_error is None
    assert not (tmp_path / queuesave.SAVE_NAME).exists()  # a second restart does not post them again
    kept = json.loads((tmp_path / queuesave.RESTORED_NAME).read_text())
    assert kept["outcome"] == out.to_dict() and [i["prompt_id"] for i in kept["pending"]] == \
        ["a", "held", "bad", "renamed", "z"]
    assert oct((tmp_path / queuesave.RESTORED_NAME).stat().st_mode & 0o777) == "0o600"
    lines = out.lines()
    assert lines[0] == "running when the server went down: prompt run; not queued again (--requeue-running would)"
    assert lines[1].endswith(": 3 pending prompt(s) queued again (a, renamed, z)"), lines
    assert "  prompt renamed is now fresh (this server does not take client prompt ids)" in lines
    assert any(line.startswith("  NOT restored: prompt bad: POST /prompt: HTTP 400") for line in lines), lines
    # what /metrics counts (issue 47): "held" the new server already had is back too; "run" is lost, "bad" refused
    assert out.present == ["held"]
    assert out.fates(died=True) == ({"crash": 1, "refused": 1}, {"pending": 4})
    assert out.fates(died=False) == ({"dropped": 1, "refused": 1}, {"pending": 4})


def test_a_restore_with_requeue_running_posts_the_running_prompt_first(tmp_path, monkeypatch):
    saved = save_of([entry(7, "run")], [entry(1, "a"), entry(2, "b")])
    server = Server(monkeypatch, health.HttpError("GET /queue: refused"))  # the queue unreadable: post them all
    out = queuesave.restore(tmp_path, "http://127.0.0.1:2", saved, requeue_running=True, first_error="OOM")
    assert [b["prompt_id"] for b in server.posted] == ["run", "a", "b"]
    assert out.restored == ["run", "a", "b"] and out.requeued_running and out.running_error == "OOM"
    assert out.lines()[0] == ("running when the server went down: prompt run (first error: OOM); "
                              "queued again first (--requeue-running)")
    assert ": 2 pending prompt(s) queued again (run, a, b)" in out.lines()[1]
    assert out.fates(died=True) == ({}, {"running": 1, "pending": 2})  # run again from the start: not lost
    # nothing was running: no first error is reported, whatever the log said
    assert queuesave.restore(tmp_path, "u", save_of([], []), first_error="OOM").running_error is None


def test_a_failed_restart_hands_the_save_to_the_record_of_its_new_process(tmp_path):
    queuesave.save(tmp_path, save_of([], [entry(1, "a")]))
    queuesave.hand_over(tmp_path, 1, 1.5, 77, 9.0)  # another server's: left alone
    assert queuesave.load(tmp_path).pid == 4242
    queuesave.hand_over(tmp_path, 4242, 1.5, 77, 9.0)
    moved = queuesave.load(tmp_path)
    assert (moved.pid, moved.create_time) == (77, 9.0) and [i.prompt_id for i in moved.pending] == ["a"]
    queuesave.discard(tmp_path)
    queuesave.discard(tmp_path)  # twice: nothing to remove is no error
    assert queuesave.load(tmp_path) is None


def test_what_is_no_queue_entry_and_what_a_short_entry_keeps():
    for raw in (5, None, [1, "p"], (1,), "abc"):
        assert queuesave._item(raw) is None, raw
    four = queuesave._item([1, "p", {}, {"client_id": "c"}])  # no outputs list: the extra data is kept
    assert four.extra_data == {"client_id": "c"} and four.outputs == [] and four.client_id == "c"
    assert queuesave._item((2, "q", {"1": {}}, {}, ["1"])).outputs == ["1"]  # a tuple is an entry too


def test_a_save_read_from_the_server_is_dated_and_a_plain_save_always_writes(tmp_path, monkeypatch):
    import datetime
    Server(monkeypatch, {"queue_running": [], "queue_pending": [entry(1, "a")]})
    saved = queuesave.read_queue("http://127.0.0.1:1", 1, 1.0)
    when = datetime.datetime.fromisoformat(saved.saved_at)
    assert when.tzinfo is not None and abs((datetime.datetime.now().astimezone() - when).total_seconds()) < 600
    path = queuesave.save(tmp_path, saved)
    assert path == tmp_path / queuesave.SAVE_NAME and path.read_text().endswith("}\n")
    assert queuesave.save(tmp_path, saved, unless_same=True) == path  # unchanged: the same path, not rewritten
    # without unless_same (restart, hand_over) the save is written even when it holds the same prompts
    queuesave.save(tmp_path, save_of([], [entry(1, "a")], saved_at="later", pid=1, create_time=1.0))
    assert queuesave.load(tmp_path).saved_at == "later"


def test_a_save_up_to_the_size_limit_is_read_one_byte_more_is_not(tmp_path, monkeypatch):
    text = json.dumps(save_of([], [entry(1, "a")]).to_dict())
    monkeypatch.setattr(queuesave, "MAX_SAVE", len(text) + 10)
    (tmp_path / queuesave.SAVE_NAME).write_text(text + " " * 10)  # exactly the limit (JSON allows the spaces)
    assert queuesave.load(tmp_path) is not None
    (tmp_path / queuesave.SAVE_NAME).write_text(text + " " * 11)
    assert queuesave.load(tmp_path) is None


def test_the_outcome_of_a_restore_as_json(tmp_path, monkeypatch):
    Server(monkeypatch, answers={"b": {"prompt_id": "b2"}})
    out = queuesave.restore(tmp_path, "u", save_of([entry(0, "r")], [entry(1, "a"), entry(2, "b")], saved_at="t0"))
    assert out.to_dict() == {"saved_at": "t0", "restored": ["a", "b"], "renamed": {"b": "b2"}, "failed": [],
                             "running": ["r"], "requeued_running": False, "running_error": None, "present": []}
    assert (tmp_path / queuesave.RESTORED_NAME).read_text().endswith("}\n")
