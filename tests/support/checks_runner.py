"""The harness the in-tree check scripts share (test support, not shipped).

multinpu_node_checks.py and multinpu_te_vae_checks.py run inside the ComfyUI interpreter, execute named
check functions once each and write what every check observed (or its traceback) to a JSON report that the
pytest side asserts on.
"""

from __future__ import annotations

import argparse
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


def exit_without_teardown(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: with rank threads around, torch's static destructors occasionally abort
    # ("terminate called without an active exception") after the report is already written
    os._exit(code)
