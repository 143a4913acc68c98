"""Whole-process wall time of `h3kit install` (from a local mirror), `h3kit verify` and `h3kit doctor` on the
installed tree: the README's figures for these commands, with the date, the machine and the load.

    PYTHONPATH=toolkit python benchmarks/cli_times.py --source $H3KIT_COMFY_SOURCE [--runs 5] [--python PY]

Each run of install gets a fresh folder (clone, checkout, patch, journal); verify and doctor run on the tree
the first install made (doctor with --device-type cpu --devices 0,1 and --python, whose probe imports torch in
that interpreter: most of doctor's time; it exits 1 on this tree, which holds no models, after running every
check). Prints min, median and max per command, and the load average before
and after; --json prints the same as one document. Nothing is left behind (the folders are temporary).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd, env, ok=(0,)) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    took = time.perf_counter() - t
    if r.returncode not in ok:
        raise SystemExit(f"cli_times: {' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return took


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", default=os.environ.get("H3KIT_COMFY_SOURCE"), help="the mirror holding the pin")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--python", default=sys.executable, help="ComfyUI's interpreter, for doctor's probe")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not args.source:
        ap.error("--source (or H3KIT_COMFY_SOURCE) is needed: a mirror holding the ComfyUI pin")
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    env = dict(os.environ)
    h3kit = [sys.executable, "-m", "h3kit"]
    times = {"install": [], "verify": [], "doctor": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="h3kit-cli-times-") as tmp:
        first = Path(tmp) / "home0"
        for i in range(args.runs):
            home = Path(tmp) / f"home{i}"
            times["install"].append(timed([*h3kit, "install", "--comfy-home", home, "--source", args.source], env))
        for _ in range(args.runs):
            times["verify"].append(timed([*h3kit, "verify", "--comfy-home", first], env))
            times["doctor"].append(timed([*h3kit, "doctor", "--comfy-home", first, "--device-type", "cpu",
                                          "--devices", "0,1", "--python", args.python], env, ok=(0, 1)))
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
           "runs": args.runs, "load_before": [round(x, 2) for x in load_before],
           "load_after": [round(x, 2) for x in os.getloadavg()],
           "seconds": {k: {"min": round(min(v), 3), "median": round(statistics.median(v), 3), "max": round(max(v), 3)}
                       for k, v in times.items()}}
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"{doc['date']}  {doc['machine']}  load {doc['load_before']} -> {doc['load_after']}  ({args.runs} runs)")
    for k, v in doc["seconds"].items():
        print(f"  h3kit {k:<8} median {v['median']:.2f} s  (min {v['min']:.2f}, max {v['max']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
