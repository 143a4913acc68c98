"""Rank 0 of a bare process group for the runtime tests (test support, not shipped).

    python process_group_driver.py SCENARIO --out FILE [--world N] [--nnodes M] [--port P] [--root DIR]

Starts comfy.multinpu_process.GroupRuntime (the driver, never a rank) with process_group_worker.py as the
worker program for every rank, runs one scenario and writes what it observed as JSON. Each scenario is a function below; they measure, they do not
assert (the tests do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
sys.path[:0] = [str(ROOT / "patches" / "src"), str(SUPPORT)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "patches" / "src"), str(SUPPORT),
                                           os.environ.get("PYTHONPATH", "")])

import torch  # noqa: E402

import comfy.multinpu  # noqa: E402
import comfy.multinpu_channel as channel  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402
import comfy.multinpu_process as mp  # noqa: E402


def _err(e):
    return {"type": type(e).__name__, "message": str(e)}


def _write_whole(path, text):
    """Write `path` so that a reader never sees it half-written: aside, then renamed over it. A test that polls for
    the file while this driver holds the group (--hold) reads it as soon as it exists; written in place, the
    file exists, empty or cut short, between its open and the last write."""
    tmp = f"{path}.{os.getpid()}.tmp"
    Path(tmp).write_text(text)
    os.replace(tmp, path)


def _attempt(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "value": value, "seconds": time.monotonic() - t0}
    except BaseException as e:  # noqa: BLE001 - a scenario reports every outcome
        return {"ok": False, "error": _err(e), "seconds": time.monotonic() - t0}


def _sum(rt):
    return rt.run("sum", {"x": torch.zeros(4)})


def _fail(rt, **payload):
    return rt.run("fail", payload)


def _pids(rt):
    return {r["rank"]: r["pid"] for r in rt.ranks()}


def scenario_basics(rt, args):
    out = {"first": _attempt(lambda: _sum(rt)), "driver_pid": os.getpid()}
    # payload fidelity: dtypes, shapes, empty and CPU tensors through shared memory, one broadcast and back
    sent = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor([True, False, True]),
            torch.randn(2, 3, 5).to(torch.bfloat16), torch.zeros(0, 7), torch.tensor(3, dtype=torch.int64)]

    def echo():
        got = rt.run("echo", {"tensors": sent, "note": "x"})
        return got["same"] and got["note"] == "x" and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(got["tensors"], sent))
    out["echo"] = _attempt(echo)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        _sum(rt)
        times.append(time.perf_counter() - t0)
    out["command_seconds"] = sorted(times)[len(times) // 2]
    t0 = time.perf_counter()
    big = rt.run("big", {"mib": 256})
    out["big"] = {"seconds": time.perf_counter() - t0, "bytes": big.numel() * big.element_size(),
                  "ok": bool((big == 1.5).all())}
    del big
    out["shm_left"] = sorted(n for n in os.listdir(wire.shm_dir()) if n.startswith(f"h3kit-{os.getpid()}-"))
    out["generation"] = rt.generation
    out["pids"] = dict(rt.members)
    return out


def scenario_failures(rt, args):
    out = {}
    out["raise"] = _attempt(lambda: _fail(rt, rank=2, kind="raise"))
    out["after_raise"] = _attempt(lambda: _sum(rt))
    out["oom"] = _attempt(lambda: _fail(rt, rank=1, kind="oom"))
    out["after_oom"] = _attempt(lambda: _sum(rt))
    out["rank0"] = _attempt(lambda: _fail(rt, rank=0, kind="raise"))
    out["after_rank0"] = _attempt(lambda: _sum(rt))
    out["generation"] = rt.generation
    return out


def scenario_links(rt, args):
    """A prompt's links after the join formed the group: then what each rank formed, and when."""
    out = {"prompt": _attempt(lambda: rt.run("prompt_links", {}))}
    out["report"] = _attempt(lambda: rt.run("links_report", {}))
    return out


def scenario_oom_loop(rt, args):
    """--repeat OOM commands in a row (each on rank --victim, which reports it itself), then a plain one: a failure a
    rank reports is no crash, so no rank is given up on however often it happens."""
    out = {"ooms": []}
    for _ in range(args.repeat):
        out["ooms"].append(_attempt(lambda: _fail(rt, rank=args.victim, kind="oom")))
    out["next"] = _attempt(lambda: _sum(rt))
    out["generation"] = rt.generation
    out["ranks"] = rt.ranks()
    return out


def _later(delay, fn):
    t = threading.Timer(delay, fn)
    t.daemon = True
    t.start()
    return t


