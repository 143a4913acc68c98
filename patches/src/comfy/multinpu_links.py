"""The collectives' links on HCCL and NCCL (issue 45): the HCCL settings a worker forms its groups with, each
group's buffer size, the join's warm-up of every link the programs use, and what a worker does before it takes a
device (core dumps, a predecessor's memory). docs/multinpu.md, "Links, buffers and the HCCL settings in force".

UNMEASURED ON HARDWARE: only HCCL reads the HCCL_* variables and the pg_options; on the CPU (gloo) the tests read
what an NPU worker would get, and the warm-up runs the same collectives and pairs on gloo.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import time

import torch

HCCL_PORT_ENV = "H3KIT_HCCL_BASE_PORT"  # the first port of this server's band (h3kit.group.hccl_band: one per server)
HCCL_PORT_START = 60000              # HCCL's own default HCCL_IF_BASE_PORT
HCCL_PORTS = 16                      # ports HCCL may take from its base port (one per device of a host; CANN docs)
HCCL_PORT_SLOTS = 16                 # generations before a base port comes round again: a band of 256 ports
# CANN's ranges (H3_FACTS 8, 14): HCCL_EXEC_TIMEOUT in [68, 17340] s, rounded down to a multiple of 68 (on A2 a value
# under 68 rounds to 0: no timeout at all); HCCL_CONNECT_TIMEOUT in [120, 7200] s, whose real wait is the value + 20 s
EXEC_RANGE = (68, 17340)
CONNECT_RANGE = (120, 7200)
CONNECT_SLACK = 20
CONNECT_TARGET = 600                 # torch_npu's advice for send/recv pairs whose two sides call far apart
BUFFSIZE_ENV = "H3KIT_HCCL_BUFFSIZE"  # "GROUP[,SIDE]" MB per communicator (h3kit plan prints the line)
CORE_ENV = "H3KIT_WORKER_CORE_DUMPS"  # 1: a worker keeps the core dump limit it inherited
MEMORY_WAIT_ENV = "H3KIT_REPLACEMENT_MEMORY_WAIT"  # seconds a replacement waits for its device's memory (120)
MEMORY_FRACTION_ENV = "H3KIT_REPLACEMENT_FREE_FRACTION"  # of the device's memory that must be free (0.5)
REPLACEMENT_ENV = "H3KIT_REPLACEMENT"  # set by the launcher on a worker that replaces a dead one


def _error(message: str):
    from comfy.multinpu_wire import GroupError  # the runtime's error type (imported late: the wire imports this)
    return GroupError(message)


def hccl_exec_timeout(timeout: float) -> int:
    """HCCL_EXEC_TIMEOUT for a group timeout: the largest multiple of 68 below it, at least 68. Below the group's own
    timeout, as torch_npu's ProcessGroupHCCL advises, so HCCL times out first and writes its own diagnostics."""
    return min(EXEC_RANGE[1], max(EXEC_RANGE[0], (math.ceil(timeout) - 1) // 68 * 68))


def hccl_base_port(generation: int) -> int:
    """HCCL_IF_BASE_PORT of a generation: one slot of HCCL_PORTS per generation in the band from H3KIT_HCCL_BASE_PORT,
    round and round, so a replacement generation never meets the lingering listeners of the last ones (EJ0003)."""
    start = int(os.environ.get(HCCL_PORT_ENV) or HCCL_PORT_START)
    if not 1024 <= start <= 65535 - HCCL_PORTS * HCCL_PORT_SLOTS:
        raise _error(f"MultiNPU: {HCCL_PORT_ENV}={start} leaves no band of {HCCL_PORTS * HCCL_PORT_SLOTS} ports. "
                     f"Fix: a port from 1024 to {65535 - HCCL_PORTS * HCCL_PORT_SLOTS}")
    return start + (max(1, generation) - 1) % HCCL_PORT_SLOTS * HCCL_PORTS


def _int_setting(name: str, value: str, lo: int, hi: int, why: str) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        n = None
    if n is None or not lo <= n <= hi:
        raise _error(f"MultiNPU: {name}={value!r} is refused: {why}. Fix: a whole number of seconds from {lo} to {hi}, "
                     f"or unset it (h3kit sets it from the group timeout)")
    return n


def hccl_timeouts(timeout: float, environ=None) -> dict:
    """{"HCCL_EXEC_TIMEOUT", "HCCL_CONNECT_TIMEOUT"} for a group timeout, an operator's values kept when valid. In
    order: HCCL_CONNECT_TIMEOUT + 20 s (its real wait) <= HCCL_EXEC_TIMEOUT < the group timeout, so a link that cannot
    form fails first, by HCCL's own connect error naming the link, then a task HCCL waits on, then the group. Defaults:
    the exec timeout as hccl_exec_timeout(), the connect timeout 600 s (torch_npu's advice) or less to keep the order,
    at least 120. An operator's value out of CANN's range (an exec timeout under 68 s rounds to 0 on A2: no timeout)
    or out of order is refused."""
    env = os.environ if environ is None else environ
    exec_chosen, conn_chosen = env.get("HCCL_EXEC_TIMEOUT"), env.get("HCCL_CONNECT_TIMEOUT")
    exec_s = (_int_setting("HCCL_EXEC_TIMEOUT", exec_chosen, *EXEC_RANGE, "HCCL takes 68 to 17340 s, and on Atlas A2 "
                           "a value under 68 rounds down to 0, which turns HCCL's own timeout off")
              if exec_chosen else hccl_exec_timeout(timeout))
    exec_s = exec_s // 68 * 68  # what HCCL uses
    conn = (_int_setting("HCCL_CONNECT_TIMEOUT", conn_chosen, *CONNECT_RANGE, "HCCL takes 120 to 7200 s")
            if conn_chosen else max(CONNECT_RANGE[0], min(CONNECT_TARGET, exec_s - CONNECT_SLACK)))
    if (exec_chosen or conn_chosen) and not conn + CONNECT_SLACK <= exec_s < timeout:
        raise _error(f"MultiNPU: HCCL_CONNECT_TIMEOUT {conn} s (+{CONNECT_SLACK} s), HCCL_EXEC_TIMEOUT {exec_s} s (a "
                     f"multiple of 68) and the group timeout {timeout:g} s are out of order. Fix: connect + "
                     f"{CONNECT_SLACK} <= exec < group timeout (unset both and h3kit keeps the order)")
    return {"HCCL_EXEC_TIMEOUT": exec_s, "HCCL_CONNECT_TIMEOUT": conn}


def hccl_environment(spec, generation: int) -> dict:
    """What a worker sets before it forms generation `generation`: its own HCCL ports, the timeouts in order
    (hccl_timeouts) and HCCL_ASYNC_ERROR_HANDLING explicitly (1: HCCL's watchdog ends a rank whose collective failed;
    an operator's value is kept). HCCL_IF_IP / HCCL_SOCKET_IFNAME (several hosts) are the operator's, inherited."""
    env = {"HCCL_IF_BASE_PORT": str(hccl_base_port(generation))}
    env.update({k: str(v) for k, v in hccl_timeouts(spec.timeout).items()})
    env["HCCL_ASYNC_ERROR_HANDLING"] = os.environ.get("HCCL_ASYNC_ERROR_HANDLING") or "1"
    return env


def check(spec):
    """At the driver's start: refuse HCCL settings a worker would fail on, and warn where the defaults cannot keep
    the order (a group timeout too short for HCCL's least values)."""
    hccl_timeouts(spec.timeout)
    buffer_sizes()
    t = hccl_timeouts(spec.timeout, {})
    if spec.device_type == "npu" and not t["HCCL_CONNECT_TIMEOUT"] + CONNECT_SLACK <= t["HCCL_EXEC_TIMEOUT"] < spec.timeout:
        logging.warning(f"MultiNPU: a group timeout of {spec.timeout:g} s leaves no room for HCCL's least timeouts "
                        f"({t}): HCCL may not report a stuck link or collective first")


# ---- each group's buffer (HCCL_BUFFSIZE per communicator) --------------------------------------------------------

def buffer_sizes(environ=None) -> dict:
    """{"group": MB or None, "side": MB or None} from H3KIT_HCCL_BUFFSIZE="GROUP[,SIDE]" (h3kit plan prints it from
    the largest message of each group); None: HCCL's own (HCCL_BUFFSIZE, else 200 MB)."""
    value = ((os.environ if environ is None else environ).get(BUFFSIZE_ENV) or "").strip()
    if not value:
        return {"group": None, "side": None}
    parts = [p.strip() for p in value.split(",")]
    if len(parts) > 2 or not all(p.isdigit() and 1 <= int(p) <= 65536 for p in parts):
        raise _error(f"MultiNPU: {BUFFSIZE_ENV}={value!r} is refused. Fix: one or two whole numbers of MB (the group's, "
                     f"then the side group's), as `h3kit plan` prints them")
    sizes = [int(p) for p in parts]
    return {"group": sizes[0], "side": sizes[-1]}


def group_options(backend: str, mb):
    """The pg_options that give one group a buffer of `mb` MB: torch_npu's ProcessGroupHCCL.Options with
    hccl_config {"hccl_buffer_size": mb} (torch_npu's "pg_options" guide; it takes precedence over HCCL_BUFFSIZE).
    None where the backend takes no per-group size (gloo; NCCL's NCCL_BUFFSIZE is process-wide) or mb is None."""
    if backend != "hccl" or not mb:
        return None
    try:
        import torch_npu
    except ImportError:
        return None
    options = torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options()
    options.hccl_config = {"hccl_buffer_size": int(mb)}
    return options


# ---- every link at join ------------------------------------------------------------------------------------------

def program_pairs(world: int) -> list:
    """The (src, dst) send/recv pairs the programs use on the main group: every rank to rank 0 (the DiT's last
    gather, comfy.multinpu.gather_v; the VAE's decoded chunks, multinpu_vae; the text encoder's outputs and
    intermediate layer, multinpu_te._forward_rank) and each rank to the next (the text encoder's layer relays,
    multinpu_te._Elsewhere / _HandOver). torch_npu (7.1.0 on) and NCCL make one communicator per unordered pair at
    its first send/recv; the side group of the weight gathers uses none."""
    pairs = [(r, 0) for r in range(1, world)] + [(r, r + 1) for r in range(world - 1)]
    return sorted(set(pairs), key=lambda p: (min(p), max(p), p))


def pair_communicators(world: int) -> dict:
    """{rank: the pair communicators it holds once program_pairs have run} (unordered pairs)."""
    keys = {tuple(sorted(p)) for p in program_pairs(world)}
    return {r: sorted(k for k in keys if r in k) for r in range(world)}


def warm(comm, pairs=()) -> list:
    """Run every kind of collective the programs use on this group once, and send/recv on each pair, checking each
    result: HCCL (and NCCL) connect a group at its first collective and a pair at its first send/recv, so every link
    forms here, at join, not inside a prompt. Pairs run in one global order (deadlock-free with blocking calls).
    Returns what ran."""
    p, r, dev = comm.world_size, comm.rank, comm.device
    ran = []

    def expect(ok, what):
        if not ok:
            raise _error(f"MultiNPU: the join's warm-up {what} on rank {r} of {p} gave a wrong result")
        ran.append(what)
    total = comm.all_reduce(torch.ones(1, device=dev))
    expect(int(total.item()) == p, "all_reduce")
    if p == 1:  # one rank: no link to form
        comm.warmed_pairs = set()
        return ran
    send_rows, recv_rows = [r + 1] * p, [i + 1 for i in range(p)]  # uneven: rank i sends i + 1 rows to everyone
    recv = comm.all_to_all_single(torch.empty(sum(recv_rows), device=dev),
                                  torch.full((p * (r + 1),), float(r), device=dev), recv_rows, send_rows)
    expect(recv.tolist() == [float(i) for i in range(p) for _ in range(i + 1)], "uneven all_to_all")
    expect(comm.all_gather_flat(torch.full((1,), float(r), device=dev)).tolist() == [float(i) for i in range(p)],
           "all_gather")
    for src in sorted({0, p - 1}):
        expect(comm.broadcast(torch.full((1,), float(r), device=dev), src).item() == src, f"broadcast from {src}")
    for a, b in pairs:
        if r == a:
            comm.send(torch.full((1,), float(a), device=dev), b)
        elif r == b:
            expect(comm.recv(torch.empty(1, device=dev), a).item() == a, f"recv {a}->{b}")
    comm.barrier()
    ran.append("barrier")
    comm.warmed_pairs = {tuple(sorted(pair)) for pair in pairs}
    return ran


# ---- before a worker takes its device ----------------------------------------------------------------------------

def limit_core_dumps(environ=None) -> bool:
    """No core dumps from a worker (a dying rank with tens of GB mapped writes them for minutes, onto the disk the
    models live on) unless H3KIT_WORKER_CORE_DUMPS=1. True when the limit was set to 0."""
    if ((os.environ if environ is None else environ).get(CORE_ENV) or "").strip() == "1":
        return False
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    return True


def memory_reader(device):
    """() -> (free, total) bytes of `device` (torch's mem_get_info on npu / cuda); None on the CPU."""
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is None or not hasattr(module, "mem_get_info"):
        return None
    return lambda: module.mem_get_info(device)


def wait_for_memory(read, environ=None, sleep=time.sleep, clock=time.monotonic) -> dict:
    """A replacement's wait for its device's memory to come back from the process it replaces (a driver releases a
    dead process's device memory after it is reaped, not at once): until H3KIT_REPLACEMENT_FREE_FRACTION (0.5) of
    the device is free, at most H3KIT_REPLACEMENT_MEMORY_WAIT (120) s, then on with a warning (its load may fail
    with an OOM, which it reports). read: () -> (free, total). Returns {"waited", "free", "total", "ok"}."""
    env = os.environ if environ is None else environ
    bound = float(env.get(MEMORY_WAIT_ENV) or 120)
    fraction = float(env.get(MEMORY_FRACTION_ENV) or 0.5)
    start = clock()
    while True:
        free, total = read()
        if free >= fraction * total:
            return {"waited": clock() - start, "free": free, "total": total, "ok": True}
        if clock() - start >= bound:
            logging.warning(f"MultiNPU: the device still has only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free "
                            f"after {bound:g} s ({MEMORY_WAIT_ENV}); going on")
            return {"waited": clock() - start, "free": free, "total": total, "ok": False}
        sleep(0.5)


def before_device(device, environ=None) -> dict:
    """What a worker does first (comfy.multinpu_worker): core dumps off unless asked; a replacement waits for its
    device's memory."""
    env = os.environ if environ is None else environ
    out = {"core_dumps_off": limit_core_dumps(env)}
    read = memory_reader(device)
    if env.get(REPLACEMENT_ENV) == "1" and read is not None:
        out["memory"] = wait_for_memory(read, env)
    return out
