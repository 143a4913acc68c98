"""h3kit front as a process over two servers (stand-ins that run prompts: tests/support/front_standin.py; the
real server with tiny models runs through the front in tests/test_front_browser.py): jobs spread over both
and fitted to their device counts, a server killed -9, hung or restarted mid-job and its job finished
elsewhere, the front killed -9 with jobs queued and all finished after its restart (each run once), /ws events
relayed with the job's id, 401s that queue nothing, and /v1/videos onto the shipped workflows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid

import pytest

from tests.support import requires
from tests.support.service_helpers import free_port

for _m in ("aiohttp", "sqlalchemy", "prometheus_client"):
    requires.module(_m, "the front extra (pip install 'h3kit[front]'; toolkit/requirements/test.txt lists it)",
                    allow_module_level=True)

from tests.support.front_helpers import (TOOLKIT, Front, Standin, http, metric_value,  # noqa: E402
                                         sleep_prompt, starts, wait_for)

BAND = (8700, 8799)
FAST = ["--lease", "4", "--dead-after", "1"]


def port() -> int:
    return free_port(*BAND)


@pytest.fixture
def procs():
    started = []
    yield started
    for p in reversed(started):
        p.stop()


def standin(procs, tmp_path, name, **kw) -> Standin:
    s = Standin(tmp_path / name, port(), **kw)
    procs.append(s)
    return s


def front(procs, tmp_path, servers, **kw) -> Front:
    f = Front(tmp_path / "front", port(), [s.url for s in servers], **kw)
    procs.append(f)
    return f




def running_on(servers, tag):
    for s in servers:
        if any(r["event"] == "start" and r["prompt"]["1"]["inputs"].get("tag") == tag for r in s.runs()):
            return s
    return None


def overlap(a: Standin, b: Standin) -> bool:
    def spans(s):
        t = {}
        for r in s.runs():
            if r["event"] in ("start", "end"):
                t.setdefault(r["prompt_id"], {})[r["event"]] = r["t"]
        return [(v["start"], v["end"]) for v in t.values() if len(v) == 2]
    return any(s1 < e2 and s2 < e1 for s1, e1 in spans(a) for s2, e2 in spans(b))


def test_jobs_spread_over_both_servers_fitted_to_their_devices(procs, tmp_path):
    import websocket

    a, b = standin(procs, tmp_path, "a", devices=1), standin(procs, tmp_path, "b", devices=2)
    f = front(procs, tmp_path, [a, b], extra=FAST)
    client = uuid.uuid4().hex
    ws = websocket.create_connection(f"ws://127.0.0.1:{f.port}/ws?clientId={client}", timeout=60)
    try:
        assert json.loads(ws.recv())["type"] == "status"
        ids = {f"j{i}": f.submit(sleep_prompt(0.8, f"j{i}"), client) for i in range(6)}
        ids["two"] = f.submit(sleep_prompt(0.2, "two", npu_count=2), client)
        hist = f.wait_done(list(ids.values()), timeout=120)
        events = _events_until(ws, ids["two"])
    finally:
        ws.close()
    ran = starts(a, b)
    assert sorted(ran) == sorted(ids) and all(len(v) == 1 for v in ran.values()), ran   # each ran once
    assert ran["two"] == [b.port]                                    # npu_count 2: only the 2-device server
    assert {p for t, (p,) in ran.items() if t != "two"} == {a.port, b.port}  # spread over both
    assert overlap(a, b), "the two servers never ran prompts at the same time"
    for tag, job_id in ids.items():
        entry = hist[job_id]
        assert entry["h3front"]["state"] == "done" and entry["h3front"]["attempts"] == 1
        [item] = entry["outputs"]["9"]["images"]
        status, body = f.call("GET", f"/view?filename={item['filename']}&subfolder={item['subfolder']}&type=output",
                              raw=True)
        assert status == 200 and body.decode().endswith(f"from {ran[tag][0]}\n"), body
    executed = [e for e in events if e["type"] == "executed"]
    assert {e["data"]["prompt_id"] for e in executed} == set(ids.values())   # mapped back to the job ids
    assert all(e["data"]["output"]["images"][0]["subfolder"].startswith(f"h3front/{e['data']['prompt_id']}/")
               for e in executed)
    jobs = f.call("GET", "/api/jobs?status=completed,failed&limit=5")[1]       # the page's queue panel
    assert jobs["pagination"]["total"] == 7 and len(jobs["jobs"]) == 5 and jobs["pagination"]["has_more"]
    assert {j["status"] for j in jobs["jobs"]} == {"completed"}
    assert all(j["preview_output"]["subfolder"].startswith(f"h3front/{j['id']}/") for j in jobs["jobs"])
    assert f.call("GET", f"/api/jobs/{ids['two']}")[1]["workflow"]["prompt"]["2"]["inputs"]["npu_count"] == 2
    text = f.metrics()
    assert metric_value(text, "h3front_jobs", 'state="done"') == 7
    assert metric_value(text, "h3front_dispatches_total", 'cause="new"') == 7
    assert metric_value(text, "h3front_servers", 'state="up"') == 2
    assert metric_value(text, "h3front_queue_wait_seconds_count") == 7


def _events_until(ws, last_job: str) -> list:
    """The relayed events up to the last job's execution_success (each job's executed comes before it)."""
    seen, out = set(), []
    while True:
        ev = json.loads(ws.recv())
        out.append(ev)
        if ev["type"] == "execution_success":
            seen.add(ev["data"]["prompt_id"])
        if len(seen) >= 7:
            return out


def test_a_server_killed_mid_job_has_it_finished_elsewhere(procs, tmp_path):
    a, b = standin(procs, tmp_path, "a"), standin(procs, tmp_path, "b")
    f = front(procs, tmp_path, [a, b], extra=FAST)
    job = f.submit(sleep_prompt(4, "long"))
    victim = wait_for("the job to start", lambda: running_on([a, b], "long"), timeout=60)
    other = b if victim is a else a
    victim.kill9()
    entry = f.wait_done([job], timeout=120)[job]
    assert entry["h3front"]["state"] == "done" and entry["h3front"]["server"] == other.url
    assert entry["h3front"]["attempts"] == 2
    item = entry["outputs"]["9"]["images"][0]
    status, body = f.call("GET", f"/view?filename={item['filename']}&subfolder={item['subfolder']}", raw=True)
    assert status == 200 and body.decode().endswith(f"from {other.port}\n")
    text = f.metrics()
    assert metric_value(text, "h3front_redispatches_total", 'cause="server_died"') == 1
    assert metric_value(text, "h3front_dispatches_total", 'cause="server_died"') == 1
    assert metric_value(text, "h3front_servers", 'state="down"') == 1


def test_a_hung_server_has_its_job_run_elsewhere_and_published_once(procs, tmp_path):
    """SIGSTOP: the server accepts connections and answers nothing. After --hang-after the job runs on the other
    server; once the hung one wakes, the front deletes the abandoned attempt there, and only the other
    server's output is published."""
    a, b = standin(procs, tmp_path, "a"), standin(procs, tmp_path, "b")
    f = front(procs, tmp_path, [a, b], extra=["--lease", "4", "--hang-after", "2"])
    job = f.submit(sleep_prompt(3, "hang"))
    victim = wait_for("the job to start", lambda: running_on([a, b], "hang"), timeout=60)
    other = b if victim is a else a
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        entry = f.wait_done([job], timeout=120)[job]
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    assert entry["h3front"]["server"] == other.url and entry["h3front"]["attempts"] == 2
    wait_for("the abandoned attempt interrupted on the woken server",
             lambda: any(r["event"] == "interrupted" for r in victim.runs()), timeout=60)
    assert metric_value(f.metrics(), "h3front_redispatches_total", 'cause="server_hung"') == 1
    assert f.history(job)["outputs"] == entry["outputs"]


