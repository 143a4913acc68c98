"""Service lifecycle fault cases, against the test stand-in server (tests/support/standin_server.py).

The stand-in is launched by `h3kit start` exactly like ComfyUI (python -B main.py ...) but misbehaves on
request: never healthy, dies during boot, ignores SIGTERM, busy queue, out-of-memory reports. It needs
neither torch nor the upstream tree, so these tests always run.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.support.service_helpers import (StandinHome, free_port, h3kit, http_json, http_status, kill_started_under,
                                     pid_running, port_is_free, wait_for)
from tests.support import jsondoc, requires

from h3kit import monitoring
from h3kit import proc as h3kit_proc
from h3kit import service


@pytest.fixture
def home(tmp_path):
    h = StandinHome(tmp_path / "comfy", free_port(8410, 8469))
    yield h
    kill_started_under(h.path)


def started_pid(home) -> int:
    rec = home.record()
    assert rec is not None, "no server record"
    return rec["pid"]


# --------------------------------------------------------------------------------------------- start


def test_start_waits_for_health_and_records_the_process(home):
    home.configure(boot_delay=5.5)
    t0 = time.monotonic()
    r = home.start(devices="0,1")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert elapsed >= 5.5
    assert http_status(f"{home.url}/system_stats") == 200  # healthy the moment start returns
    assert "healthy after" in r.stdout
    assert "waiting for" in r.stderr  # progress while it waits

    rec = home.record()
    proc = psutil.Process(rec["pid"])
    # the same start as psutil reads it now, to the toolkit's tolerance (boot time moves by whole seconds when the
    # clock is stepped: a 1.00 s difference was seen in CI)
    assert rec["create_time"] == pytest.approx(proc.create_time(), abs=h3kit_proc.CREATE_TIME_TOLERANCE)
    assert rec["cmdline"] == proc.cmdline()
    assert rec["cmdline"][1:] == ["-B", "main.py", "--listen", "127.0.0.1", "--port", str(home.port), "--cpu"]
    assert rec["devices"] == [0, 1] and rec["device_type"] == "cpu" and rec["port"] == home.port
    boot = home.boots()[0]
    assert boot["env"]["H3KIT_SIM_DEVICES"] == "2"
    assert boot["dont_write_bytecode"] == 1
    assert boot["pgid"] == boot["sid"] == rec["pid"]  # own session and process group
    logs = home.root / "logs"
    assert os.readlink(logs / "latest") == os.path.basename(rec["log"])
    assert rec["log"].startswith(str(logs / "comfyui-"))
    assert "stand-in server (not ComfyUI)" in open(rec["log"]).read()


@pytest.mark.parametrize("kind, devices, variable", [("npu", "0,1,2,3", "ASCEND_RT_VISIBLE_DEVICES"),
                                                     ("cuda", "1,3", "CUDA_VISIBLE_DEVICES")])
def test_accelerator_start_exposes_devices_and_checks_them(home, kind, devices, variable):
    # the stand-in is one process: the thread transport (npu and cuda default to one process per device)
    r = home.start("--transport", "threads", devices=devices, device_type=kind)
    assert r.returncode == 0, r.stderr
    boot = home.boots()[0]
    assert boot["env"][variable] == devices
    assert "--cpu" not in boot["argv"]
    st = home.status()
    assert st["running"] and len(st["devices"]) == len(devices.split(","))
    assert home.record()["transport"] == "threads" and boot["env"]["H3KIT_GROUP"] is None


def test_accelerators_default_to_one_process_per_device(home):
    # a stand-in writes no ranks.json, so start waits for the group and names what it waits for
    r = home.start(devices="0,1", device_type="npu", timeout=3)
    assert r.returncode == 1 and "start_timeout" in r.stderr
    assert "group: the process group is unknown" in r.stderr
    boot = home.boots()[0]
    group = json.loads(boot["env"]["H3KIT_GROUP"])
    assert group["local_size"] == 2 and group["nnodes"] == 1 and group["master_addr"] == "127.0.0.1"
    assert 0 < group["master_port"] < 65536 and len(boot["env"]["H3KIT_GROUP_KEY"]) == 64
    assert oct((home.root / "group.key").stat().st_mode)[-3:] == "600"
    assert not pid_running(boot["pid"]) and port_is_free(home.port)


def test_device_count_mismatch_fails_and_stops_the_child(home):
    home.configure(devices=1)
    r = home.start("--transport", "threads", devices="0,1", device_type="npu")
    assert r.returncode == 1
    assert "device_mismatch" in r.stderr and "lists 1 device" in r.stderr
    assert not pid_running(home.boots()[0]["pid"])
    assert port_is_free(home.port)


@pytest.mark.parametrize("devices, fragment", [("1, 2,3", "not a non-negative integer"), ("0,1,2", "3 devices"),
                                               ("2,1", "ascending")])
def test_bad_device_list_is_refused_before_anything_runs(home, devices, fragment):
    r = home.start(devices=devices)
    assert r.returncode == 2
    assert fragment in r.stderr and "Traceback" not in r.stderr
    assert home.boots() == [] and not home.root.exists()


def test_never_healthy_server_times_out_and_is_stopped(home):
    home.configure(healthy=False)
    r = home.start(timeout=2)
    assert r.returncode == 1
    assert "start_timeout" in r.stderr
    assert "stand-in server (not ComfyUI)" in r.stderr  # the log's last lines
    assert not pid_running(home.boots()[0]["pid"])
    assert port_is_free(home.port)
    st = home.status()  # the record stays, naming the dead process, so restart can retry
    assert st["record"] and not st["running"]


def test_server_dying_during_boot_fails_at_once(home):
    home.configure(boot_delay=0.3, exit_during_boot=3)
    t0 = time.monotonic()
    r = home.start(timeout=120)
    assert r.returncode == 1
    assert time.monotonic() - t0 < 30
    assert "server_exited" in r.stderr and "code 3" in r.stderr
    assert "RuntimeError: stand-in boot failure" in r.stderr
    st = home.status()
    assert st["first_error"]["summary"] == "RuntimeError: stand-in boot failure"


def test_start_again_reports_the_running_instance(home):
    assert home.start().returncode == 0
    pid = started_pid(home)
    again = home.start()
    assert again.returncode == 0
    assert "already running" in again.stdout and str(pid) in again.stdout
    assert len(home.boots()) == 1
    other = h3kit("start", "--comfy-home", home.path, "--runtime-root", home.root, "--devices", "0",
                  "--device-type", "cpu", "--port", free_port(8410, 8469, exclude=(home.port,)))
    # a second server of the tree on another port is allowed (issue 46), but not on the devices of the first
    assert other.returncode == 1 and "devices_in_use" in other.stderr and "--port" in other.stderr
    assert len(home.boots()) == 1


def test_public_listen_address_warns(home):
    r = home.start("--listen", "0.0.0.0")
    assert r.returncode == 0, r.stderr
    assert "no authentication" in r.stderr
    assert home.record()["listen"] == "0.0.0.0"
    assert home.status()["healthy"]


def test_extra_args_reach_the_server_and_survive_restart(home):
    bad = home.start(extra=["--port", "9"])
    assert bad.returncode == 2 and "bad_extra_args" in bad.stderr
    r = home.start(extra=["--preview-method", "auto"])
    assert r.returncode == 0, r.stderr
    assert home.record()["extra_args"] == ["--preview-method", "auto"]
    assert home.run("restart").returncode == 0
    assert [b["argv"][-2:] for b in home.boots()] == [["--preview-method", "auto"]] * 2
    assert monitoring.restarts(home.root) == {"manual": 1}  # h3kit_service_restarts_total on the server's /metrics


def test_python_comes_from_the_install_state(home, tmp_path):
    link = tmp_path / "bin" / "python-for-comfy"
    link.parent.mkdir()
    link.symlink_to(sys.executable)
    state = home.path / ".h3kit" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"python": str(link)}))
    r = home.start()
    assert r.returncode == 0, r.stderr
    assert home.record()["python"] == str(link) and home.record()["cmdline"][0] == str(link)
    assert home.run("stop").returncode == 0
    bad = home.start("--python", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "bad_python" in bad.stderr


def test_start_holds_the_lock_until_healthy_and_the_server_does_not(home):
    home.configure(boot_delay=2.0)
    child = subprocess.Popen([sys.executable, "-m", "h3kit", "start", "--comfy-home", str(home.path),
                              "--devices", "0", "--device-type", "cpu", "--port", str(home.port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = home.root / service.LOCK_NAME
    wait_for(lambda: home.boots(), 30, "the stand-in to boot")
    with open(lock, "a") as f:
        with pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # start holds it while waiting for health
        assert child.wait(60) == 0
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on return; the server did not inherit it
        with pytest.raises(service.LockBusy, match="starting or stopping"):
            with service.service_lock(home.root, wait=0.2):
                pass


# --------------------------------------------------------------------------------------------- stop / restart


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(home):
    home.configure(ignore_sigterm=True)
    assert home.start().returncode == 0
    pid = started_pid(home)
    r = home.run("stop", "--grace", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["stopped"] and out["signals"] == ["SIGTERM", "SIGKILL"] and out["pid"] == pid
    assert not pid_running(pid) and port_is_free(home.port) and home.record() is None


def test_stop_without_a_record_is_a_no_op(home):
    r = home.run("stop")
    assert r.returncode == 0 and "nothing to stop" in r.stdout


def posted(home) -> list[tuple]:
    """(boot, prompt_id, client_id) of every POST /prompt the stand-in's boots received, in order."""
    path = home.path / "standin-prompts.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    return [(r["boot"], r.get("prompt_id"), r.get("client_id")) for r in rows]


