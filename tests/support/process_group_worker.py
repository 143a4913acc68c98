"""A bare worker of comfy.multinpu_process's process group, for the runtime tests (test support, not shipped).

Runs the real worker loop (comfy.multinpu_group.serve) with test programs instead of the H3 runners, so a
rank costs an interpreter with torch, not one with ComfyUI. Started by the driver as
`python -B -m process_group_worker` with PYTHONPATH holding patches/src and this folder. Worker rank 0's
return value is the command's result in the driver.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

# SIGTERM is taken by one thread of the worker (comfy.multinpu_launch.watch_termination), which notes who ended the
# process before it exits, even while the main thread is inside a collective; blocked here, before torch starts
# threads of its own, so that no other thread takes it
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import torch  # noqa: E402

import comfy.multinpu  # noqa: E402
import comfy.multinpu_group as mp  # noqa: E402
import comfy.multinpu_wire as wire  # noqa: E402


# H3KIT_TEST_NO_COMMAND_LINK=R: worker rank R never makes its command connection (it hangs there, beating), so the
# driver's forming must name it within the join timeout
NO_COMMAND_LINK = "H3KIT_TEST_NO_COMMAND_LINK"
if os.environ.get(NO_COMMAND_LINK):
    _connect_channel = mp.connect_channel

    def _never_for_commands(address, signer, hello, *args, **kwargs):
        if hello.get("role") == "command" and hello.get("rank") == int(os.environ[NO_COMMAND_LINK]):
            time.sleep(3600)
        return _connect_channel(address, signer, hello, *args, **kwargs)
    mp.connect_channel = _never_for_commands


# What this worker did to form its groups, in order: [(call, the last command it had taken)] (the "hccl" program
# reads it): the side group of the weight gathers must be made at join, before any command
GROUP_CALLS = []
HCCL_VARS = ("HCCL_IF_BASE_PORT", "HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT", "HCCL_ASYNC_ERROR_HANDLING")
CONTEXT = []
# The send/recv pairs this worker used, each with the command it first appeared in (None: at join) and its group
# (None: the main group): on HCCL (torch_npu 7.1.0 on) and NCCL each pair's communicator forms at its first use
PAIRS = {}


def _recording(name, fn):
    def call(*args, **kwargs):
        GROUP_CALLS.append((name, CONTEXT[0].command if CONTEXT else None,
                            {k: os.environ.get(k) for k in HCCL_VARS}))
        return fn(*args, **kwargs)
    return call


def _pair_recording(fn):
    def call(tensor, peer, group=None, *args, **kwargs):
        me = torch.distributed.get_rank()
        key = ("main" if group is None else "side", min(me, peer), max(me, peer))
        PAIRS.setdefault(key, CONTEXT[0].command if CONTEXT else None)
        return fn(tensor, peer, group, *args, **kwargs)
    return call


torch.distributed.send = _pair_recording(torch.distributed.send)
torch.distributed.recv = _pair_recording(torch.distributed.recv)
torch.distributed.init_process_group = _recording("init_process_group", torch.distributed.init_process_group)
torch.distributed.new_group = _recording("new_group", torch.distributed.new_group)


@mp.program("hccl")
def _hccl(context, comm, payload):
    """What this rank's groups were formed with, and when; then the side group as a sharded forward asks for it."""
    side = comm.side()
    return {"calls": list(GROUP_CALLS), "same_side": side is comm.side(), "generation": context.generation,
            "pid": os.getpid()} if comm.rank == 0 else None


@mp.program("prompt_links")
def _prompt_links(context, comm, payload):
    """The links a prompt's programs use, with the same primitives: the Ulysses all-to-all (uneven shards), the DiT's
    last gather onto rank 0 (gather_v), the VAE's decoded chunks handed to rank 0, the text encoder's layer relays
    (rank r to r + 1), its final broadcast from the last rank and its outputs to rank 0, the side group's weight
    gathers."""
    p, r = comm.world_size, comm.rank
    sizes = [3 + i for i in range(p)]
    comfy.multinpu.all_to_all_scatter_heads(torch.ones(1, p, sizes[r], 2), comm, sizes)
    comfy.multinpu.gather_v(torch.ones(sizes[r], 2), comm, sizes=sizes, dst=0)
    if r != 0:
        comm.send(torch.full((4,), float(r)), 0)
    else:
        chunks = [comm.recv(torch.empty(4), src) for src in range(1, p)]
        assert all(c[0].item() == i + 1 for i, c in enumerate(chunks))
    for src in range(p - 1):
        if r in (src, src + 1):
            comfy.multinpu.peer_copy(torch.ones(2) if r == src else torch.empty(2), comm, src, src + 1)
    comfy.multinpu.broadcast(torch.ones(2), comm, src=p - 1)
    comm.side().all_gather_flat(torch.ones(3))
    return os.getpid()


@mp.program("links_report")
def _links_report(context, comm, payload):
    """Every rank's pairs and groups formed after join (a command's), gathered onto rank 0 as counts; rank 0's own
    records in full."""
    later_pairs = sum(1 for cmd in PAIRS.values() if cmd is not None)
    later_groups = sum(1 for _, cmd, _ in GROUP_CALLS if cmd is not None)
    counts = comm.all_gather_flat(torch.tensor([float(later_pairs), float(later_groups), float(len(PAIRS))]))
    if comm.rank != 0:
        return None
    return {"counts": counts.view(comm.world_size, 3).tolist(), "pairs": [[*k, v] for k, v in sorted(PAIRS.items())],
            "groups": [[name, cmd] for name, cmd, _ in GROUP_CALLS], "env": GROUP_CALLS[0][2]}


