"""Parity of the multi-device H3 components against one device, run inside the ComfyUI interpreter.

    python parity_worker.py --comfy-home DIR --component dit|te|vae --device-type cpu|npu|cuda --npu-count N
                            --out FILE [--transport threads|process] [--faults none,NAME,...]
                            [--dtypes float32,bfloat16] [--no-lora] [--no-override] [--layouts ...] [--steps K]
                            [--timeout S]
    python parity_worker.py --comfy-home DIR [--device-type T] [--transport T] --out FILE --jobs JSON

`h3kit parity` starts this script with the interpreter that runs ComfyUI, h3kit's toolkit on its PYTHONPATH
(worker.run; by hand, put it there). It uses the patched tree's own code end to end, and the
MultiNPUParallelConfig node (validate_inputs, then execute) for the parallel side. N must be 2 or more: one device
would be compared with itself. One module per component builds and judges its rows: parity_dit.py (sequence
parallel DiT), parity_te.py (text encoder), parity_vae.py (video and audio VAE); parity_common.py holds what they
share, the process group's set-up included (--transport process: this script drives a group of N worker
processes, rank 0 included, as the server does, comfy.multinpu_process; the workers load the same checkpoint files, which stay on disk for the whole
run, in --out's folder).

The JSON written to --out: {"ok", "rows": [...], "config": {...}} or {"ok": false, "error"}; each row has "pass"
and, when it failed, the reasons in "failed". With --jobs (several runs in this one process, each given as a list of
the arguments above; h3kit.runtime.parity.run_jobs): {"ok", "reports": [one such report per run]}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

# h3kit is on PYTHONPATH (worker.run puts h3kit alone there, never the site-packages a wheel sits in)
from h3kit.runtime import parity_common as common
from h3kit.runtime.parity_dit import (  # noqa: F401  (names the tests and check scripts read here)
    AUDIO_SHAPE, DIT_FAULTS, GATE_MARGIN, GATES as DIT_GATES, LAYOUTS, NOISE, SHARDINGS, TEXT_LEN, TEXT_LEN_8, TINY,
    VIDEO_SHAPE, _tiny_checkpoint, text_len)
from h3kit.runtime.parity_te import TE_FAULT_NOTE, TE_GATE_COS, TE_GATE_MAX_REL, TE_GATE_REL_RMS  # noqa: F401
from h3kit.runtime.parity_vae import AUDIO_LATENT_T, VAE_FAULT_NOTE, VAE_LAYOUTS, VAE_TILES  # noqa: F401

COMPONENTS = ("dit", "te", "vae")
FAULTS = {"dit": DIT_FAULTS, "te": {"reduce": TE_FAULT_NOTE}, "vae": {"chunks": VAE_FAULT_NOTE}}


def _run_component(args):
    from h3kit.runtime import parity_dit, parity_te, parity_vae
    return {"dit": parity_dit.run_dit, "te": parity_te.run_te, "vae": parity_vae.run_vae}[args.component](args)


def _bad_arguments(args):
    """A message when the arguments cannot make a meaningful run, else None."""
    if args.npu_count < 2:
        return (f"--npu-count {args.npu_count}: parity compares several devices with one; with one device it "
                "would compare a model with itself")
    known = FAULTS[args.component]
    unknown = [f for f in args.faults if f != "none" and f not in known]
    if unknown or not args.faults:
        return f"--faults {','.join(args.faults)}: {args.component} knows none and {', '.join(known)}"
    if any(f.startswith("lora") for f in args.faults) and not args.lora:
        return "--faults lora-*: the LoRA faults need the LoRA rows (drop --no-lora)"
    if args.weights != "float" and args.component != "dit":
        return f"--weights {args.weights}: dit only"
    if args.weights == "int8" and any(f.startswith("lora") for f in args.faults):
        return "--faults lora-*: the INT8 rows carry no LoRA"
    if args.component == "dit" and not args.sharding:
        return f"--sharding: one or both of {', '.join(SHARDINGS)}"
    if any(f.startswith("shard-") for f in args.faults) and "sharded" not in args.sharding:
        return "--faults shard-*: the sharded-weight faults need the sharded rows (--sharding sharded)"
    if args.override and args.weights == "int8":
        return "--override: the INT8 rows run without the attention override rows (drop --override)"
    if args.component != "dit" and len(args.faults) != 1:
        return f"--faults: {args.component} runs one pass, none or {', '.join(known)}"
    bad = [d for d in args.dtypes if d not in ("float32", "bfloat16")]
    if bad or not args.dtypes or (args.component == "dit" and "float32" not in args.dtypes):
        return f"--dtypes {','.join(args.dtypes)}: float32 (always, for dit) and/or bfloat16"
    return None



def _parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--component", choices=COMPONENTS, default="dit")
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", type=int, required=True)
    ap.add_argument("--weights", choices=("float", "int8"), default="float", help="dit: the tiny DiT's weights")
    ap.add_argument("--transport", choices=("threads", "process"), default="threads")
    ap.add_argument("--faults", default="none",
                    help="comma-separated passes: none (the clean run) and/or faults of the component (FAULTS)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="dit and te: the dtypes to compare in")
    ap.add_argument("--no-lora", dest="lora", action="store_false", help="dit: leave out the LoRA rows")
    ap.add_argument("--no-override", dest="override", action="store_false",
                    help="dit: leave out the rows with a user attention override")
    ap.add_argument("--sharding", default=",".join(SHARDINGS),
                    help="dit: the weights of the parallel rows, replicated and/or sharded (the sharded rows run the "
                         "default attention and must equal their replicated twin exactly)")
    ap.add_argument("--layouts", default="", help="comma-separated rows to run (default: all of the component's)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", required=True)
    return ap


def _parse(argv):
    args = _parser().parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.faults = [x for x in args.faults.split(",") if x]
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    args.sharding = [x for x in SHARDINGS if x in args.sharding.split(",")]
    if args.component == "dit":
        args.layouts = args.layouts or list(LAYOUTS)
        args.override = args.override and args.weights == "float"
    return args


def _run(args):
    """(the report of one run, its exit code)."""
    problem = _bad_arguments(args)
    try:
        result = {"ok": False, "error": {"code": "bad_arguments", "message": problem}} if problem else \
            _run_component(args)
        code = 0 if result["ok"] else (2 if "error" in result else 1)
    except Exception as e:
        traceback.print_exc()
        result = {"ok": False, "error": {"code": "worker_failed", "message": f"{type(e).__name__}: {e}"}}
        code = 3
    finally:
        common.end_run()
    return result, code


def _jobs(argv):
    """--jobs JSON: several runs in this one process (the test suite's way to pay for one interpreter, one ComfyUI
    import and, with the process transport, one group of workers instead of one per run). JSON is a list of
    argument lists, each this script's arguments but --comfy-home, --device-type, --transport and --out, which
    all runs share; with the process transport, runs with the same --npu-count share one group."""
    ap = argparse.ArgumentParser()
    for name in ("--comfy-home", "--out", "--jobs"):
        ap.add_argument(name, required=True)
    ap.add_argument("--device-type", default="cpu")
    ap.add_argument("--transport", default="threads")
    outer = ap.parse_args(argv)
    shared = ["--comfy-home", outer.comfy_home, "--device-type", outer.device_type, "--transport", outer.transport,
              "--out", outer.out]
    jobs = [_parse(shared + list(job)) for job in json.loads(outer.jobs)]
    tempfile.tempdir = os.path.dirname(os.path.abspath(outer.out))
    reports = [_run(a)[0] for a in jobs]  # a run with another --npu-count replaces the group (common.start_group)
    return {"ok": all(r["ok"] for r in reports), "reports": reports}, outer.out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--jobs" in argv:
        result, out = _jobs(argv)
        code = 0 if result["ok"] else 1
    else:
        args = _parse(argv)
        # checkpoints stay on disk while workers may load them: in --out's folder, which h3kit parity removes
        tempfile.tempdir = os.path.dirname(os.path.abspath(args.out))
        result, code = _run(args)
        out = args.out
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    common.stop_group()
    return code


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # the report is written; skip interpreter teardown, where torch's static destructors occasionally
    # abort ("terminate called without an active exception") once rank threads have run
    os._exit(code)
