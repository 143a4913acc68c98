"""What the join's warm-up of every link costs on gloo (issue 45 item 3: comfy/multinpu_links.warm).

    python benchmarks/multinpu_join_warmup.py [--world 2,4,8] [--repeats 5] [--json]

Per world size, P processes join a gloo group (file rendezvous) and its side group, then time, median of --repeats:
the join's warm-up as it was (one all_reduce on each group) and as it is (links.warm on the group with the programs'
send/recv pairs, and on the side group). On gloo no link is made lazily, so this is the warm-up's own cost, what
every generation formation now adds on the CPU; on HCCL / NCCL the same calls also make the communicators (unmeasured
on hardware).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patches" / "src"))


def _rank(rank, world, rdv, repeats, out):
    import comfy.multinpu as mn
    import comfy.multinpu_links as links
    comm = mn.init_process_comm("gloo", f"file://{rdv}", rank, world, timeout=60)
    side = comm.side()
    old, new = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        comm.all_reduce(torch.ones(1))
        side.all_reduce(torch.ones(1))
        old.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        links.warm(comm, links.program_pairs(world))
        links.warm(side)
        new.append(time.perf_counter() - t0)
    if rank == 0:
        out.put({"world": world, "old_ms": 1e3 * statistics.median(old), "new_ms": 1e3 * statistics.median(new),
                 "pairs": len(links.program_pairs(world))})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", default="2,4,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    rows = []
    for world in [int(w) for w in args.world.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            q = ctx.Queue()
            procs = [ctx.Process(target=_rank, args=(r, world, f"{tmp}/rdv", args.repeats, q)) for r in range(world)]
            for p in procs:
                p.start()
            rows.append(q.get(timeout=300))
            for p in procs:
                p.join(60)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"P={r['world']}: join warm-up {r['old_ms']:.1f} ms before (one all_reduce per group), "
                  f"{r['new_ms']:.1f} ms now (every collective kind, {r['pairs']} send/recv pairs, both groups)")


if __name__ == "__main__":
    main()