def _fault(rt, name, args):
    """One fault while a command runs, then the next command: what each cost, and who was left behind."""
    last = rt.world_size - 1
    before = dict(rt.members)
    out = {"fault": name, "pids_before": before}
    victim = None
    if name == "raise_block0":
        fault = lambda: _fail(rt, rank=last, kind="raise", steps=4, at=0)  # noqa: E731
    elif name == "raise_later_block":
        fault = lambda: _fail(rt, rank=last, kind="raise", steps=4, at=3)  # noqa: E731
    elif name == "oom_last_rank":
        fault = lambda: _fail(rt, rank=last, kind="oom", steps=4, at=1)  # noqa: E731
    elif name == "raise_rank0":
        fault = lambda: _fail(rt, rank=0, kind="raise", steps=4, at=2)  # noqa: E731
    elif name in ("kill9", "sigstop"):
        victim = before[1]
        sig = signal.SIGKILL if name == "kill9" else signal.SIGSTOP
        _later(1.0, lambda: os.kill(victim, sig))
        # rank 0 sleeps while the others wait for it in the first all_reduce: the victim dies (or stops) in there
        fault = lambda: _fail(rt, rank=0, kind="sleep", seconds=3.0, steps=2, at=0)  # noqa: E731
    else:
        raise ValueError(name)
    out["victim_pid"] = victim
    out["error"] = _attempt(fault)
    out["next"] = _attempt(lambda: _sum(rt))
    out["pids_after"] = dict(rt.members)
    out["generation"] = rt.generation
    time.sleep(0.5)
    out["left_behind"] = [pid for pid in before.values() if _alive(pid)]
    return out


def _alive(pid):
    try:
        import psutil
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except Exception:
        return False


FAULTS = ("raise_block0", "raise_later_block", "oom_last_rank", "raise_rank0", "kill9", "sigstop")


def _each_fault(rt, args, names, fault):
    """A command that works, then each fault of `names` (--faults: a subset) through fault(rt, name, args)."""
    out = {"driver_pid": os.getpid(), "first": _attempt(lambda: _sum(rt))}
    for name in (args.faults.split(",") if args.faults else names):
        out[name] = fault(rt, name, args)
    out["driver_pid_after"] = os.getpid()
    return out


def scenario_faults(rt, args):
    """Every fault of FAULTS once (run with H3KIT_EMULATE_NO_RELEASE=1 for HCCL/NCCL's semantics)."""
    return _each_fault(rt, args, FAULTS, _fault)


def _hang_fault(rt, name, args):
    """One fault of HANGS while a command runs, then the next command: what each cost, and who was left behind."""
    last = rt.world_size - 1
    out = {"fault": name, "pids_before": dict(rt.members)}
    t0 = time.monotonic()
    if name == "blocked_send":
        # the last rank holds after a command (its heartbeat beating) and reads no command meanwhile; the next
        # command's header (16 MiB in the pickle) fills its connection's socket buffer
        out["stall"] = _attempt(lambda: rt.run("stall_after", {"rank": last, "seconds": args.sleep}))
        t0 = time.monotonic()
        out["error"] = _attempt(lambda: rt.run("blob", {"blob": b"x" * (16 << 20)}))
    elif name == "hung_in_kernel":
        # the last rank blocks at step 1 (time.sleep: the GIL released, as a device wait does; its heartbeat thread
        # beats on) while its peers wait for it in that step's all_reduce
        out["error"] = _attempt(lambda: _fail(rt, rank=last, kind="sleep", seconds=600, steps=4, at=1))
    elif name == "kill9":
        # an existing fault, for the side-by-side figures: the last rank SIGKILLed 1 s into a command
        victim = out["pids_before"][last]
        _later(1.0, lambda: os.kill(victim, signal.SIGKILL))
        t0 += 1.0
        out["error"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=3.0, steps=2, at=0))
    elif name == "stuck_collective":
        out["error"] = _attempt(lambda: rt.run("stuck", {"seconds": 600}))
    elif name in DEVICE_CLOCK:
        return _device_clock_fault(rt, name, args, out)
    elif name == "slow_progress":
        # the last rank takes args.slow seconds before each of 6 all_reduces: much longer than the progress bound in
        # all, never that long without reaching a collective
        out["error"] = _attempt(lambda: rt.run("slow", {"rank": last, "seconds": args.slow, "steps": 6}))
    else:
        raise ValueError(name)
    out["fault_to_error"] = time.monotonic() - t0
    out["next"] = _attempt(lambda: _sum(rt))
    out["fault_to_next"] = time.monotonic() - t0
    out["pids_after"] = dict(rt.members)
    time.sleep(0.5)
    out["left_behind"] = [pid for pid in out["pids_before"].values() if _alive(pid)]
    return out


HANGS = ("hung_in_kernel", "stuck_collective", "slow_progress", "blocked_send")
# the device's clock (issue 45), run with H3KIT_EMULATE_ASYNC_DEVICE=1 and H3KIT_MULTINPU_FAULT naming files in
# $H3KIT_TEST_FAULT_DIR (tests/test_multinpu_process_hang.py, hangs_twin): the slow fault on every rank, a late loader,
# a stuck device, a stats call blocked for 20 s
DEVICE_CLOCK = ("device_slow", "late_loader", "device_stuck", "blocked_stats")


