"""What starting a group's worker processes costs: a fresh interpreter that imports torch per worker (what h3kit's
launcher does today, `python -B -m comfy.multinpu_worker`) against children forked from one process that imported
torch once (multiprocessing's forkserver with torch preloaded), side by side in one run.

    python benchmarks/worker_spawn.py [--workers 8] [--rounds 3]

Each round starts --workers processes each way; a worker imports torch and runs one small op, then exits. Printed:
the wall time from the first start to the last exit and the CPU seconds the whole machine spent meanwhile (from
/proc/stat, so the forkserver's grandchildren count too). CPU only: whether torch_npu may be imported before a fork
is not measured here (the forkserver would import torch alone, never touch a device, and leave torch_npu and
ComfyUI's model code to each child). A measurement for a proposal, not a feature of h3kit.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import time


def busy_seconds() -> float:
    """CPU seconds of the whole machine so far (user, nice, system, irq, softirq, steal), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / 100.0


def forked_worker():
    import torch  # already imported by the forkserver: a lookup

    torch.ones(4).sum()


def exec_round(n: int):
    cpu, t = busy_seconds(), time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-B", "-c", "import torch; torch.ones(4).sum()"]) for _ in range(n)]
    codes = [p.wait() for p in procs]
    assert codes == [0] * n, codes
    return time.monotonic() - t, busy_seconds() - cpu


def fork_round(ctx, n: int):
    cpu, t = busy_seconds(), time.monotonic()
    procs = [ctx.Process(target=forked_worker) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert [p.exitcode for p in procs] == [0] * n, [p.exitcode for p in procs]
    return time.monotonic() - t, busy_seconds() - cpu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])
    cpu, t = busy_seconds(), time.monotonic()
    fork_round(ctx, 1)  # starts the forkserver: its one import of torch
    print(f"forkserver start (one import of torch) and one worker: {time.monotonic() - t:.2f} s, "
          f"{busy_seconds() - cpu:.2f} CPU-s")
    results = {"exec": [], "fork": []}
    for _ in range(args.rounds):  # alternately, so that the machine's load weighs on both alike
        results["exec"].append(exec_round(args.workers))
        results["fork"].append(fork_round(ctx, args.workers))
    for how, label in (("exec", "a fresh interpreter each"), ("fork", "forked from the forkserver")):
        walls, cpus = zip(*results[how])
        print(f"{args.workers} workers, {label}: median {statistics.median(walls):.2f} s wall, "
              f"{statistics.median(cpus):.2f} CPU-s ({statistics.median(cpus) / args.workers:.2f} per worker)")


if __name__ == "__main__":
    main()
