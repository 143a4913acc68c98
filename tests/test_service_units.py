"""The service library's parts on their own: log scanning, process identity and teardown, the record."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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
    time.sleep(0.3)  # now a zombie of this process
    assert proc.verify(ident.pid, ident.create_time, ident.cmdline).state == proc.GONE


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


def test_record_round_trip_and_a_corrupt_record(tmp_path):
    rec = service.Record(pid=1, create_time=2.5, cmdline=["py", "-B", "main.py"], port=8189, listen="0.0.0.0",
                         device_type="npu", devices=[0, 1], python="py", comfy_home="/c", log="/c/l.log")
    service.write_record(tmp_path, rec)
    assert service.read_record(tmp_path) == rec
    assert rec.url == "http://127.0.0.1:8189"
    assert set(json.loads((tmp_path / "server.json").read_text())) == {
        "pid", "create_time", "cmdline", "port", "listen", "device_type", "devices", "python", "comfy_home",
        "log", "extra_args", "started_at", "transport", "nnodes", "node_rank", "master_addr", "master_port",
        "join_timeout"}
    (tmp_path / "server.json").write_text("{not json")
    with pytest.raises(service.ServiceError, match="not a valid server record"):
        service.read_record(tmp_path)


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
