"""Kill a worker of node 1 again and again in a real 2 + 2 loopback service and time what each kill costs.

Starts node 0 (ComfyUI, the driver, ranks 0-1) and node 1 (the agent, ranks 2-3) of one process-transport group
on 127.0.0.1 with `h3kit start`, from an installed tree with the demo's tiny checkpoints (node 1
gets a copy of the tree without the models: its workers load node 0's files by path), under
H3KIT_EMULATE_NO_RELEASE=1 (HCCL/NCCL's failure semantics). Then, every round: wait until the group re-formed
after the last kill (fresh workers hold no model), submit a demo prompt with a new text, SIGKILL node 1's rank 3
a random 0.2-4 s after the prompt started running (most land in the text encoder's install or load, the rest in
the sampler or in the server's own work between commands), and time the prompt's end. A prompt that does not end
within --bound seconds stops the soak (the driver's log then says every 10 s what it waits for). At the end one
more prompt must succeed. Prints a JSON line per round and a summary; stops both nodes.

    PYTHONPATH=toolkit python benchmarks/multinpu_kill_soak.py --comfy-home TREE
        [--rounds 15] [--bound 150]

TREE is an installed tree (h3kit install); it and its copy for node 1 are used in place (models written once).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from h3kit import demo

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(url: str, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with NO_PROXY.open(req, timeout=10) as resp:
        return json.loads(resp.read() or b"null")


def free_pair() -> int:
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    raise SystemExit("no two free ports in a row")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy-home", required=True, type=Path)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bound", type=float, default=150.0)
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    home = args.comfy_home.resolve()
    home1 = home.parent / "host1" / "ComfyUI"
    if not (home / "models" / "diffusion_models" / "h3kit_tiny_dit.safetensors").exists():
        demo.write_tiny_checkpoints(home, args.python)
    if not home1.exists():
        shutil.copytree(home, home1, symlinks=True, ignore=lambda d, names: [
            n for n in names if n == ".git" or (d == str(home) and n in ("models", "output"))])
    port, master = free_pair(), free_pair()
    env = dict(os.environ, H3KIT_GROUP_KEY=os.urandom(32).hex(), H3KIT_EMULATE_NO_RELEASE="1")

    def node(n: int):
        return [sys.executable, "-m", "h3kit", "start", "--comfy-home", str(home if n == 0 else home1), "--devices",
                "0,1", "--device-type", "cpu", "--transport", "process", "--nnodes", "2", "--node-rank", str(n),
                "--master-port", str(master), "--python", args.python, "--timeout", "400", "--join-timeout", "300",
                "--json"] + (["--port", str(port)] if n == 0 else [])
    url = f"http://127.0.0.1:{port}"
    starts = [subprocess.Popen(node(n), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for n in (0, 1)]
    try:
        for p in starts:
            out, err = p.communicate(timeout=500)
            if p.returncode != 0:
                raise SystemExit(f"start failed: {out[-2000:]}{err[-2000:]}")
        ranks_file = home / ".h3kit" / "run" / "ranks.json"

        def prompt(tag: str, steps: int = 10) -> dict:
            p = demo.demo_prompt(4, tag)
            for n in p.values():
                if n["class_type"] == "RandomNoise":
                    n["inputs"]["noise_seed"] = random.randint(0, 2 ** 31)
                if n["class_type"] == "BasicScheduler":
                    n["inputs"]["steps"] = steps
                if n["class_type"] == "MiniMaxH3ImageToVideo":
                    n["inputs"]["prompt"] += f" ({tag})"  # a new text: the text encoder runs
            return http_json(f"{url}/prompt", {"prompt": p})["prompt_id"]

        def ended(pid: str, bound: float):
            t0 = time.monotonic()
            while time.monotonic() - t0 < bound:
                entry = http_json(f"{url}/history/{pid}").get(pid)
                if entry and entry["status"].get("completed") is not None:
                    return entry["status"]
                time.sleep(0.05)
            return None

        warm = ended(prompt("warm", 3), args.bound)
        print(json.dumps({"warm": warm and warm["status_str"]}), flush=True)
        prev, rows = None, []
        for i in range(args.rounds):
            t0 = time.monotonic()
            while time.monotonic() - t0 < 300:
                try:
                    data = json.loads(ranks_file.read_text())
                    victim = data["ranks"][3]["pid"]
                    if (data["state"] == "ready" and all(r["joined"] for r in data["ranks"]) and victim != prev
                            and os.path.exists(f"/proc/{victim}")):
                        break
                except (OSError, ValueError, KeyError, IndexError):
                    pass
                time.sleep(0.2)
            ready_after = time.monotonic() - t0
            prev = victim
            pid = prompt(f"kill{i}")
            while not http_json(f"{url}/queue")["queue_running"]:
                time.sleep(0.02)
            delay = random.uniform(0.2, 4.0)
            time.sleep(delay)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass
            t_kill = time.monotonic()
            status = ended(pid, args.bound)
            row = {"round": i, "group_ready_after_s": round(ready_after, 1), "kill_after_s": round(delay, 2),
                   "to_end_s": round(time.monotonic() - t_kill, 2)}
            if status is None:
                row["outcome"] = f"HUNG: no end within {args.bound:g} s"
            else:
                errors = [m[1] for m in status["messages"] if m[0] == "execution_error"]
                row["outcome"] = errors[0]["exception_message"].splitlines()[0][:200] if errors else status["status_str"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if status is None:
                break
        final = ended(prompt("final", 3), args.bound)
        failed = [r["to_end_s"] for r in rows if r["outcome"] not in ("success",) and not r["outcome"].startswith("HUNG")]
        print(json.dumps({"rounds": len(rows), "failed_prompts": len(failed),
                          "kill_to_error_s": [min(failed), max(failed)] if failed else None,
                          "hung": sum(r["outcome"].startswith("HUNG") for r in rows),
                          "final": final and final["status_str"]}), flush=True)
    finally:
        for n, h in ((1, home1), (0, home)):
            subprocess.run([sys.executable, "-m", "h3kit", "stop", "--comfy-home", str(h), "--json"],
                           capture_output=True, timeout=120)


if __name__ == "__main__":
    main()
