"""Run one SPMD case from multinpu_cases on P real processes joined by a gloo process group.

    python multinpu_gloo.py --world P[,P...] --case NAME --rdv FILE [--timeout S] [--deadline S] [--params JSON]

The parent imports torch once and forks the ranks before running any torch op (so forking is safe
and a rank costs milliseconds, not a fresh interpreter). Each rank joins the group through a file://
rendezvous, runs the case with multinpu.init_process_comm's communicator and sends back its result
or its traceback. The parent enforces a deadline: ranks still running then are terminated, then
killed, and reported as hung. Several world sizes run one after the other (one rendezvous file
each, FILE.P). It prints one JSON report on stdout: {"groups": [{"world", "elapsed_s", "ranks":
[{"rank", "exitcode", "killed", "status": ok|error|no_result|hung, "result"|"error"+"traceback"}]}]}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multinpu_cases  # noqa: E402


def _rank_main(rank, world, case, params, rdv, timeout, conn):
    try:
        mn = multinpu_cases.load_multinpu()
        comm = mn.init_process_comm("gloo", f"file://{rdv}", rank, world, timeout=timeout)
        result = multinpu_cases.CASES[case](comm, mn, **params)
        conn.send({"status": "ok", "result": result})
    except BaseException as e:
        conn.send({"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        conn.close()
    # skip destroy_process_group: after a failed peer it can block on the dead rank
    sys.stdout.flush()


def run_group(ctx, world, case, params, rdv, timeout, deadline):
    t0 = time.monotonic()
    procs, conns = [], []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(rank, world, case, params, rdv, timeout, child_end))
        p.start()
        child_end.close()
        procs.append(p)
        conns.append(parent_end)
    reports = [None] * world
    end = t0 + deadline
    for rank, (p, conn) in enumerate(zip(procs, conns)):
        if conn.poll(max(0.0, end - time.monotonic())):
            try:
                reports[rank] = conn.recv()
            except EOFError:
                pass
        p.join(max(0.0, min(5.0, end - time.monotonic())))
    out = []
    for rank, p in enumerate(procs):
        hung = p.is_alive()
        if hung:
            p.terminate()
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        rep = reports[rank] or {"status": "hung" if hung else "no_result"}
        rep.update(rank=rank, exitcode=p.exitcode, killed=hung)
        out.append(rep)
    return {"world": world, "elapsed_s": time.monotonic() - t0, "ranks": out}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", required=True, help="world size, or several separated by commas")
    ap.add_argument("--case", required=True, choices=sorted(multinpu_cases.CASES))
    ap.add_argument("--rdv", required=True)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--deadline", type=float, default=60.0)
    ap.add_argument("--params", default="{}")
    args = ap.parse_args(argv)
    import torch  # noqa: F401  (imported once here, inherited by the forked ranks)

    ctx = multiprocessing.get_context("fork")
    params = json.loads(args.params)
    groups = [run_group(ctx, int(w), args.case, params, f"{args.rdv}.{w}", args.timeout, args.deadline)
              for w in args.world.split(",")]
    print(json.dumps({"groups": groups}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
