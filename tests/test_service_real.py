"""Service lifecycle against the real ComfyUI server on CPU.

One server is shared by the tests of this module, which run in file order: start, status, the busy-queue
refusal, restart after an idle run (with a real out-of-memory error in its log when the host refuses
impossible allocations), SIGKILL then restart, a foreign port holder, stop. That is three boots of 10-20 s
each. Every test first makes sure the server is in the state it needs, so each also runs alone.

The server runs in a copy of the installed tree (ComfyUI writes its database and outputs there), from the
default runtime root `.h3kit/run` where install put the launch scripts: the first start goes through
`start-4npu.sh` and the restart of the killed server through `restart.sh`, as a deployment would. Ports
come from 8470-8489.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.service_helpers import (Home, free_port, http_json, http_status, kill_started_under,
                                     pid_running, port_is_free, wait_for)
from tests.support import jsondoc

# The tree the server runs from: the patched install. With "pin_tree" (the plain pin) the same tests run,
# with the h3kit commands in place of the launch scripts install would have put there.
TREE_FIXTURE = "installed_tree"
BOOT_TIMEOUT = 240

pytestmark = [pytest.mark.upstream, pytest.mark.slow]


@pytest.fixture(scope="module")
def comfy_tree(request, tmp_path_factory):
    source = request.getfixturevalue(TREE_FIXTURE)
    dest = tmp_path_factory.mktemp("service-real") / "ComfyUI"
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git"), symlinks=True)
    yield dest
    kill_started_under(dest)


@pytest.fixture(scope="module")
def server(comfy_tree, comfy_python):
    home = Home(comfy_tree, free_port(8470, 8489))
    home.python = comfy_python
    yield home
    home.run("stop", "--grace", "5")


def start(home: Home):
    return home.start("--python", home.python, timeout=BOOT_TIMEOUT)


def launch(home: Home, script: str, *args):
    """Run an installed launch script the way an operator would: only the documented variables set."""
    path = home.root / script
    if not path.exists():
        assert TREE_FIXTURE != "installed_tree", f"install did not put {script} in {home.root}"
        return None
    env = dict(os.environ, NPU_DEVICES="0", COMFYUI_PORT=str(home.port), H3KIT_DEVICE_TYPE="cpu",
               H3KIT=f"{sys.executable} -m h3kit")
    for name in ("H3KIT_RUNTIME_ROOT", "H3KIT_COMFY_HOME"):
        env.pop(name, None)  # the scripts find both from where they live
    return subprocess.run([str(path), *args], env=env, capture_output=True, text=True, timeout=BOOT_TIMEOUT + 60)


def ensure_running(home: Home) -> int:
    st = home.status()
    if not (st["running"] and st["healthy"]):
        r = start(home)
        assert r.returncode == 0, r.stderr
    return home.record()["pid"]


def queue(home: Home) -> tuple[int, int]:
    q = http_json(f"{home.url}/queue")
    return len(q["queue_running"]), len(q["queue_pending"])


def blur_prompt(color: int) -> dict:
    # ~2-3 s on this machine's CPU, no model needed; the colour defeats the output cache
    return {"1": {"class_type": "EmptyImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1,
                                                        "color": color}},
            "2": {"class_type": "ImageBlur", "inputs": {"image": ["1", 0], "blur_radius": 31, "sigma": 10.0}},
            "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}}}


def test_start_waits_for_health(server):
    st = server.status()
    assert not st["running"]
    # the interpreter comes from install's state.json when the script starts it
    r = launch(server, "start-4npu.sh") or start(server)
    assert r.returncode == 0, r.stderr
    assert http_status(f"{server.url}/system_stats") == 200
    rec = server.record()
    assert pid_running(rec["pid"])
    assert rec["cmdline"][1:4] == ["-B", "main.py", "--listen"] and "--cpu" in rec["cmdline"]
    assert "Starting server" in Path(rec["log"]).read_text()
    assert f"started: pid {rec['pid']}" in r.stdout
    assert rec["python"] == server.python and rec["devices"] == [0] and rec["port"] == server.port


def test_status_reports_the_running_server(server):
    pid = ensure_running(server)
    st = server.status()
    assert st["running"] is True and st["healthy"] is True and st["pid"] == pid
    assert st["uptime_s"] > 0 and st["port"] == server.port
    assert st["devices"] and st["devices"][0]["name"] == "cpu" and st["devices"][0]["vram_total"] > 0
    assert st["queue"] == {"running": 0, "pending": 0}
    text = server.run("status")
    assert text.returncode == 0 and f"running: yes, pid {pid}" in text.stdout and "queue: 0 running" in text.stdout


def test_busy_queue_makes_restart_refuse_without_force(server):
    pid = ensure_running(server)
    for i in range(4):
        http_json(f"{server.url}/prompt", {"prompt": blur_prompt(int(time.time() * 1000 + i) % 16777215)})
    try:
        wait_for(lambda: sum(queue(server)) >= 2, 20, "the queue to fill")
        r = server.run("restart")
        assert r.returncode == 1
        assert "queue_busy" in r.stderr and "pending prompt(s)" in r.stderr and "--force" in r.stderr
        assert server.record()["pid"] == pid and pid_running(pid)
    finally:
        http_json(f"{server.url}/queue", {"clear": True})
        http_json(f"{server.url}/interrupt", {})
        wait_for(lambda: queue(server) == (0, 0), 60, "the queue to drain")


def test_restart_after_an_idle_run(server):
    pid = ensure_running(server)
    oom = _host_refuses_huge_allocations()
    if oom:
        # A real failure in the log: an allocation no host can satisfy fails at once ("can't allocate
        # memory"), which the runbook treats as an out-of-memory error.
        huge = {"1": {"class_type": "EmptyImage",
                      "inputs": {"width": 16384, "height": 16384, "batch_size": 4096, "color": 0}},
                "2": {"class_type": "PreviewAny", "inputs": {"source": ["1", 0]}}}
        prompt_id = http_json(f"{server.url}/prompt", {"prompt": huge})["prompt_id"]
        wait_for(lambda: http_json(f"{server.url}/history/{prompt_id}"), 30, "the prompt to fail")
        first = server.status()["first_error"]
        assert first["kind"] == "oom" and "can't allocate memory" in first["summary"]
    r = server.run("restart", "--json", timeout=BOOT_TIMEOUT + 60)
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["was_running"] and out["previous_pid"] == pid and out["pid"] != pid
    assert out["queue"] == {"running": 0, "pending": 0}
    assert out["phases"]["start"] > 1 and out["phases"]["total"] >= out["phases"]["start"]
    if oom:
        assert out["previous_error"]["kind"] == "oom"
    assert not pid_running(pid)
    assert http_status(f"{server.url}/system_stats") == 200
    assert server.status()["first_error"] is None  # the new run's log is clean


# --- the queue survives restarts: three prompts, the first one running, the other two pending --------------


def queue_three(home: Home) -> list[str]:
    """Queue three prompts with client ids; return their ids once the first runs and the others wait. The first
    is four times the work of the others, so it is still running while a restart reads the queue."""
    seed = int(time.time() * 1000)
    first = blur_prompt(seed % 16777215)
    first["1"]["inputs"].update(width=2048, height=2048)
    ids = [http_json(f"{home.url}/prompt", {"prompt": p, "client_id": f"h3kit-test-client-{i}"})["prompt_id"]
           for i, p in enumerate([first, blur_prompt((seed + 1) % 16777215), blur_prompt((seed + 2) % 16777215)])]

    def settled():
        q = http_json(f"{home.url}/queue")
        return [i[1] for i in q["queue_running"]] == ids[:1] and [i[1] for i in q["queue_pending"]] == ids[1:]
    wait_for(settled, 30, "the first prompt to run and the others to wait")
    return ids


def completed(home: Home, prompt_id: str) -> dict | None:
    """The history entry of a prompt that ran to success on the server now on the port, else None."""
    try:
        entry = http_json(f"{home.url}/history/{prompt_id}").get(prompt_id)
    except OSError:
        return None
    return entry if entry and entry["status"]["status_str"] == "success" else None


def assert_ran_again(home: Home, ids: list[str], clients: list[int]) -> None:
    for prompt_id, client in zip(ids, clients):
        entry = wait_for(lambda: completed(home, prompt_id), 180, f"prompt {prompt_id} to complete")
        assert entry["prompt"][3]["client_id"] == f"h3kit-test-client-{client}"  # its client sees it run


def test_restart_while_a_prompt_runs_keeps_the_pending_prompts(server):
    pid = ensure_running(server)
    ids = queue_three(server)
    r = server.run("restart", "--force", "--json", timeout=BOOT_TIMEOUT + 60)
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["previous_pid"] == pid and out["queue"] == {"running": 1, "pending": 2}
    assert out["restored"]["running"] == ids[:1] and out["restored"]["requeued_running"] is False
    assert out["restored"]["restored"] == ids[1:] and out["restored"]["failed"] == []
    # the other two complete on the new server, under their own ids, without anyone submitting them again
    assert_ran_again(server, ids[1:], [1, 2])
    assert completed(server, ids[0]) is None and not http_json(f"{server.url}/history/{ids[0]}")


def test_requeue_running_runs_the_interrupted_prompt_again_first(server):
    ensure_running(server)
    ids = queue_three(server)
    r = server.run("restart", "--requeue-running", timeout=BOOT_TIMEOUT + 60)
    assert r.returncode == 0, r.stderr
    assert f"running when the server went down: prompt {ids[0]}" in r.stdout
    assert "queued again first (--requeue-running)" in r.stdout
    assert_ran_again(server, ids, [0, 1, 2])
    history = http_json(f"{server.url}/history")
    assert [history[i]["prompt"][0] for i in ids] == sorted(history[i]["prompt"][0] for i in ids)  # in order


def test_watch_restores_the_queue_after_a_kill_9(server):
    pid = ensure_running(server)
    watch = subprocess.Popen([sys.executable, "-m", "h3kit", "watch", "--comfy-home", str(server.path),
                              "--runtime-root", str(server.root), "--interval", "0.5", "--backoff", "0.1",
                              "--timeout", str(BOOT_TIMEOUT), "--max-seconds", str(BOOT_TIMEOUT + 300)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(watch.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        ids = queue_three(server)
        save = server.root / "queue.json"

        def saved():
            data = json.loads(save.read_text()) if save.exists() else {}
            return [i["prompt_id"] for i in data.get("pending", [])] == ids[1:]
        wait_for(saved, 30, "watch to save the queue")
        os.kill(pid, signal.SIGKILL)  # no server left to ask: watch restores its last save
        wait_for(lambda: any(" restored: " in line for line in lines), BOOT_TIMEOUT + 60, "watch's restore")
        watch.send_signal(signal.SIGTERM)  # the restarted server keeps running
        watch.wait(30)
        reader.join(10)
    finally:
        if watch.poll() is None:
            watch.kill()
    errs = "".join(lines)
    assert "saved by the last healthy check" in errs and f"prompt {ids[0]}" in errs, errs
    assert_ran_again(server, ids[1:], [1, 2])
    assert server.record()["pid"] != pid


def test_sigkilled_server_is_seen_as_not_running_and_restarted(server):
    pid = ensure_running(server)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_running(pid), 10, "the server to die")
    st = server.run("status")
    assert st.returncode == 1 and "running: no" in st.stdout and f"process {pid} has exited" in st.stdout
    assert server.status()["running"] is False  # the record is still there; the process is not
    r = launch(server, "restart.sh") or server.run("restart", timeout=BOOT_TIMEOUT + 60)
    assert r.returncode == 0, r.stderr
    assert "was not running" in r.stdout
    assert server.status()["healthy"]


def test_foreign_process_on_the_port_is_refused_and_left_alive(server, comfy_tree, tmp_path):
    server_pid = ensure_running(server)
    port = free_port(8470, 8489)  # reserved: never the server's
    foreign = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        wait_for(lambda: not port_is_free(port), 15, "the foreign server to listen")
        other = Home(comfy_tree, port, runtime_root=tmp_path / "other-run")
        r = other.start("--python", server.python, "--json")
        assert r.returncode == 1
        err = jsondoc.error(r.stdout, r.returncode)
        assert err["code"] == "port_in_use" and err["details"]["holders"][0]["pid"] == foreign.pid
        assert f"pid {foreign.pid}" in r.stderr and "http.server" in r.stderr
        assert foreign.poll() is None and other.record() is None

        # h3kit's own server, seen from another runtime root, is just as foreign there
        mine = Home(comfy_tree, server.port, runtime_root=tmp_path / "third-run")
        r = mine.start("--python", server.python)
        assert r.returncode == 1 and f"pid {server_pid}" in r.stderr
        assert pid_running(server_pid) and mine.record() is None
    finally:
        foreign.terminate()
        foreign.wait(10)


def test_stop_frees_the_port(server):
    pid = ensure_running(server)
    r = server.run("stop", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["stopped"] and out["pid"] == pid and out["signals"] == ["SIGTERM"]
    assert port_is_free(server.port) and not pid_running(pid)
    assert server.record() is None
    assert server.run("status").returncode == 1


def test_comfyuis_own_option_rules_guard_the_arguments_after_the_separator(server):
    """The real tree's comfy/cli_args.py decides: its prefixes of --listen/--port are refused before a
    server starts, and an argument only ComfyUI can judge ends the real server with argparse's line, which
    start, status and logs --errors show."""
    if server.status()["running"]:
        server.run("stop")
    for extra, said in ((["--liste", "0.0.0.0"], "(ComfyUI reads it as --listen)"),
                        (["--por", "8308"], "(ComfyUI reads it as --port)"),
                        (["--cuda-dev", "1"], "(ComfyUI reads it as --cuda-device)"),
                        (["--oneapi", "x"], "would set the devices"),
                        (["--highvram"], "not allowed with argument --cpu")):
        r = server.start("--python", server.python, extra=extra)
        assert r.returncode == 2 and "bad_extra_args" in r.stderr and said in r.stderr, r.stderr
    r = server.start("--python", server.python, extra=["--front-end-root", "/nonexistent/h3kit"], timeout=60)
    line = "main.py: error: argument --front-end-root: The path '/nonexistent/h3kit' does not exist."
    assert r.returncode == 1 and "server_exited" in r.stderr and line in r.stderr, r.stderr
    st = server.status()
    assert st["running"] is False and st["first_error"]["summary"] == line
    assert line in server.run("logs", "--errors").stdout


def _host_refuses_huge_allocations() -> bool:
    try:
        return Path("/proc/sys/vm/overcommit_memory").read_text().strip() in ("0", "2")
    except OSError:
        return False


# ---- several servers of one tree (issue 46) ---------------------------------------------------------------


def tiny_h3_prompt(seed: int) -> dict:
    """The demo's tiny H3 workflow (npu_count 1), its noise seed varied so no output is cached."""
    prompt = json.loads((Path(__file__).resolve().parents[1] / "workflows" / "api" / "demo_t2va_tiny.json").read_text())
    prompt["8"]["inputs"]["noise_seed"] = seed
    return prompt