def test_a_server_restarted_mid_job_has_it_run_again(procs, tmp_path):
    """A server that comes back on its port without the prompt (a restart that lost its queue): the job runs
    again (cause server_restarted), whichever server takes it."""
    a, b = standin(procs, tmp_path, "a"), standin(procs, tmp_path, "b")
    f = front(procs, tmp_path, [a, b], extra=["--lease", "4", "--dead-after", "60"])
    job = f.submit(sleep_prompt(4, "restart"))
    victim = wait_for("the job to start", lambda: running_on([a, b], "restart"), timeout=60)
    victim.kill9()
    procs.append(Standin(victim.home, victim.port))
    entry = f.wait_done([job], timeout=120)[job]
    assert entry["h3front"]["state"] == "done" and entry["h3front"]["attempts"] == 2
    assert metric_value(f.metrics(), "h3front_redispatches_total", 'cause="server_restarted"') == 1


def test_the_front_killed_with_jobs_queued_finishes_all_after_restart(procs, tmp_path):
    a, b = standin(procs, tmp_path, "a"), standin(procs, tmp_path, "b")
    f = front(procs, tmp_path, [a, b], extra=FAST)
    ids = {f"k{i}": f.submit(sleep_prompt(1.5, f"k{i}")) for i in range(6)}
    wait_for("two jobs running", lambda: len(starts(a, b)) >= 2, timeout=60)
    f.kill9()
    before = starts(a, b)
    assert len(before) < 6, "every job started before the kill: nothing was left queued"
    again = Front(f.data_dir, f.port, [a.url, b.url], extra=FAST, log_name="front-2.log")
    procs.append(again)
    hist = again.wait_done(list(ids.values()), timeout=180)
    assert all(e["h3front"]["state"] == "done" for e in hist.values())
    ran = starts(a, b)
    assert sorted(ran) == sorted(ids) and all(len(v) == 1 for v in ran.values()), ran  # adopted, not rerun


