"""What GET /metrics costs (issue 39 item 4): scrape latency with the server idle, during a prompt and during a group
replacement, and a demo prompt's time with no scraper, with a scrape every 100 ms (a Prometheus at a 0.1 s interval,
150x its default) and under a bounded local scrape storm (8 clients each scraping again 50 ms after each answer; the
route answers one scrape per 0.25 s in all, comfy/multinpu_metrics.Pacer), alternately (ABC, CBA, ...), side by side;
the server's CPU per scrape and per prompt (/proc).

    PYTHONPATH=toolkit python benchmarks/metrics_scrape.py --comfy-home TREE [--rounds 3] [--port 8190]

TREE: an installed tree (`h3kit install`); the demo's tiny H3 checkpoints are written into it when missing. The
script starts the server itself (`h3kit start --transport process`, 2 cpu ranks, worker rank 1's DiT forward runs
out of memory while a trigger file exists: the replacement it measures), stops it at the end, and scrapes only
127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
STORM = "storm: 8 clients, each every 50 ms"
HARD_STORM = "storm: 32 clients, back to back"
PAST_PACE = 0.3  # a single scraper's interval, beyond the route's pace: its latency is the route's own, no turn waited


def get(url: str, timeout: float = 10.0) -> bytes:
    with _NO_PROXY.open(url, timeout=timeout) as resp:
        return resp.read()


def post(url: str, body: dict):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with _NO_PROXY.open(req, timeout=30) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def scrape_ms(url: str, path: str = "/metrics") -> float:
    t0 = time.perf_counter()
    get(f"{url}{path}")
    return (time.perf_counter() - t0) * 1000


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Scraper:
    """`threads` threads scraping `url` + `path`, each waiting `every` seconds between scrapes, until stop()."""

    def __init__(self, url: str, every: float, threads: int = 1, path: str = "/metrics"):
        self.url, self.every, self.path, self.times = url, every, path, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self):
        while not self._stop.is_set():
            self.times.append(scrape_ms(self.url, self.path))
            if self.every:
                self._stop.wait(self.every)

    def stop(self) -> list:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        return self.times


def recoveries(url: str, text: str = None) -> float:
    """h3kit_group_recovery_seconds_count: the group's recoveries so far."""
    text = text if text is not None else get(f"{url}/metrics").decode()
    lines = text.splitlines()
    return float(next(ln.split()[-1] for ln in lines if ln.startswith("h3kit_group_recovery_seconds_count")))


def run_prompt(url: str, tag: str, npu_count: int = 2) -> tuple[str, float]:
    """The demo's prompt at `npu_count`, whole: the models unloaded first (POST /free), so it loads, encodes the text,
    samples and decodes as `h3kit demo`'s prompt does (a new seed alone would rerun the sampler and the decode only)."""
    from h3kit import demo
    post(f"{url}/free", {"unload_models": True, "free_memory": True})
    prompt = demo.demo_prompt(npu_count, tag)
    for node in prompt.values():
        if node["class_type"] == "RandomNoise":
            node["inputs"]["noise_seed"] = random.randint(0, 2**31)  # nothing from the cache
    t0 = time.monotonic()
    pid = post(f"{url}/prompt", {"prompt": prompt})["prompt_id"]
    while True:
        entry = json.loads(get(f"{url}/history/{pid}")).get(pid)
        if entry and entry["status"].get("completed") is not None:
            return entry["status"]["status_str"], time.monotonic() - t0
        time.sleep(0.05)


def summary(ms: list) -> str:
    ms = sorted(ms)
    if not ms:
        return "none"
    return (f"n {len(ms)}, median {statistics.median(ms):.1f} ms, p95 {ms[int(0.95 * (len(ms) - 1))]:.1f} ms, "
            f"max {ms[-1]:.1f} ms")


def spy(server: int, out: Path | None):
    """py-spy recording the server's Python stacks while they hold the GIL (what a stalled route waits for), or None."""
    if out is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(server), "--gil", "--threads", "--rate", "200",
                             "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def server_cpu_rate(server: int, seconds: float) -> float:
    """The server's CPU seconds per second while nobody asks it anything (heartbeats, the progress watch)."""
    c0, t0 = cpu_seconds(server), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(server) - c0) / (time.monotonic() - t0)


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, its scraper threads included: what the storm's clients cost."""
    t = os.times()
    return t.user + t.system


