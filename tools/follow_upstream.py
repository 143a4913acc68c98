#!/usr/bin/env python3
"""Follow upstream in one command: the whole loop on the newest commit a branch of the source holds, one table.

    make follow-upstream [REV=master]          # or: python tools/follow_upstream.py --onto REV [--out DIR] [--json F]

Steps, each a row of the table (what passed, what broke, where), each run only when the steps it needs passed:
  rebase      h3kit patches rebase --onto REV: per patch clean / merged three-way / conflicting (the hunks named)
  install     h3kit install --commit REV --force into OUT/ComfyUI (plainly or three-way), then verify
  look-ahead  tests/test_patches_rebase_upstream.py on REV: the series rebases and installs, the DiT parity on 2
              devices, and upstream's tests-unit subset on the patched and the plain tree (a test failing only
              with the series is drift)
  parity te / parity vae   h3kit parity on the installed tree, 2 simulated devices
  node matrix tests/test_h3_node_matrix.py at npu_count 2 against 1 on the installed tree (H3KIT_TEST_TREE)
Nothing is written outside OUT (default: a new folder under /tmp): not the checkout's patches/, not the source.
When REV conflicts, OUT/rebase/conflicts/ holds the marked files and report.txt the hunks: docs/upstream.md says
how to resolve them (patches rebase --resolved) and move the pin (--write).

Runs in the ComfyUI environment (tools/ensure-venv.sh), the source from H3KIT_COMFY_SOURCE. Exit 0 when every
step passed, 1 when one broke (the table says which), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list, env: dict | None = None, timeout: float = 1800) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def h3kit(*args, env=None, timeout=1800):
    return run([sys.executable, "-m", "h3kit", *args], env=env, timeout=timeout)


def pytest_row(files: list, select: str, env: dict) -> tuple[str, str, float]:
    rc, out, err, secs = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rxXfE", "-k", select,
                              *files], env=dict(env, H3KIT_REQUIRE_UPSTREAM="1"))
    summary = (out.strip().splitlines() or ["no output"])[-1].strip("= ")
    moved = re.findall(r"^XFAIL \S+ - (.*)$", out, re.M)  # drift reported as xfail: upstream moved
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+.*)$", out, re.M)
    verdict = "broke" if rc != 0 else ("drift" if moved else "passed")
    return verdict, "; ".join(failed + moved)[:600] or summary, secs


def follow(onto: str, out: Path, python: str) -> list[dict]:
    rows = []

    def add(step, verdict, detail, secs):
        rows.append({"step": step, "verdict": verdict, "detail": detail, "seconds": round(secs, 1)})
        print(f"follow-upstream: {step}: {verdict} ({secs:.0f} s) {detail}", file=sys.stderr, flush=True)
        return verdict in ("passed", "merged")

    rc, stdout, err, secs = h3kit("patches", "rebase", "--onto", onto, "--out", out / "rebase", "--json")
    doc = json.loads(stdout) if stdout.strip().startswith("{") else {}
    if rc not in (0, 1) or "data" not in doc:
        add("rebase", "broke", (doc.get("error") or {}).get("message") or err.strip()[-400:], secs)
        return rows
    data = doc["data"]
    commit = data["onto"]
    counts = ", ".join(f"{v} {k}" for k, v in data["counts"].items())
    hunks = "; ".join(f"{c['patch']}: {c['file']} {c['hunk']}" for c in data["conflicts"])
    if not add("rebase", "conflict" if rc == 1 else ("merged" if data["counts"]["merged"] else "passed"),
               f"{commit[:12]}: {counts}" + (f"; conflicts: {hunks} (marked files: {out}/rebase/conflicts)" if hunks
                                             else ""), secs):
        return rows
    home = out / "ComfyUI"
    rc, stdout, err, secs = h3kit("install", "--comfy-home", home, "--python", python, "--commit", commit, "--force",
                                  "--json")
    merge = (json.loads(stdout).get("data") or {}).get("merge") if stdout.strip().startswith("{") else None
    how = ", ".join(sorted({m["how"] for m in merge["patches"]})) if merge else "plainly (REV is the pin)"
    rc2, _, err2, secs2 = h3kit("verify", "--comfy-home", home) if rc == 0 else (1, "", "", 0)
    if not add("install", "passed" if rc == rc2 == 0 else "broke",
               f"series applied {how}; verify {'OK' if rc2 == 0 else 'failed'}" if rc == 0 else err.strip()[-400:],
               secs + secs2):
        return rows
    env = {"H3KIT_FOLLOW_REV": onto, "H3KIT_TEST_TREE": str(home)}
    add("look-ahead", *pytest_row(["tests/test_patches_rebase_upstream.py"], "newest_master", env))
    for component in ("te", "vae"):
        rc, stdout, err, secs = h3kit("parity", "--comfy-home", home, "--component", component, "--npu-count", "2",
                                      "--device-type", "cpu", "--python", python)
        last = (err.strip().splitlines() or ["?"])[-1]
        add(f"parity {component}", "passed" if rc == 0 else "broke", last, secs)
    add("node matrix", *pytest_row(["tests/test_h3_node_matrix.py"], "npu2 or every_h3_node", env))
    return rows


def table(onto: str, rows: list) -> str:
    lines = [f"h3kit follow-upstream onto {onto}", "", "| step | verdict | seconds | detail |", "| --- | --- | ---: | --- |"]
    lines += [f"| {r['step']} | {r['verdict']} | {r['seconds']} | {r['detail']} |" for r in rows]
    total = sum(r["seconds"] for r in rows)
    return "\n".join(lines + ["", f"{len(rows)} step(s), {total:.0f} s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--onto", default="master", help="a branch, tag or commit of the source (default master)")
    ap.add_argument("--out", type=Path, help="where the rebased series, the installed tree and the report go")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs ComfyUI (default: this one)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON to this file")
    args = ap.parse_args()
    if not os.environ.get("H3KIT_COMFY_SOURCE"):
        print("follow-upstream: set H3KIT_COMFY_SOURCE to a mirror holding the pin and REV", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="h3kit-follow-"))
    if out.exists() and any(out.iterdir()):
        print(f"follow-upstream: {out} is not empty: give a new --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows = follow(args.onto, out, args.python)
    text = table(args.onto, rows)
    (out / "follow-upstream.md").write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"onto": args.onto, "rows": rows}, indent=1) + "\n")
    print(text)
    return 0 if rows and all(r["verdict"] in ("passed", "merged") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
