"""The harness the in-tree check scripts share (test support, not shipped).

multinpu_node_checks.py and multinpu_te_vae_checks.py run inside the ComfyUI interpreter, execute named
check functions once each and write what every check observed (or its traceback) to a JSON report that the
pytest side asserts on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback


def boot_comfy(argv=None) -> argparse.Namespace:
    """Parse the scripts' common flags and import ComfyUI from --comfy-home on CPU, as its server would."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    args = ap.parse_args(argv)
    sys.path.insert(0, args.comfy_home)
    os.chdir(args.comfy_home)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import comfy.model_management  # noqa: F401
    return args


def run_checks(checks: dict, only: str, out: str, extra=None) -> int:
    """Run the named checks (all when `only` is empty); `extra()`, called after them, adds entries."""
    results = {}
    for name in [n for n in only.split(",") if n] or list(checks):
        try:
            results[name] = {"ok": True, "value": checks[name]()}
        except BaseException as e:
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    for name, value in (extra() if extra else {}).items():
        results[name] = {"ok": True, "value": value}
    with open(out, "w") as f:
        json.dump(results, f, indent=2, default=repr)
    return 0


def all_equal(ref, other) -> bool:
    """Two sequences of tensors hold the same tensors, one for one: as many of them, at least one, and each
    torch.equal (zip alone would pass a short or empty output)."""
    import torch
    ref, other = list(ref), list(other)
    return len(ref) == len(other) > 0 and all(torch.equal(a, b) for a, b in zip(ref, other))


@contextlib.contextmanager
def counted_programs(names):
    """Count the runs of the worker programs `names` (comfy.multinpu_group.PROGRAMS) while inside, per rank and
    context. Yields {"registered": {name: "module.function"}, "calls": {name: [(rank, id(context)), ...]}}; the
    real programs are back on exit."""
    import comfy.multinpu_group
    programs = comfy.multinpu_group.PROGRAMS
    real = {n: programs[n] for n in names}
    out = {"registered": {n: f"{fn.__module__}.{fn.__name__}" for n, fn in real.items()}, "calls": {n: [] for n in names}}
    for n in names:
        programs[n] = lambda context, comm, payload, n=n: out["calls"][n].append((comm.rank, id(context))) or real[n](
            context, comm, payload)
    try:
        yield out
    finally:
        programs.update(real)


@contextlib.contextmanager
def serving(runtime):
    """`runtime` as this process's process group while the block runs: what comfy.multinpu_process.runtime_for
    hands every component, as in a server started with the process transport."""
    import comfy.multinpu_process as mp
    before, mp._RUNTIME = mp._RUNTIME, runtime
    try:
        yield runtime
    finally:
        mp._RUNTIME = before


def exit_without_teardown(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: with rank threads around, torch's static destructors occasionally abort
    # ("terminate called without an active exception") after the report is already written
    os._exit(code)


def run_script(script, comfy_home, python: str, tmp, env: dict | None = None, timeout: float = 300) -> dict:
    """pytest side: run a check script in the ComfyUI interpreter with 4 simulated devices, the toolkit on
    PYTHONPATH and `tmp` as H3KIT_CHECK_TMP; returns its report. `env` adds or (with None values) removes
    variables."""
    import subprocess
    from pathlib import Path

    toolkit = Path(__file__).resolve().parents[2] / "toolkit"
    full = dict(os.environ, H3KIT_SIM_DEVICES="4", H3KIT_CHECK_TMP=str(tmp),
                PYTHONPATH=os.pathsep.join([str(toolkit), os.environ.get("PYTHONPATH", "")]))
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    out = Path(tmp) / "checks.json"
    proc = subprocess.run([python, str(script), "--comfy-home", str(comfy_home), "--out", str(out)], env=full,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def value(checks: dict, name: str):
    """pytest side: what check `name` observed (its traceback as the failure when it raised)."""
    result = checks[name]
    assert result["ok"], result.get("traceback")
    return result["value"]