def pending_ids(home) -> list[str]:
    return [item[1] for item in http_json(f"{home.url}/queue")["queue_pending"]]


def test_a_running_prompt_refuses_restart_unless_forced_and_pending_prompts_are_kept(home):
    home.configure(boots=[{"queue": [1, 3]}])  # only the first boot has a queue of its own
    assert home.start().returncode == 0
    pid = started_pid(home)
    r = home.run("restart")
    assert r.returncode == 1
    assert "queue_busy" in r.stderr and "prompt r0 is running (3 pending" in r.stderr
    assert "--force" in r.stderr and "--requeue-running" in r.stderr
    assert pid_running(pid) and started_pid(home) == pid and not (home.root / "queue.json").exists()
    forced = home.run("restart", "--force", "--json")
    assert forced.returncode == 0, forced.stderr
    assert not pid_running(pid) and started_pid(home) != pid
    out = jsondoc.data(forced.stdout, forced.returncode)
    assert out["queue"] == {"running": 1, "pending": 3}
    assert out["restored"]["restored"] == ["p0", "p1", "p2"] and out["restored"]["running"] == ["r0"]
    assert out["restored"]["requeued_running"] is False and out["restored"]["failed"] == []
    # queued again on the new boot, in order, with their client ids; the running one was not
    assert posted(home) == [(1, "p0", "standin-client"), (1, "p1", "standin-client"), (1, "p2", "standin-client")]
    assert pending_ids(home) == ["p0", "p1", "p2"]
    # the save is consumed: a second restart does not submit them twice
    assert not (home.root / "queue.json").exists()
    kept = home.root / "queue.restored.json"
    assert oct(kept.stat().st_mode & 0o777) == "0o600"
    assert json.loads(kept.read_text())["outcome"]["restored"] == ["p0", "p1", "p2"]
    # /metrics (issue 47): the running prompt the forced restart stopped is lost, "dropped"; the pending ones are back
    got = monitoring.record(home.root)
    assert (got["prompts_lost"], got["prompts_requeued"]) == ({"dropped": 1}, {"pending": 3})