def _device_clock_fault(rt, name, args, out):
    folder = Path(os.environ["H3KIT_TEST_FAULT_DIR"])
    last = rt.world_size - 1
    t0 = time.monotonic()
    if name == "device_slow":  # every rank's device needs args.slow s more for `sum`, each second completing
        (folder / "slow-all").touch()
        out["error"] = _attempt(lambda: _sum(rt))
        (folder / "slow-all").unlink()
    elif name == "late_loader":  # the last rank's load takes args.slow s more device time than its peers'
        (folder / f"late-{last}").touch()
        digest = {"files": "late", "options": "-"}
        late = mp.RemoteConfig("config", {"digest": digest, "name": "late.safetensors"}, digest, "a late model")
        out["error"] = _attempt(lambda: rt.run("uses_config", {"id": late.id}, configs=[late]))
        (folder / f"late-{last}").unlink()
    elif name == "device_stuck":  # the last rank's device never completes its next collective while its host beats
        (folder / f"stuck-{last}").touch()
        out["error"] = _attempt(lambda: _fail(rt, rank=-1, kind="raise", steps=4, at=0))
        (folder / f"stuck-{last}").unlink()
    elif name == "blocked_stats":  # every rank's allocator counters blocked for args.sleep s while it computes
        out["error"] = _attempt(lambda: rt.run("blocked_stats", {"seconds": args.sleep}))
    out["fault_to_error"] = time.monotonic() - t0
    out["next"] = _attempt(lambda: _sum(rt))
    out["pids_after"] = dict(rt.members)
    time.sleep(0.5)
    out["left_behind"] = [pid for pid in out["pids_before"].values() if _alive(pid)]
    return out


def scenario_hangs(rt, args):
    """Every fault of HANGS once (--faults: a subset), with HCCL/NCCL's semantics (H3KIT_EMULATE_NO_RELEASE=1)."""
    return _each_fault(rt, args, HANGS, _hang_fault)


def scenario_hccl(rt, args):
    """What worker rank 0 formed its groups with, in two generations (a failure between them)."""
    out = {"first": _attempt(lambda: rt.run("hccl", {}))}
    out["failed"] = _attempt(lambda: _fail(rt, rank=1, kind="raise"))
    out["second"] = _attempt(lambda: rt.run("hccl", {}))
    return out


def scenario_kill(rt, args):
    out = {}
    victim = rt.members[args.victim]
    out["victim_pid"] = victim
    _later(0.5, lambda: os.kill(victim, signal.SIGKILL))
    out["killed"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=30, steps=1, at=0))
    out["after_kill"] = _attempt(lambda: _sum(rt))
    out["replacement_pid"] = rt.members.get(args.victim)
    out["generation"] = rt.generation
    return out


def scenario_hang(rt, args):
    out = {}
    victim = rt.members[2]
    os.kill(victim, signal.SIGSTOP)
    out["hung"] = _attempt(lambda: _sum(rt))
    out["after_hang"] = _attempt(lambda: _sum(rt))
    out["victim_pid"] = victim
    out["replacement_pid"] = rt.members.get(2)
    return out


def scenario_idle(rt, args):
    out = {"first": _attempt(lambda: _sum(rt))}
    time.sleep(args.idle)  # longer than the group's collective timeout
    out["after_idle"] = _attempt(lambda: _sum(rt))
    return out


def scenario_configs(rt, args):
    out = {}
    digest = {"files": "abc", "options": "def"}
    good = mp.RemoteConfig("config", {"digest": digest, "name": "a.safetensors"}, digest, "model a")
    out["install"] = _attempt(lambda: rt.run("uses_config", {"id": good.id}, configs=[good]))
    out["installed"] = dict(good.installed)
    mismatch = mp.RemoteConfig("config", {"digest": digest, "differ_on": 2}, digest, "model b")
    out["mismatch"] = _attempt(lambda: rt.run("uses_config", {"id": mismatch.id}, configs=[mismatch]))
    missing = mp.RemoteConfig("config", {"digest": digest, "fail_on": 1, "name": "c.safetensors"}, digest, "model c")
    out["missing"] = _attempt(lambda: rt.run("uses_config", {"id": missing.id}, configs=[missing]))
    out["after"] = _attempt(lambda: _sum(rt))
    # what POST /free and ComfyUI's OOM handler call (comfy.model_management.unload_all_models clears the model
    # cache): the workers free theirs before the next command, which then installs its model again
    import comfy.model_cache
    out["freed_before"] = _attempt(lambda: rt.run("freed", {}))
    comfy.model_cache.clear()
    out["after_free"] = _attempt(lambda: rt.run("uses_config", {"id": good.id}, configs=[good]))
    out["freed_after"] = _attempt(lambda: rt.run("freed", {}))
    out["no_free"] = _attempt(lambda: rt.run("uses_config", {"id": good.id}, configs=[good]))
    out["freed_last"] = _attempt(lambda: rt.run("freed", {}))
    return out


def scenario_form_only(rt, args):
    return {"sum": _attempt(lambda: _sum(rt)), "ranks": rt.ranks()}


def scenario_remote_kill(rt, args):
    """Two nodes: kill a worker of node 1 (the agent's) mid-command; the group is replaced."""
    out = {"first": _attempt(lambda: _sum(rt)), "pids": dict(rt.members)}
    victim = rt.members[rt.world_size - 1]
    out["victim_pid"] = victim
    _later(0.5, lambda: os.kill(victim, signal.SIGKILL))
    out["killed"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=3, steps=1, at=0))
    out["after_kill"] = _attempt(lambda: _sum(rt))
    out["replacement_pid"] = rt.members.get(rt.world_size - 1)
    return out


