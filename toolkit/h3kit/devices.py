"""Device lists and device kinds, shared by `start`, `check-workflow`, `parity` and `demo`.

The Ascend runtime reads ASCEND_RT_VISIBLE_DEVICES left to right and silently stops at the first entry it
cannot use ("1, 2,3" exposes only device 1; an out-of-order id drops the rest), so h3kit refuses any list
that the runtime would not read in full, instead of discovering the loss at the first prompt.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from h3kit.errors import DeviceListError, UsageError

ALLOWED_COUNTS = (1, 2, 4, 8)
DEVICE_TYPES = ("npu", "cuda", "cpu")

ASCEND_VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"
CUDA_VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
# Read by comfy/multidevice.py (added by the patch series): on a CPU host the server simulates this many
# devices so every multi-device path runs, and is checked, without an accelerator.
SIM_DEVICES_ENV = "H3KIT_SIM_DEVICES"

VISIBLE_ENV = {"npu": ASCEND_VISIBLE_ENV, "cuda": CUDA_VISIBLE_ENV, "cpu": SIM_DEVICES_ENV}


def parse_device_list(text: str, *, allowed_counts: tuple[int, ...] = ALLOWED_COUNTS) -> list[int]:
    """Parse "0,1,2,3" into [0, 1, 2, 3].

    Ids must be non-negative integers written without spaces or signs, unique and ascending, and there must
    be 1, 2, 4 or 8 of them. Raises DeviceListError naming the first offending entry otherwise.
    """
    if text is None or not str(text).strip():
        raise DeviceListError("empty device list", hint="give device ids like 0,1,2,3")
    raw = str(text)
    ids: list[int] = []
    for pos, item in enumerate(raw.split(",")):
        if not item or not item.isascii() or not item.isdigit():
            raise DeviceListError(
                f"device list {raw!r}: entry {pos + 1} ({item!r}) is not a non-negative integer",
                hint="write ids separated by commas, without spaces: 0,1,2,3 "
                     "(the Ascend runtime silently ignores everything after a bad entry)")
        value = int(item)
        if value > 65535:
            raise DeviceListError(f"device list {raw!r}: id {value} is out of range")
        if value in ids:
            raise DeviceListError(f"device list {raw!r}: id {value} appears twice",
                                  hint="list each device once")
        if ids and value < ids[-1]:
            raise DeviceListError(
                f"device list {raw!r}: id {value} comes after {ids[-1]}; ids must be ascending",
                hint=f"write them in order: {','.join(str(i) for i in sorted(set(ids + [value])))}...")
        ids.append(value)
    if len(ids) not in allowed_counts:
        counts = ", ".join(str(c) for c in allowed_counts)
        raise DeviceListError(f"device list {raw!r} has {len(ids)} devices; H3 runs on {counts}",
                              hint="MultiNPUParallelConfig's npu_count must be 1, 2, 4 or 8 and match the devices of "
                                   "the service (this list, times the hosts of a multi-host group)")
    return ids


def format_device_list(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


def detect_device_type() -> str:
    """npu when an Ascend device or its tools are present, else cuda when an NVIDIA one is, else cpu.

    Looks at device nodes and driver tools only: importing torch (and torch-npu) here would cost seconds
    and fail outright on a host where torch-npu is installed without CANN.
    """
    dev = Path("/dev")
    if any(dev.glob("davinci[0-9]*")) or shutil.which("npu-smi"):
        return "npu"
    if any(dev.glob("nvidia[0-9]*")) or shutil.which("nvidia-smi"):
        return "cuda"
    return "cpu"


def resolve_device_type(kind: str) -> str:
    if kind == "auto":
        return detect_device_type()
    if kind not in DEVICE_TYPES:
        raise UsageError(f"unknown device type {kind!r}", hint="use auto, npu, cuda or cpu")
    return kind


def visible_devices_from_env(environ=None) -> tuple[str, list[int]] | None:
    """The device list the environment exposes, as (variable, ids), or None when none is set."""
    environ = os.environ if environ is None else environ
    for name in (ASCEND_VISIBLE_ENV, CUDA_VISIBLE_ENV):
        value = environ.get(name)
        if value:
            return name, parse_device_list(value)
    return None
