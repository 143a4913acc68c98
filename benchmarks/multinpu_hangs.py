"""Seconds from each new fault of issue 28 to its error and to the next success, beside a kill -9, in one run.

Runs tests/support/process_group_driver.py's `hangs` scenario (the real driver and worker loop, bare test programs
instead of the H3 runners) on 2 ranks, with HCCL/NCCL's failure semantics emulated
(H3KIT_EMULATE_NO_RELEASE=1) and the default settings (group timeout 300 s, heartbeat 15 s, progress bound 60 s,
send bound 10 s) unless given:

- kill9: the last rank SIGKILLed 1 s into a command (an existing fault, for comparison);
- hung_in_kernel: the last rank blocks at step 1 of a command with the GIL released (its heartbeat beats on) while
  rank 0 waits in that step's all_reduce;
- blocked_send: the last rank holds 45 s after a command (beating, reading no command); the next command's 16 MiB
  header fills its connection.

    python benchmarks/multinpu_hangs.py [--progress S] [--send S] [--json]

Prints one row per fault: seconds from the fault to the error, and to the next command's success.

--server does hung_in_kernel through the real server instead: `h3kit start --transport process` on TREE (an
installed tree; the demo's tiny checkpoints are written into it once), one host, 2 ranks on cpu,
H3KIT_EMULATE_NO_RELEASE=1 and nothing else set (group timeout 300 s, heartbeat 15 s, progress bound 60 s unless
--progress). A warm prompt; then rank 1 blocks at the start of a prompt's first DiT forward with the GIL released
(H3KIT_MULTINPU_FAULT=dit_forward:hang, its trigger file present) while rank 0 waits for it; the clock starts at
rank 1's own log line saying so. Prints seconds from the hang to the prompt's error and to the next
prompt's success (submitted at once, nobody acting), the error, and the server's pid before and after.

    PYTHONPATH=toolkit python benchmarks/multinpu_hangs.py --server --comfy-home TREE [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"
FAULTS = ("kill9", "hung_in_kernel", "blocked_send")


def run(args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "patches" / "src"), str(SUPPORT)]),
               H3KIT_EMULATE_NO_RELEASE="1")
    for name, value in (("H3KIT_PROGRESS_TIMEOUT", args.progress), ("H3KIT_SEND_TIMEOUT", args.send)):
        if value is not None:
            env[name] = str(value)
    with tempfile.TemporaryDirectory(prefix="h3kit-hangs-") as tmp:
        out = Path(tmp) / "hangs.json"
        proc = subprocess.run([sys.executable, str(SUPPORT / "process_group_driver.py"), "hangs", "--out", str(out),
                               "--world", "2", "--timeout", str(args.timeout),
                               "--faults", ",".join(FAULTS), "--sleep", "45"],
                              env=env, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise SystemExit(f"the driver wrote nothing:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
BOUND = 900.0   # seconds any one wait below may take before the run is called hung


def http_json(url: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with NO_PROXY.open(req, timeout=10) as resp:
        return json.loads(resp.read() or b"null")


def until(predicate, what: str, step: float = 0.05):
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise SystemExit(f"no {what} within {BOUND:g} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def h3kit(*args, env=None, timeout=BOUND):
    p = subprocess.run([sys.executable, "-m", "h3kit", *map(str, args), "--json"], env=env, capture_output=True,
                       text=True, timeout=timeout)
    doc = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
    if p.returncode != 0:
        raise SystemExit(f"h3kit {args[0]} failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return doc.get("data", doc)


def serve_hang(home: Path, args) -> dict:
    """hung_in_kernel through a real server on `home` (see the module's docstring)."""
    from h3kit import demo, service
    with tempfile.TemporaryDirectory(prefix="h3kit-hang-server-") as tmp:
        trigger = Path(tmp) / "hang-1"
        env = dict(os.environ, H3KIT_EMULATE_NO_RELEASE="1",
                   H3KIT_MULTINPU_FAULT=f"dit_forward:hang:{tmp}/hang-{{rank}}")
        if args.progress is not None:
            env["H3KIT_PROGRESS_TIMEOUT"] = str(args.progress)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        h3kit("start", "--comfy-home", home, "--devices", "0,1", "--device-type", "cpu", "--transport", "process",
              "--port", port, env=env)
        try:
            rec = service.read_record(home / ".h3kit" / "run")
            log = Path(rec.log)

            def prompt(tag: str) -> str:
                p = demo.demo_prompt(2, tag)
                for n in p.values():
                    if n["class_type"] == "RandomNoise":
                        n["inputs"]["noise_seed"] = random.randint(0, 2 ** 31)  # a new prompt, nothing cached
                return http_json(f"{url}/prompt", {"prompt": p})["prompt_id"]

            def ended(pid: str) -> dict:
                def done():
                    entry = http_json(f"{url}/history/{pid}").get(pid)
                    return entry if entry and entry["status"].get("completed") is not None else None
                return until(done, f"end of prompt {pid}")["status"]
            t0 = time.monotonic()
            warm = ended(prompt("warm"))["status_str"]
            warm_s = time.monotonic() - t0
            server = h3kit("status", "--comfy-home", home)["pid"]
            offset = log.stat().st_size
            trigger.touch()
            try:
                pid = prompt("hang")

                def hanging():
                    with open(log, "rb") as f:
                        f.seek(offset)
                        return b"rank 1: H3KIT_MULTINPU_FAULT=dit_forward:hang:" in f.read()
                until(hanging, "log line of rank 1 blocking in its DiT forward", step=0.02)
                t_hang = time.monotonic()
                status = ended(pid)
                to_error = time.monotonic() - t_hang
            finally:
                trigger.unlink()
            errors = [m[1] for m in status["messages"] if m[0] == "execution_error"]
            nxt = ended(prompt("after_hang"))["status_str"]
            to_next = time.monotonic() - t_hang
            return {"warm": warm, "warm_s": round(warm_s, 1), "to_error": round(to_error, 1),
                    "error": (f"{errors[0]['exception_type']}: {errors[0]['exception_message']}" if errors
                              else status["status_str"]),
                    "to_next": round(to_next, 1), "next": nxt, "server_pid": server,
                    "server_pid_after": h3kit("status", "--comfy-home", home)["pid"]}
        finally:
            subprocess.run([sys.executable, "-m", "h3kit", "stop", "--comfy-home", str(home), "--json"],
                           capture_output=True, timeout=120)


def main_server(args):
    from h3kit import demo
    home = args.comfy_home.resolve()
    if not (home / "models" / "diffusion_models" / "h3kit_tiny_dit.safetensors").exists():
        demo.write_tiny_checkpoints(home, sys.executable)
    rows = [serve_hang(home, args)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'to error':>9} {'to next':>8}  {'server pid':17}  error")
    for r in rows:
        print(f"{r['to_error']:8.1f}s {r['to_next']:7.1f}s  "
              f"{r['server_pid']:>7} -> {r['server_pid_after']:<7}  "
              f"{'' if r['next'] == 'success' else '(next: ' + r['next'] + ') '}{r['error'][:400].strip()}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--timeout", type=float, default=300.0, help="the group timeout (default 300 s, h3kit's)")
    ap.add_argument("--progress", type=float, help="H3KIT_PROGRESS_TIMEOUT (default: the runtime's, 60 s)")
    ap.add_argument("--send", type=float, help="H3KIT_SEND_TIMEOUT (default: the runtime's, 10 s)")
    ap.add_argument("--server", action="store_true", help="hung_in_kernel through the real server (--comfy-home)")
    ap.add_argument("--comfy-home", type=Path, help="--server: an installed tree")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.server:
        if args.comfy_home is None:
            ap.error("--server needs --comfy-home (an installed tree: h3kit install)")
        return main_server(args)
    rows = []
    result = run(args)
    if "crash" in result or not result.get("form", {}).get("ok"):
        raise SystemExit(json.dumps(result.get('crash') or result.get('form'))[:2000])
    for fault in FAULTS:
        f = result[fault]
        rows.append({"fault": fault, "error": None if f["error"]["ok"] else
                     f"{f['error']['error']['type']}: {f['error']['error']['message'][:160]}",
                     "to_error": round(f["fault_to_error"], 1), "to_next": round(f["fault_to_next"], 1),
                     "next_ok": f["next"]["ok"], "driver_same": result["driver_pid_after"] == result["driver_pid"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'fault':15} {'to error':>9} {'to next':>8}  error")
    for r in rows:
        print(f"{r['fault']:15} {r['to_error']:8.1f}s {r['to_next']:7.1f}s  "
              f"{'' if r['next_ok'] else '(next FAILED) '}{r['error']}")


if __name__ == "__main__":
    main()