def scenario_kill_while_loading(rt, args):
    """Two nodes: a worker of node 1 is SIGKILLed while every rank loads a model (the text encoder's load in the
    real server: the install command has ended, the driver waits for the ranks' ready reports), --repeat times
    at delays spread over the load; each time the load fails naming the victim and the next command succeeds.
    The victim (rank 3) loads for 4 s, the others for 0.5 s: most kills land after its sibling reported its
    load (issue 19's 300 s wait, under torchrun then: the sibling's death aborted the idle-looking generation and
    the victim's, seen next, was dropped)."""
    import random
    wire.LOAD_TIMEOUT = min(wire.LOAD_TIMEOUT, args.load_timeout)  # a hang shows as a load past this bound
    rounds = []
    out = {"first": _attempt(lambda: _sum(rt)), "rounds": rounds}
    digest = {"files": "te", "options": "x"}
    for i in range(args.repeat):
        victim_rank = rt.world_size - 1
        victim = rt.members[victim_rank]
        cfg = mp.RemoteConfig("config", {"digest": digest, "name": "te.safetensors",
                                         "load_seconds": {victim_rank: 4.0, "others": 0.5}}, digest, f"text encoder {i}")
        delay = 1.0 + 2.5 * random.random()
        _later(delay, lambda: os.kill(victim, signal.SIGKILL))
        t_kill = time.monotonic() + delay
        r = {"delay": delay, "victim_pid": victim, "pids": dict(rt.members)}
        r["killed"] = _attempt(lambda: rt.run("uses_config", {"id": cfg.id}, configs=[cfg]))
        r["to_error"] = time.monotonic() - t_kill
        r["next"] = _attempt(lambda: _sum(rt))
        r["to_next"] = time.monotonic() - t_kill
        r["state"] = rt.state
        rounds.append(r)
        logging.info(f"kill_while_loading round {i}: {json.dumps(r, default=str)}")
        if not r["next"]["ok"]:
            break
    return out


def scenario_death_after_load_report(rt, args):
    """Two nodes: while a model loads, rank 2 reports its load done and is then SIGKILLed while rank 3 still loads
    (a launcher stopping a dead worker's sibling that had finished its load, in either order): the driver, which
    waits for the ranks' load reports with no command in flight, must fail the load naming rank 2, not wait for
    rank 3's report until the load timeout (issue 19's 300 s wait)."""
    wire.LOAD_TIMEOUT = min(wire.LOAD_TIMEOUT, args.load_timeout)
    out = {"first": _attempt(lambda: _sum(rt)), "pids": dict(rt.members)}
    digest = {"files": "te", "options": "x"}
    cfg = mp.RemoteConfig("config", {"digest": digest, "name": "te.safetensors",
                                     "load_seconds": {3: 8.0, "others": 0.2}}, digest, "text encoder")
    victim = rt.members[2]
    out["victim_pid"] = victim

    def kill_once_reported():
        deadline = time.monotonic() + 10
        while rt.ctl.peek(f"ready/{cfg.id}/2") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        out["victim_reported"] = rt.ctl.peek(f"ready/{cfg.id}/2") is not None
        os.kill(victim, signal.SIGKILL)
        out["killed_at"] = time.monotonic()
    threading.Thread(target=kill_once_reported, daemon=True).start()
    out["killed"] = _attempt(lambda: rt.run("uses_config", {"id": cfg.id}, configs=[cfg]))
    out["kill_to_error"] = time.monotonic() - out.pop("killed_at", time.monotonic())
    out["after"] = _attempt(lambda: _sum(rt))
    return out


def scenario_hostile(rt, args):
    """A local user without the key writes into the control store: garbage into `gen` (read at the next
    forming) and into a result slot; a signed value copied into
    another slot (a rank's `up` into the next command's error report); a bumped failure counter; then a flood of
    keys. Every worker must drop what it cannot verify and keep serving. Then the command channel:
    what this user can send on it (garbage, an oversized frame, a hello signed with another key, one replayed
    from another connection, one naming worker rank 0's pid, a flood of big frames) is dropped, and another
    user cannot connect at all."""
    import psutil
    out = {"first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members),
           "restarts_before": {r["rank"]: r["restarts"] for r in rt.ranks()}}
    evil = torch.distributed.PrefixStore(channel.STORE_PREFIX, channel.connect_store("127.0.0.1", rt.port, 10.0))
    g, n = rt.generation, rt.next_cmd
    evil.set("gen", b"not-a-number")
    out["after_garbage"] = _attempt(lambda: _sum(rt))

    def forge(n=n + 1):  # while command n + 1 runs: a forged result, a forged error report, a bumped counter
        evil.set(f"res/{g}/{n}", b"forged result")
        evil.set(f"err/{g}/{n}/1", b"forged error")
        evil.add(f"failed/{g}", 1)
    _later(0.5, forge)
    out["during_forgery"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=1.5, steps=1, at=0))
    n += 1
    copied = evil.get(f"up/{g}/1")  # a value this service signed, for slot up/{g}/1
    evil.set(f"err/{g}/{n + 1}/1", copied)  # replayed as rank 1's error report of the next command (the failure
    # counter bumped above makes the driver read it)
    # the driver reads the reports while a command runs: one that holds the group for a while
    out["during_replay"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=1.0, steps=1, at=0))
    out["after_replay"] = _attempt(lambda: _sum(rt))
    out["replayed_runs"] = rt.commands
    me, store = psutil.Process(), psutil.Process(rt._store.proc.pid)
    rss0, store0 = me.memory_info().rss, store.memory_info().rss
    blob = b"x" * (4 << 20)
    for i in range(int(args.flood)):
        evil.set(f"flood/{i}", blob)
    out["flood_rss_growth"] = me.memory_info().rss - rss0
    out["flood_store_rss_growth"] = store.memory_info().rss - store0
    out["after_flood"] = _attempt(lambda: _sum(rt))
    out["channel"] = _channel_probes(rt, args)
    out["after_channel"] = _attempt(lambda: _sum(rt))
    out["pids_after"] = dict(rt.members)
    out["restarts_after"] = {r["rank"]: r["restarts"] for r in rt.ranks()}
    out["generation_before"], out["generation_after"] = g, rt.generation
    return out


