"""h3kit front's logic without servers: the queue's claims, leases and publication, users' turns, auth, the
/v1/videos mapping onto the shipped workflows, the /ws event mapping (tests/test_front.py runs processes)."""

from __future__ import annotations

import json
import os
import threading

import pytest

from tests.support import requires

for _m in ("aiohttp", "sqlalchemy", "prometheus_client"):
    requires.module(_m, "the front extra (pip install 'h3kit[front]'; toolkit/requirements/test.txt lists it)",
                    allow_module_level=True)

from h3kit.front import FrontUsageError, auth, videos  # noqa: E402
from h3kit.front import store as st  # noqa: E402
from h3kit.front.comfyapi import npu_count_of  # noqa: E402
from h3kit.front.dispatch import output_items, prompt_for, rewrite_outputs  # noqa: E402
from h3kit.front.servers import Server  # noqa: E402


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make_store(tmp_path, clock=None) -> st.Store:
    return st.Store(f"sqlite:///{tmp_path / 'q.db'}", clock=clock or Clock())


def add(store, user="alice", npu=None, prompt=None):
    store.clock.t += 1  # distinct creation times: the order is by acceptance
    return store.add(kind="comfy", user=user, prompt=prompt or {"1": {"class_type": "X", "inputs": {}}},
                     extra={}, npu_count=npu)


# ---------------------------------------------------------------------------------------------- the queue

def test_claims_from_many_threads_and_two_stores_take_each_job_once(tmp_path):
    """Two fronts (two Store objects on one database file), four threads each, race for 60 jobs: every job is
    claimed exactly once. Fails if the claim's UPDATE loses its WHERE state='queued' (checked: jobs were then
    claimed by several threads)."""
    a, b = make_store(tmp_path, clock=None), None
    b = st.Store(a.url)
    ids = {add(a).id for _ in range(60)}
    claimed, lock = [], threading.Lock()

    def worker(store, owner):
        while True:
            job = store.claim(server="http://s", devices=1, owner=owner, lease=30)
            if job is None:
                return
            with lock:
                claimed.append(job.id)
    threads = [threading.Thread(target=worker, args=(s, f"{s is a}-{i}")) for s in (a, b) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)
    assert a.counts()[st.RUNNING] == 60


def test_users_take_turns_oldest_last_dispatch_first(tmp_path):
    """alice queues three, then bob one, then carol one: after alice's first, bob and carol go before alice's
    second (round robin between users), and within a user the oldest goes first."""
    s = make_store(tmp_path)
    a1, a2, a3 = add(s, "alice"), add(s, "alice"), add(s, "alice")
    b1 = add(s, "bob")
    order = []
    for _ in range(2):
        s.clock.t += 1
        order.append(s.claim(server="x", devices=1, owner="o", lease=30).id)
    c1 = add(s, "carol")
    for _ in range(3):
        s.clock.t += 1
        order.append(s.claim(server="x", devices=1, owner="o", lease=30).id)
    assert order == [a1.id, b1.id, c1.id, a2.id, a3.id]


def test_npu_count_must_fit_the_server_and_auto_fits_any(tmp_path):
    s = make_store(tmp_path)
    four, auto = add(s, npu=4), add(s, npu=None)
    assert s.claim(server="x", devices=2, owner="o", lease=30).id == auto.id
    assert s.claim(server="x", devices=2, owner="o", lease=30) is None
    assert s.claim(server="y", devices=4, owner="o", lease=30).id == four.id


def test_publish_only_by_the_lease_holder_of_that_attempt_and_once(tmp_path):
    s = make_store(tmp_path)
    job = add(s)
    got = s.claim(server="x", devices=1, owner="A", lease=30)
    pid = got.server_prompt_id
    assert not s.publish(job.id, "B", pid, state=st.DONE, outputs={}, status={})          # not its lease
    assert not s.publish(job.id, "A", "another-attempt", state=st.DONE, outputs={}, status={})
    assert s.publish(job.id, "A", pid, state=st.DONE, outputs={"9": {}}, status={"status_str": "success"})
    assert not s.publish(job.id, "A", pid, state=st.DONE, outputs={}, status={})          # once
    assert s.get(job.id).state == st.DONE and s.get(job.id).outputs == {"9": {}}


def test_an_expired_lease_is_taken_over_by_one_front_and_the_old_holder_loses_it(tmp_path):
    clock = Clock()
    s = make_store(tmp_path, clock)
    job = add(s)
    got = s.claim(server="x", devices=1, owner="A", lease=10)
    assert s.expired() == []
    clock.t += 11
    [exp] = s.expired()
    assert s.take_over(exp, "B", 10)
    assert not s.take_over(exp, "C", 10)                 # the same expired view: B was first
    assert not s.publish(job.id, "A", got.server_prompt_id, state=st.DONE, outputs={}, status={})
    assert s.renew("A", 10) == 0 and s.renew("B", 10) == 1


