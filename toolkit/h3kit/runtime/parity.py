"""Run the parity worker inside the ComfyUI interpreter and judge what it reports.

The worker (parity_worker.py, beside this module) builds a tiny random-weight model with the patched
tree's own code, runs it on one device and through the MultiNPUParallelConfig node on N, and writes
one row per case (dit: layout and attention mode; te: layout and split; vae: latent length) with
max_abs, max_rel, cos, rel_rms, the bytes moved and (te, vae) how often the weight file was read; the dit rows
also carry each rank's own counts and the floor one device measured on itself. This
module finds the interpreter, starts the worker (h3kit.runtime.worker: its own session, a deadline,
only that session killed on expiry), and turns its failures into H3kitErrors. With transport "process" the
worker drives a process group of N worker processes, rank 0 included, as the server does
(comfy.multinpu_process), started and ended in that session.
"""

from __future__ import annotations

import json
from pathlib import Path

from h3kit import service
from h3kit.errors import H3kitError, NotAComfyTree, UsageError
from h3kit.runtime import worker

WORKER = Path(__file__).with_name("parity_worker.py")
COMPONENTS = ("dit", "te", "vae")
# the DiT's gate per device type: exact where the split is (cpu), else the floor one device measures on itself in
# the run (the same sampling again, and with another attention backend) times GATE_MARGIN, unmeasured on hardware
GATE_MARGIN = 4
_DIT_RANKS = ("every rank ran every block of every forward and received the cost model's bytes, the LoRA applied "
              "exactly once and the user's attention override run on every rank (each rank's own count), sharded "
              "weights max_abs == 0 against the replicated run")
DIT_GATES = {"cpu": "max_abs == 0 against one device on each output of each forward (fp32 and bf16)",
             "npu": f"max_rel <= {GATE_MARGIN} x the floor one device measures on itself (unmeasured on hardware)",
             "cuda": f"max_rel <= {GATE_MARGIN} x the floor one device measures on itself (unmeasured on hardware)"}
GATES = {"dit": "{dit}; " + _DIT_RANKS,
         "dit/int8": "{dit}; " + _DIT_RANKS + ", the NPU INT8 arm's W8A8 and W8A16 calls on both sides",
         "te": "max_rel <= 1e-05, cos >= 0.99999 and rel_rms <= 1e-04 (fp32 and bf16 checkpoints: upstream computes "
               "the text encoder in fp32), identical on every rank, weight_reads == 1",
         "vae": "max_abs == 0, weight_reads == 1"}
# --inject-fault NAME per component (the first is the default); parity_worker.FAULTS describes each
FAULTS = {"dit": ("shard", "rope", "heads", "noise", "noise-attention", "noise-mlp", "lora-twice", "lora-missing",
                 "shard-offset", "shard-order"),
          "te": ("reduce",), "vae": ("chunks",)}
DEFAULT_TIMEOUT = 900.0
# what either transport imports: the components ask comfy.multinpu_process.runtime_for for their runtime, and the
# thread transport runs the process runtime's built-ins and wire code (and multidevice and model_cache, which the
# series adds too); with PROCESS_FILES and SERVER_FILES, every file under patches/src (tests/test_parity_cli.py)
PATCHED_FILES = ("comfy/multinpu.py", "comfy/multinpu_clock.py", "comfy/multinpu_threads.py", "comfy/multinpu_dit.py",
                 "comfy/multinpu_shard.py", "comfy/multinpu_te.py",
                 "comfy/multinpu_vae.py", "comfy/multinpu_weights.py", "comfy_extras/nodes_multinpu.py",
                 "comfy/npu_quant.py", "comfy/multinpu_process.py", "comfy/multinpu_group.py",
                 "comfy/multinpu_models.py", "comfy/multinpu_wire.py", "comfy/multinpu_links.py", "comfy/multinpu_channel.py",
                 "comfy/multinpu_launch.py", "comfy/multinpu_zygote.py", "comfy/multinpu_progress.py", "comfy/multinpu_members.py",
                 "comfy/multinpu_commands.py", "comfy/multinpu_installs.py", "comfy/multinpu_runtime_base.py",
                 "comfy/multidevice.py", "comfy/model_cache.py")
WEIGHTS = ("float", "int8")  # dit: the tiny DiT as saved (fp32), or its block linears in INT8 (ConvRot)
PROCESS_FILES = ("comfy/multinpu_worker.py",)  # what only the process transport runs
SERVER_FILES = ("comfy/multinpu_metrics.py",)  # what only the server imports (GET /metrics): no parity run needs it
TRANSPORTS = ("threads", "process")
# with processes a LoRA that differs on a worker stops the run at the handshake (ConfigMismatch, before any
# forward): the parity worker holds no device copy a rank computes with, so there is none to break
PROCESS_UNREACHABLE = ("lora-twice", "lora-missing")


class ParityFailed(H3kitError):
    code = "parity_failed"


def check_tree(comfy_home: Path, transport: str = "threads") -> None:
    home = Path(comfy_home)
    if not (home / "comfy" / "model_management.py").is_file():
        raise NotAComfyTree(home, "no comfy/model_management.py")
    needed = PATCHED_FILES + (PROCESS_FILES if transport == "process" else ())
    missing = [p for p in needed if not (home / p).is_file()]
    if missing:
        raise H3kitError(f"{home} lacks the multi-device patches ({', '.join(missing)} missing)",
                         code="not_patched", hint=f"run h3kit install --comfy-home {home}")


