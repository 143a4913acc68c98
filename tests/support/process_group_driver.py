"""Rank 0 of a bare process group for the runtime tests (test support, not shipped).

    python process_group_driver.py SCENARIO --out FILE [--world N] [--nnodes M] [--port P] [--root DIR]

Starts comfy.multinpu_process.GroupRuntime with process_group_worker.py as the worker program, runs one
scenario and writes what it observed as JSON. Each scenario is a function below; they measure, they do not
assert (the tests do).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
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
import comfy.multinpu_group as group  # noqa: E402
import comfy.multinpu_process as mp  # noqa: E402


def _err(e):
    return {"type": type(e).__name__, "message": str(e)}


def _attempt(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return {"ok": True, "value": value, "seconds": time.monotonic() - t0}
    except BaseException as e:  # noqa: BLE001 - a scenario reports every outcome
        return {"ok": False, "error": _err(e), "seconds": time.monotonic() - t0}


def _sum(rt):
    def body(comm):
        x = torch.zeros(4)
        return comfy.multinpu.all_reduce(x, comm).tolist()
    return rt.run("sum", {"x": torch.zeros(4)}, body)


def _fail(rt, **payload):
    return rt.run("fail", payload, lambda comm: comfy.multinpu.barrier(comm))


def scenario_basics(rt, args):
    out = {"first": _attempt(lambda: _sum(rt))}
    # payload fidelity: dtypes, shapes, empty and CPU tensors through one header and one broadcast
    sent = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.tensor([True, False, True]),
            torch.randn(2, 3, 5).to(torch.bfloat16), torch.zeros(0, 7), torch.tensor(3, dtype=torch.int64)]

    def echo(comm):
        return all(torch.equal(comm.recv(torch.empty_like(t), r), t)
                   for r in range(1, rt.world_size) for t in sent)
    out["echo"] = _attempt(lambda: rt.run("echo", {"tensors": sent, "note": "x"}, echo))
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        _sum(rt)
        times.append(time.perf_counter() - t0)
    out["command_seconds"] = sorted(times)[len(times) // 2]
    out["generation"] = rt.generation
    out["pids"] = dict(rt.members)
    return out


def scenario_failures(rt, args):
    out = {}
    out["raise"] = _attempt(lambda: _fail(rt, rank=2, kind="raise"))
    out["after_raise"] = _attempt(lambda: _sum(rt))
    out["oom"] = _attempt(lambda: _fail(rt, rank=1, kind="oom"))
    out["after_oom"] = _attempt(lambda: _sum(rt))

    class Interrupted(Exception):
        pass

    def interrupted(comm):
        raise Interrupted("interrupted on rank 0")
    out["rank0"] = _attempt(lambda: rt.run("fail", {"rank": -1, "kind": "raise"}, interrupted))
    out["after_rank0"] = _attempt(lambda: _sum(rt))
    out["generation"] = rt.generation
    return out


def scenario_kill(rt, args):
    out = {}
    victim = rt.members[args.victim]
    out["victim_pid"] = victim

    def killed(comm):
        os.kill(victim, signal.SIGKILL)
        comfy.multinpu.barrier(comm)
    out["killed"] = _attempt(lambda: rt.run("fail", {"rank": args.victim, "kind": "sleep", "seconds": 30}, killed))
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
    out["install"] = _attempt(lambda: rt.run("uses_config", {"id": good.id}, lambda comm: comfy.multinpu.all_reduce(
        torch.tensor([2.0]), comm).item(), configs=[good]))
    out["installed"] = dict(good.installed)
    mismatch = mp.RemoteConfig("config", {"digest": digest, "differ_on": 2}, digest, "model b")
    out["mismatch"] = _attempt(lambda: rt.run("uses_config", {"id": mismatch.id}, lambda comm: None,
                                              configs=[mismatch]))
    missing = mp.RemoteConfig("config", {"digest": digest, "fail_on": 1, "name": "c.safetensors"}, digest, "model c")
    out["missing"] = _attempt(lambda: rt.run("uses_config", {"id": missing.id}, lambda comm: None, configs=[missing]))
    out["after"] = _attempt(lambda: _sum(rt))
    return out


def scenario_form_only(rt, args):
    return {"sum": _attempt(lambda: _sum(rt)), "ranks": rt.ranks()}


def scenario_remote_kill(rt, args):
    """Two nodes: kill a worker of node 1 (the agent's) mid-command; the agent replaces it."""
    out = {"first": _attempt(lambda: _sum(rt)), "pids": dict(rt.members)}
    victim = rt.members[rt.world_size - 1]
    out["victim_pid"] = victim

    def killed(comm):
        os.kill(victim, signal.SIGKILL)
        comfy.multinpu.barrier(comm)
    out["killed"] = _attempt(lambda: rt.run("fail", {"rank": -1, "kind": "raise"}, killed))
    out["after_kill"] = _attempt(lambda: _sum(rt))
    out["replacement_pid"] = rt.members.get(rt.world_size - 1)
    return out


def scenario_all(rt, args):
    """The one-host scenarios one after the other, in one group (each leaves it usable for the next)."""
    out = {}
    for name in ("basics", "idle", "failures", "configs", "kill", "hang"):
        t0 = time.monotonic()
        out[name] = SCENARIOS[name](rt, args)
        out[name]["scenario_seconds"] = time.monotonic() - t0
    return out


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
    ap.add_argument("--hold", type=float, default=0.0, help="stay up this long after writing --out (orphan tests)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if os.environ.get('H3KIT_TEST_DEBUG') else logging.INFO, format='[rank 0] %(asctime)s %(message)s', stream=sys.stdout)
    os.environ.setdefault(group.KEY_ENV, group.new_key())
    spec = group.GroupSpec(nnodes=args.nnodes, node_rank=0, local_size=args.world // args.nnodes, device_type="cpu",
                        master_port=args.port, timeout=args.timeout, join_timeout=args.join_timeout,
                        runtime_root=args.root, worker_module="process_group_worker")
    result = {"scenario": args.scenario}
    t0 = time.monotonic()
    try:
        rt = mp.start_runtime(spec, os.environ[group.KEY_ENV])
        result["port"] = rt.port
        Path(args.out + ".port").write_text(str(rt.port))
        form = _attempt(lambda: mp.wait_ready(rt, args.join_timeout + 5))
        result["form"] = form
        if form["ok"]:
            result.update(SCENARIOS[args.scenario](rt, args))
        result["ranks"] = rt.ranks()
        result["state"], result["error"] = rt.state, rt.error
    except BaseException as e:  # noqa: BLE001
        result["crash"] = {**_err(e), "traceback": traceback.format_exc()}
    result["seconds"] = time.monotonic() - t0
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    time.sleep(args.hold)
    mp.stop_runtime()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