def _probe(address, send, nonce_to=None):
    """Connect to the command channel (a Unix socket's path, or a (host, port) of its TCP listener) as this user,
    send what send(nonce) gives; True when the driver closed the connection without a word."""
    import socket as so
    if isinstance(address, str):
        target, fd = channel._address(address)
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
    else:
        target, fd = tuple(address), None
        s = so.socket(so.AF_INET, so.SOCK_STREAM)
    try:
        s.settimeout(15)
        s.connect(target)
        nonce = channel._recv_exact(s, 32)
        try:
            s.sendall(send(nonce))
            return s.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
    finally:
        s.close()
        if fd is not None:
            os.close(fd)


def _frame(signer, nonce, obj, seq=1):
    body = signer.dumps((nonce, "w", seq, obj))
    return len(body).to_bytes(4, "big") + body


def _channel_probes(rt, args):
    import psutil
    import stat
    import subprocess
    path = rt._channel.path
    signer = wire.Signer(os.environ[wire.KEY_ENV].encode())
    foreign = wire.Signer(wire.new_key().encode())
    rank0 = rt.members[0]
    out = {"path": path, "folder_mode": stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode),
           "socket_mode": stat.S_IMODE(os.stat(path).st_mode)}
    probes = {
        "garbage": lambda nonce: b"\x00\x00\x00\x10" + b"\x80\x05garbage bytes!",
        "oversized": lambda nonce: b"\xff\xff\xff\xff" + b"x" * 1024,
        "foreign": lambda nonce: _frame(foreign, nonce, {"hello": {"role": "command", "rank": 0, "pid": os.getpid(),
                                                                     "generation": rt.generation}}),
        "replayed": lambda nonce: _frame(signer, os.urandom(32), {"hello": {"role": "command", "rank": 0,
                                                                            "pid": os.getpid(), "generation": rt.generation}}),
        "impostor": lambda nonce: _frame(signer, nonce, {"hello": {"role": "beat", "rank": 0, "pid": rank0}}),
    }
    for name, send in probes.items():
        out[name] = _probe(path, send)
    me = psutil.Process()
    rss0 = me.memory_info().rss
    blob = b"\x00\x40\x00\x00" + b"y" * (4 << 20)  # a 4 MiB frame, as a flood
    out["flood_closed"] = sum(_probe(path, lambda nonce: blob) for _ in range(int(args.flood)))
    out["flood_rss_growth"] = me.memory_info().rss - rss0
    out["dropped"] = rt._channel.dropped
    if os.geteuid() == 0 and os.path.exists("/usr/bin/setpriv") and os.path.exists("/usr/bin/python3"):
        other = subprocess.run(["/usr/bin/setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                                "/usr/bin/python3", "-c", "import socket, sys; socket.socket(socket.AF_UNIX)"
                                ".connect(sys.argv[1])", path], capture_output=True, text=True, timeout=60)
        out["other_user"] = {"rc": other.returncode, "stderr": other.stderr[-300:]}
    return out


# What the deleter leaves alone (docs/multinpu.md, "What a store client can still do"): deleting `layout` holds
# every worker started afterwards (the replacements after a failure) until the join timeout.
SPARED = ("layout",)