def test_requests_without_a_valid_token_get_401_and_queue_nothing(procs, tmp_path):
    tokens = tmp_path / "tokens"
    alice, bob = "a" * 24, "b" * 24
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    tokens.chmod(0o600)
    a = standin(procs, tmp_path, "a")
    f = front(procs, tmp_path, [a], token=alice, extra=["--tokens", str(tokens)])
    body = {"prompt": sleep_prompt(0.1, "nope")}
    for tok in (None, "", "c" * 24, alice[:-1]):
        assert http("POST", f.url + "/prompt", body, token=tok)[0] == 401
        assert http("POST", f.url + "/v1/videos", {"prompt": "x"}, token=tok)[0] == 401
        assert http("GET", f.url + "/queue", token=tok)[0] == 401
    assert f.call("GET", "/front/status")[1]["jobs"]["queued"] == 0
    assert f.call("GET", "/queue")[1] == {"queue_running": [], "queue_pending": []}
    assert a.runs() == []
    job = f.submit(sleep_prompt(0.1, "yes"))
    f.wait_done([job])
    assert f.call("GET", f"/history/{job}", token=bob)[1] == {}          # bob does not see alice's jobs
    import http.client as httpclient
    conn = httpclient.HTTPConnection("127.0.0.1", f.port, timeout=30)
    conn.request("GET", f"/?token={alice}")
    r = conn.getresponse()
    cookie = r.getheader("Set-Cookie", "")
    assert r.status == 302 and cookie.startswith("h3front_token=") and "HttpOnly" in cookie   # the page's login
    r.read()
    conn.request("GET", "/", headers={"Cookie": cookie.split(";")[0]})
    page = conn.getresponse()
    assert page.status == 200 and f"front stand-in {a.port}" in page.read().decode()   # the page, by proxy
    assert f.call("POST", "/free", {"unload_models": True})[0] == 405     # no write to a server past the queue
    assert http("GET", f.url + "/healthz")[0] == 200