def check_request(component: str, npu_count: int, fault: str = None, weights: str = "float",
                  transport: str = "threads") -> None:
    """Refuse, with the fix, a parity run that could not mean anything (UsageError, exit 2)."""
    if component not in COMPONENTS:
        raise UsageError(f"unknown component {component!r}", hint=f"use one of {', '.join(COMPONENTS)}")
    if transport not in TRANSPORTS:
        raise UsageError(f"unknown transport {transport!r}", hint=f"use one of {', '.join(TRANSPORTS)}")
    if transport == "process" and fault in PROCESS_UNREACHABLE:
        raise UsageError(f"--inject-fault {fault} breaks a device copy in the parity worker's process, which "
                         "computes nothing with the process transport (a worker whose LoRA differs fails the digest check before any "
                         "forward, tests/test_multinpu_process.py)", code="fault_not_applicable",
                         hint=f"use --transport threads for {fault}, or another fault")
    if transport == "process" and weights != "float":
        raise UsageError(f"--weights {weights} runs with the thread transport only", code="bad_weights",
                         hint="drop --transport process (its INT8 call counts are per process)")
    if npu_count < 2:
        raise UsageError(f"--npu-count {npu_count}: parity compares a run on several devices with one device; "
                         "on one device it would compare a model with itself", code="meaningless_count",
                         hint="use --npu-count 2 or 4, with that many devices visible")
    if fault is not None and fault not in FAULTS[component]:
        raise UsageError(f"--inject-fault {fault}: {component} has no such fault",
                         hint=f"use one of {', '.join(FAULTS[component])}")
    if weights not in WEIGHTS or (weights != "float" and component != "dit"):
        raise UsageError(f"--weights {weights} applies to --component dit only", code="bad_weights",
                         hint="run --weights int8 with --component dit")


def gate(component: str, weights: str = "float", device_type: str = "cpu") -> str:
    return GATES.get(f"{component}/{weights}", GATES[component]).format(dit=DIT_GATES.get(device_type, DIT_GATES["npu"]))


def run(comfy_home, component: str, device_type: str, npu_count: int, *, python: str = None,
        fault: str = None, timeout: float = DEFAULT_TIMEOUT, weights: str = "float", extra_args=(),
        transport: str = "threads") -> dict:
    """Run the worker; returns its report {"ok", "rows", "config"}. Raises H3kitError when it cannot produce rows.

    fault: one of FAULTS[component], injected on purpose (the gates must then fail), or None. transport
    "process": the parallel side runs on npu_count processes (gloo on cpu, hccl on npu, nccl on cuda).
    """
    check_request(component, npu_count, fault, weights, transport)
    if weights != "float":
        extra_args = ("--weights", weights, *extra_args)
    home = Path(comfy_home).resolve()
    check_tree(home, transport)
    py = service.resolve_python(home, python)
    service.require_torch(home, py, device_type, "parity")
    cmd = [py, str(WORKER), "--comfy-home", str(home), "--component", component, "--device-type", device_type,
           "--npu-count", str(npu_count), "--transport", transport, *extra_args]
    if fault is not None:
        cmd += ["--faults", fault]
    report = worker.run(cmd, timeout=timeout, what="the parity worker", timeout_code="parity_timeout")
    return checked(report, npu_count)


def checked(report: dict, npu_count: int) -> dict:
    """A run's report, or its error raised as run() raises it."""
    error = report.get("error")
    if error:
        if error.get("code") == "device_check":
            raise UsageError(error["message"], code="device_mismatch",
                             hint=f"run with exactly {npu_count} devices visible, as the server will "
                                  "(ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES), or change --npu-count")
        raise H3kitError(f"parity worker: {error.get('message')}", code=error.get("code", "worker_failed"),
                         details={"log_tail": report.get("log_tail")})
    return report


def run_jobs(comfy_home, device_type: str, jobs, *, python: str = None, timeout: float = DEFAULT_TIMEOUT,
             transport: str = "threads") -> list:
    """Several runs in one worker process: one interpreter, one ComfyUI import and, with transport "process", one
    group of worker processes per npu_count (a job with another replaces it). jobs: dicts of run()'s
    arguments (component, npu_count, and optionally fault, weights, extra_args), each checked as run() checks it.
    Returns each job's report as the worker wrote it, in order: pass it to checked() to get run()'s result or error.
    The command line runs one run per worker (run()); the test suite runs its parity rows this way."""
    argvs = []
    for job in jobs:
        job = dict(job)
        component, n = job.pop("component"), job.pop("npu_count")
        fault, weights, extra = job.pop("fault", None), job.pop("weights", "float"), tuple(job.pop("extra_args", ()))
        if job:
            raise UsageError(f"run_jobs: unknown job keys {sorted(job)}")
        check_request(component, n, fault, weights, transport)
        argv = ["--component", component, "--npu-count", str(n), *(("--weights", weights) if weights != "float"
                                                                    else ()), *extra]
        if fault is not None:
            argv += ["--faults", fault]
        argvs.append(argv)
    home = Path(comfy_home).resolve()
    check_tree(home, transport)
    py = service.resolve_python(home, python)
    service.require_torch(home, py, device_type, "parity")
    cmd = [py, str(WORKER), "--comfy-home", str(home), "--device-type", device_type, "--transport", transport,
           "--jobs", json.dumps(argvs)]
    report = worker.run(cmd, timeout=timeout, what="the parity worker", timeout_code="parity_timeout")
    if "reports" not in report:  # the worker could not start the runs at all
        raise H3kitError(f"parity worker: {(report.get('error') or {}).get('message')}", code="worker_failed",
                         details={"log_tail": report.get("log_tail")})
    for r in report["reports"]:
        r.setdefault("log_tail", report["log_tail"])
    return report["reports"]