def scenario_forged_heartbeats(rt, args):
    """Two nodes (every rank and node 1's agent beat on the command channel: node 0's on its Unix socket, node 1's
    on its TCP listener), a store client and a channel client without the key running all along: garbage into
    the heartbeat keys of old, every key the store lists deleted (all but SPARED while the group is idle; the
    old beat keys after), the channel's TCP port flooded with garbage, oversized frames and hellos signed with
    another key or replayed from another connection, naming node 1's workers and agent; hellos on the Unix
    socket naming a worker. Healthy ranks must not be killed; a SIGSTOPped one, on either node, must still be
    found hung within the bound."""
    import socket as so
    out = {"first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members)}
    raw = channel.connect_store("127.0.0.1", rt.port, 10.0)
    evil = torch.distributed.PrefixStore(channel.STORE_PREFIX, raw)
    foreign = wire.Signer(wire.new_key().encode())
    signer = wire.Signer(os.environ[wire.KEY_ENV].encode())  # only to sign a hello for another connection
    tcp = (rt.spec.master_addr, rt.port + wire.CHANNEL_PORT_OFFSET)
    stop, idle = threading.Event(), threading.Event()
    idle.set()
    rounds, deleted, probes = [0], {}, {"closed": 0, "sent": 0}
    prefix = channel.STORE_PREFIX + "/"

    def delete_all():
        for key in raw.list_keys():
            name = key[len(prefix):] if key.startswith(prefix) else key
            beat = name.startswith(("hb/", "agent_hb/"))
            if (beat or idle.is_set()) and not name.startswith(SPARED) and raw.delete_key(key):
                group = name.split("/")[0]
                deleted[group] = deleted.get(group, 0) + 1

    def flood(members):
        for r, pid in members.items():
            if rt.spec.node_of(r) == 0:
                continue
            hellos = [{"role": "beat", "rank": r, "pid": pid}, {"role": "agent", "node": 1, "pid": AGENT[0].pid}]
            sends = [lambda nonce: b"\x00\x00\x00\x05junk!", lambda nonce: b"\xff\xff\xff\xff",
                     *[lambda nonce, h=h: _frame(foreign, nonce, {"hello": h}) for h in hellos],
                     *[lambda nonce, h=h: _frame(signer, os.urandom(32), {"hello": h}) for h in hellos]]
            for send in sends:
                try:
                    probes["sent"] += 1
                    probes["closed"] += _probe(tcp, send)
                except OSError:
                    pass

    def forge():
        while not stop.wait(0.2):
            rounds[0] += 1
            members = dict(rt.members)
            for r, pid in members.items():
                evil.add(f"hb/{r}", 1)
                evil.set(f"hb/{r}/{pid}", b"\x80\x05forged beat")
                if rt.spec.node_of(r) == 0 and rounds[0] % 5 == 0:
                    try:  # a beat on the Unix socket naming this worker, signed with another key
                        address, fd = channel._address(rt._channel.path)
                        with so.socket(so.AF_UNIX, so.SOCK_STREAM) as c:
                            c.settimeout(5)
                            c.connect(address)
                            nonce = channel._recv_exact(c, 32)
                            c.sendall(_frame(foreign, nonce, {"hello": {"role": "beat", "rank": r, "pid": pid}}))
                            c.recv(1)
                        if fd is not None:
                            os.close(fd)
                    except OSError:
                        pass
            evil.set("agent_hb/1", b"\x80\x05forged agent beat")
            delete_all()
            flood(members)
    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    time.sleep(3 * wire.HEARTBEAT_STALE)  # idle: the monitor checks every rank's heartbeat all along
    out["ranks_while_deleted"] = {r["rank"]: {"alive": r["alive"], "pid": r.get("pid")} for r in rt.ranks()}
    idle.clear()  # from here only the beat keys of old: the group must re-form after each hang (SPARED aside)
    out["deleted_while_idle"] = dict(deleted)
    out["healthy"] = _attempt(lambda: _sum(rt))
    out["pids_healthy"] = dict(rt.members)
    for name, rank in (("remote_stopped", rt.world_size - 1), ("local_stopped", 1)):
        victim = rt.members.get(rank)
        if victim is None:
            out[name] = {"ok": True, "skipped": f"the group is {rt.state}: {rt.error}"}
            continue
        os.kill(victim, signal.SIGSTOP)
        out[name] = _attempt(lambda: _sum(rt))
        out[name]["victim_pid"] = victim
        out[f"after_{name}"] = _attempt(lambda: _sum(rt))
    stop.set()
    forger.join(30)
    out["forged_rounds"] = rounds[0]
    out["deleted"] = deleted
    out["tcp_probes"] = probes
    out["channel_dropped"] = rt._channel.dropped
    return out


def scenario_deleted_command(rt, args):
    """A store client without the key deleting, while five commands run, every command key it sees (cmd/{g}/{n},
    where worker rank 0 relayed each command to the others before the commands went to every rank on its own
    channel connection) and every other key it lists but `layout` and the process groups' rendezvous keys
    (pg{g}/...); then one command without it."""
    out = {"first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members), "generation_before": rt.generation}
    raw = channel.connect_store("127.0.0.1", rt.port, 10.0)
    prefix = channel.STORE_PREFIX + "/"
    stop, hits, deleted = threading.Event(), [], {}

    def delete():
        while not stop.is_set():
            g, n = rt.generation, rt.next_cmd
            for k in (n - 1, n):
                key = f"{prefix}cmd/{g}/{k}"
                if raw.check([key]) and raw.delete_key(key):
                    hits.append([g, k])
            for key in raw.list_keys():
                name = key[len(prefix):] if key.startswith(prefix) else key
                if name != "layout" and not key.startswith("pg") and raw.delete_key(key):
                    group = name.split("/")[0]
                    deleted[group] = deleted.get(group, 0) + 1
    deleter = threading.Thread(target=delete, daemon=True)
    deleter.start()
    out["attacked"], out["held"] = [], []
    for _ in range(5):  # a prompt: a command that holds the group for a while, then one with inputs and a result
        out["held"].append(_attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=args.sleep, steps=2, at=0)))
        out["attacked"].append(_attempt(lambda: _sum(rt)))
    stop.set()
    deleter.join(5)
    out["deleted"] = hits
    out["deleted_keys"] = deleted
    out["pids_attacked"] = dict(rt.members)
    out["generation_attacked"] = rt.generation
    out["after"] = _attempt(lambda: _sum(rt))
    out["pids_after"] = dict(rt.members)
    return out


