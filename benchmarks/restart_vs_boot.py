"""`h3kit restart` of an idle server against a bare boot of the same tree, side by side in one run.

Bare boot: `python -B main.py --listen 127.0.0.1 --port P --cpu` (the command h3kit runs), timed from just
before the process is spawned to the first 200 from GET /system_stats, polled every 0.05 s. No h3kit.
ComfyUI locks its database file and the h3kit-managed server holds the tree's default one, so the bare
boot gets its own (`--database-url`), created by one untimed warm-up boot: both then open an up-to-date
database they can lock, as a restart does.

Restart: `python -m h3kit restart --runtime-root R` run as a user would, timed from just before the
command is spawned until it exits, which it does only once the new server answers /system_stats. It
includes the CLI's own start-up, the queue check, reading the previous log, SIGTERM and the wait for the
old process and its port, and the new boot.

Rounds alternate which of the two goes first, so slow drift on a shared machine hits both alike. The
h3kit-managed server idles on its own port while the bare boot runs on another. Prints every round, the
medians, the ratio restart / bare (target: at most 1.15) both of the medians and as the median of the
rounds' own ratios (steadier when other work shares the machine), and how much of the restart lies
outside the new server's boot.

    PYTHONPATH=toolkit python benchmarks/restart_vs_boot.py [--comfy-home TREE] [--rounds 5]

Without --comfy-home the ComfyUI pin is checked out from H3KIT_COMFY_SOURCE into a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from h3kit.proc import wait_port_free

ROOT = Path(__file__).resolve().parents[1]
PIN = json.loads((ROOT / "source_deps_info.json").read_text())["upstream"]["commit"]
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(port: int) -> bool:
    try:
        with _NO_PROXY.open(f"http://127.0.0.1:{port}/system_stats", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def checkout_pin(dest: Path) -> Path:
    source = os.environ.get("H3KIT_COMFY_SOURCE")
    if not source:
        sys.exit("set H3KIT_COMFY_SOURCE to a mirror holding the pin, or pass --comfy-home")
    tree = dest / "ComfyUI"
    subprocess.run(["git", "clone", "-q", "--no-checkout", source, str(tree)], check=True)
    # the offline mirror lacks two blobs H3 does not use: checkout reports them and still succeeds
    subprocess.run(["git", "-C", str(tree), "checkout", "-q", "--detach", PIN], capture_output=True)
    return tree


def bare_boot(tree: Path, python: str, port: int, work: Path, limit: float) -> float:
    argv = [python, "-B", "main.py", "--listen", "127.0.0.1", "--port", str(port), "--cpu",
            "--database-url", f"sqlite:///{work / 'bare.db'}"]
    with open(work / "bare.log", "ab") as out:
        t0 = time.monotonic()
        child = subprocess.Popen(argv,
                                 cwd=tree, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        try:
            while not healthy(port):
                if child.poll() is not None:
                    sys.exit(f"bare boot exited with {child.returncode}; see {work / 'bare.log'}")
                if time.monotonic() - t0 > limit:
                    sys.exit(f"bare boot not healthy after {limit} s; see {work / 'bare.log'}")
                time.sleep(0.05)
            return time.monotonic() - t0
        finally:
            os.killpg(child.pid, signal.SIGTERM)
            child.wait(30)
            # untimed: the next round needs the port back (the same check `h3kit start` makes)
            if not wait_port_free("127.0.0.1", port, 30):
                sys.exit(f"port {port} still busy 30 s after the bare boot stopped")


def h3kit(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "h3kit", *args], capture_output=True, text=True, env=env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--comfy-home", type=Path, help="a ComfyUI tree (default: a fresh checkout of the pin)")
    ap.add_argument("--python", default=sys.executable, help="interpreter that runs ComfyUI")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8490, help="h3kit's server; the bare boot uses port + 1")
    ap.add_argument("--limit", type=float, default=300, help="seconds allowed for one boot")
    ap.add_argument("--json", action="store_true", help="print one JSON document at the end")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="h3kit-restart-bench-"))
    tree = args.comfy_home.resolve() if args.comfy_home else checkout_pin(work)
    run_root = work / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "toolkit"),
                                                                    os.environ.get("PYTHONPATH")])))
    common = ["--comfy-home", str(tree), "--runtime-root", str(run_root)]
    print(f"tree {tree}, python {args.python}, {args.rounds} rounds", file=sys.stderr)
    # the first boot of a fresh tree also creates its database: do it once, untimed
    r = h3kit("start", *common, "--devices", "0", "--device-type", "cpu", "--port", str(args.port),
              "--python", args.python, "--timeout", str(args.limit), env=env)
    if r.returncode:
        sys.exit(f"h3kit start failed:\n{r.stderr}")
    bare_boot(tree, args.python, args.port + 1, work, args.limit)  # creates the bare boot's database
    bare, restart, overhead = [], [], []
    try:
        for i in range(args.rounds):
            order = ("bare", "restart") if i % 2 == 0 else ("restart", "bare")
            for what in order:
                if what == "bare":
                    bare.append(bare_boot(tree, args.python, args.port + 1, work, args.limit))
                else:
                    t0 = time.monotonic()
                    r = h3kit("restart", *common, "--timeout", str(args.limit), "--json", env=env)
                    restart.append(time.monotonic() - t0)
                    if r.returncode:
                        sys.exit(f"h3kit restart failed:\n{r.stderr}")
                    # everything but the new server's own boot: CLI start-up, checks, stop, port wait
                    overhead.append(restart[-1] - json.loads(r.stdout)["phases"]["start"])
            print(f"round {i + 1}: bare boot {bare[-1]:.2f} s, h3kit restart {restart[-1]:.2f} s "
                  f"({restart[-1] / bare[-1]:.3f}; outside the new boot {overhead[-1]:.2f} s)", file=sys.stderr)
    finally:
        h3kit("stop", *common, env=env)
    mb, mr = statistics.median(bare), statistics.median(restart)
    paired = statistics.median(r / b for r, b in zip(restart, bare))
    mo = statistics.median(overhead)
    result = {"bare_boot_s": [round(x, 3) for x in bare], "restart_s": [round(x, 3) for x in restart],
              "restart_outside_boot_s": [round(x, 3) for x in overhead],
              "median_bare_boot_s": round(mb, 3), "median_restart_s": round(mr, 3), "ratio": round(mr / mb, 3),
              "median_paired_ratio": round(paired, 3), "median_restart_outside_boot_s": round(mo, 3),
              "target": 1.15, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
              "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"median bare boot   {mb:.2f} s  ({', '.join(f'{x:.2f}' for x in bare)})")
        print(f"median h3kit restart {mr:.2f} s  ({', '.join(f'{x:.2f}' for x in restart)})")
        print(f"restart outside the new boot (CLI, queue check, stop, port): median {mo:.2f} s")
        print(f"ratio restart / bare boot: {mr / mb:.3f} of the medians, {paired:.3f} median of the rounds' "
              f"ratios (target <= 1.15)")
    shutil.rmtree(work, ignore_errors=True)  # the pin checkout (when made here), logs, runtime root


if __name__ == "__main__":
    main()
