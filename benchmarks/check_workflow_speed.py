"""Whole-process time of `h3kit check-workflow` on the largest upstream H3 template (target: median <= 0.3 s).

    python benchmarks/check_workflow_speed.py [--runs N] [FILE]

FILE defaults to video_minimax_h3_fun_controlnet_union.json (91 KB) from comfyui-workflow-templates-json
(H3KIT_TEMPLATES_DIR, else the cache tools/ensure-venv.sh fills). Each entry point runs N times as a fresh
process: `python -m h3kit` and, when installed, the `h3kit` console script; a bare `python -c pass` runs
alongside as the interpreter's own floor. Children run without PYTHONDONTWRITEBYTECODE (an installed
package has its bytecode compiled). Parity first: every run's --json output must be identical (same
findings from both entry points), else the script fails before printing a time.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

TEMPLATE = "video_minimax_h3_fun_controlnet_union.json"
TARGET_S = 0.3


def find_template() -> Path:
    env = os.environ.get("H3KIT_TEMPLATES_DIR")
    cache = Path(os.environ.get("H3KIT_CACHE") or Path.home() / ".cache" / "h3kit")
    bases = [Path(env)] if env else sorted(cache.glob("testdata/workflow-templates-json-*"))
    for base in reversed(bases):
        path = base / "comfyui_workflow_templates_json" / "templates" / TEMPLATE
        if path.is_file():
            return path
    sys.exit(f"{TEMPLATE} not found: set H3KIT_TEMPLATES_DIR or run tools/ensure-venv.sh")


# A user's install keeps compiled bytecode; a shell that sets PYTHONDONTWRITEBYTECODE would time the compiler.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def time_runs(cmd: list[str], runs: int) -> tuple[list[float], set[bytes]]:
    times, outputs = [], set()
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, env=ENV)
        times.append(time.perf_counter() - start)
        if proc.returncode not in (0, 1):
            sys.exit(f"{' '.join(cmd)} failed with {proc.returncode}: {proc.stderr.decode()[-500:]}")
        outputs.add(proc.stdout)
    return times, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", type=Path)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    path = args.file or find_template()
    check = ["check-workflow", "--json", "--devices", "0,1,2,3", str(path)]

    entries = {"python -m h3kit": [sys.executable, "-m", "h3kit", *check]}
    script = Path(sys.executable).with_name("h3kit")
    script = script if script.is_file() else (shutil.which("h3kit") and Path(shutil.which("h3kit")))
    if script:
        entries["h3kit (console script)"] = [str(script), *check]

    for cmd in entries.values():  # warm the page cache and write the bytecode cache
        subprocess.run(cmd, capture_output=True, env=ENV)
    floor, _ = time_runs([sys.executable, "-c", "pass"], args.runs)
    results, outputs = {}, set()
    for name, cmd in entries.items():
        results[name], out = time_runs(cmd, args.runs)
        outputs |= out
    if len(outputs) != 1:
        sys.exit("parity failed: the --json outputs differ between runs or entry points")

    print(f"# check-workflow speed, {date.today()}, {platform.machine()} {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    print(f"# file: {path.name} ({path.stat().st_size // 1024} KB), {args.runs} runs each; parity: "
          f"{len(entries) * args.runs} identical --json outputs")
    print(f"{'entry point':28} {'median s':>9} {'min s':>7} {'max s':>7}")
    print(f"{'python -c pass (floor)':28} {statistics.median(floor):9.3f} {min(floor):7.3f} {max(floor):7.3f}")
    ok = True
    for name, times in results.items():
        median = statistics.median(times)
        ok &= median <= TARGET_S
        print(f"{name:28} {median:9.3f} {min(times):7.3f} {max(times):7.3f}")
    print(f"target: median <= {TARGET_S} s: {'met' if ok else 'NOT met'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
