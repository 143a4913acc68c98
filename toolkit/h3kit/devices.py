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
MAX_DEVICE_ID = 65535
SHOWN_CHARS = 40   # of a bad list or entry, in an error message: a 5,000-id list is not echoed whole


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted for a message, cut to `limit` characters with the full length said."""
    if len(text) <= limit:
        return repr(text)
    return repr(text[:limit]) + f"... ({len(text)} characters)"


def parse_device_list(text: str, *, allowed_counts: tuple[int, ...] = ALLOWED_COUNTS) -> list[int]:
    """Parse "0,1,2,3" into [0, 1, 2, 3].

    Ids must be non-negative integers written without spaces or signs, unique and ascending, and there must
    be 1, 2, 4 or 8 of them. Raises DeviceListError naming the first offending entry otherwise.
    """
    if text is None or not str(text).strip():
        raise DeviceListError("empty device list", hint="give device ids like 0,1,2,3")
    raw = str(text)
    items = raw.split(",")
    counts = ", ".join(str(c) for c in allowed_counts)
    if len(items) > max(allowed_counts):  # said before any entry is read: a huge list is not walked
        raise DeviceListError(f"device list {shown(raw)} has {len(items)} devices; H3 runs on {counts}",
                              hint="MultiNPUParallelConfig's npu_count must be 1, 2, 4 or 8 and match the devices of "
                                   "the service (this list, times the hosts of a multi-host group)")
    ids: list[int] = []
    for pos, item in enumerate(items):
        if not item or not item.isascii() or not item.isdigit():
            raise DeviceListError(
                f"device list {shown(raw)}: entry {pos + 1} ({shown(item)}) is not a non-negative integer",
                hint="write ids separated by commas, without spaces: 0,1,2,3 "
                     "(the Ascend runtime silently ignores everything after a bad entry)")
        # compared as text first: int() refuses more than 4,300 digits, and such an id is out of range anyway
        if len(item.lstrip("0")) > len(str(MAX_DEVICE_ID)) or int(item) > MAX_DEVICE_ID:
            raise DeviceListError(f"device list {shown(raw)}: id {shown(item)} is out of range (0-{MAX_DEVICE_ID})")
        value = int(item)
        if value in ids:
            raise DeviceListError(f"device list {shown(raw)}: id {value} appears twice",
                                  hint="list each device once")
        if ids and value < ids[-1]:
            raise DeviceListError(
                f"device list {shown(raw)}: id {value} comes after {ids[-1]}; ids must be ascending",
                hint=f"write them in order: {','.join(str(i) for i in sorted(set(ids + [value])))}...")
        ids.append(value)
    if len(ids) not in allowed_counts:
        raise DeviceListError(f"device list {shown(raw)} has {len(ids)} devices; H3 runs on {counts}",
                              hint="MultiNPUParallelConfig's npu_count must be 1, 2, 4 or 8 and match the devices of "
                                   "the service (this list, times the hosts of a multi-host group)")
    return ids


def check_device_ids(ids, *, allowed_counts: tuple[int, ...] = ALLOWED_COUNTS) -> list[int]:
    """A list of ids (from a record, a spec) checked by the same rules as a typed list."""
    if not isinstance(ids, (list, tuple)) or not all(type(i) is int for i in ids):
        raise DeviceListError(f"devices {shown(str(ids))} is not a list of integers")
    if any(i < 0 for i in ids):
        raise DeviceListError(f"devices {shown(str(ids))}: ids must be non-negative")
    return parse_device_list(format_device_list(list(ids)), allowed_counts=allowed_counts)


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
            try:
                return name, parse_device_list(value)
            except DeviceListError as e:  # say where the list came from: the user typed no list here
                raise DeviceListError(f"{name} in the environment: {e.message}",
                                      hint=f"{e.hint + '; ' if e.hint else ''}or unset {name} and pass --devices",
                                      details={"variable": name, "value": value}) from None
    return None
