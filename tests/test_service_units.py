"""The service library's parts on their own: log scanning, process identity and teardown, the record."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from h3kit import health, logscan, proc, service
from h3kit.errors import UsageError

RED, GREEN, RESET = "\x1b[1m\x1b[31m", "\x1b[32m", "\x1b[0m"

# What the pinned ComfyUI writes around a failed prompt (execution.py), colours included.
COMFY_OOM_LOG = f"""\
{GREEN}[INFO]{RESET} Starting server
{GREEN}[INFO]{RESET} got prompt
{RED}[ERROR]{RESET} !!! Exception during processing !!! NPU out of memory. Tried to allocate 2.00 GiB
{RED}[ERROR]{RESET} Traceback (most recent call last):
  File "/srv/ComfyUI/execution.py", line 530, in execute
    output_data, output_ui, has_subgraph = await get_output_data(prompt_id, unique_id, obj)
                                           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB

{GREEN}[INFO]{RESET} Memory summary:
|===========================================================================|
| CUDA OOMs: 1                                                              |
{RED}[ERROR]{RESET} Got an OOM, unloading all loaded models.
{GREEN}[INFO]{RESET} Prompt executed in 3.02 seconds
{GREEN}[INFO]{RESET} got prompt
{RED}[ERROR]{RESET} !!! Exception during processing !!! mat1 and mat2 shapes cannot be multiplied
{RED}[ERROR]{RESET} Traceback (most recent call last):
  File "/srv/ComfyUI/execution.py", line 530, in execute
