"""What a ComfyUI worker's start costs in imports, with and without the fork server's imports already done
(comfy/multinpu_zygote.py, PRELOAD and PRELOAD_COMFY): each way in a fresh interpreter, --rounds times,
alternating; prints the CPU seconds (user + system) of the worker's own imports, i.e. what each worker pays.

    PYTHONPATH=toolkit python benchmarks/worker_imports.py --comfy-home TREE [--rounds 3]

TREE: a ComfyUI tree with the h3kit series applied (`h3kit install`). CPU only (the worker imports as on --cpu).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import importlib, json, resource, sys
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
preload = sys.argv[1].split(",") if sys.argv[1] else []
for name in preload:
    importlib.import_module(name)
start = cpu()
import torch, comfy.multinpu_group, comfy.multinpu_links, comfy.multinpu_wire, comfy.options
comfy.options.enable_args_parsing()
sys.argv = [sys.argv[0], "--cpu"]
import comfy.cli_args
comfy.cli_args.args.cpu = True
import comfy.model_management
for name in ("comfy.multinpu_models", "comfy.multinpu_dit", "comfy.multinpu_te", "comfy.multinpu_vae"):
    importlib.import_module(name)
print(json.dumps({"preload": start, "worker": cpu() - start}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, f"{args.comfy_home}")
    from comfy.multinpu_zygote import PRELOAD, PRELOAD_COMFY  # what the fork server imports
    preload = PRELOAD + PRELOAD_COMFY
    seen = {"exec": [], "fork": []}
    for _ in range(args.rounds):
        for how, names in (("exec", ""), ("fork", ",".join(preload))):
            out = subprocess.run([sys.executable, "-B", "-c", CHILD, names], cwd=args.comfy_home, capture_output=True,
                                 text=True, check=True).stdout
            seen[how].append(json.loads(out.splitlines()[-1]))
    for how, runs in seen.items():
        worker = [r["worker"] for r in runs]
        print(f"{how}: a worker's imports {statistics.median(worker):.2f} CPU-s (runs {', '.join(f'{w:.2f}' for w in worker)})"
              + (f"; the fork server's, once per launcher, {statistics.median(r['preload'] for r in runs):.2f} CPU-s"
                 if how == "fork" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
