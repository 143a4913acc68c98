"""h3kit front: N jobs through the front on 2 servers against 1 (throughput ratio), and the front's overhead per
job against the same jobs sent straight to one server; the modes alternate round by round (ABC, CBA, ...) in one
run, side by side.

    PYTHONPATH=toolkit python benchmarks/front_throughput.py                       # stand-in servers
    PYTHONPATH=toolkit python benchmarks/front_throughput.py --comfy-home TREE --python PY   # real servers

Stand-ins (tests/support/front_standin.py) run each prompt for --standin-seconds and do no work: the ratio is
the dispatcher's alone, and the overhead per job is the front's own (accept, claim, dispatch, follow, copy the
output, publish). Real servers: two ComfyUI servers of TREE (an installed tree; the demo's tiny H3 checkpoints
are written into it when missing) on 127.0.0.1, each on one simulated device (--cpu), each warmed with one
prompt; every job is the demo prompt (npu_count 1) with its own seed, so each samples, decodes and saves anew.
On a 2-core host the two servers share the cores: the ratio is what this machine gives, not what two sets of
NPUs give. Modes: `front-2` (the front over both servers), `front-1` (over one), `direct-1` (the N prompts
POSTed straight to that server's queue, then its /history polled: no front). Throughput = N / (first
submission to last job done); overhead per job = (front-1 - direct-1) / N.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "toolkit"))

from tests.support.front_helpers import Front, Standin, http, sleep_prompt, wait_for  # noqa: E402
from tests.support.service_helpers import free_port  # noqa: E402

BAND = (8800, 8899)


def real_servers(args, tmp: Path) -> list:
    from h3kit import demo
    from tests.support import comfy_server

    home = Path(args.comfy_home)
    demo.write_tiny_checkpoints(home, args.python)
    servers = []
    for name in ("a", "b"):
        env = {"OMP_WAIT_POLICY": "PASSIVE"}  # two torch processes on two cores: spinning threads starve each other
        if args.threads:
            env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        s = comfy_server.Server(home, tmp / name, args.python, free_port(*BAND), env=env)
        for comp, (rel, _seed) in demo.tiny_components().items():
            (s.models / rel).parent.mkdir(parents=True, exist_ok=True)
            (s.models / rel).symlink_to(home / "models" / rel)
        servers.append(s.start(timeout=600))
        s.run_prompt(job_prompt(args, "warm"), timeout=600)
    return servers


def job_prompt(args, tag: str) -> dict:
    if not args.comfy_home:
        return sleep_prompt(args.standin_seconds, tag)
    from h3kit import demo

    prompt = demo.demo_prompt(1, tag)
    for node in prompt.values():
        if node["class_type"] == "RandomNoise":
            node["inputs"]["noise_seed"] = uuid.uuid4().int % (1 << 31)
    return prompt


def run_front(args, tmp: Path, servers, n: int) -> float:
    f = Front(tmp / f"front-{uuid.uuid4().hex[:6]}", free_port(*BAND), [s.url for s in servers])
    try:
        t0 = time.monotonic()
        ids = [f.submit(job_prompt(args, f"j{i}")) for i in range(n)]
        hist = f.wait_done(ids, timeout=args.timeout)
        wall = time.monotonic() - t0
        bad = [e["h3front"] for e in hist.values() if e["h3front"]["state"] != "done"]
        if bad:
            raise SystemExit(f"jobs failed: {bad[:3]}")
        return wall
    finally:
        f.stop()


def run_direct(args, server, n: int) -> float:
    t0 = time.monotonic()
    ids = []
    for i in range(n):
        status, answer = http("POST", server.url + "/prompt", {"prompt": job_prompt(args, f"d{i}")})
        assert status == 200, answer
        ids.append(answer["prompt_id"])

    def done():
        return all(pid in (http("GET", f"{server.url}/history/{pid}")[1] or {}) for pid in ids)
    wait_for("the direct prompts done", done, timeout=args.timeout, every=0.05)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--standin-seconds", type=float, default=2.0)
    ap.add_argument("--comfy-home", help="an installed tree: real servers instead of stand-ins")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs ComfyUI")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--threads", type=int, default=0, help="real servers: OMP_NUM_THREADS of each (0: torch's default)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="h3kit-front-bench-"))
    servers = real_servers(args, tmp) if args.comfy_home else \
        [Standin(tmp / n, free_port(*BAND), run_seconds=args.standin_seconds) for n in ("a", "b")]
    modes = {"front-2": lambda: run_front(args, tmp, servers, args.jobs),
             "front-1": lambda: run_front(args, tmp, servers[:1], args.jobs),
             "direct-1": lambda: run_direct(args, servers[0], args.jobs)}
    walls = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for m in (list(modes) if r % 2 == 0 else list(reversed(modes))):
                walls[m].append(modes[m]())
                print(f"round {r + 1} {m}: {walls[m][-1]:.2f} s for {args.jobs} jobs", file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.stop()
    report(args, walls)
    return 0


def report(args, walls: dict) -> None:
    n = args.jobs
    med = {m: statistics.median(v) for m, v in walls.items()}
    ratios = [b / a for a, b in zip(walls["front-2"], walls["front-1"])]
    overheads = [(f - d) / n for f, d in zip(walls["front-1"], walls["direct-1"])]
    out = {"servers": f"real (tiny H3, --cpu, threads {args.threads or 'default'})" if args.comfy_home else f"stand-in ({args.standin_seconds:g} s a job)",
           "jobs": n, "rounds": args.rounds, "load_average": os.getloadavg(),
           "wall_s": {m: [round(x, 2) for x in v] for m, v in walls.items()},
           "jobs_per_minute": {m: round(60 * n / v, 2) for m, v in med.items()},
           "throughput_ratio_2_over_1": {"median": round(statistics.median(ratios), 3),
                                         "rounds": [round(x, 3) for x in ratios]},
           "front_overhead_per_job_s": {"median": round(statistics.median(overheads), 3),
                                        "rounds": [round(x, 3) for x in overheads]}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(main())