def test_requeue_running_queues_the_running_prompt_first_and_a_refused_prompt_is_reported(home):
    home.configure(boots=[{"queue": [1, 2]}, {"refuse": ["p1"]}])
    assert home.start().returncode == 0
    home.report_oom()
    wait_for(lambda: "Got an OOM" in open(home.record()["log"]).read(), 10, "the OOM lines")
    r = home.run("restart", "--requeue-running")
    assert r.returncode == 0, r.stderr
    assert posted(home) == [(1, "r0", "standin-client"), (1, "p0", "standin-client"), (1, "p1", "standin-client")]
    assert pending_ids(home) == ["r0", "p0"]
    assert ("running when the server went down: prompt r0 (first error: torch.OutOfMemoryError: NPU out of memory."
            in r.stdout) and "queued again first (--requeue-running)" in r.stdout
    assert "NOT restored: prompt p1: " in r.stdout and "Prompt outputs failed validation" in r.stdout
    saved = json.loads((home.root / "queue.restored.json").read_text())
    assert [i["prompt_id"] for i in saved["pending"]] == ["p0", "p1"]  # the refused prompt can still be read
    got = monitoring.record(home.root)  # r0 runs again: not lost; p1 is, refused by the new server
    assert (got["prompts_lost"], got["prompts_requeued"]) == ({"refused": 1}, {"running": 1, "pending": 1})