def test_without_tokens_the_front_refuses_a_public_address(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(TOOLKIT))
    out = subprocess.run([sys.executable, "-m", "h3kit", "front", "--host", "0.0.0.0", "--server",
                          "http://127.0.0.1:1", "--data-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2 and "--tokens" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_v1_videos_runs_the_shipped_workflows(procs, tmp_path):
    a = standin(procs, tmp_path, "a", devices=2, run_seconds=0.3)
    f = front(procs, tmp_path, [a], extra=FAST)
    status, video = f.call("POST", "/v1/videos", {"prompt": "a fox in the snow", "size": "768x1344", "seconds": 5})
    assert status == 200 and video["status"] in ("queued", "in_progress") and video["id"].startswith("video_")
    import base64
    png = b"\x89PNG\r\n\x1a\nstand-in reference"
    status, ref = f.call("POST", "/v1/videos", {"prompt": "her", "input_reference":
                                                "data:image/png;base64," + base64.b64encode(png).decode()})
    assert status == 200
    for v in (video, ref):
        wait_for(f"{v['id']} completed", lambda v=v: f.call("GET", f"/v1/videos/{v['id']}")[1]["status"] == "completed")
    runs = [r for r in a.runs() if r["event"] == "start"]
    t2v = next(n for n in runs[0]["prompt"].values() if n["class_type"] == "MiniMaxH3ImageToVideo")["inputs"]
    assert (t2v["prompt"], t2v["width"], t2v["height"], t2v["length"]) == ("a fox in the snow", 768, 1344, 124)
    cfg = next(n for n in runs[0]["prompt"].values() if n["class_type"] == "MultiNPUParallelConfig")["inputs"]
    assert cfg["npu_count"] == 2                          # "auto": the server's own device count
    load = next(n for n in runs[1]["prompt"].values() if n["class_type"] == "LoadImage")["inputs"]["image"]
    assert (a.home / "input" / load).read_bytes() == png  # uploaded to the server that ran it
    status, body = f.call("GET", f"/v1/videos/{video['id']}/content", raw=True)
    assert status == 200 and body.decode().endswith(f"from {a.port}\n")
    listed = f.call("GET", "/v1/videos")[1]
    assert {v["id"] for v in listed["data"]} == {video["id"], ref["id"]}
    assert f.call("DELETE", f"/v1/videos/{video['id']}")[1]["deleted"] is True
    assert f.call("GET", f"/v1/videos/{video['id']}")[0] == 404
    assert f.call("POST", "/v1/videos", {"prompt": "x", "size": "1x1"})[0] == 400
    boundary = uuid.uuid4().hex
    form = b"".join([f"--{boundary}\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nform\r\n".encode(),
                     f"--{boundary}\r\nContent-Disposition: form-data; name=\"seconds\"\r\n\r\n2\r\n".encode(),
                     f"--{boundary}\r\nContent-Disposition: form-data; name=\"input_reference\"; "
                     f"filename=\"me.png\"\r\nContent-Type: image/png\r\n\r\n".encode(), png + b"form",
                     f"\r\n--{boundary}--\r\n".encode()])
    status, multi = f.call("POST", "/v1/videos", data=form, content_type=f"multipart/form-data; boundary={boundary}")
    assert status == 200, multi
    wait_for("the multipart job completed", lambda: f.call("GET", f"/v1/videos/{multi['id']}")[1]["status"] == "completed")
    last = [r for r in a.runs() if r["event"] == "start"][-1]["prompt"]
    load = next(n for n in last.values() if n["class_type"] == "LoadImage")["inputs"]["image"]
    assert (a.home / "input" / load).read_bytes() == png + b"form" and multi["seconds"] == "2.0"


def test_a_request_from_another_sites_page_is_refused(procs, tmp_path):
    """Without tokens the front trusts loopback; a page of another site open in the user's browser must not
    queue work through it (ComfyUI refuses such requests the same way). Its own page's requests pass."""
    a = standin(procs, tmp_path, "a")
    f = front(procs, tmp_path, [a])
    body = json.dumps({"prompt": sleep_prompt(0.1, "csrf")}).encode()
    for origin, status in (("http://evil.example", 403), (f"http://127.0.0.1:{f.port}", 200)):
        req = urllib.request.Request(f.url + "/prompt", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Origin": origin})
        try:
            got = urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=30).status
        except urllib.error.HTTPError as e:
            got = e.code
        assert got == status, origin
    jobs = f.call("GET", "/front/status")[1]["jobs"]
    assert sum(jobs.values()) == 1                   # the refused request queued nothing


def test_the_trees_servers_are_found_from_their_service_records(procs, tmp_path):
    """--comfy-home: the front reads the tree's service records (read-only: the runtime root's and those under
    servers/<port>/, where a tree keeps its other servers) and dispatches to the servers h3kit started there
    (the service tests' stand-in: it answers /system_stats and /queue, and runs no prompt)."""
    from tests.support.service_helpers import StandinHome

    home = StandinHome(tmp_path / "comfy", port())
    home.configure(devices=2)
    other = StandinHome(tmp_path / "comfy", port())
    other.root = home.root / "servers" / str(other.port)
    other.root.mkdir(parents=True)
    for h in (home, other):
        started = h.start()
        assert started.returncode == 0, started.stderr
    try:
        records = [(h.root / "server.json").read_bytes() for h in (home, other)]
        f = front(procs, tmp_path, [], extra=["--comfy-home", str(home.path)])
        up = wait_for("the tree's servers up", lambda: [s for s in f.call("GET", "/front/status")[1]["servers"]
                                                        if s["state"] == "up"][1:], timeout=60)
        up = [s for s in f.call("GET", "/front/status")[1]["servers"] if s["state"] == "up"]
        assert sorted((s["url"], s["devices"]) for s in up) == sorted([(home.url, 2), (other.url, 2)])
        job = f.submit(sleep_prompt(0.1, "tree", npu_count=2))
        wait_for("the job on a tree's server", lambda: any(e.get("prompt_id") for e in _standin_prompts(home)),
                 timeout=60)
        assert f.call("GET", "/queue")[1]["queue_running"][0][1] == job
        assert [(h.root / "server.json").read_bytes() for h in (home, other)] == records   # read, never written
    finally:
        for h in (other, home):
            h.run("stop")


def _standin_prompts(home) -> list:
    path = home.path / "standin-prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_interrupt_and_delete_reach_the_job_wherever_it_is(procs, tmp_path):
    """POST /interrupt {prompt_id} stops the running job on its server (it ends cancelled, not run again);
    POST /queue {delete} drops a queued one before it runs."""
    a = standin(procs, tmp_path, "a")
    f = front(procs, tmp_path, [a], extra=FAST)
    running = f.submit(sleep_prompt(5, "stop-me"))
    queued = f.submit(sleep_prompt(0.1, "drop-me"))
    wait_for("the first job running", lambda: running_on([a], "stop-me"), timeout=60)
    assert f.call("POST", "/queue", {"delete": [queued]})[0] == 200
    assert f.call("POST", "/interrupt", {"prompt_id": running})[0] == 200
    hist = f.wait_done([running, queued], timeout=60)
    assert hist[running]["h3front"]["state"] == "cancelled" and hist[queued]["h3front"]["state"] == "cancelled"
    assert [r["event"] for r in a.runs() if r["event"] in ("start", "interrupted")] == ["start", "interrupted"]
    assert set(starts(a)) == {"stop-me"}