@mp.program("close_link")
def _close_link(context, comm, payload):
    """Rank payload["rank"] closes its command connection and holds the command for payload["seconds"] (a rank
    whose connection ends during a command, its process alive); the others wait in the closing barrier."""
    if context.rank == payload["rank"]:
        import socket
        context.link.sock.shutdown(socket.SHUT_RDWR)
        time.sleep(payload["seconds"])
    return os.getpid()


@mp.program("sum")
def _sum(context, comm, payload):
    """Every rank adds its rank to the payload's (zero) tensor: 0 + 1 + ... + P-1 everywhere."""
    x = payload["x"] * 0 + context.rank
    return comfy.multinpu.all_reduce(x, comm).tolist()


@mp.program("echo")
def _echo(context, comm, payload):
    # the payload came through shared memory to rank 0 and one broadcast to the others: every rank's copy
    # goes back to rank 0 to compare, and rank 0's copy back to the driver
    tensors = payload["tensors"]
    if comm.rank != 0:
        for t in tensors:
            comm.send(t.contiguous(), 0)
        return None
    same = all(torch.equal(comm.recv(torch.empty_like(t), r), t) for r in range(1, comm.world_size) for t in tensors)
    return {"tensors": tensors, "same": same, "note": payload["note"]}


@mp.program("big")
def _big(context, comm, payload):
    """A result of payload["mib"] MiB from rank 0 (the shared-memory hand-off of a decoded video)."""
    comfy.multinpu.barrier(comm)
    return torch.full((payload["mib"] << 18,), 1.5) if comm.rank == 0 else None


@mp.program("fail")
def _fail(context, comm, payload):
    """`steps` all_reduces on every rank (the blocks of a forward); rank payload["rank"] fails at step `at`."""
    steps, at = payload.get("steps", 1), payload.get("at", 0)
    for step in range(steps):
        if step == at and context.rank == payload["rank"]:
            kind = payload["kind"]
            if kind == "oom":
                raise torch.OutOfMemoryError(f"tried to allocate {payload.get('bytes', 1 << 40)} bytes")
            if kind == "exit":
                os._exit(7)
            if kind == "sleep":
                time.sleep(payload["seconds"])
            else:
                raise ValueError(f"injected failure on rank {context.rank} at step {step}")
        comfy.multinpu.all_reduce(torch.ones(4), comm)
    return os.getpid()


@mp.program("stall_after")
def _stall_after(context, comm, payload):
    """Rank payload["rank"] holds payload["seconds"] after the command's closing barrier (its result is in, the
    driver goes on): it reads no command meanwhile, its heartbeat beating (a rank hung between commands)."""
    if context.rank == payload["rank"]:
        return mp.After(lambda: time.sleep(payload["seconds"]))
    return os.getpid()


@mp.program("slow")
def _slow(context, comm, payload):
    """`steps` all_reduces; before each, rank payload["rank"] computes for payload["seconds"] (a slow rank that keeps
    reaching its collectives: its peers wait for it in each)."""
    for _ in range(payload["steps"]):
        if context.rank == payload["rank"]:
            time.sleep(payload["seconds"])
        comfy.multinpu.all_reduce(torch.ones(4), comm)
    return os.getpid()


@mp.program("stuck")
def _stuck(context, comm, payload):
    """Every rank enters a collective that never completes (a stand-in for an HCCL collective stuck on a broken
    link: the process comm's own bookkeeping, a wait with the GIL released inside), its heartbeat beating."""
    comfy.multinpu.all_reduce(torch.ones(4), comm)
    comm._call("all_reduce", lambda group=None: time.sleep(payload["seconds"]))
    return os.getpid()


@mp.program("blocked_stats")
def _blocked_stats(context, comm, payload):
    """Every rank computes for payload["seconds"] holding its allocator's mutex (a device sync during an OOM retry):
    a call of the memory stats waits for it meanwhile. Then one all_reduce."""
    import threading
    import comfy.multinpu_clock as clock
    mutex = threading.Lock()
    real = clock.memory_stats

    def stats(device, reset_peak=False):
        with mutex:
            return real(device, reset_peak)
    for module in (clock, comfy.multinpu):
        module.memory_stats = stats
    try:
        with mutex:
            time.sleep(payload["seconds"])
    finally:
        for module in (clock, comfy.multinpu):
            module.memory_stats = real
    comfy.multinpu.all_reduce(torch.ones(4), comm)
    return os.getpid()


@mp.program("blob")
def _blob(context, comm, payload):
    """A command whose header is big (payload["blob"] bytes travel in the pickle, not through shared memory)."""
    comfy.multinpu.all_reduce(torch.ones(4), comm)
    return len(payload["blob"])


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
    seconds = payload.get("load_seconds", 0)  # a model read from disk (after the command's closing barrier)
    time.sleep(seconds.get(context.rank, seconds.get("others", 0)) if isinstance(seconds, dict) else seconds)
    return _Held(digest)


@mp.program("uses_config")
def _uses_config(context, comm, payload):
    held = context.configs[payload["id"]]
    return comfy.multinpu.all_reduce(torch.tensor([float(len(held.digest))]), comm).item()


@mp.program("freed")
def _freed(context, comm, payload):
    """How often each rank was asked to free its models (context.free), and the configurations it holds."""
    counts = comfy.multinpu.all_gather_flat(torch.tensor([float(len(context.freed))]), comm)  # [P]
    return {"freed": [int(c) for c in counts.tolist()], "configs": len(context.configs)}


def main():
    wire.die_with_parent()
    spec = wire.GroupSpec.from_json(os.environ[wire.GROUP_ENV])
    rank = int(os.environ[wire.RANK_ENV])
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s", stream=sys.stdout)
    freed = []
    context = mp.WorkerContext(spec, rank, "cpu")
    CONTEXT.append(context)
    context.free = lambda: freed.append(time.time())
    context.freed = freed
    mp.serve(context)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