def test_requeue_counts_attempts_and_fails_after_the_last(tmp_path):
    s = make_store(tmp_path)
    job = add(s)
    for attempt in (1, 2):
        got = s.claim(server="x", devices=1, owner="A", lease=30)
        assert got.attempts == attempt
        assert s.requeue(job.id, "A", got.server_prompt_id, "server_died", max_attempts=3) == st.QUEUED
        assert s.get(job.id).cause == "server_died" and s.get(job.id).server is None
    got = s.claim(server="x", devices=1, owner="A", lease=30)
    assert s.requeue(job.id, "A", got.server_prompt_id, "server_hung", max_attempts=3) == st.FAILED
    assert "server_hung" in s.get(job.id).error


def test_cancel_queued_at_once_running_marked(tmp_path):
    s = make_store(tmp_path)
    q, r = add(s), add(s)
    s.claim(server="x", devices=1, owner="A", lease=30)  # q is older: it runs
    assert s.cancel(q.id).state == st.RUNNING and s.get(q.id).cancel
    assert s.cancel(r.id).state == st.CANCELLED
    assert s.claim(server="y", devices=1, owner="A", lease=30) is None


def test_the_queue_survives_a_new_store_on_the_same_file(tmp_path):
    s = make_store(tmp_path)
    ids = [add(s).id for _ in range(3)]
    s.close()
    again = st.Store(s.url)
    assert [j.id for j in again.list(states=(st.QUEUED,))] == ids


def test_postgres_urls_use_the_extras_driver():
    assert st.engine_url("postgresql://u:p@h/db") == "postgresql+pg8000://u:p@h/db"
    assert st.engine_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"
    assert st.engine_url("sqlite:///x.db") == "sqlite:///x.db"


# ---------------------------------------------------------------------------------------------- auth