@pytest.fixture(scope="module")
def second(server, comfy_tree):
    """A second server of the same tree and runtime root, on device 1 and a port of its own (one boot serves both
    tests below); stopped at the end."""
    from h3kit import demo
    demo.write_tiny_checkpoints(comfy_tree, server.python)
    home = Home(comfy_tree, free_port(8470, 8489, exclude=(server.port,)))
    home.python = server.python
    yield home
    home.run("stop", "--port", home.port, "--grace", "5")


def start_second(home: Home) -> dict:
    r = home.start("--python", home.python, "--json", devices="1", timeout=BOOT_TIMEOUT)
    assert r.returncode == 0, r.stderr
    return jsondoc.data(r.stdout, r.returncode)


def test_a_second_server_of_the_tree_runs_prompts_beside_the_first(server, second, comfy_tree):
    ensure_running(server)
    started = start_second(second)
    assert started["runtime_root"] == str(server.root / "servers" / str(second.port))
    assert server.record()["port"] == server.port  # the first server keeps its record
    # the first server busy with a dozen blur prompts; the second runs the tiny H3 workflow meanwhile
    seed = int(time.time() * 1000)
    busy = [http_json(f"{server.url}/prompt", {"prompt": blur_prompt((seed + i) % 16777215)})["prompt_id"]
            for i in range(12)]
    wait_for(lambda: queue(server)[0] == 1, 60, "the first server to run a prompt")
    mine = http_json(f"{second.url}/prompt", {"prompt": tiny_h3_prompt(seed)})["prompt_id"]
    wait_for(lambda: completed(second, mine), 300, "the second server's prompt to complete")
    running, pending = queue(server)
    assert running + pending > 0, "the first server's work ended before the second's prompt: nothing ran at once"
    assert not completed(server, busy[-1])
    # each server wrote into its own output folder: the first into the tree's, the second into output/<port>
    videos = list((comfy_tree / "output" / str(second.port) / "h3kit_demo").glob("video*"))
    assert videos, sorted(p.name for p in (comfy_tree / "output").rglob("*"))[:20]
    http_json(f"{server.url}/queue", {"clear": True})
    http_json(f"{server.url}/interrupt", {})
    # status lists both; the commands that act on one need --port while both run
    r = server.run("status", "--json")
    assert [s["port"] for s in jsondoc.data(r.stdout, r.returncode)["servers"]] == [server.port, second.port]
    r = server.run("stop")
    assert r.returncode == 1 and "several_servers" in r.stderr


def test_stop_keep_queue_then_start_runs_every_prompt_it_kept(server, second):
    start_second(second)  # already running after the test above: nothing starts
    ids = queue_three(second)  # one running, two pending
    r = second.run("stop", "--port", second.port, "--keep-queue", "--json")
    assert r.returncode == 0, r.stderr
    out = jsondoc.data(r.stdout, r.returncode)
    assert out["stopped"] and out["kept"] and out["queue"] == {"running": 1, "pending": 2}
    started = start_second(second)
    assert started["restored"]["restored"] == ids and started["restored"]["failed"] == []  # the running one first
    assert_ran_again(second, ids, [0, 1, 2])
    # queued once: a plain stop now discards nothing and says so
    r = second.run("stop", "--port", second.port)
    assert r.returncode == 0 and "queue: empty, nothing discarded" in r.stdout, r.stdout
