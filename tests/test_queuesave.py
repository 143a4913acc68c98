"""h3kit.queuesave without a server: what a save holds, what a restore posts, and a save that is not h3kit's."""

from __future__ import annotations

import json
import os

from h3kit import queuesave

ITEM = [3, "5e2f5a36-5d54-4a4c-9a8e-7d7a2c5f0b11", {"1": {"class_type": "X", "inputs": {}}},
        {"client_id": "browser-1", "create_time": 1764583000000, "extra_pnginfo": {"workflow": {}}}, ["1"]]


def saved_from(queue: dict) -> queuesave.Saved:
    items = lambda key: [queuesave._item(i) for i in queue[key]]  # noqa: E731
    return queuesave.Saved(4242, 1.5, "http://127.0.0.1:1", "2026-12-01T10:00:00+00:00",
                           items("queue_running"), sorted(items("queue_pending"), key=lambda i: i.number))


def test_the_body_queues_the_prompt_again_as_it_was():
    item = queuesave._item(ITEM)
    assert item.body() == {"prompt": ITEM[2], "prompt_id": ITEM[1], "client_id": "browser-1",
                           "extra_data": {"extra_pnginfo": {"workflow": {}}}, "partial_execution_targets": ["1"]}
    assert queuesave._item([1, None, {}]) is None and queuesave._item("junk") is None


def test_a_save_is_private_round_trips_and_is_not_rewritten_when_unchanged(tmp_path):
    later = [5, "p2", {"1": {}}, {}, []]
    saved = saved_from({"queue_running": [], "queue_pending": [later, ITEM]})
    assert [i.prompt_id for i in saved.pending] == [ITEM[1], "p2"]  # in the order the server runs them
    path = queuesave.save(tmp_path, saved)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    back = queuesave.load(tmp_path)
    assert back.summary() == saved.summary() and back.is_of(4242, 1.5) and not back.is_of(4242, 2.0)
    before = path.stat().st_mtime_ns
    os.utime(path, ns=(before - 10**9, before - 10**9))
    again = queuesave.Saved(4242, 1.5, saved.url, "2026-12-01T10:00:05+00:00", [], saved.pending)
    queuesave.save(tmp_path, again, unless_same=True)
    assert path.stat().st_mtime_ns == before - 10**9  # same prompts: left as it was
    again.pending = again.pending[:1]
    queuesave.save(tmp_path, again, unless_same=True)
    assert [i["prompt_id"] for i in json.loads(path.read_text())["pending"]] == [ITEM[1]]


def test_a_save_h3kit_did_not_write_is_never_restored(tmp_path):
    for text in ("not json", json.dumps({"pid": 1}), json.dumps({"pid": 1, "create_time": 1, "url": "u",
                                                                  "saved_at": "t", "running": [], "pending": [5]})):
        (tmp_path / queuesave.SAVE_NAME).write_text(text)
        assert queuesave.load(tmp_path) is None
