"""The toolkit's side of monitoring (toolkit/h3kit/monitoring.py, issue 39): the restarts h3kit watch and restart
count, in the record the server's /metrics reads and as a node_exporter textfile; doctor's word on prometheus_client;
the names both sides share. Torch-free. Restarts made by the real commands: tests/test_service_standin.py."""

from __future__ import annotations

import ast
import json
import re
import time
import types

import pytest

from h3kit import health, monitoring, queuesave, supervise
from tests.conftest import ROOT
from tests.test_queuesave import Server, entry, save_of

SERVER_SIDE = (ROOT / "patches" / "src" / "comfy" / "multinpu_metrics.py").read_text()


def test_restarts_are_counted_by_reason_in_both_records(tmp_path):
    assert monitoring.restarts(tmp_path) == {}
    monitoring.count_restart(tmp_path, "died")
    monitoring.count_restart(tmp_path, "died")
    assert monitoring.count_restart(tmp_path, "manual") == {"died": 2, "manual": 1}
    assert monitoring.restarts(tmp_path) == {"died": 2, "manual": 1}
    text = (tmp_path / "metrics" / monitoring.TEXTFILE).read_text()
    # every reason from 0: the first restart is an increase for H3kitCrashLoop (a series born at 1 is none)
    assert text.splitlines()[1:5] == ["# TYPE h3kit_service_restarts_total counter",
                                      'h3kit_service_restarts_total{reason="died"} 2',
                                      'h3kit_service_restarts_total{reason="manual"} 1',
                                      'h3kit_service_restarts_total{reason="unhealthy"} 0']
    stamp = float(text.splitlines()[-1].split()[-1])
    assert text.splitlines()[-1].startswith("h3kit_service_last_restart_timestamp_seconds ")
    assert abs(stamp - time.time()) < 3600
    assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == [".lock", "h3kit_service.prom", "restarts.json"]


def test_a_restart_is_never_failed_by_its_count(tmp_path):
    (tmp_path / "metrics").write_text("a file where the folder goes")
    assert monitoring.count_restart(tmp_path, "unhealthy") == {}
    with pytest.raises(ValueError):
        monitoring.count_restart(tmp_path, "because")


def test_the_server_reads_what_the_toolkit_writes():
    # the server's module runs in ComfyUI's interpreter, which may lack h3kit: the names are written twice, pinned here
    files = re.search(r'RESTARTS_FILE = os.path.join\("(\w+)", "([\w.]+)"\)', SERVER_SIDE).groups()
    assert files == (monitoring.METRICS_DIR, monitoring.RESTARTS_FILE)
    assert f'RUNTIME_ROOT_ENV = "{monitoring.RUNTIME_ROOT_ENV}"' in SERVER_SIDE
    assert ast.literal_eval(re.search(r"RESTART_REASONS = (\(.*?\))", SERVER_SIDE).group(1)) == monitoring.REASONS
    assert ast.literal_eval(re.search(r"LOST_REASONS = (\(.*?\))", SERVER_SIDE).group(1)) == monitoring.LOST_REASONS
    assert ast.literal_eval(re.search(r"REQUEUED_STATES = (\(.*?\))", SERVER_SIDE).group(1)) == \
        monitoring.REQUEUED_STATES
    runtime = (ROOT / "toolkit" / "requirements" / "comfy-runtime-cpu.txt").read_text().splitlines()
    assert monitoring.PROMETHEUS_CLIENT in runtime


def test_doctor_names_prometheus_client():
    assert monitoring.doctor_finding({"prometheus_client": "0.26.0"}, "/py")[0] == "ok"
    severity, message, fix = monitoring.doctor_finding({}, "/opt/py")
    assert severity == "warning" and "503" in message
    assert fix.startswith(f"/opt/py -m pip install {monitoring.PROMETHEUS_CLIENT}")


# --- prompts lost and queued again across a restart (issue 47): what watch and restart count from the save ----------

def _dead_server(monkeypatch, tmp_path, module, *, alive=False):
    """The record of a server (dead unless `alive`) whose save holds running r1 and pending p1, p2; the new server
    (health.request_json's stand-in) refuses p2. Starting (and stopping) is stubbed in `module`'s namespace."""
    log = tmp_path / "comfy.log"
    log.write_text("")
    rec = types.SimpleNamespace(pid=4242, create_time=1.5, url="http://127.0.0.1:1", log=str(log), listen="127.0.0.1",
                                port=1, comfy_home=str(tmp_path), group=types.SimpleNamespace(is_agent=False),
                                verify=lambda: types.SimpleNamespace(alive=alive))
    new = types.SimpleNamespace(record=types.SimpleNamespace(pid=4343, url="http://127.0.0.1:2"), seconds=1.0)
    monkeypatch.setattr(module, "start_keeping_queue", lambda *a, **k: new)
    monkeypatch.setattr(module, "stop_locked", lambda *a, **k: None)
    saved = save_of([entry(1, "r1")], [entry(2, "p1"), entry(3, "p2")])
    queuesave.save(tmp_path, saved)
    Server(monkeypatch, answers={"p2": health.HttpError("POST /prompt: HTTP 400", status=400)})
    return rec, saved