RuntimeError: mat1 and mat2 shapes cannot be multiplied (77x768 and 1024x320)
{RED}[ERROR]{RESET} Failed to validate prompt for output 9:
{GREEN}[INFO]{RESET} Prompt executed in 0.10 seconds
"""


def write(tmp_path, text):
    path = tmp_path / "comfyui.log"
    path.write_text(text)
    return path


def test_first_error_of_a_comfy_oom_is_an_oom_with_its_exception(tmp_path):
    first = logscan.first_error(write(tmp_path, COMFY_OOM_LOG))
    assert first.kind == "oom" and first.line == 3
    assert first.summary == "torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB"
    assert first.lines[-1] == "[ERROR] Got an OOM, unloading all loaded models."  # the marker joins its block
    assert not any("\x1b" in ln for ln in first.lines)


def test_error_blocks_separate_each_failure(tmp_path):
    blocks = logscan.error_blocks(write(tmp_path, COMFY_OOM_LOG))
    assert [(b.kind, b.line) for b in blocks] == [("oom", 3), ("error", 16), ("error", 20)]
    assert blocks[1].summary == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (77x768 and 1024x320)"
    assert blocks[2].summary == "[ERROR] Failed to validate prompt for output 9:"[len("[ERROR] "):]
    assert logscan.error_blocks(tmp_path / "missing.log") == []


def test_the_oom_marker_alone_and_the_cpu_allocator_count_as_oom(tmp_path):
    marker_only = "got prompt\n[ERROR] Got an OOM, unloading all loaded models.\n"
    assert logscan.first_error(write(tmp_path, marker_only)).kind == "oom"
    cpu = ("[ERROR] !!! Exception during processing !!! [enforce fail at alloc_cpu.cpp:127] err == 0. "
           "DefaultCPUAllocator: can't allocate memory: you tried to allocate 4398046511104 bytes.\n")
    assert logscan.first_error(write(tmp_path, cpu)).kind == "oom"
    plain = "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: nope\nafter\n"
    blk = logscan.first_error(write(tmp_path, plain))
    assert blk.kind == "error" and blk.summary == "ValueError: nope" and len(blk.lines) == 3
    assert logscan.first_error(write(tmp_path, "[INFO] all good\n[WARNING] only a warning\n")) is None


def test_following_reports_the_marker_as_its_own_block():
    scanner = logscan.ErrorScanner(merge_oom=False)
    blocks = [b for ln in COMFY_OOM_LOG.splitlines() for b in scanner.feed(ln)] + scanner.finish()
    assert [(b.kind, b.line) for b in blocks][:2] == [("oom", 3), ("oom", 13)]


def test_tail_strips_colours(tmp_path):
    assert logscan.tail(write(tmp_path, COMFY_OOM_LOG), 2) == [
        "[ERROR] Failed to validate prompt for output 9:", "[INFO] Prompt executed in 0.10 seconds"]


def test_history_errors_and_oom_classification():
    assert health.is_oom_error({"exception_type": "torch.OutOfMemoryError", "exception_message": "x"})
    assert health.is_oom_error({"exception_type": "RuntimeError", "exception_message": "NPU out of memory."})
    assert not health.is_oom_error({"exception_type": "ValueError", "exception_message": "bad input"})


# --------------------------------------------------------------------------------------------- proc


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def test_verify_tells_alive_gone_and_recycled_apart(sleeper):
    ident = proc.identify(sleeper.pid)
    assert proc.verify(ident.pid, ident.create_time, ident.cmdline).state == proc.ALIVE
    late = proc.verify(ident.pid, ident.create_time - 60, ident.cmdline)
    assert late.state == proc.RECYCLED and late.now["pid"] == sleeper.pid
    assert proc.verify(ident.pid, ident.create_time, ["other"]).state == proc.RECYCLED
    sleeper.kill()
    sleeper.wait()
    assert proc.verify(ident.pid, ident.create_time, ident.cmdline).state == proc.GONE


def test_verify_sees_an_unreaped_child_as_gone(sleeper):
    ident = proc.identify(sleeper.pid)
    os.kill(sleeper.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30  # the kernel makes it a zombie of this process (not reaped: no wait())
    while psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"pid {sleeper.pid} is {psutil.Process(sleeper.pid).status()}, no zombie"
        time.sleep(0.02)
    assert proc.verify(ident.pid, ident.create_time, ident.cmdline).state == proc.GONE


def test_a_server_that_exits_before_its_record_is_written_still_gets_a_valid_record(tmp_path):
    """Seen in CI: argparse refused an argument and the server was a zombie before h3kit read it; its command line
    was unreadable and the record said create_time 0, which every later command refused as a bad record."""
    from h3kit.service import process
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "no zombie"
        time.sleep(0.02)
    started = psutil.Process(child.pid).create_time()
    spec = service.StartSpec(str(tmp_path / "c"), [0], "cpu", port=8189, python=sys.executable)
    argv = service.server_argv(sys.executable, spec)
    rec = process._record_child(tmp_path, child, argv, spec, tmp_path / "logs" / "comfyui-1.log", None)
    child.wait()
    assert rec.cmdline == argv and rec.create_time == started > 0
    assert service.read_record(tmp_path) == rec
    assert proc.verify(rec.pid, rec.create_time, rec.cmdline).state == proc.GONE


def test_terminate_group_reaches_children_and_escalates():
    code = ("import signal, subprocess, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('ready', flush=True); time.sleep(60)\n")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert leader.stdout.readline().strip() == "ready"
        kids = psutil.Process(leader.pid).children(recursive=True)
        assert len(kids) == 1
        down = proc.terminate_group(proc.identify(leader.pid), grace=0.5, kill_wait=5)
        assert down.signals == ["SIGTERM", "SIGKILL"] and down.survivors == []
        assert not kids[0].is_running() or kids[0].status() == psutil.STATUS_ZOMBIE
    finally:
        if leader.poll() is None:
            leader.kill()
        leader.wait()


def test_port_holders_names_the_listener(sleeper):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert not proc.port_is_free("127.0.0.1", port)
        assert {"pid": os.getpid()}.items() <= proc.port_holders(port)[0].items()
    assert proc.port_is_free("127.0.0.1", port)


# --------------------------------------------------------------------------------------------- service


def _valid_record(tmp_path, **over) -> dict:
    rec = {"pid": 4242, "create_time": 2.5,
           "cmdline": ["/usr/bin/python3", "-B", "main.py", "--listen", "0.0.0.0", "--port", "8189"],
           "port": 8189, "listen": "0.0.0.0", "device_type": "npu", "devices": [0, 1], "python": "/usr/bin/python3",
           "comfy_home": str(tmp_path / "c"), "log": str(tmp_path / "logs" / "comfyui-1.log"), "extra_args": [],
           "started_at": "2026-01-01T00:00:00+00:00"}
    rec.update(over)
    return rec


def test_a_group_agents_record_round_trips(tmp_path):
    # node 1 of a multi-host group: the record names the agent, which runs no main.py
    agent = _valid_record(tmp_path, cmdline=["/usr/bin/python3", "-B", "-m", "comfy.multinpu_group"],
                          transport="process", nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
                          join_timeout=300.0)
    rec = service.Record(**agent)
    service.write_record(tmp_path, rec)
    assert service.read_record(tmp_path) == rec and rec.group.is_agent
    assert service.server_argv(rec.python, rec.spec()) == ["/usr/bin/python3", "-B", "-m", "comfy.multinpu_group"]


def test_record_round_trip_and_a_corrupt_record(tmp_path):
    rec = service.Record(**_valid_record(tmp_path))
    service.write_record(tmp_path, rec)
    assert service.read_record(tmp_path) == rec
    assert rec.url == "http://127.0.0.1:8189"
    assert set(json.loads((tmp_path / "server.json").read_text())) == set(service.RECORD_FIELDS)
    (tmp_path / "server.json").write_text("{not json")
    with pytest.raises(service.BadRecord, match="not a valid server record"):
        service.read_record(tmp_path)


LONG = "9" * 5000
BAD_FIELDS = [
    ("pid", 0, "pid must be an integer"), ("pid", -1, "pid must be"), ("pid", 1, "pid must be"),
    ("pid", True, "pid must be"), ("pid", "4242", "pid must be"), ("pid", 2 ** 40, "pid must be"),
    ("pid", 4.0, "pid must"),
    ("create_time", "x", "create_time must be"), ("create_time", -5, "create_time must be"),
    ("create_time", None, "create_time must be"),
    ("cmdline", "main.py", "cmdline must be a list"), ("cmdline", [], "cmdline does not run main.py"),
    ("cmdline", ["sleep", "1000"], "does not run main.py (nor the group agent"), ("cmdline", [1, 2], "must be a string"),
    ("cmdline", ["/usr/bin/python3", "-m", "comfy.multinpu_group"], "does not match"),
    ("cmdline", ["/usr/bin/python3", "-B", "main.py", "--listen", "0.0.0.0", "--port", "9999"], "does not match"),
    ("port", 0, "port must be"), ("port", 70000, "port must be"), ("port", "8189", "port must be"),
    ("listen", "localhost", "listen must be one IP"), ("listen", 5, "listen must be"),
    ("device_type", "tpu", "device_type must be"), ("device_type", None, "device_type must be"),
    ("devices", [1, 0, 7], "devices"), ("devices", [0, 0], "twice"), ("devices", [-1], "non-negative"),
    ("devices", [0, 1, 2], "3 devices"), ("devices", "0,1", "not a list"), ("devices", [True], "not a list"),
    ("devices", [10 ** 100], "out of range"), ("devices", list(range(5000)), "5000 devices"),
    ("python", "relative/py", "python must be an absolute path"), ("python", 5, "python must be"),
    ("comfy_home", "", "comfy_home must be"), ("comfy_home", "c", "comfy_home must be an absolute path"),
    ("log", "/etc/passwd", "log must be a log under"), ("log", "/dev/zero", "log must be"),
    ("extra_args", "--foo", "extra_args must be a list"), ("extra_args", [1], "must be a string"),
    ("extra_args", ["--foo"], "does not match"), ("started_at", 5, "started_at must be"),
    ("started_at", LONG, "started_at must be a string under"),
    ("transport", "tcp", "transport must be one of"), ("nnodes", 0, "nnodes must be"), ("nnodes", 2, "not a group"),
    ("node_rank", 1, "node 1 of 1"), ("master_addr", "host-a", "master_addr must be one IP"),
    ("master_port", 70000, "master_port must be"), ("join_timeout", -1, "join_timeout must be"),
]


@pytest.mark.parametrize("field, value, fragment", BAD_FIELDS,
                         ids=[f"{f}={str(v)[:20]}" for f, v, _ in BAD_FIELDS])
def test_every_record_field_is_validated(tmp_path, field, value, fragment):
    data = _valid_record(tmp_path)
    data[field] = value
    (tmp_path / "server.json").write_text(json.dumps(data))
    with pytest.raises(service.BadRecord) as e:
        service.read_record(tmp_path)
    assert fragment in e.value.message and len(e.value.message) < 600
    assert e.value.exit_code == 1


@pytest.mark.parametrize("text, fragment", [("[]", "not a JSON object"), ('{"pid": NaN}', "unknown") ,
                                            ("null", "not a JSON object"), ("[" * 100000, "not a valid"),
                                            (json.dumps({"evil": 1}), "unknown field(s) evil")])
def test_a_record_that_is_not_an_object_of_known_fields(tmp_path, text, fragment):
    (tmp_path / "server.json").write_text(text)
    with pytest.raises(service.BadRecord, match="not a valid server record") as e:
        service.read_record(tmp_path)
    assert fragment in e.value.message or fragment == "unknown" and "NaN" not in e.value.message


def test_a_record_of_another_tree_and_nan_times_are_refused(tmp_path):
    (tmp_path / "server.json").write_text(json.dumps(_valid_record(tmp_path)).replace("2.5", "NaN"))
    with pytest.raises(service.BadRecord, match="create_time must be a positive number"):
        service.read_record(tmp_path)
    (tmp_path / "server.json").write_text(json.dumps(_valid_record(tmp_path)).replace("4242", LONG))
    with pytest.raises(service.BadRecord) as e:  # past int()'s 4,300 digits: refused, not a crash
        service.read_record(tmp_path)
    assert len(e.value.message) < 600
    (tmp_path / "server.json").write_text(json.dumps(_valid_record(tmp_path)))
    with pytest.raises(service.BadRecord, match="names another ComfyUI tree"):
        service.read_record(tmp_path, comfy_home=tmp_path / "elsewhere")
    assert service.read_record(tmp_path, comfy_home=tmp_path / "c").pid == 4242


def test_extra_args_in_a_record_are_checked_with_the_trees_own_options(tmp_path):
    home = tmp_path / "c"
    (home / "comfy").mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "support" / "standin_cli_args.py", home / "comfy" / "cli_args.py")
    base = _valid_record(tmp_path)
    ok = dict(base, extra_args=["--preview-method", "auto"], cmdline=base["cmdline"] + ["--preview-method", "auto"])
    (tmp_path / "server.json").write_text(json.dumps(ok))
    assert service.read_record(tmp_path).extra_args == ["--preview-method", "auto"]
    sneaky = dict(base, extra_args=["--liste", "0.0.0.0"], cmdline=base["cmdline"] + ["--liste", "0.0.0.0"])
    (tmp_path / "server.json").write_text(json.dumps(sneaky))
    with pytest.raises(service.BadRecord, match="ComfyUI reads it as --listen"):
        service.read_record(tmp_path)


def test_argparse_failure_at_start_is_the_first_error(tmp_path):
    log = tmp_path / "comfyui-1.log"
    log.write_text("h3kit: starting ...\nusage: main.py [-h] [--listen [IP]]\n               [--cpu]\n"
                   "main.py: error: argument --front-end-root: The path '/nope' does not exist.\n")
    blk = logscan.first_error(log)
    assert blk.summary == "main.py: error: argument --front-end-root: The path '/nope' does not exist."


@pytest.mark.parametrize("kind, variable, value", [("npu", "ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3"),
                                                   ("cuda", "CUDA_VISIBLE_DEVICES", "0,1,2,3"),
                                                   ("cpu", "H3KIT_SIM_DEVICES", "4")])
def test_child_environment_per_device_type(kind, variable, value):
    env = service.child_environment(kind, [0, 1, 2, 3], base={})
    assert env[variable] == value and env["PYTHONUNBUFFERED"] == "1"
    argv = service.server_argv("py", service.StartSpec("/c", [0, 1, 2, 3], kind))
    assert ("--cpu" in argv) == (kind == "cpu")


@pytest.mark.parametrize("listen", ["localhost", "1.2.3", "127.0.0.1,::1", ""])
def test_listen_must_be_one_ip_address(listen):
    with pytest.raises(UsageError):
        service.validate_listen(listen)


def test_terminating_a_process_that_has_just_exited_is_not_an_error():
    """The server may die between the identity check and the first signal (watch meets this in a crash loop)."""
    # the child lives until told to end, so it is identified alive (a child that ends at once can be a zombie by
    # the time identify reads it: a loaded CI run failed so)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    ident = proc.identify(child.pid)
    child.stdin.close()
    child.wait()
    down = proc.terminate_group(ident, grace=0.1, kill_wait=0.1)
    assert down.signals == [] and down.survivors == []


def test_a_server_dying_mid_answer_is_a_failed_request_not_a_crash():
    """A stand-in that sends its headers and dies before the body made `watch` end with an internal error
    (http.client.IncompleteRead is no OSError); it is a failed health check like any other."""
    import socket
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def answer_half():
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 297\r\n\r\n{\"sys")
        conn.close()

    t = threading.Thread(target=answer_half, daemon=True)
    t.start()
    try:
        with pytest.raises(health.HttpError) as e:
            health.request_json(f"http://127.0.0.1:{srv.getsockname()[1]}/system_stats", timeout=5)
        assert "292 more expected" in str(e.value), str(e.value)
    finally:
        t.join(5)
        srv.close()
