"""A bare worker of comfy.multinpu_process's process group, for the runtime tests (test support, not shipped).

Runs the real worker loop (comfy.multinpu_group.serve) with test programs instead of the H3 runners, so a
rank costs an interpreter with torch, not one with ComfyUI. Started by GroupRuntime as
`python -B -m process_group_worker` with PYTHONPATH holding patches/src and this folder.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import torch

import comfy.multinpu
import comfy.multinpu_group as mp


@mp.program("sum")
def _sum(context, comm, payload):
    """Every rank adds its contribution to rank 0's tensor; the result is checked on rank 0."""
    x = payload["x"] * 0 + context.rank
    comfy.multinpu.all_reduce(x, comm)


@mp.program("echo")
def _echo(context, comm, payload):
    # the payload came through the store header plus one broadcast: send it back to rank 0 to compare
    for t in payload["tensors"]:
        comm.send(t.contiguous(), 0)


@mp.program("fail")
def _fail(context, comm, payload):
    if context.rank == payload["rank"]:
        if payload["kind"] == "oom":
            raise torch.OutOfMemoryError(f"tried to allocate {payload.get('bytes', 1 << 40)} bytes")
        if payload["kind"] == "exit":
            os._exit(7)
        if payload["kind"] == "sleep":
            time.sleep(payload["seconds"])
        raise ValueError(f"injected failure on rank {context.rank}")
    comfy.multinpu.barrier(comm)


class _Held:
    def __init__(self, digest):
        self.digest = digest


@mp.program("config")
def _config(context, comm, payload):
    digest = dict(payload["digest"])
    if context.rank == payload.get("differ_on"):
        digest["files"] = "another-file"
    if context.rank == payload.get("fail_on"):
        raise FileNotFoundError(f"/models/{payload['name']} is missing on this host")
    return _Held(digest)


@mp.program("uses_config")
def _uses_config(context, comm, payload):
    held = context.configs[payload["id"]]
    comfy.multinpu.all_reduce(torch.tensor([float(len(held.digest))]), comm)


def main():
    mp.die_with_parent()
    spec = mp.GroupSpec.from_json(os.environ[mp.GROUP_ENV])
    rank = int(os.environ[mp.RANK_ENV])
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stdout)
    freed = []
    context = mp.WorkerContext(spec, rank, "cpu")
    context.free = lambda: freed.append(time.time())
    mp.serve(context)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
