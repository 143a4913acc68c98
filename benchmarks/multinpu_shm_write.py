"""What reserving the /dev/shm hand-off costs: comfy.multinpu_wire.shm_write (posix_fallocate, then the copy through
the mapping) against the ftruncate-only write it replaced (the copy then allocates the pages; SIGBUS on a full tmpfs).

    python benchmarks/multinpu_shm_write.py [--gib 1] [--repeats 6] [--dir /dev/shm] [--json]

Run it with the interpreter that runs ComfyUI (torch). The two writes alternate; min and median per write.
Numbers vary with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "patches" / "src"))

import torch  # noqa: E402

import comfy.multinpu_wire as wire  # noqa: E402


def ftruncate_write(path, tensors):
    """The write before: the file sized with ftruncate only, the pages allocated by the copy."""
    metas, offset = wire.shm_layout(tensors)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, offset)
    os.close(fd)
    buf = torch.from_file(path, shared=True, size=offset, dtype=torch.uint8)
    for t, (start, nbytes, _, _, _) in zip(tensors, metas):
        buf[start:start + nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return metas, offset


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--dir", default=wire.shm_dir())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tensors = [torch.ones(int(args.gib * (1 << 30)) // 4)]
    times = {"ftruncate (before)": [], "posix_fallocate (shm_write)": []}
    for _ in range(args.repeats):
        for name, fn in (("ftruncate (before)", ftruncate_write), ("posix_fallocate (shm_write)", wire.shm_write)):
            path = os.path.join(args.dir, f"h3kit-bench-{uuid.uuid4().hex}")
            t0 = time.perf_counter()
            try:
                fn(path, tensors)
                times[name].append(time.perf_counter() - t0)
            finally:
                wire.shm_remove(path)
    out = {name: {"min_s": min(v), "median_s": statistics.median(v)} for name, v in times.items()}
    if args.json:
        print(json.dumps({"gib": args.gib, "repeats": args.repeats, "dir": args.dir, "writes": out}))
    else:
        for name, v in out.items():
            print(f"{name}: {args.gib:g} GiB, min {v['min_s']:.3f} s, median {v['median_s']:.3f} s")


if __name__ == "__main__":
    main()
