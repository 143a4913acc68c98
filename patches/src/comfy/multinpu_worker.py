"""A worker process of the group, `python -B -m comfy.multinpu_worker [the server's ComfyUI arguments]`, started by a
launcher (comfy.multinpu_launch): it binds its device before comfy.model_management picks one, and parses the
server's ComfyUI arguments."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys

# SIGTERM is taken by one thread of the worker (comfy.multinpu_launch.watch_termination), which notes who ended the
# process before it exits, even while the main thread is inside a collective; blocked here, before torch starts
# threads of its own, so that no other thread takes it
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import torch  # noqa: E402

import comfy.multinpu_group  # noqa: E402
import comfy.multinpu_links  # noqa: E402
import comfy.multinpu_wire  # noqa: E402
import comfy.options  # noqa: E402

# the runners whose worker sides (their @comfy.multinpu_group.program functions) this process serves
RUNNERS = ("comfy.multinpu_models", "comfy.multinpu_dit", "comfy.multinpu_te", "comfy.multinpu_vae")


def bind_device(device_type: str, local_rank: int) -> torch.device:
    """Make this process's device current: before anything asks comfy.model_management for it."""
    if device_type == "cpu":
        return torch.device("cpu")
    torch.get_device_module(device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)


def main():
    comfy.multinpu_wire.die_with_parent()
    spec = comfy.multinpu_wire.GroupSpec.from_json(os.environ[comfy.multinpu_wire.GROUP_ENV])
    rank = int(os.environ[comfy.multinpu_wire.RANK_ENV])  # set by its launcher (comfy.multinpu_launch.LocalWorkers)
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s", stream=sys.stdout)
    device = bind_device(spec.device_type, rank % spec.local_size)
    comfy.multinpu_links.before_device(device)  # core dumps off unless asked; a replacement waits for the memory

    # comfy.cli_args parses sys.argv when it is first imported, as in main.py: the server's own arguments
    comfy.options.enable_args_parsing()
    cli_args = importlib.import_module("comfy.cli_args")
    if spec.device_type == "cpu":
        cli_args.args.cpu = True  # before comfy.model_management is imported, or it probes CUDA
    model_management = importlib.import_module("comfy.model_management")
    for name in RUNNERS:
        importlib.import_module(name)

    context = comfy.multinpu_group.WorkerContext(spec, rank, device)
    context.free = model_management.unload_all_models
    comfy.multinpu_group.serve(context)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    # skip interpreter teardown: torch's static destructors can abort once a process group has run
    os._exit(0)
