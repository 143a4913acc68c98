"""Step caching (upstream's EasyCache / LazyCache) with MultiNPUParallelConfig, on the running server of a tree.

For each cache node, placed before (or, with --after, after) the node, the demo prompt (tiny H3 checkpoints,
`h3kit demo` writes them) runs with --steps steps at npu_count N and at npu_count 1, each with the cache and
without it. Reported per run: the steps the cache skipped and ran (its verbose log lines in the server log,
written during the run), whether the prompt failed and why; per pair: the latents of npu_count N against
npu_count 1 (max_abs, max_rel), with the cache and without.

    h3kit demo --comfy-home DIR --device-type cpu --npu-count 2 --keep-running   # server, checkpoints
    python benchmarks/step_cache.py --comfy-home DIR --npu-count 2 --steps 12 [--after] [--json]

h3kit on PYTHONPATH (PYTHONPATH=toolkit from the checkout). The server's transport is whatever it was started
with (demo --transport threads|process).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from h3kit import outputs, service
from h3kit.demo import DemoFailed, _node_id, _output_file, demo_prompt, run_prompt

CACHE_INPUTS = {"EasyCache": {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": True},
                "LazyCache": {"reuse_threshold": 0.2, "start_percent": 0.15, "end_percent": 0.95, "verbose": True}}


def prompt_with(node: str | None, npu: int, steps: int, after: bool, tag: str) -> dict:
    p = demo_prompt(npu, tag)
    cfg = _node_id(p, "MultiNPUParallelConfig")
    sched = _node_id(p, "BasicScheduler")
    p[sched]["inputs"]["steps"] = steps
    if node is None:
        return p
    if after:  # config -> cache -> guider and scheduler
        p["90"] = {"class_type": node, "inputs": {"model": [cfg, 0], **CACHE_INPUTS[node]}}
        for nid, n in p.items():
            if nid != "90" and n["inputs"].get("model") == [cfg, 0]:
                n["inputs"]["model"] = ["90", 0]
    else:  # loader -> cache -> config
        p["90"] = {"class_type": node, "inputs": {"model": p[cfg]["inputs"]["model"], **CACHE_INPUTS[node]}}
        p[cfg]["inputs"]["model"] = ["90", 0]
    return p


def run(rec, home: Path, node: str | None, npu: int, steps: int, after: bool, timeout: float) -> dict:
    tag = f"stepcache_{node or 'none'}_{'after' if after else 'before'}_n{npu}"
    p = prompt_with(node, npu, steps, after, tag)
    log = Path(rec.log)
    start = log.stat().st_size
    out = {"node": node, "npu_count": npu, "place": "after" if after else "before", "steps": steps}
    try:
        _, outs = run_prompt(rec, p, timeout)
        out["latents"] = {k: str(_output_file(home, outs, _node_id(p, "SaveLatent", f"{k}_latent"), "latents"))
                          for k in ("video", "audio")}
        out["ok"] = True
    except DemoFailed as e:
        out["ok"], out["error"] = False, e.message[:400]
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    out["skipped"] = sum("- skipping step" in line for line in text.splitlines())
    out["ran"] = sum("- NOT skipping step" in line for line in text.splitlines())
    if not out["ok"]:
        out["log_error"] = next((line.strip() for line in text.splitlines() if "MultiNPU:" in line), None)
    return out


def compare(a: dict, b: dict) -> dict | None:
    if not (a.get("ok") and b.get("ok")):
        return None
    rows = {}
    for kind in ("video", "audio"):
        (sa, va), (sb, vb) = outputs.read_latent(Path(a["latents"][kind])), outputs.read_latent(Path(b["latents"][kind]))
        rows[kind] = outputs.compare(vb, va, sb, sa)
    return {k: {"max_abs": r["max_abs"], "max_rel": r["max_rel"]} for k, r in rows.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--npu-count", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--after", action="store_true", help="place the cache node after MultiNPUParallelConfig")
    ap.add_argument("--nodes", default="EasyCache,LazyCache")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    home = Path(args.comfy_home).resolve()
    rec = service.read_record(service.runtime_root(home))
    if rec is None:
        print(f"no server runs for {home}: h3kit demo --comfy-home {home} --keep-running first", file=sys.stderr)
        return 2
    report = {"transport": rec.transport, "devices": list(rec.devices), "runs": [], "pairs": []}
    base = {n: run(rec, home, None, n, args.steps, False, args.timeout) for n in (args.npu_count, 1)}
    report["runs"] += list(base.values())
    report["pairs"].append({"node": None, "vs_one": compare(base[args.npu_count], base[1])})
    for node in args.nodes.split(","):
        got = {n: run(rec, home, node, n, args.steps, args.after, args.timeout) for n in (args.npu_count, 1)}
        report["runs"] += list(got.values())
        report["pairs"].append({"node": node, "vs_one": compare(got[args.npu_count], got[1])})
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"transport {report['transport']}, devices {report['devices']}, {args.steps} steps")
        for r in report["runs"]:
            print(f"  {str(r['node']):9s} {r['place']:6s} npu_count {r['npu_count']}: "
                  + (f"skipped {r['skipped']}, ran {r['ran']}" if r["ok"] else f"FAILED: {r.get('log_error') or r['error']}"))
        for p in report["pairs"]:
            print(f"  {str(p['node']):9s} npu_count {args.npu_count} vs 1: {p['vs_one']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
