"""How often upstream's next commits take the patch series: plainly, three-way, or with a conflict.

For every first-parent commit after the pin on each branch (default: the mirror's master and the H3
video-extension branch), the series is tried as `h3kit install --commit C --force` would: `git apply`
plainly (h3kit.patches.plan_forward on the touched files at C); where that fails, the three-way replay of
h3kit.rebase (git apply --3way against the base blobs the index lines name). Commits whose touched files are
the same blobs as an earlier commit's take the earlier verdict (most upstream commits touch none of them).

    python benchmarks/patch_footprint.py [--source MIRROR] [--root H3KIT_CHECKOUT] [--branch B ...] [--json]

--root defaults to this checkout; give another checkout (e.g. main's) to measure its series: the replay
computes the index lines from the pin, so a series written before they existed is measured the same way.
Prints one row per branch and, with -v, one line per commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "toolkit"))

from h3kit import gitutil, manifest  # noqa: E402
from h3kit.patches import Series, plan_forward  # noqa: E402
from h3kit.rebase import replay  # noqa: E402

DEFAULT_BRANCHES = ("master", "feat/minimax-h3-video-extend")


def _branch_ref(source: str, branch: str) -> str:
    for cand in (branch, f"refs/heads/{branch}", f"origin/{branch}"):
        if gitutil.run(["rev-parse", "--verify", "--quiet", f"{cand}^{{commit}}"], source, check=False).returncode == 0:
            return cand
    raise SystemExit(f"{source} has no branch {branch}")


def measure(source: str, root: Path, branches, verbose=False) -> dict:
    data = manifest.load(root)
    series = Series.load(root)
    pin = manifest.pin(data)
    touched = series.touched_files()
    pin_files = gitutil.read_blobs(source, pin, touched)
    memo: dict[tuple, tuple[str, list]] = {}
    rows = []
    for branch in branches:
        ref = _branch_ref(source, branch)
        commits = gitutil.run(["rev-list", "--first-parent", "--reverse", f"{pin}..{ref}"], source).stdout.split()
        counts = {"plain": 0, "three-way": 0, "conflict": 0}
        detail = []
        for c in commits:
            files = gitutil.read_blobs(source, c, touched)
            key = tuple(manifest.git_blob_id(files[p]) if files[p] is not None else None for p in touched)
            if key not in memo:
                plan = plan_forward(series, files)
                if not plan.conflicts and all(s.state == "apply" for s in plan.states):
                    memo[key] = ("plain", [])
                else:
                    rep = replay(series, pin_files, files, c)
                    memo[key] = ("three-way" if rep.ok else "conflict",
                                 [f"{h['patch']}: {h['file']} {h['hunk'] or ''}".strip() for h in rep.conflicting_hunks()])
            verdict, where = memo[key]
            counts[verdict] += 1
            subject = gitutil.run(["log", "-1", "--format=%s", c], source).stdout.strip()
            detail.append({"commit": c, "verdict": verdict, "conflicts": where, "subject": subject})
            if verbose:
                print(f"  {branch} {c[:10]} {verdict:9} {subject[:60]}" + (f"  [{where[0]}" + (f" +{len(where) - 1} more" if len(where) > 1 else "") + "]" if where else ""),
                      file=sys.stderr)
        rows.append({"branch": branch, "commits": len(commits), **counts, "head": commits[-1] if commits else None,
                     "detail": detail})
    return {"pin": pin, "source": source, "root": str(root), "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", default=os.environ.get("H3KIT_COMFY_SOURCE"), help="local mirror (env H3KIT_COMFY_SOURCE)")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the h3kit checkout whose series to measure")
    ap.add_argument("--branch", action="append", help=f"branch of the mirror (repeatable; default {', '.join(DEFAULT_BRANCHES)})")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not args.source or not os.path.isdir(args.source):
        print("patch_footprint: give --source a local mirror holding the pin (or set H3KIT_COMFY_SOURCE)", file=sys.stderr)
        return 2
    os.environ["H3KIT_ROOT"] = str(Path(args.root).resolve())
    t0 = time.monotonic()
    result = measure(args.source, Path(args.root).resolve(), args.branch or DEFAULT_BRANCHES, verbose=args.verbose)
    result["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"series of {result['root']} (pin {result['pin'][:12]}), every first-parent commit after the pin:")
    print(f"{'branch':32} {'commits':>7} {'plain':>6} {'three-way':>10} {'conflict':>9}")
    for r in result["rows"]:
        print(f"{r['branch']:32} {r['commits']:7} {r['plain']:6} {r['three-way']:10} {r['conflict']:9}")
    print(f"({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
