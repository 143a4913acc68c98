"""Where a `.ci/run` spends its CPU: each process's CPU seconds, attributed to the pytest test it was started under.

pytest sets PYTEST_CURRENT_TEST in its environment for each test, and every process a test starts inherits it (the
servers `h3kit start` detaches, their workers, stores and stand-ins too, which `time` misses because nobody waits
for them). This samples /proc every 0.2 s until SIGTERM or SIGINT, keeps each process's last user + system time, and
writes {test id: CPU seconds} as JSON, then prints the files that cost most. What it cannot see: the pytest
processes' own CPU (their environment predates the test), processes that live under 0.2 s (h3kit's CLI runs,
0.1-0.2 CPU-s each), and a module fixture's processes are counted to the file's first test. Linux only.

    python benchmarks/ci_cpu_by_test.py OUT.json &   # then, beside it:
    CI=true bash .ci/run; kill %1
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sys
import time

KEY = b"PYTEST_CURRENT_TEST="


def sample(seen: dict, tick: int):
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
            i = env.find(KEY)
            if i < 0:
                continue
            test = env[i + len(KEY): env.find(b"\0", i)].decode(errors="replace").split(" ")[0]
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            key = (pid, fields[19])
            kind = seen[key][2] if key in seen else command_kind(pid)
        except (OSError, ValueError):
            continue  # gone, or not ours to read
        # after the command's closing parenthesis: utime and stime are fields 12 and 13, starttime 20 (1-based
        # from state); the start time tells a reused pid from the process seen before
        seen[key] = (test, (int(fields[11]) + int(fields[12])) / tick, kind)


def command_kind(pid: str) -> str:
    """What a process is, in a few words: the program's name and, for Python, its module or script."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    if not argv:
        return "?"
    prog = os.path.basename(argv[0])
    if not prog.startswith("python"):
        return prog
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest = rest[1:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return f"python -m {rest[1]}" + (f" {rest[2]}" if rest[1] == "h3kit" and len(rest) > 2 else "")
    if rest[:1] == ["-c"]:
        return "python -c"
    return f"python {os.path.basename(rest[0])}" if rest else "python"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-3], file=sys.stderr)
        return 2
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    seen: dict = {}
    tick = os.sysconf("SC_CLK_TCK")
    while not stop:
        sample(seen, tick)
        time.sleep(0.2)
    per_test: dict = collections.Counter()
    per_kind: dict = collections.defaultdict(lambda: [0, 0.0])
    for test, cpu, kind in seen.values():
        per_test[test] += cpu
        per_kind[kind][0] += 1
        per_kind[kind][1] += cpu
    with open(argv[0], "w") as f:
        json.dump(dict(per_test), f, indent=0, sort_keys=True)
    per_file = collections.Counter()
    for test, cpu in per_test.items():
        per_file[test.split("::")[0]] += cpu
    print(f"{sum(per_file.values()):.0f} CPU-s attributed to {len(per_test)} tests; the costliest files:")
    for name, cpu in per_file.most_common(15):
        print(f"{cpu:8.1f}  {name}")
    print("by command (processes, CPU-s):")
    for kind, (n, cpu) in sorted(per_kind.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{n:6d} {cpu:8.1f}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
