"""What `make demo` may build on this host, decided before it builds anything (`python -m h3kit.demohost`).

`make demo` builds one environment, from toolkit/requirements/comfy-runtime-cpu.txt: a CPU build of torch,
no torch-npu, no CANN. On an NPU (or NVIDIA) host that environment cannot drive the cards, and `h3kit demo`
would pick the host's device type and fail after minutes of building. So the Makefile asks here first, with
the same cheap detection doctor and `--device-type auto` use (h3kit.devices.detect_device_type: /dev/davinci*
or npu-smi, /dev/nvidia* or nvidia-smi; torch is never imported), and:

- cpu, or DEVICE_TYPE=cpu: build the CPU environment and run the demo there (simulated devices);
- npu or cuda with COMFY_PYTHON=... (an interpreter with that device's torch and h3kit): run the demo with it,
  building nothing;
- npu or cuda without COMFY_PYTHON: build nothing, say what to run instead, exit 2.

Only the standard library and h3kit.devices: the bootstrap Python that runs this has no click.
"""

from __future__ import annotations

import subprocess
import sys

from h3kit import devices as h3devices

NEEDS = {"npu": "torch 2.14.0 with torch-npu 2.14.0 and CANN's environment (README, 'Environment')",
         "cuda": "a CUDA build of torch and torchaudio"}
INSTALL = {"npu": "'.[npu]'", "cuda": "."}


def plan(device_type: str, python: str | None) -> tuple[str, str | None]:
    """("cpu", None): build the CPU environment; ("python", None): run with `python`, build nothing;
    ("refuse", message): build nothing, say the message."""
    kind = h3devices.resolve_device_type(device_type)
    if kind == "cpu":
        return "cpu", None
    if python:
        problem = _h3kit_missing(python)
        return ("refuse", problem) if problem else ("python", None)
    seen = "this host has" if device_type == "auto" else "DEVICE_TYPE asks for"
    return "refuse", (
        f"make demo: {seen} {kind} devices, and the environment make demo builds is CPU-only "
        f"(toolkit/requirements/comfy-runtime-cpu.txt: no {'torch-npu, no CANN' if kind == 'npu' else 'CUDA'}), "
        f"so h3kit demo could not drive them; nothing was built. Run one of:\n"
        f"  make demo COMFY_PYTHON=/opt/h3/python-cann   # an interpreter with {NEEDS[kind]},\n"
        f"                                               # h3kit installed into it: pip install -e {INSTALL[kind]} "
        f"(h3kit doctor --device-type {kind} --python PY says what it lacks)\n"
        f"  make demo DEVICE_TYPE=cpu                    # the CPU simulation on this host "
        "(builds the CPU environment)")


def _h3kit_missing(python: str) -> str | None:
    try:
        r = subprocess.run([python, "-c", "import h3kit, click"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"make demo: COMFY_PYTHON={python} cannot run ({e}); give an interpreter (or its wrapper) that exists"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return (f"make demo: COMFY_PYTHON={python} cannot import h3kit ({last}); install it there first: "
                f"{python} -m pip install -e . (from this checkout; '.[npu]' on an NPU host), then run make demo "
                f"COMFY_PYTHON={python} again")
    return None


def main(argv: list[str]) -> int:
    """argv: DEVICE_TYPE [COMFY_PYTHON]. Prints the plan's word (cpu, python) on stdout, or the message on stderr
    and exits 2."""
    device_type = argv[0] if argv else "auto"
    python = argv[1] if len(argv) > 1 and argv[1] else None
    try:
        what, message = plan(device_type, python)
    except h3devices.UsageError as e:
        print(f"make demo: DEVICE_TYPE={device_type}: {e.message} ({e.hint})", file=sys.stderr)
        return 2
    if what == "refuse":
        print(message, file=sys.stderr)
        return 2
    print(what)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