def test_tokens_file(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# team\nalice  " + "a" * 20 + "\n\nbob " + "b" * 16 + "  # the app\n")
    f.chmod(0o600)
    tokens = auth.load_tokens(f)
    assert tokens == {"a" * 20: "alice", "b" * 16: "bob"}
    assert auth.user_of({"Authorization": "Bearer " + "b" * 16}, {}, {}, tokens) == "bob"
    assert auth.user_of({}, {auth.COOKIE: "a" * 20}, {}, tokens) == "alice"
    assert auth.user_of({"Authorization": "Bearer " + "c" * 16}, {}, {}, tokens) is None
    assert auth.user_of({}, {}, {}, tokens) is None
    assert auth.user_of({}, {}, {}, None) == auth.LOCAL_USER


@pytest.mark.parametrize("text,mode,words", [
    ("alice " + "a" * 20 + "\n", 0o644, "chmod 600"),
    ("alice short\n", 0o600, "line 1"),
    ("alice " + "a" * 20 + "\nbob " + "a" * 20 + "\n", 0o600, "line 2"),
    ("# nobody\n", 0o600, "names no user"),
])
def test_bad_tokens_files_name_the_fix(tmp_path, text, mode, words):
    f = tmp_path / "tokens"
    f.write_text(text)
    f.chmod(mode)
    with pytest.raises(FrontUsageError) as e:
        auth.load_tokens(f)
    assert words in e.value.message + (e.value.hint or "")


def test_without_tokens_only_loopback():
    auth.check_bind("127.0.0.1", None)
    auth.check_bind("::1", None)
    auth.check_bind("0.0.0.0", {"x" * 16: "alice"})
    with pytest.raises(FrontUsageError) as e:
        auth.check_bind("0.0.0.0", None)
    assert "--tokens" in e.value.hint


# ---------------------------------------------------------------------------------------------- mapping

def test_npu_count_of_prompts():
    cfg = lambda v: {"class_type": "MultiNPUParallelConfig", "inputs": {"npu_count": v}}  # noqa: E731
    assert npu_count_of({"1": cfg(4)}) == 4
    assert npu_count_of({"1": cfg("auto")}) is None
    assert npu_count_of({"1": {"class_type": "KSampler", "inputs": {}}}) is None
    with pytest.raises(ValueError):
        npu_count_of({"1": cfg(4), "2": cfg(2)})


def test_auto_becomes_the_servers_device_count():
    job = st.Job(**{**dict.fromkeys(st.Job.__dataclass_fields__), "prompt": {
        "5": {"class_type": "MultiNPUParallelConfig", "inputs": {"npu_count": "auto"}}}, "extra": {}})
    server = Server("http://s", "url", devices=8)
    assert prompt_for(job, server)["5"]["inputs"]["npu_count"] == 8
    assert job.prompt["5"]["inputs"]["npu_count"] == "auto"


def test_outputs_are_rewritten_under_the_job():
    out = {"9": {"images": [{"filename": "a.mp4", "subfolder": "video", "type": "output"}], "animated": [True]},
           "3": {"text": ["not a file"]}}
    new = rewrite_outputs(out, "J", "P")
    assert [i["subfolder"] for i in output_items(new)] == ["h3front/J/P/video"]
    assert out["9"]["images"][0]["subfolder"] == "video"


@pytest.fixture(scope="module")
def shipped():
    return videos.load_workflows({})


def test_shipped_workflows_flatten_to_api_form(shipped):
    t2v, ref2v = shipped["t2v"], shipped["ref2v"]
    assert {n["class_type"] for n in t2v.values()} >= {"MiniMaxH3ImageToVideo", "SaveVideo", "MultiNPUParallelConfig"}
    assert any(n["class_type"] == "LoadImage" for n in ref2v.values())
    h3 = next(n for n in ref2v.values() if n["class_type"] == "MiniMaxH3ReferenceToVideo")
    src, slot = h3["inputs"]["ref_images.ref_image_0"]
    assert ref2v[src]["class_type"] == "LoadImage" and slot == 0
    assert "control_after_generate" not in json.dumps(t2v) and "fixed" not in json.dumps(t2v)


def test_video_request_maps_onto_the_workflow(shipped, tmp_path):
    prompt, params, npu = videos.build_job(shipped, {"prompt": "a fox", "size": "768x1344", "seconds": "5"},
                                           None, "png", tmp_path)
    h3 = next(n for n in prompt.values() if n["class_type"] == "MiniMaxH3ImageToVideo")["inputs"]
    assert (h3["prompt"], h3["width"], h3["height"]) == ("a fox", 768, 1344)
    assert h3["length"] == 124 and (h3["length"] - 5) % 17 == 0   # 5 s x 24 fps = 120, aligned up to 17k+5
    assert npu is None and params["kind"] == "t2v" and params["size"] == "768x1344"
    cfg = next(n for n in prompt.values() if n["class_type"] == "MultiNPUParallelConfig")
    assert cfg["inputs"]["npu_count"] == "auto"
    prompt, params, npu = videos.build_job(shipped, {"prompt": "her", "npu_count": "4"}, b"PNG", "png", tmp_path)
    load = next(n for n in prompt.values() if n["class_type"] == "LoadImage")["inputs"]["image"]
    assert (tmp_path / load).read_bytes() == b"PNG" and params["kind"] == "ref2v" and npu == 4


@pytest.mark.parametrize("req,param", [({}, "prompt"), ({"prompt": "x", "size": "big"}, "size"),
                                       ({"prompt": "x", "size": "100x100"}, "size"),
                                       ({"prompt": "x", "seconds": "-1"}, "seconds"),
                                       ({"prompt": "x", "npu_count": 3}, "npu_count")])
def test_bad_video_requests_name_the_parameter(shipped, tmp_path, req, param):
    with pytest.raises(videos.BadRequest) as e:
        videos.build_job(shipped, req, None, "png", tmp_path)
    assert e.value.param == param and e.value.body()["error"]["param"] == param


def test_ws_events_are_mapped_to_the_job_and_its_client_only():
    from h3kit.front.relay import Relay

    relay = Relay()
    job = st.Job(**{**dict.fromkeys(st.Job.__dataclass_fields__), "id": "JOB", "user": "alice",
                    "server_prompt_id": "ATTEMPT", "extra": {"client_id": "c1"}})
    relay.watch(job)
    client, ev = relay.map_event("http://s", {"type": "executed", "data": {
        "prompt_id": "ATTEMPT", "node": "9", "output": {"images": [{"filename": "a.mp4", "subfolder": "", "type": "output"}]}}})
    assert client == "alice\0c1" and ev["data"]["prompt_id"] == "JOB"
    assert ev["data"]["output"]["images"][0]["subfolder"] == "h3front/JOB/ATTEMPT"
    assert relay.map_event("http://s", {"type": "executing", "data": {"prompt_id": "someone-else"}}) is None
    assert relay.map_event("http://s", {"type": "status", "data": {"status": {}}}) is None


def test_the_cli_stays_light_with_the_front_registered():
    import subprocess
    import sys

    code = ("import sys; from h3kit import cli; cli.main(['--help'], standalone_mode=False); "
            "print([m for m in ('aiohttp', 'sqlalchemy', 'prometheus_client') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert "front" in out.stdout and out.stdout.strip().endswith("[]"), out.stdout + out.stderr


def test_a_prompt_sends_only_the_fronts_own_uploads(tmp_path):
    """A string input naming a file outside the front's inputs folder (absolute, "..", a symlink) uploads
    nothing: a prompt must not carry the front host's files to a server. Fails without the check (the
    dispatcher then uploaded /etc/passwd)."""
    from h3kit.front.dispatch import named_uploads

    inputs = tmp_path / "inputs"
    (inputs / "h3front").mkdir(parents=True)
    (inputs / "h3front" / "ref.png").write_bytes(b"png")
    (inputs / "link.png").symlink_to("/etc/passwd")
    prompt = {"1": {"class_type": "LoadImage", "inputs": {"image": "h3front/ref.png"}},
              "2": {"class_type": "X", "inputs": {"a": "/etc/passwd", "b": "../../etc/passwd", "c": "link.png",
                                                  "d": "h3front/ref.png [input]", "e": 3}}}
    assert named_uploads(prompt, inputs) == [("h3front/ref.png", inputs / "h3front" / "ref.png")]
