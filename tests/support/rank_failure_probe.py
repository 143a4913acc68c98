"""Fail rank 2 of a 3-rank ThreadGroup.run and print what the caller catches, as JSON (test support).

    python rank_failure_probe.py

Runs patches/src/comfy/multinpu.py's real ThreadGroup and RankThreads. Where torch is not installed (make
test's torch-free runs on Python 3.10 and 3.13), `torch` is a stand-in with only the calls the thread group
makes on CPU (device, the grad-mode queries and context managers, the dtypes the module names); what is under
test is the interpreter's exception handling (BaseException.add_note exists from 3.11 only), not torch.
"""

from __future__ import annotations

import contextlib
import json
import sys
import types

sys.path.insert(0, __import__("os").path.dirname(__file__))


def _torch_standin():
    torch = types.ModuleType("torch")

    class device:
        def __init__(self, spec):
            self.type, self.index = str(spec), None

        def __str__(self):
            return self.type

    torch.device = device
    torch.bfloat16, torch.float16, torch.float32 = "bfloat16", "float16", "float32"
    torch.is_grad_enabled = lambda: True
    torch.is_inference_mode_enabled = lambda: False
    torch.inference_mode = lambda mode=True: contextlib.nullcontext()
    torch.set_grad_enabled = lambda mode: contextlib.nullcontext()
    torch.distributed = types.ModuleType("torch.distributed")
    sys.modules["torch"], sys.modules["torch.distributed"] = torch, torch.distributed


def main():
    try:
        import torch  # noqa: F401
        real_torch = True
    except ImportError:
        _torch_standin()
        real_torch = False
    import multinpu_cases
    mn = multinpu_cases.load_multinpu()
    group = mn.ThreadGroup(["cpu"] * 3, timeout=10.0)
    threads = mn.RankThreads(group.devices)

    def fn(comm):
        if comm.rank == 2:
            raise MemoryError("simulated out of memory on rank 2")
        mn.barrier(comm)  # ranks 0 and 1 wait in a collective: the failure must free them at once

    report = {"python": list(sys.version_info[:2]), "real_torch": real_torch}
    try:
        group.run(fn, threads)
        report["raised"] = None
    except BaseException as e:
        report.update(raised=type(e).__name__, message=str(e), notes=list(getattr(e, "__notes__", [])))
    finally:
        threads.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
