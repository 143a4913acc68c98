"""Whole-process wall time of `h3kit --help` (target: median <= 0.25 s), beside a bare interpreter start.

    python benchmarks/cli_startup.py [--runs 21]

Runs each command alternately so that machine load affects both alike, and prints the medians and which
heavy modules (torch, git, numpy) `--help` imported (there must be none).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(cmd) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=21)
    args = ap.parse_args()
    exe = shutil.which("h3kit") or str(Path(sys.executable).with_name("h3kit"))
    cmds = {"python -c pass": [sys.executable, "-c", "pass"],
            "h3kit --help": [exe, "--help"],
            "h3kit install --help": [exe, "install", "--help"]}
    times = {k: [] for k in cmds}
    for name, cmd in cmds.items():
        timed(cmd)  # warm the page cache
    for _ in range(args.runs):
        for name, cmd in cmds.items():
            times[name].append(timed(cmd))
    probe = ("import sys; from h3kit.cli import main\n"
             "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(','.join(m for m in ('torch', 'git', 'numpy') if m in sys.modules) or 'none')")
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    for name, ts in times.items():
        print(f"{name:30s} median {statistics.median(ts):.3f} s  (min {min(ts):.3f}, max {max(ts):.3f}, n={len(ts)})")
    print(f"heavy modules imported by --help: {heavy}")
    ok = statistics.median(times["h3kit --help"]) <= 0.25 and heavy == "none"
    print("target (median <= 0.25 s, no heavy import):", "met" if ok else "MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
