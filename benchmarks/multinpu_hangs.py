"""Seconds from each new fault of issue 28 to its error and to the next success, beside a kill -9, in one run.

Runs tests/support/process_group_driver.py's `hangs` scenario (the real driver and worker loop, bare test programs
instead of the H3 runners) on 2 ranks with each launcher, with HCCL/NCCL's failure semantics emulated
(H3KIT_EMULATE_NO_RELEASE=1) and the default settings (group timeout 300 s, heartbeat 15 s, progress bound 60 s,
send bound 10 s) unless given:

- kill9: the last rank SIGKILLed 1 s into a command (an existing fault, for comparison);
- hung_in_kernel: the last rank blocks at step 1 of a command with the GIL released (its heartbeat beats on) while
  rank 0 waits in that step's all_reduce;
- blocked_send: the last rank holds 45 s after a command (beating, reading no command); the next command's 16 MiB
  header fills its connection.

    python benchmarks/multinpu_hangs.py [--launcher h3kit --launcher torchrun] [--progress S] [--send S] [--json]

Prints one row per fault and launcher: seconds from the fault to the error, and to the next command's success.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = ROOT / "tests" / "support"
FAULTS = ("kill9", "hung_in_kernel", "blocked_send")


def run(launcher: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "patches" / "src"), str(SUPPORT)]),
               H3KIT_EMULATE_NO_RELEASE="1")
    for name, value in (("H3KIT_PROGRESS_TIMEOUT", args.progress), ("H3KIT_SEND_TIMEOUT", args.send)):
        if value is not None:
            env[name] = str(value)
    with tempfile.TemporaryDirectory(prefix="h3kit-hangs-") as tmp:
        out = Path(tmp) / "hangs.json"
        proc = subprocess.run([sys.executable, str(SUPPORT / "process_group_driver.py"), "hangs", "--out", str(out),
                               "--world", "2", "--timeout", str(args.timeout), "--launcher", launcher,
                               "--faults", ",".join(FAULTS), "--sleep", "45"],
                              env=env, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise SystemExit(f"{launcher}: the driver wrote nothing:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launcher", action="append", choices=("h3kit", "torchrun"))
    ap.add_argument("--timeout", type=float, default=300.0, help="the group timeout (default 300 s, h3kit's)")
    ap.add_argument("--progress", type=float, help="H3KIT_PROGRESS_TIMEOUT (default: the runtime's, 60 s)")
    ap.add_argument("--send", type=float, help="H3KIT_SEND_TIMEOUT (default: the runtime's, 10 s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for launcher in args.launcher or ["h3kit", "torchrun"]:
        result = run(launcher, args)
        if "crash" in result or not result.get("form", {}).get("ok"):
            raise SystemExit(f"{launcher}: {json.dumps(result.get('crash') or result.get('form'))[:2000]}")
        for fault in FAULTS:
            f = result[fault]
            rows.append({"launcher": launcher, "fault": fault, "error": None if f["error"]["ok"] else
                         f"{f['error']['error']['type']}: {f['error']['error']['message'][:160]}",
                         "to_error": round(f["fault_to_error"], 1), "to_next": round(f["fault_to_next"], 1),
                         "next_ok": f["next"]["ok"], "driver_same": result["driver_pid_after"] == result["driver_pid"]})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'launcher':9} {'fault':15} {'to error':>9} {'to next':>8}  error")
    for r in rows:
        print(f"{r['launcher']:9} {r['fault']:15} {r['to_error']:8.1f}s {r['to_next']:7.1f}s  "
              f"{'' if r['next_ok'] else '(next FAILED) '}{r['error']}")


if __name__ == "__main__":
    main()