def scenario_closed_link(rt, args):
    """Worker rank --victim closes its command connection during a command and holds it (alive, in no
    collective): the command fails naming that rank, the group is replaced, the next command runs."""
    out = {"first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members)}
    out["closed"] = _attempt(lambda: rt.run("close_link", {"rank": args.victim, "seconds": args.sleep}))
    out["after"] = _attempt(lambda: _sum(rt))
    out["pids_after"] = dict(rt.members)
    return out


def scenario_store_lost(rt, args):
    """The store's process is SIGKILLed while the group is idle (with --flood N: N values of 4 MiB written into
    it, past its growth limit, and it ends itself): the driver starts it again on the same port, the whole
    group is replaced, the next command runs."""
    import psutil
    out = {"driver_pid": os.getpid(), "first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members),
           "store_pid": rt._store.proc.pid}
    starts = rt._store.starts  # 1 in a fresh group; more after an earlier scenario of a sequence lost the store
    if args.flood:
        rss0 = psutil.Process().memory_info().rss
        evil = torch.distributed.PrefixStore(channel.STORE_PREFIX, channel.connect_store("127.0.0.1", rt.port, 10.0))
        try:
            for i in range(int(args.flood)):
                evil.set(f"flood/{i}", b"x" * (4 << 20))
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - the store ended under the flood
            out["flood_stopped"] = _err(e)
        out["flood_rss_growth"] = psutil.Process().memory_info().rss - rss0
    else:
        os.kill(rt._store.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    while rt._store.starts < starts + 1 and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    out["next"] = _attempt(lambda: _sum(rt))
    out["next_after"] = time.monotonic() - t0
    out["store_pid_after"] = rt._store.proc.pid
    out["store_starts"] = rt._store.starts - starts + 1  # the store's starts in this scenario, the first counted
    out["pids_after"] = dict(rt.members)
    if not args.flood:  # then while a command runs: it fails naming the store, and the one after runs
        store_pid = rt._store.proc.pid
        _later(1.0, lambda: os.kill(store_pid, signal.SIGKILL))
        out["mid_command"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=4.0))
        out["mid_command_store_pid"] = store_pid
        out["after_mid_command"] = _attempt(lambda: _sum(rt))
    out["driver_pid_after"] = os.getpid()
    return out


def start_agent(rt, node=1):
    """Node `node`'s agent (`python -m comfy.multinpu_group`) of this group, as another host would run it."""
    import json as _json
    import subprocess
    spec = _json.loads(rt.spec.to_json())
    spec.update(node_rank=node, master_port=rt.port, runtime_root=None)
    env = dict(os.environ, **{wire.GROUP_ENV: _json.dumps(spec)})
    return subprocess.Popen([sys.executable, "-B", "-m", "comfy.multinpu_group"], env=env, stdin=subprocess.DEVNULL)


def scenario_agent_lost(rt, args):
    """Two nodes: node 1's agent is SIGKILLed (its workers die with it) while a command runs; then it is started
    again and the group must come back by itself."""
    out = {"driver_pid": os.getpid(), "first": _attempt(lambda: _sum(rt)), "pids_before": dict(rt.members)}
    agent = AGENT[0]
    killed = []
    _later(1.0, lambda: (os.kill(agent.pid, signal.SIGKILL), killed.append(time.monotonic())))
    out["lost"] = _attempt(lambda: _fail(rt, rank=0, kind="sleep", seconds=args.sleep, steps=2, at=0))
    out["kill_to_error"] = time.monotonic() - killed[0] if killed else None
    agent.wait(10)
    out["while_lost"] = _attempt(lambda: _sum(rt))  # fails fast: the host is known lost
    out["state_while_lost"] = rt.state
    AGENT[0] = start_agent(rt)
    t0 = time.monotonic()
    while rt.state != "ready" and time.monotonic() - t0 < 120:
        time.sleep(0.2)
    out["back_after"] = time.monotonic() - t0
    out["after"] = _attempt(lambda: _sum(rt))
    out["kill_to_next_success"] = time.monotonic() - killed[0] if killed and out["after"]["ok"] else None
    out["pids_after"] = dict(rt.members)
    out["driver_pid_after"] = os.getpid()
    return out


AGENT = [None]


def watch_clocks() -> dict:
    """{rank: the clocks its beats named} from now on, every process of the rank on every host counted ("sync" on
    plain gloo, "twin" under H3KIT_EMULATE_ASYNC_DEVICE=1 once a marker was recorded; comfy.multinpu.BEAT_LISTENERS):
    shows which clock a run ran on, node 1's workers (started by its agent) included."""
    clocks = {}

    def seen(rank, progress):
        if isinstance(progress, dict) and progress.get("clock"):
            clocks.setdefault(rank, set()).add(progress["clock"])
    comfy.multinpu.BEAT_LISTENERS.append(seen)
    return clocks


def scenario_all(rt, args):
    """The one-host scenarios one after the other, in one group (each leaves it usable for the next)."""
    out = {}
    for name in ("basics", "idle", "failures", "configs", "kill", "hang"):
        t0 = time.monotonic()
        out[name] = SCENARIOS[name](rt, args)
        out[name]["scenario_seconds"] = time.monotonic() - t0
    return out


def scenario_sequence(rt, args):
    """--steps JSON, [[label, scenario, {argument: value}], ...]: those scenarios one after the other in this one
    group (each leaves it usable for the next), each with its own --sleep, --victim, --flood... as given, its record
    under its label. A line "scenario LABEL begins" in the log before each: scenario_log() in the tests cuts out a
    scenario's part."""
    out = {}
    for label, name, overrides in json.loads(args.steps):
        step = argparse.Namespace(**{**vars(args), **overrides})
        logging.info(f"scenario {label} begins")
        t0 = time.monotonic()
        out[label] = SCENARIOS[name](rt, step)
        out[label]["scenario_seconds"] = time.monotonic() - t0
    logging.info("scenario sequence ends")
    return out


def _free_ports(n: int) -> int:
    """A port on the loopback that the kernel gave, with the n - 1 ports after it free too."""
    import socket as so
    for _ in range(200):
        with so.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + n - 1 > 65535:
                continue
            try:
                for k in range(1, n):
                    with so.socket() as t:
                        t.bind(("127.0.0.1", port + k))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no {n} free ports in a row")


SCENARIOS = {k.removeprefix("scenario_"): v for k, v in list(globals().items()) if k.startswith("scenario_")}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--root", default=None)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--join-timeout", type=float, default=60.0)
    ap.add_argument("--victim", type=int, default=2)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--flood", type=int, default=0, help="hostile: how many 4 MiB keys to write")
    ap.add_argument("--agent", action="store_true", help="start node 1's agent (two nodes)")
    ap.add_argument("--faults", default="", help="scenario faults: a comma-separated subset of FAULTS")
    ap.add_argument("--sleep", type=float, default=3.0, help="agent_lost, deleted_command: how long rank 0 holds a "
                    "command")
    ap.add_argument("--load-timeout", type=float, default=60.0, help="kill_while_loading: the driver's load bound")
    ap.add_argument("--repeat", type=int, default=1, help="kill_while_loading: how many rounds")
    ap.add_argument("--slow", type=float, default=3.0, help="hangs: seconds the slow rank takes before each step")
    ap.add_argument("--hold", type=float, default=0.0, help="stay up this long after writing --out (orphan tests)")
    ap.add_argument("--steps", default="[]", help="sequence: the scenarios to run, [[label, name, {argument: value}], "
                    "...]")
    args = ap.parse_args(argv)
    if args.nnodes > 1 and args.port == 0:
        args.port = _free_ports(2)  # the store's and the channel's for other hosts (+1)
    logging.basicConfig(level=logging.DEBUG if os.environ.get('H3KIT_TEST_DEBUG') else logging.INFO, format='[driver] %(asctime)s %(message)s', stream=sys.stdout)
    os.environ.setdefault(wire.KEY_ENV, wire.new_key())
    spec = wire.GroupSpec(nnodes=args.nnodes, node_rank=0, local_size=args.world // args.nnodes, device_type="cpu",
                          master_port=args.port, timeout=args.timeout, join_timeout=args.join_timeout,
                          runtime_root=args.root, worker_module="process_group_worker")
    result = {"scenario": args.scenario}
    t0 = time.monotonic()
    try:
        clocks = watch_clocks()
        rt = mp.start_runtime(spec, os.environ[wire.KEY_ENV])
        result["port"] = rt.port
        if args.agent:
            AGENT[0] = start_agent(rt)
        _write_whole(args.out + ".port", str(rt.port))
        form = _attempt(lambda: mp.wait_ready(rt, args.join_timeout + 5))
        result["form"] = form
        if form["ok"]:
            result.update(SCENARIOS[args.scenario](rt, args))
        result["ranks"] = rt.ranks()
        result["state"], result["error"] = rt.state, rt.error
        result["clocks"] = {rank: sorted(seen) for rank, seen in sorted(clocks.items())}
    except BaseException as e:  # noqa: BLE001
        result["crash"] = {**_err(e), "traceback": traceback.format_exc()}
    result["seconds"] = time.monotonic() - t0
    _write_whole(args.out, json.dumps(result, indent=2, default=str))
    time.sleep(args.hold)
    mp.stop_runtime()
    if AGENT[0] is not None:
        AGENT[0].terminate()
        AGENT[0].wait(10)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
