"""Reading what a prompt wrote, without torch: ComfyUI's .latent files and the tracks of an MP4.

The toolkit may run in an environment without torch (the ComfyUI interpreter is a separate one on an NPU
host), and the files involved in the demo are small, so both readers are plain Python.
"""

from __future__ import annotations

import array
import json
import math
import struct
import sys
from pathlib import Path

from h3kit.errors import H3kitError

_DTYPES = {"F32": ("f", 4), "F64": ("d", 8)}


class OutputFormatError(H3kitError):
    code = "bad_output_file"


def read_latent(path: Path, key: str = "latent_tensor") -> tuple[list[int], array.array]:
    """(shape, values) of the tensor `key` in a safetensors file such as SaveLatent's .latent."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise OutputFormatError(f"{path}: too short for a safetensors file")
    n = struct.unpack("<Q", data[:8])[0]
    try:
        header = json.loads(data[8:8 + n])
        entry = header[key]
    except (ValueError, KeyError) as e:
        raise OutputFormatError(f"{path}: no {key!r} tensor ({e})") from None
    if entry["dtype"] not in _DTYPES:
        raise OutputFormatError(f"{path}: {key} is {entry['dtype']}, only {sorted(_DTYPES)} are read")
    code, size = _DTYPES[entry["dtype"]]
    a, b = entry["data_offsets"]
    values = array.array(code)
    values.frombytes(data[8 + n + a:8 + n + b])
    if sys.byteorder != "little":
        values.byteswap()
    return list(entry["shape"]), values


def compare(ref: array.array, other: array.array, ref_shape=None, other_shape=None) -> dict:
    """max_abs and max_rel (max |other - ref| / max |ref|) of two equally long value arrays.

    Refuses (OutputFormatError) what a gate could pass on nothing: arrays of other lengths or shapes, empty
    arrays, and a reference of zeros only (max_rel would divide by nothing, and an all-zero output on both
    sides is a broken run, not parity). A NaN or an infinity in either makes both figures infinite (and
    counts them in `non_finite`): max() over floats skips a NaN unless it comes first, and a gate must
    never pass on one.
    """
    if ref_shape is not None and other_shape is not None and list(ref_shape) != list(other_shape):
        raise OutputFormatError(f"cannot compare shape {list(other_shape)} with {list(ref_shape)}")
    if len(ref) != len(other):
        raise OutputFormatError(f"cannot compare {len(ref)} values with {len(other)}")
    if not len(ref):
        raise OutputFormatError("nothing to compare: both outputs are empty")
    bad = sum(not math.isfinite(x) for x in ref) + sum(not math.isfinite(y) for y in other)
    if bad:
        return {"max_abs": math.inf, "max_rel": math.inf, "values": len(ref), "non_finite": bad}
    scale = max(abs(x) for x in ref)
    if scale == 0:
        raise OutputFormatError(f"the reference output is all zeros ({len(ref)} values): a comparison with it "
                                "would pass on nothing")
    max_abs = max(abs(x - y) for x, y in zip(ref, other))
    return {"max_abs": max_abs, "max_rel": max_abs / scale, "values": len(ref), "non_finite": 0}


def mp4_tracks(path: Path) -> list[str]:
    """Handler types of an MP4's tracks ('vide', 'soun', ...), read from its moov/trak/mdia/hdlr boxes."""
    data = Path(path).read_bytes()
    found: list[str] = []

    def walk(start: int, end: int, depth: int) -> None:
        pos = start
        while pos + 8 <= end and depth < 8:
            size, kind = struct.unpack(">I4s", data[pos:pos + 8])
            header = 8
            if size == 1 and pos + 16 <= end:
                size, header = struct.unpack(">Q", data[pos + 8:pos + 16])[0], 16
            elif size == 0:
                size = end - pos
            if size < header or pos + size > end:
                return
            if kind in (b"moov", b"trak", b"mdia"):
                walk(pos + header, pos + size, depth + 1)
            elif kind == b"hdlr" and pos + header + 12 <= end:
                found.append(data[pos + header + 8:pos + header + 12].decode("ascii", "replace"))
            pos += size

    walk(0, len(data), 0)
    return found
