"""What OpenMP's wait policy costs when several torch processes share few cores (make test sets
OMP_WAIT_POLICY=PASSIVE for that reason, tools/run-tests.sh): --jobs `h3kit parity` runs at once, each on 4 simulated
devices (threads), with the policy unset (libgomp's threads spin for a while after each parallel region) and with
PASSIVE (they sleep), alternately, side by side in one run.

    PYTHONPATH=toolkit python benchmarks/omp_wait.py --comfy-home TREE [--jobs 2] [--rounds 2]

TREE: an installed tree (`h3kit install`). Printed per policy: the median wall time of a round (all jobs started
together, to the last exit) and the CPU seconds the whole machine spent meanwhile (/proc/stat). Every run must pass
its parity gate, so the policy changes no result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def busy_seconds() -> float:
    """CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / 100.0


def one_round(home: str, jobs: int, policy: str | None) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-m", "h3kit", "parity", "--comfy-home", home, "--component", "dit", "--device-type", "cpu",
           "--npu-count", "4", "--python", sys.executable]
    t0, c0 = time.monotonic(), busy_seconds()
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(jobs)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0 or "parity passed" not in err:
            sys.exit(f"omp_wait: a parity run failed ({policy or 'unset'}): {err.strip()[-600:]}")
    return time.monotonic() - t0, busy_seconds() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    results = {"unset": [], "PASSIVE": []}
    for _ in range(args.rounds):
        for name, policy in (("unset", None), ("PASSIVE", "PASSIVE")):
            results[name].append(one_round(args.comfy_home, args.jobs, policy))
    print(f"{args.jobs} x `h3kit parity --npu-count 4` at once, {args.rounds} round(s) per policy, "
          f"{os.cpu_count()} cores")
    for name, rows in results.items():
        print(f"  OMP_WAIT_POLICY {name:7s}: median wall {statistics.median(r[0] for r in rows):6.1f} s, "
              f"machine CPU {statistics.median(r[1] for r in rows):6.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