def _fates_on_file(root):
    text = (root / "metrics" / monitoring.TEXTFILE).read_text()
    series = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("h3kit_prompts_"))
    return monitoring.record(root), series


@pytest.mark.parametrize("requeue_running", [False, True])
def test_a_watch_restart_of_a_dead_server_counts_its_saved_prompts_lost_or_queued_again(tmp_path, monkeypatch,
                                                                                        requeue_running):
    rec, _ = _dead_server(monkeypatch, tmp_path, supervise.service)
    monkeypatch.setattr(supervise.service, "read_record", lambda root, home=None: rec)
    events = []
    policy = supervise.WatchPolicy(requeue_running=requeue_running)
    outcome = supervise.WatchOutcome("interrupted", "")
    emit = lambda event, message, **extra: events.append(event)  # noqa: E731
    got = supervise._restart_locked(tmp_path, rec, policy, emit, outcome, "died")
    assert got.pid == 4343 and events == ["queue_saved", "started", "restored"]
    record, series = _fates_on_file(tmp_path)
    assert record["restarts"] == {"died": 1}
    # r1 ran when the server died: lost to the crash unless watch queued it again; p1 back; p2 refused by the new one
    lost = {"refused": 1} if requeue_running else {"crash": 1, "refused": 1}
    requeued = {"pending": 1, "running": 1} if requeue_running else {"pending": 1}
    assert (record["prompts_lost"], record["prompts_requeued"]) == (lost, requeued)
    assert series == {'h3kit_prompts_lost_total{reason="crash"}': "0" if requeue_running else "1",
                      'h3kit_prompts_lost_total{reason="dropped"}': "0",
                      'h3kit_prompts_lost_total{reason="refused"}': "1",
                      'h3kit_prompts_requeued_total{state="pending"}': "1",
                      'h3kit_prompts_requeued_total{state="running"}': "1" if requeue_running else "0"}
    # a second crash adds to the counts (the restored prompts were saved again by the new server's ticks)
    queuesave.save(tmp_path, save_of([entry(2, "p1")], [], pid=4242))
    supervise._restart_locked(tmp_path, rec, policy, emit, outcome, "died")
    record, _ = _fates_on_file(tmp_path)
    assert record["restarts"] == {"died": 2}
    assert record["prompts_lost"].get("crash", 0) == (0 if requeue_running else 2)


def test_h3kit_restart_counts_the_running_prompt_it_stopped_as_dropped_and_of_a_dead_server_as_crash(tmp_path,
                                                                                                     monkeypatch):
    from h3kit.service import restart_policy
    monkeypatch.setattr(restart_policy, "_wait_port_or_name_holder", lambda *a: None)
    for alive, reason in ((True, "dropped"), (False, "crash")):
        rec, saved = _dead_server(monkeypatch, tmp_path, restart_policy, alive=alive)
        _, _, restored = restart_policy._stop_start_restore(tmp_path, rec, alive, saved, None, {}, grace=1.0,
                                                            timeout=1.0, requeue_running=False, progress=print)
        assert restored.restored == ["p1"]
    record, series = _fates_on_file(tmp_path)
    assert record["prompts_lost"] == {"dropped": 1, "crash": 1, "refused": 2}
    assert record["prompts_requeued"] == {"pending": 2}
    assert series['h3kit_prompts_lost_total{reason="dropped"}'] == "1"


def test_prompt_counts_keep_the_restarts_and_a_record_of_before_issue_47_reads(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "restarts.json").write_text(json.dumps({"restarts": {"died": 2}}))  # an older record
    assert monitoring.record(tmp_path) == {"restarts": {"died": 2}, "prompts_lost": {}, "prompts_requeued": {},
                                           "last_restart": None}
    monitoring.count_prompts(tmp_path, {"crash": 1}, {"pending": 3})
    monitoring.count_prompts(tmp_path, {"crash": 1, "refused": 1}, {})
    data = json.loads((tmp_path / "metrics" / "restarts.json").read_text())
    assert data == {"restarts": {"died": 2}, "prompts_lost": {"crash": 2, "refused": 1},
                    "prompts_requeued": {"pending": 3}}
    stamp = monitoring.count_restart(tmp_path, "died") and monitoring.record(tmp_path)["last_restart"]
    assert abs(stamp - time.time()) < 3600
    # counting prompts later keeps the time of the last restart on the textfile, not the time of the count
    monitoring.count_prompts(tmp_path, {}, {"running": 1})
    text = (tmp_path / "metrics" / monitoring.TEXTFILE).read_text()
    assert text.splitlines()[-1] == f"h3kit_service_last_restart_timestamp_seconds {stamp:.3f}"
    with pytest.raises(ValueError):
        monitoring.count_prompts(tmp_path, {"vanished": 1}, {})
    (tmp_path / "metrics" / "restarts.json").unlink()
    (tmp_path / "metrics" / "restarts.json").mkdir()  # unwritable: the restart goes on, nothing counted
    assert monitoring.count_prompts(tmp_path, {"crash": 1}, {})["prompts_lost"] == {}