def measure(url: str, server: int, trigger: Path, rounds: int, spy_out: Path | None = None, npu_count: int = 2
            ) -> None:
    run_prompt(url, "warm")
    idle_cpu = server_cpu_rate(server, 20.0)
    c0, t0, idle = cpu_seconds(server), time.monotonic(), []
    for _ in range(100):  # spaced beyond the route's pace (0.25 s), so that none waits its turn
        idle.append(scrape_ms(url))
        time.sleep(PAST_PACE)
    spent = cpu_seconds(server) - c0 - idle_cpu * (time.monotonic() - t0)
    print(f"idle, one scrape every {PAST_PACE * 1000:.0f} ms: {summary(idle)}")
    print(f"the server's CPU per scrape (100 of them, less its own idle CPU, {idle_cpu * 1000:.1f} ms a second, "
          f"over the same span): {spent / 100 * 1000:.2f} ms")
    s = Scraper(url, PAST_PACE)
    status, _ = run_prompt(url, "during")
    print(f"during a prompt ({status}), one scrape every {PAST_PACE * 1000:.0f} ms: {summary(s.stop())}")
    before = recoveries(url)
    recorder = spy(server, spy_out)
    trigger.touch()
    try:
        status, _ = run_prompt(url, "oom")
    finally:
        trigger.unlink()
    t0, during, light = time.monotonic(), [], []
    while True:  # until the new generation serves (ranks.json is written only then: the scrape itself tells)
        t1 = time.perf_counter()
        text = get(f"{url}/metrics").decode()
        during.append((time.perf_counter() - t1) * 1000)
        if recoveries(url, text) > before:
            break
        light.append(scrape_ms(url, "/prompt"))  # upstream's lightest route, beside it: what the process itself allows
        time.sleep(PAST_PACE)
    print(f"during the group's replacement after a worker OOM (prompt {status}; serving again after "
          f"{time.monotonic() - t0:.1f} s): {summary(during)}; GET /prompt meanwhile: {summary(light)}")
    slow = [(round(ms), i) for i, ms in enumerate(during) if ms > 250]
    print(f"scrapes of the replacement over 250 ms (ms, index of {len(during)}): {slow or 'none'}")
    if recorder is not None:
        recorder.send_signal(2)  # py-spy writes its profile on SIGINT
        recorder.wait(60)
        print(f"the server's stacks holding the GIL from the OOM prompt to serving again: {spy_out}")
    # the same storm on upstream's lightest route (GET /prompt): what any HTTP storm costs on this host
    modes = {"no scraper": None, "a scrape every 100 ms": (0.1, 1), STORM: (0.05, 8), HARD_STORM: (0, 32),
             "the same storm on GET /prompt": (0.05, 8, "/prompt")}
    times = {m: [] for m in modes}
    cpu = {m: [] for m in modes}
    clients = {m: [] for m in modes}
    storm_scrapes = {STORM: [], HARD_STORM: []}
    if not rounds:
        return
    print(f"side-by-side rounds: the demo prompt at npu_count {npu_count}")
    run_prompt(url, "warm-again")  # the OOM handler unloaded the models: loaded again here, not in a measured round
    for r in range(rounds):
        for mode, how in (list(modes.items()) if r % 2 == 0 else list(modes.items())[::-1]):  # ABC, CBA, ...
            s = Scraper(url, *how) if how else None
            c0, o0 = cpu_seconds(server), own_cpu_seconds()
            status, seconds = run_prompt(url, f"{r}-{len(times[mode])}", npu_count)
            cpu[mode].append(cpu_seconds(server) - c0)
            scraped = s.stop() if s else []
            clients[mode].append(own_cpu_seconds() - o0)
            if mode in (STORM, HARD_STORM):
                storm_scrapes[mode] += scraped
            assert status == "success", status
            times[mode].append(seconds)
    base = times["no scraper"]
    for mode, t in times.items():
        # each round's ratio to the same round's prompt without a scraper: the load of a shared host drifts
        ratio = statistics.median(x / b for x, b in zip(t, base))
        print(f"demo prompt, {mode}: median {statistics.median(t):.2f} s ({', '.join(f'{x:.2f}' for x in t)}); "
              f"median of the rounds' ratios to no scraper {100 * (ratio - 1):+.1f} %; the server's CPU per prompt "
              f"median {statistics.median(cpu[mode]):.2f} s ({', '.join(f'{x:.2f}' for x in cpu[mode])}); "
              f"the clients' (this process') CPU per prompt median {statistics.median(clients[mode]):.2f} s")
    for mode, ms in storm_scrapes.items():
        print(f"{mode}, its scrapes (each waits its turn behind the others'): {summary(ms)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True, type=Path)
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs ComfyUI")
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--spy", type=Path, help="record the server with py-spy (on PATH) through the replacement, here")
    ap.add_argument("--no-prompts", action="store_true", help="latencies only: skip the side-by-side prompt rounds")
    ap.add_argument("--npu-count", type=int, choices=(1, 2), default=2,
                    help="the rounds' prompt: 2 ranks (both cores of a 2-core host busy) or 1 (a core left to the "
                         "HTTP side, as a host with cores beyond its ranks has)")
    args = ap.parse_args()
    from h3kit import demo
    demo.write_tiny_checkpoints(args.comfy_home, args.python)  # those missing
    work = Path(tempfile.mkdtemp(prefix="h3kit-metrics-bench-"))
    env = dict(os.environ, H3KIT_MULTINPU_FAULT=f"dit_forward:oom:{work}/oom-{{rank}}")
    start = [sys.executable, "-m", "h3kit", "start", "--comfy-home", str(args.comfy_home), "--devices", "0,1",
             "--device-type", "cpu", "--transport", "process", "--python", args.python, "--port", str(args.port)]
    started = subprocess.run(start, env=env, capture_output=True, text=True)
    if started.returncode != 0:
        sys.exit(f"metrics_scrape: h3kit start failed: {started.stderr[-2000:]}")
    try:
        print(f"{os.cpu_count()} cores; server {args.comfy_home}, 2 cpu ranks (process transport), "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        record = json.loads((args.comfy_home / ".h3kit" / "run" / "server.json").read_text())
        measure(f"http://127.0.0.1:{args.port}", record["pid"], work / "oom-1", 0 if args.no_prompts else args.rounds,
                args.spy, args.npu_count)
    finally:
        subprocess.run([sys.executable, "-m", "h3kit", "stop", "--comfy-home", str(args.comfy_home)],
                       capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