def test_restart_after_a_crash_restores_what_watch_saved_last(home):
    home.configure(boots=[{"queue": [1, 2]}])
    assert home.start().returncode == 0
    pid = started_pid(home)
    r = home.run("watch", "--interval", "0.2", "--max-seconds", "1")
    assert r.returncode == 0, r.stderr
    assert json.loads((home.root / "queue.json").read_text())["pid"] == pid
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_running(pid), 10, "the server to die")
    r = home.run("restart", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["was_running"] is False and out["restored"]["restored"] == ["p0", "p1"]
    assert pending_ids(home) == ["p0", "p1"]
    got = monitoring.record(home.root)  # r0 died with the server and was not queued again
    assert (got["prompts_lost"], got["prompts_requeued"]) == ({"crash": 1}, {"pending": 2})
    # h3kit stop ends the service on purpose: no save is left for a later restart to revive. A short watch saves
    # on its first healthy tick; on a loaded host that tick's check can time out, so watch again until one saves
    wait_for(lambda: home.run("watch", "--interval", "0.2", "--max-seconds", "0.5").returncode == 0
             and (home.root / "queue.json").exists(), 60, "a watch tick to save the restarted server's queue")
    assert home.run("stop").returncode == 0 and not (home.root / "queue.json").exists()


def test_restart_shows_the_previous_oom(home):
    assert home.start().returncode == 0
    home.report_oom()
    wait_for(lambda: "Got an OOM" in open(home.record()["log"]).read(), 10, "the OOM lines")
    st = home.status()
    assert st["first_error"]["kind"] == "oom"
    assert st["first_error"]["summary"] == "torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB"
    r = home.run("restart", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["previous_error"]["kind"] == "oom" and out["was_running"]
    assert set(out["phases"]) == {"check", "stop", "port", "start", "total"}
    text = home.run("restart")
    assert text.returncode == 0
    assert "previous run's log shows no error" in text.stdout  # the new log is clean
    assert "phases: check" in text.stdout


def _record_of(proc: psutil.Process, home, **over) -> dict:
    rec = {"pid": proc.pid, "create_time": proc.create_time(), "cmdline": proc.cmdline(),
           "port": home.port, "listen": "127.0.0.1", "device_type": "cpu", "devices": [0],
           "python": sys.executable, "comfy_home": str(home.path),
           "log": str(home.root / "logs" / "comfyui-20260101-000000.log"), "extra_args": [],
           "started_at": "2026-01-01T00:00:00+00:00"}
    rec.update(over)
    return rec


@pytest.mark.parametrize("case", ["other_tree", "create_time", "cmdline", "interpreter"])
def test_a_record_naming_a_foreign_process_is_never_acted_on(home, tmp_path, case):
    """pid, start time and command line can all match a process that is not this tree's server: its main.py
    is another tree's, or it runs under another interpreter than the one h3kit launched."""
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (decoy / "main.py").write_text("import time\ntime.sleep(120)\n")
    argv = ["-B", "main.py", "--listen", "127.0.0.1", "--port", str(home.port), "--cpu"]
    if case == "interpreter":
        other_python = shutil.which("python3", path="/usr/bin:/bin")
        if not other_python or os.path.realpath(other_python) == os.path.realpath(sys.executable):
            requires.skip("no second Python interpreter on this machine (/usr/bin/python3 other than this one)")
        foreign = subprocess.Popen([other_python, *argv], cwd=home.path)  # this tree's main.py, the stand-in
    else:
        foreign = subprocess.Popen([sys.executable, *argv] + (["--highvram"] if case == "cmdline" else []),
                                   cwd=decoy)
    try:
        proc = psutil.Process(foreign.pid)
        wait_for(lambda: "main.py" in proc.cmdline(), 10, "the decoy to run")
        if case == "interpreter":  # the stand-in prints its banner before it listens: the restart must find it held
            wait_for(lambda: http_status(f"{home.url}/") is not None, 30, "the foreign server to listen")
        record = _record_of(proc, home)
        if case == "create_time":
            record["create_time"] -= 3600  # the recorded server started an hour before this process
        if case == "cmdline":
            record["cmdline"] = record["cmdline"][:-1]  # what h3kit ran; the process runs something else
        home.root.mkdir(parents=True)
        (home.root / "server.json").write_text(json.dumps(record))

        st = home.status()
        assert st["running"] is False, st
        expected = {"other_tree": f"runs {decoy / 'main.py'}", "create_time": "another process",
                    "cmdline": "different command line", "interpreter": "its interpreter is"}[case]
        assert expected in st["stale"], st["stale"]
        r = home.run("stop")
        assert r.returncode == 0 and "stale record removed, nothing signalled" in r.stdout
        assert home.record() is None and foreign.poll() is None

        (home.root / "server.json").write_text(json.dumps(record))
        t0 = time.monotonic()
        r = home.run("restart")  # the settings are reused, the foreign process is left alone
        if case == "interpreter":  # that one holds the port: named at once, not after PORT_WAIT
            assert r.returncode == 1 and f"in use by pid {foreign.pid}" in r.stderr, r.stderr
            assert time.monotonic() - t0 < service.PORT_WAIT / 2, time.monotonic() - t0
        else:
            assert r.returncode == 0, r.stderr
            assert "was not running" in r.stdout
            assert started_pid(home) != foreign.pid
        assert foreign.poll() is None
    finally:
        foreign.kill()
        foreign.wait()


def test_a_record_matching_a_foreign_sleep_is_a_bad_record(home):
    foreign = subprocess.Popen(["sleep", "1000"])
    try:
        record = _record_of(psutil.Process(foreign.pid), home)
        home.root.mkdir(parents=True)
        (home.root / "server.json").write_text(json.dumps(record))
        for command in ("status", "stop", "restart", "logs", "watch"):
            r = home.run(command, *(["--max-seconds", "1"] if command == "watch" else []))
            assert r.returncode == 1, (command, r.stderr)
            assert "bad_record" in r.stderr and "does not run main.py" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert foreign.poll() is None
    finally:
        foreign.kill()
        foreign.wait()


def test_restart_without_a_record_says_start_first(home):
    r = home.run("restart")
    assert r.returncode == 1 and "not_started" in r.stderr


# --------------------------------------------------------------------------------------------- logs


def test_logs_print_filter_and_follow(home):
    assert home.start().returncode == 0
    home.report_oom()
    log = home.record()["log"]
    wait_for(lambda: "Got an OOM" in open(log).read(), 10, "the OOM lines")
    whole = home.run("logs")
    assert whole.returncode == 0 and "stand-in server (not ComfyUI)" in whole.stdout
    assert "\x1b[" not in whole.stdout  # colours are dropped when the output is not a terminal
    assert home.run("logs", "-n", "2").stdout.splitlines() == [
        "[INFO] Memory summary: (stand-in)", "[ERROR] Got an OOM, unloading all loaded models."]
    errors = home.run("logs", "--errors").stdout
    assert "OUT OF MEMORY" in errors and "torch.OutOfMemoryError" in errors
    assert "stand-in server" not in errors

    follow = subprocess.Popen([sys.executable, "-m", "h3kit", "logs", "-f", "--errors",
                               "--runtime-root", str(home.root)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: "OUT OF MEMORY" in follow.stdout.readline(), 15, "the existing OOM block")
        assert home.run("restart").returncode == 0
        wait_for(lambda: "new server log" in follow.stdout.readline(), 15, "the switch to the new log")
        home.report_oom()
        wait_for(lambda: "OUT OF MEMORY" in follow.stdout.readline(), 15, "the new OOM, followed live")
    finally:
        follow.send_signal(signal.SIGTERM)
        assert follow.wait(10) == 0


def test_logs_without_any_log(home):
    r = home.run("logs")
    assert r.returncode == 1 and "no_log" in r.stderr


# --------------------------------------------------------------------------------------------- watch

WATCH_FAST = ["--interval", "0.2", "--backoff", "0.1", "--grace", "2", "--timeout", "30"]


def spawn_watch(home, *args):
    return subprocess.Popen([sys.executable, "-m", "h3kit", "watch", "--runtime-root", str(home.root),
                             *WATCH_FAST, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_watch_restarts_a_dead_server_and_ends_on_stop(home):
    assert home.start().returncode == 0
    pid = started_pid(home)
    watch = spawn_watch(home, "--max-seconds", "60")
    try:
        assert "watching" in watch.stderr.readline()  # watch holds the record and follows this server now
        os.kill(pid, signal.SIGKILL)
        new = wait_for(lambda: (home.record() or {}).get("pid") not in (None, pid) and home.status()["healthy"],
                       30, "watch to restart the server")
        assert new
        assert home.run("stop").returncode == 0
        out, errs = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, errs
    assert "watch ended (stopped)" in out
    assert "the server is not running" in errs and "started" in errs
    assert monitoring.restarts(home.root) == {"died": 1}


def test_a_server_that_stop_killed_before_removing_its_record_is_no_restart(home, monkeypatch):
    # `h3kit stop` kills the server, waits for its port, then removes the record: a watch tick in between sees a
    # dead server with a record. Its restart finds no record under the lock and must count nothing (CI once read
    # {"died": 2} here). The tick's backoff pause is where the stop finishes, made certain by the patched sleep.
    from h3kit import supervise
    assert home.start().returncode == 0
    pid = started_pid(home)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_running(pid), 10, "the server to die")
    real_sleep = time.sleep

    def stop_finishes(seconds):
        service.remove_record(home.root)
        real_sleep(0)

    monkeypatch.setattr(supervise.time, "sleep", stop_finishes)
    events: list[dict] = []
    out = supervise.watch(home.root, supervise.WatchPolicy(interval=0.1, backoff=0.1, max_seconds=30),
                          on_event=events.append)
    assert [e["event"] for e in events] == ["watching", "restart"]
    assert out.reason == "stopped" and out.restarts == 0
    assert monitoring.restarts(home.root) == {}


def test_watch_restores_the_queue_after_a_kill_9(home):
    home.configure(boots=[{"queue": [1, 2]}])
    assert home.start().returncode == 0
    pid = started_pid(home)
    watch = spawn_watch(home, "--max-seconds", "60")
    try:
        wait_for(lambda: (home.root / "queue.json").exists(), 20, "watch's first save")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: len(posted(home)) == 2, 30, "watch to restore the queue")
        assert home.run("stop").returncode == 0
        out, errs = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, errs
    assert posted(home) == [(1, "p0", "standin-client"), (1, "p1", "standin-client")]  # r0 was not requeued
    assert "queue_saved: 1 running, 2 pending prompt(s) (saved by the last healthy check" in errs
    assert "running when the server went down: prompt r0" in errs and "not queued again" in errs
    assert "2 prompt(s) queued again" in out
    # both records (issue 47): the server's /metrics and node_exporter's textfile count r0 lost to the crash
    got = monitoring.record(home.root)
    assert (got["prompts_lost"], got["prompts_requeued"]) == ({"crash": 1}, {"pending": 2})
    assert 'h3kit_prompts_lost_total{reason="crash"} 1' in \
        (home.root / "metrics" / monitoring.TEXTFILE).read_text().splitlines()


def test_watch_restarts_after_consecutive_failed_health_checks(home):
    home.configure(boots=[{"unhealthy_after": 0.5}])  # only the first boot goes bad
    assert home.start().returncode == 0
    pid = started_pid(home)
    watch = spawn_watch(home, "--failures", "3", "--max-seconds", "60")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        # watch's own "started" line, not the server's health: a SIGTERM while watch still waits for the new
        # server's health is an interrupted start, which (rightly) takes that server down with it
        wait_for(lambda: any("started" in line for line in lines), 30, "watch's restart")
        watch.send_signal(signal.SIGTERM)
        out = watch.stdout.read()
        watch.wait(20)
        reader.join(10)
        errs = "".join(lines)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert len(home.boots()) == 2
    assert watch.returncode == 0
    assert errs.count("health_failed") >= 3 and "3 failed health checks in a row" in errs
    assert monitoring.restarts(home.root) == {"unhealthy": 1}
    assert 'h3kit_service_restarts_total{reason="unhealthy"} 1' in (home.root / "metrics" / "h3kit_service.prom").read_text()
    assert "watch ended (interrupted)" in out
    assert not pid_running(pid) and pid_running(started_pid(home))  # ending watch leaves the server up


def test_watch_stops_a_crash_loop_with_capped_backoff(home):
    # the first boot dies after half a second; every later boot dies while booting
    home.configure(exit_during_boot=1, boots=[{"exit_during_boot": None, "die_after": 0.5}])
    assert home.start().returncode == 0
    watch = spawn_watch(home, "--crash-limit", "3", "--crash-window", "120", "--backoff-max", "0.2",
                        "--max-seconds", "60")
    out, errs = watch.communicate(timeout=90)
    assert watch.returncode == 1, errs
    assert "crash_loop" in errs and "3 restarts within 120 s" in errs
    assert "RuntimeError: stand-in boot failure" in errs  # the first error of the last log
    delays = [line.split("restarting in ")[1].split(" s")[0] for line in errs.splitlines() if "restarting in" in line]
    assert delays == ["0.1", "0.2", "0.2"]  # doubling, capped at --backoff-max
    assert len(home.boots()) == 4
    assert not any(pid_running(b["pid"]) for b in home.boots())


def test_watch_backoff_starts_again_after_a_stable_period(home):
    # every boot is healthy for 3 s, then dies: room for watch's two checks 0.3 s apart after its restart's own wait
    # for health, on a loaded machine too (at 1 s, one check of a torch-free run in a .ci/run of 2026-12-06 came too
    # late and the delay doubled)
    home.configure(die_after=3.0)
    assert home.start().returncode == 0
    watch = spawn_watch(home, "--interval", "0.1", "--stable-after", "0.3", "--backoff-max", "10",
                        "--crash-limit", "3", "--max-seconds", "60")
    out, errs = watch.communicate(timeout=90)
    assert watch.returncode == 1 and "crash_loop" in errs, errs
    delays = [line.split("restarting in ")[1].split(" s")[0] for line in errs.splitlines() if "restarting in" in line]
    assert delays == ["0.1", "0.1", "0.1"]  # each server was stable for 0.3 s before it died: no doubling


def test_watch_ends_at_max_seconds_and_leaves_the_server_running(home):
    assert home.start().returncode == 0
    r = home.run("watch", "--interval", "0.2", "--max-seconds", "1", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["reason"] == "time_limit" and out["restarts"] == 0 and out["events"][0]["event"] == "watching"
    assert pid_running(started_pid(home))


@pytest.mark.parametrize("where", ["log", "history"])
def test_watch_frees_memory_after_an_oom_before_anything_harsher(home, where):
    assert home.start().returncode == 0
    pid = started_pid(home)
    watch = spawn_watch(home, "--max-seconds", "60")
    try:
        first = watch.stderr.readline()  # "watching" comes once the log offset and history are read
        assert "watching" in first
        home.report_oom(log=where == "log", history=where == "history")
        frees = wait_for(home.frees, 15, "POST /free")
        # three more ticks (each reads /history) after the free: the same OOM must not be answered twice
        ticks = home.history_reads()
        wait_for(lambda: home.history_reads() >= ticks + 3, 60, "three more ticks of watch")
        watch.send_signal(signal.SIGTERM)
        out, errs = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert frees[0] == {"unload_models": True, "free_memory": True}
    assert len(home.frees()) == 1
    assert "out of memory reported" in errs and "POST /free" in errs
    assert started_pid(home) == pid and len(home.boots()) == 1  # no restart


def test_watch_needs_a_record(home):
    r = home.run("watch", "--max-seconds", "1")
    assert r.returncode == 1 and "not_started" in r.stderr


# --------------------------------------------------------------------------------------------- launch scripts


def test_launch_scripts_start_four_devices_and_restart(home):
    from pathlib import Path
    launch = Path(__file__).resolve().parents[1] / "launch"
    env = dict(os.environ, NPU_DEVICES="0,1,2,3", COMFYUI_PORT=str(home.port),
               H3KIT_RUNTIME_ROOT=str(home.root), H3KIT_COMFY_HOME=str(home.path),
               H3KIT=f"{sys.executable} -m h3kit", H3KIT_TRANSPORT="threads")  # the stand-in is one process
    r = subprocess.run([str(launch / "start-4npu.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert home.boots()[0]["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"
    assert len(home.status()["devices"]) == 4
    pid = started_pid(home)
    r = subprocess.run([str(launch / "restart.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert started_pid(home) != pid and home.status()["healthy"]
    assert home.boots()[1]["env"]["ASCEND_RT_VISIBLE_DEVICES"] == "0,1,2,3"


# ------------------------------------------------------------------- review fixes: identity and settings


def test_a_wrapper_interpreter_is_still_recognised_and_stopped(home, tmp_path):
    """--python may be a script that sets the environment up and execs Python (CANN's set_env.sh, a shim):
    the server must stay recognisable as ours, and stop must really stop it."""
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/bash\nsleep 0.3\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    r = home.start("--python", str(wrapper))
    assert r.returncode == 0, r.stderr
    rec = home.record()
    assert rec["cmdline"][0] != "/bin/bash"  # rewritten once the wrapper had exec'd Python
    st = home.status()
    assert st["running"] is True, st
    pid = rec["pid"]
    r = h3kit("stop", "--comfy-home", home.path)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: not pid_running(pid), 10, "the wrapped server to exit")
    assert port_is_free(home.port)


def test_start_refuses_our_server_running_with_other_settings(home):
    assert home.start(devices="0").returncode == 0
    pid = started_pid(home)
    r = home.start("--json", devices="0,1,2,3")
    assert r.returncode == 1
    err = jsondoc.error(r.stdout, r.returncode)
    assert err["code"] == "already_running_other_settings" and "h3kit stop" in err["fix"]
    assert pid_running(pid) and started_pid(home) == pid  # left exactly as it was
    other_python = home.path.parent / "python-other"
    other_python.symlink_to(sys.executable)
    r = home.start("--json", "--python", str(other_python), devices="0")  # same devices, another interpreter
    assert r.returncode == 1 and jsondoc.error(r.stdout, r.returncode)["code"] == "already_running_other_settings"


def test_a_bad_comfy_home_changes_nothing(tmp_path):
    typo = tmp_path / "typo"
    r = h3kit("start", "--comfy-home", typo, "--devices", "0", "--device-type", "cpu")
    assert r.returncode == 2 and "no main.py" in r.stderr
    assert not typo.exists()  # no runtime root, lock or log left behind


def test_listen_on_an_address_of_another_machine_is_bad_input(home):
    r = home.start("--listen", "192.0.2.1")  # TEST-NET-1: never assigned to this machine
    assert r.returncode == 2 and "not an address of this machine" in r.stderr and "Traceback" not in r.stderr
    assert home.record() is None


def test_a_signal_while_the_server_starts_leaves_no_server(home):
    """SIGTERM (or Ctrl-C) that lands just after the server is started, before it is recorded and start's cleanup is
    in place (the kill point `server-started`), waits until it is: start exits 143 and no server is left, its port
    free. Before, the server, in its own session, outlived h3kit unrecorded, holding the port (and, on a real host,
    the devices), and `h3kit stop` could not name it."""
    r = home.run("start", "--devices", "0", "--device-type", "cpu", "--port", home.port, "--timeout", 60,
                 env=dict(os.environ, H3KIT_TEST_KILL_AT="server-started:1:TERM"))
    assert r.returncode == 143 and "Traceback" not in r.stderr, r.stderr
    rec = home.record()
    assert rec is not None, "the started server was not recorded"
    assert not pid_running(rec["pid"]), "the interrupted start left its server running"
    assert port_is_free(home.port)
    assert all(not pid_running(b["pid"]) for b in home.boots()), "a stand-in that booted still runs"
