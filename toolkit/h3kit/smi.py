"""The accelerator driver's own tools: `npu-smi info` (Ascend) and `nvidia-smi` (NVIDIA), run and parsed.

They answer without torch and without the Python environment, so doctor can tell a missing or broken
driver from a broken environment. Parsing follows the tools' documented table and CSV formats; the test
data in tests/data/smi/ was written to those formats by hand and has not been captured on hardware.

Memory figures are returned in bytes (the tools print MiB). `npu-smi info` lists the physical cards by
NPU id with one chip row each (two rows per card on dual-chip cards); its HBM column is "used / total".
"""

from __future__ import annotations

import re
import shutil
import subprocess

SMI_TIMEOUT = 30.0
MIB = 1024 * 1024
NVIDIA_QUERY = ["--query-gpu=index,name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"]

_NPU_VERSION = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*(\S+)\s*\|")
_CHIP_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*([0-9A-Fa-f]{4}:[0-9A-Fa-f:.]+|NA)\s*\|(.*)\|\s*$")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


def parse_npu_smi(text: str) -> dict:
    """`npu-smi info` -> {"version", "devices": [{"npu", "chip", "name", "health", "bus_id", "used", "total"}]}.

    One entry per chip, in the order listed; used/total are the HBM figures (the last "a / b" pair of
    the chip row) in bytes. The process table that follows the device table is not read.
    """
    version = None
    devices = []
    card = None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line:
            break  # the per-process table reuses the column layout
        found = _NPU_VERSION.search(line)
        if found:
            version = found.group(2)
            continue
        chip = _CHIP_ROW.match(line)
        if chip and card is not None:
            pairs = _PAIR.findall(chip.group(3))
            used, total = (int(pairs[-1][0]) * MIB, int(pairs[-1][1]) * MIB) if pairs else (None, None)
            devices.append(dict(card, chip=int(chip.group(1)), bus_id=chip.group(2), used=used, total=total))
            continue
        row = _NPU_ROW.match(line)
        if row:
            card = {"npu": int(row.group(1)), "name": row.group(2), "health": row.group(3)}
    return {"tool": "npu-smi", "version": version, "devices": devices}


def parse_nvidia_smi(text: str) -> dict:
    """nvidia-smi's CSV query (NVIDIA_QUERY) -> {"version", "devices": [{"index", "name", "total", "free"}]}."""
    devices, version = [], None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != 5 or not cells[0].isdigit():
            continue
        index, name, total, free, version = cells
        devices.append({"index": int(index), "name": name,
                        "total": int(float(total)) * MIB if _number(total) else None,
                        "free": int(float(free)) * MIB if _number(free) else None})
    return {"tool": "nvidia-smi", "version": version, "devices": devices}


def _number(text: str) -> bool:
    return bool(re.fullmatch(r"\d+(\.\d+)?", text))


def query(kind: str) -> dict | None:
    """Run the driver tool for `kind` ("npu" or "cuda"); None when it is not on PATH.

    Returns the parsed answer, or {"tool", "error"} when it ran and failed (a driver that is installed
    but not loaded answers that way).
    """
    tool, args, parse = {"npu": ("npu-smi", ["info"], parse_npu_smi),
                         "cuda": ("nvidia-smi", NVIDIA_QUERY, parse_nvidia_smi)}.get(kind, (None, None, None))
    if tool is None:
        return None
    path = shutil.which(tool)
    if path is None:
        return None
    try:
        proc = subprocess.run([path, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"tool": tool, "path": path, "error": f"{tool} did not answer: {e}"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"tool": tool, "path": path, "error": f"{tool} exited with {proc.returncode}: {' '.join(tail)}"}
    out = parse(proc.stdout)
    out["path"] = path
    if not out["devices"]:
        out["error"] = f"{tool} answered but listed no device"
    return out
