#!/usr/bin/env python3
"""A small mutation check: do the tests that claim a module catch a realistic one-line fault in it?

For each module of MODULES it collects the mutation sites of the module's source (or of the functions
named for it), draws up to --max-mutants of them (deterministically: --seed), and for each one writes the
mutated module into a temporary copy of the tree (the checkout itself is never written), runs the tests that
claim the module there (pytest -x, no xdist), and counts the mutant killed (a test failed, or the run passed
its time limit) or survived (every test passed). It prints a table (module, sites, mutants, killed, survived)
and every survivor with its line; --json writes the same as one document.

Mutations (one per mutant): a comparison flipped or loosened (== !=, < <=, > >=, in / not in, is / is not),
and / or swapped, `not` dropped, + / - swapped, an integer constant moved by one (off-by-one in slices,
bounds and counts), a statement that is a call dropped (replaced by `pass`), `return X` made `return None`.

    tools/mutate.py [--module NAME ...] [--max-mutants N] [--seed S] [--python PY] [--tree PATH]
                    [--tests NODEID ...] [--json OUT] [--list]

The tests run with --python (default: this interpreter) and the environment as given (H3KIT_COMFY_SOURCE etc.).
A baseline run of the module's tests on the unmutated copy must pass first: otherwise the module is reported
as 'baseline failed' and no mutant is counted. Survivors are either killed by a new behaviour test or listed in
docs/testing.md as equivalent, with the reason.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module -> (source, the tests that claim it, the top-level functions/classes mutated (None: all), note)
MODULES = {
    "queuesave": ("toolkit/h3kit/queuesave.py", ["tests/test_queuesave.py"], None,
                  "the queue's save and restore"),
    "channel": ("patches/src/comfy/multinpu_channel.py", ["tests/test_multinpu_channel.py"],
                ["_recv_exact", "recv_frame", "Link", "ChannelServer"],
                "the command channel: framing, signature checks, handshake, MAX_PENDING"),
    "fetch": ("toolkit/h3kit/weights/fetch.py", ["tests/test_models_fetch_units.py", "tests/test_models_fetch.py",
                                                  "tests/test_models_first_hour.py"], None,
              "models fetch: download, resume, hash verification"),
    "patchfile": ("toolkit/h3kit/patchfile.py", ["tests/test_patchfile_units.py", "tests/test_patch_engine.py"], None,
                  "the patch engine: parsing and applying the series' sections"),
    "shard": ("patches/src/comfy/multinpu_shard.py", ["tests/test_multinpu_shard_units.py",
                                                      "tests/test_multinpu_shard.py"], None,
              "sharded slices of the DiT's weights (needs torch and the pin: its tests run an installed tree)"),
    "naming": ("patches/src/comfy/multinpu_launch.py",
               ["tests/test_multinpu_launch_units.py"] + [f"tests/test_multinpu_process.py::{t}" for t in (
                   "test_a_death_its_launcher_caused_is_not_named_first",
                   "test_a_failing_rank_is_named_and_the_next_command_runs",
                   "test_a_killed_worker_fails_the_command_at_once_and_the_group_is_replaced",
                   "test_a_hung_worker_is_noticed_by_its_heartbeat")],
               ["secondary", "recycled", "watch_termination", "termination_note", "process_identity",
                "_exit_reason", "LocalWorkers"],
               "failure naming of the process group (slow: one 3-rank group per run, "
               "about a minute)"),
    "ulysses": ("patches/src/comfy/multinpu.py",
                [f"tests/test_multinpu_collectives.py::{t}" for t in (
                    "test_collectives_threads", "test_world_size_one_moves_nothing",
                    "test_heads_not_divisible_names_the_shapes",
                    "test_ulysses_makes_at_most_two_copies_per_direction_threads",
                    "test_ulysses_makes_at_most_two_copies_per_direction_gloo")],
                ["all_to_all_scatter_heads", "all_to_all_gather_heads"],
                "the Ulysses all-to-all exchange (needs torch)"),
    "progress": ("patches/src/comfy/multinpu_progress.py",
                 [f"tests/test_multinpu_process_hang.py::{t}" for t in (
                     "test_a_rank_that_does_not_reach_the_collective_its_peers_wait_in_is_named_after_the_bound",
                     "test_a_rank_that_never_took_the_command_is_named",
                     "test_a_slow_rank_that_reaches_each_collective_is_never_named",
                     "test_a_rank_whose_beats_stop_is_left_to_the_heartbeat",
                     "test_a_peer_held_by_a_silent_rank_is_not_named_for_it",
                     "test_a_collective_every_rank_is_stuck_in_is_named",
                     "test_where_a_rank_is_is_said_in_words",
                     "test_a_forgotten_member_is_judged_afresh_when_its_beats_come_back",
                     "test_ranks_between_collectives_are_not_waiting_in_one",
                     "test_a_rank_that_entered_no_collective_yet_is_behind_its_peers",
                     "test_the_furthest_behind_of_the_ranks_behind_is_named",
                     "test_progress_without_a_collective_number_is_collective_0_throughout")],
                 None, "the progress watch: which rank holds a command (its unit tests; the groups that run it are "
                       "the same file's slow tests)"),
    "rebase": ("toolkit/h3kit/rebase.py", ["tests/test_patches_rebase.py"], None,
               "the series moved three-way onto a newer upstream (needs the pin: H3KIT_COMFY_SOURCE)"),
    "members": ("patches/src/comfy/multinpu_members.py",
                ["tests/test_multinpu_members_units.py",
                 "tests/test_metrics_units.py::test_the_driver_notifies_monitoring_at_each_state"],
                None, "the driver's membership and generations (GroupMonitor, Generations) on fakes of the store, "
                      "the launcher and the clock (needs torch); the groups that run it are test_multinpu_process*"),
    "agent": ("patches/src/comfy/multinpu_launch.py", ["tests/test_multinpu_agent_units.py"],
              ["write_ranks_file", "gloo_on_loopback", "Agent", "agent_main"],
              "the launcher's agent side (a node R > 0): its workers, deaths and kill requests, the ranks file, "
              "following the master (unit tests with a fake store and fake workers)"),
}
# modules whose tests run a tree that `h3kit install` patched: the patches/src file reaches them only through
# its patch, so each mutant (and the baseline) is written into the patches by `h3kit patches refresh`
# (needs H3KIT_COMFY_SOURCE); the other patches/src modules are imported from patches/src by their tests
INSTALLED = {"shard"}

COMPARE_SWAPS = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
                 ast.GtE: ast.Gt, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add}


@dataclass
class Site:
    index: int          # the node's position in ast.walk order of the module
    kind: str
    line: int
    what: str           # "line 12: a == b -> a != b"


def _short(node) -> str:
    text = ast.unparse(node).replace("\n", " ")
    return text if len(text) <= 70 else text[:67] + "..."


def _in_scope(tree: ast.Module, scope) -> set[int]:
    """ids of the nodes inside the named top-level definitions (all nodes when scope is None)."""
    roots = [tree] if scope is None else [n for n in tree.body if getattr(n, "name", None) in scope]
    if scope is not None and len(roots) != len(scope):
        missing = set(scope) - {n.name for n in roots}
        raise SystemExit(f"mutate: no top-level {sorted(missing)} in the module: fix MODULES")
    return {id(n) for r in roots for n in ast.walk(r)}


def _docstrings(tree) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body and \
                isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant):
            out.add(id(n.body[0]))
    return out


def _mutations(node):
    """(kind, apply) for each way `node` can be mutated; apply(node) changes it in place."""
    out = []
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE_SWAPS:
        def flip(n):
            n.ops = [COMPARE_SWAPS[type(n.ops[0])]()]
        out.append(("compare", flip))
    elif isinstance(node, ast.BoolOp):
        def swap(n):
            n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
        out.append(("and/or", swap))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        out.append(("drop not", None))  # replaced by its operand (see _apply)
    elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
        def swap_op(n):
            n.op = BINOP_SWAPS[type(n.op)]()
        out.append(("+/-", swap_op))
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        def plus_one(n):
            n.value = n.value + 1
        out.append(("constant+1", plus_one))
        if node.value != 0:
            def minus_one(n):
                n.value = n.value - 1
            out.append(("constant-1", minus_one))
    elif isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
        out.append(("drop call", None))
    elif isinstance(node, ast.Return) and node.value is not None and not (
            isinstance(node.value, ast.Constant) and node.value.value is None):
        def none(n):
            n.value = ast.Constant(None)
        out.append(("return None", none))
    return out


def _skip(node, parents) -> bool:
    """Nodes whose mutation only changes a log line or a message: not what the tests are asked about here."""
    p = parents.get(id(node))
    while p is not None:
        if isinstance(p, ast.JoinedStr):
            return True
        if isinstance(p, ast.Call) and isinstance(p.func, ast.Attribute) and \
                isinstance(p.func.value, ast.Name) and p.func.value.id == "logging":
            return True
        p = parents.get(id(p))
    return False


def sites(source: str, scope) -> list[Site]:
    tree = ast.parse(source)
    keep, docs = _in_scope(tree, scope), _docstrings(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for index, node in enumerate(ast.walk(tree)):
        if id(node) not in keep or id(node) in docs or _skip(node, parents):
            continue
        for kind, apply in _mutations(node):
            before = _short(node)
            after = _apply_copy(node, kind, apply)
            out.append(Site(index, kind, getattr(node, "lineno", 0), f"line {node.lineno}: {before}  ->  {after}"))
    return out


def _apply_copy(node, kind, apply) -> str:
    if kind == "drop not":
        return _short(node.operand)
    if kind == "drop call":
        return "pass"
    n = copy.deepcopy(node)
    apply(n)
    return _short(n)


def mutant_source(source: str, site: Site) -> str | None:
    tree = ast.parse(source)
    parents = {id(c): (p, f, i) for p in ast.walk(tree) for f, v in ast.iter_fields(p)
               for i, c in enumerate(v if isinstance(v, list) else [v]) if isinstance(c, ast.AST)}
    node = list(ast.walk(tree))[site.index]
    kind_apply = dict(_mutations(node))
    if site.kind not in kind_apply:
        return None
    if site.kind in ("drop not", "drop call"):
        parent, field, i = parents[id(node)]
        new = node.operand if site.kind == "drop not" else ast.Pass()
        value = getattr(parent, field)
        if isinstance(value, list):
            value[i] = new
        else:
            setattr(parent, field, new)
    else:
        kind_apply[site.kind](node)
    ast.fix_missing_locations(tree)
    text = ast.unparse(tree) + "\n"
    try:
        compile(text, "<mutant>", "exec")
    except SyntaxError:
        return None
    return text


def copy_tree(src: Path, dst: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored) into dst; a tree that is no git checkout (an
    exported commit) is copied whole, without bytecode."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=src, capture_output=True)
    if listing.returncode != 0:
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".git"))
        return
    files = listing.stdout.split(b"\0")
    for f in files:
        if not f:
            continue
        rel = f.decode()
        s, d = src / rel, dst / rel
        if s.is_file() or s.is_symlink():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(s, d, follow_symlinks=False)


def run_tests(python: str, tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "toolkit"), str(tree)]),
               PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.monotonic()
    try:
        p = subprocess.run([python, "-B", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                            "-n", "0", *tests], cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"")
        return "timeout", time.monotonic() - t0, out.decode(errors="replace") if isinstance(out, bytes) else out
    out = p.stdout + p.stderr
    last = out.strip().splitlines()[-1] if out.strip() else ""
    if p.returncode == 0 and " passed" not in last:  # every test skipped: nothing was checked
        return "nothing ran", time.monotonic() - t0, out
    return ("passed" if p.returncode == 0 else "failed"), time.monotonic() - t0, out


def write_module(name: str, args, tree: Path, path: Path, text: str) -> None:
    """The module's text in the tree's copy; for an INSTALLED module, in its patch too."""
    path.write_text(text)
    if name not in INSTALLED:
        return
    source = os.environ.get("H3KIT_COMFY_SOURCE")
    if not source:
        raise SystemExit(f"mutate: {name}: set H3KIT_COMFY_SOURCE (its tests run a patched tree; the patch is "
                         "refreshed from the mutant)")
    env = dict(os.environ, PYTHONPATH=str(tree / "toolkit"), PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([args.python, "-B", "-m", "h3kit", "patches", "refresh", "--source", source], cwd=tree,
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"mutate: {name}: h3kit patches refresh failed: {(p.stdout + p.stderr)[-2000:]}")


def check_module(name: str, args, tree: Path) -> dict:
    rel, tests, scope, note = MODULES[name]
    tests = args.tests or tests
    path = tree / rel
    source = path.read_text()
    all_sites = sites(source, scope)
    drawn = list(all_sites)
    random.Random(f"{args.seed}:{name}").shuffle(drawn)
    drawn = sorted(drawn[:args.max_mutants], key=lambda s: (s.line, s.index, s.kind))
    row = {"module": name, "source": rel, "tests": tests, "sites": len(all_sites), "mutants": 0, "killed": 0,
           "survived": 0, "timeouts": 0, "survivors": [], "note": note}
    # the baseline: the tests pass on the unmutated module as ast.unparse writes it (the mutants' form)
    write_module(name, args, tree, path, ast.unparse(ast.parse(source)) + "\n")
    try:
        verdict, secs, out = run_tests(args.python, tree, tests, args.baseline_timeout)
        if verdict != "passed":
            row["baseline"] = f"baseline {verdict}: " + "\n".join(out.strip().splitlines()[-15:])
            print(f"mutate: {name}: the tests do not pass on the unmutated module ({verdict}); no mutant counted",
                  file=sys.stderr)
            print(row["baseline"], file=sys.stderr)
            return row
        row["baseline_s"] = round(secs, 1)
        limit = max(60.0, 4 * secs)
        for i, site in enumerate(drawn, 1):
            text = mutant_source(source, site)
            if text is None:
                continue
            write_module(name, args, tree, path, text)
            verdict, secs, out = run_tests(args.python, tree, tests, limit)
            row["mutants"] += 1
            if verdict == "passed":
                row["survived"] += 1
                row["survivors"].append(f"{rel}:{site.what}")
            else:
                row["killed"] += 1
                row["timeouts"] += verdict == "timeout"
            print(f"mutate: {name} {i}/{len(drawn)} {'SURVIVED' if verdict == 'passed' else 'killed  '} "
                  f"({secs:.1f} s) {site.what}", file=sys.stderr, flush=True)
    finally:
        write_module(name, args, tree, path, source)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--module", action="append", choices=sorted(MODULES), help="a module to check (repeatable; "
                    "default: queuesave, channel, fetch, patchfile)")
    ap.add_argument("--max-mutants", type=int, default=40, help="mutants drawn per module (default 40)")
    ap.add_argument("--seed", default="1", help="the draw's seed (default 1)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the tests")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout to copy (default: this one)")
    ap.add_argument("--tests", nargs="+", help="run these tests instead of the module's (one --module)")
    ap.add_argument("--baseline-timeout", type=float, default=900.0)
    ap.add_argument("--json", type=Path, help="also write the table and survivors as JSON here")
    ap.add_argument("--list", action="store_true", help="list the drawn mutants and exit")
    args = ap.parse_args(argv)
    modules = args.module or ["queuesave", "channel", "fetch", "patchfile"]
    if args.tests and len(modules) != 1:
        ap.error("--tests goes with exactly one --module")
    if args.max_mutants < 1:
        ap.error("--max-mutants must be at least 1")
    if args.list:
        for name in modules:
            rel, _, scope, _ = MODULES[name]
            found = sites((args.tree / rel).read_text(), scope)
            drawn = list(found)
            random.Random(f"{args.seed}:{name}").shuffle(drawn)
            for s in sorted(drawn[:args.max_mutants], key=lambda s: (s.line, s.index, s.kind)):
                print(f"{name}: {s.what}")
            print(f"{name}: {len(found)} sites, {min(len(found), args.max_mutants)} drawn")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="h3kit-mutate-") as tmp:
        tree = Path(tmp) / "tree"
        copy_tree(args.tree.resolve(), tree)
        for name in modules:
            rows.append(check_module(name, args, tree))
    print(f"\n{'module':<11} {'sites':>5} {'mutants':>7} {'killed':>6} {'survived':>8}  tests")
    for r in rows:
        if "baseline" in r:
            print(f"{r['module']:<11} {r['sites']:>5} {'-':>7} {'-':>6} {'-':>8}  {' '.join(r['tests'])} "
                  f"(baseline failed)")
        else:
            print(f"{r['module']:<11} {r['sites']:>5} {r['mutants']:>7} {r['killed']:>6} {r['survived']:>8}  "
                  f"{' '.join(r['tests'])}")
    for r in rows:
        for s in r["survivors"]:
            print(f"SURVIVED {s}")
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "max_mutants": args.max_mutants, "modules": rows},
                                        indent=1) + "\n")
    return 1 if any("baseline" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
