"""Collectives for running one model across several devices (sequence and tensor parallelism).

Every function here is called SPMD-style: each rank runs the same code with its own communicator
(`comm`), and a collective returns on every rank once all ranks have called it.

Two transports sit behind one communicator interface:
- ThreadComm: the ranks are threads of one process (ComfyUI is one server process). Data moves by
  peer copies, tensor.to(other_device, copy=True); with every device "cpu" this is the CPU
  simulation used by the tests, where every copy is a real clone so aliasing bugs show.
- ProcessComm: the ranks are processes of a torch.distributed process group (hccl on Ascend, nccl on
  CUDA, gloo on CPU); only the backend name differs between them.

Symbols used in the shape comments: P ranks, r this rank, s_r the rows rank r holds, S = sum of s_r,
B batch, H heads, D head dim. Shards may be uneven (s_r differ); nothing here pads a result.

Nothing waits forever: every wait is bounded by the group's timeout, a rank that raises aborts the
group so the others fail at once, and a rank that stalls makes the others raise CollectiveTimeout
naming it. This module needs torch only (no comfy imports), so it can be tested on its own.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import os
import queue
import threading
import time

import torch
import torch.distributed

try:
    from comfy import multinpu_clock as clock
except ImportError:  # this file loaded on its own by path (unit tests without ComfyUI): its sibling, the same way
    import importlib.util as _util
    import sys as _sys
    _spec = _util.spec_from_file_location("h3kit_multinpu_clock", os.path.join(os.path.dirname(__file__),
                                                                               "multinpu_clock.py"))
    clock = _sys.modules.get(_spec.name)
    if clock is None:
        clock = _sys.modules[_spec.name] = _util.module_from_spec(_spec)
        _spec.loader.exec_module(clock)

# Long enough for the slowest rank to reach the next collective in a real 38k-token H3 forward
# (a block is well under a second); short enough that a hung card surfaces as an error, not a hang.
DEFAULT_TIMEOUT = 300.0
# Test switch: "1" gives the process transport's gloo collectives HCCL's and NCCL's failure semantics, where an
# error, a destroyed group or the death of one rank releases no peer: a collective that fails waits out the
# group's timeout before it raises (gloo itself fails it within milliseconds).
EMULATE_NO_RELEASE_ENV = "H3KIT_EMULATE_NO_RELEASE"


class CollectiveError(RuntimeError):
    """A collective could not complete because another rank failed or the group was aborted."""


class CollectiveTimeout(CollectiveError):
    """A rank did not reach a collective (or finish its work) within the group's timeout."""


# 16-bit partial results are summed in fp32 and rounded once: adding P bf16 partials in bf16 rounds
# after every addition, an error one device (whose matmul accumulates in fp32) never makes
ACCUMULATE_DTYPES = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def _sum_in_rank_order(parts: list, dtype: torch.dtype) -> torch.Tensor:
    """parts[0] + parts[1] + ... in rank order (so every rank gets bit-identical sums), accumulated in fp32
    for 16-bit dtypes, returned in `dtype` (a new tensor)."""
    out = parts[0].to(ACCUMULATE_DTYPES.get(dtype, dtype), copy=True)
    for p in parts[1:]:
        out += p
    return out.to(dtype)


def _add_note(exc: BaseException, note: str):
    # BaseException.add_note is Python 3.11+. On 3.10 the note goes where 3.11 keeps it (__notes__); either
    # way the exception keeps its type, so an OOM on rank 2 still reads as an OOM to ComfyUI's handler
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]


def _stream_sync(device: torch.device):
    # Peer copies read another rank's tensor outside that rank's stream order: the producer must have
    # finished writing it before it is published, and the reader must have finished copying before the
    # producer may reuse the memory.
    if device.type != "cpu":
        torch.get_device_module(device).current_stream(device).synchronize()


def _set_device(device: torch.device):
    if device.type != "cpu" and device.index is not None:
        torch.get_device_module(device).set_device(device)


class ThreadGroup:
    """Rendezvous state shared by P ranks that are threads of one process.

    devices[r] is rank r's device; the same device may appear several times (the CPU simulation is
    ["cpu"] * P). One group serves one SPMD run: once a rank failed or timed out the group stays
    broken and every later collective on it raises at once, so create a new group per run.
    bytes_moved counts the bytes copied between ranks (a rank's own data is not counted), bytes_received[r]
    the part of them that rank r received.
    """

    def __init__(self, devices, timeout: float = DEFAULT_TIMEOUT):
        if len(devices) == 0:
            raise ValueError("ThreadGroup needs at least one device")
        self.devices = [torch.device(d) for d in devices]
        self.world_size = len(self.devices)
        self.timeout = float(timeout)
        self.bytes_moved = 0
        self.bytes_received = [0] * self.world_size
        self._lock = threading.Lock()
        self._mail_cv = threading.Condition(self._lock)
        self._barrier = threading.Barrier(self.world_size)
        self._slots = [None] * self.world_size
        self._progress = [0] * self.world_size
        self._mailbox = collections.defaultdict(collections.deque)
        self._failure = None  # (rank or None, exception): the first failure, which every rank reports

    def comm(self, rank: int) -> ThreadComm:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a group of {self.world_size}")
        return ThreadComm(self, rank)

    def abort(self, rank, exc: BaseException):
        """Break the group: ranks waiting in a collective raise CollectiveError naming `rank`."""
        with self._lock:
            if self._failure is None:
                self._failure = (rank, exc)
            self._mail_cv.notify_all()
        self._barrier.abort()

    def failure(self):
        with self._lock:
            return self._failure

    def run(self, fn, threads: RankThreads = None):
        """Run fn(comm) on every rank and return the P results in rank order.

        Rank 0 runs in the calling thread, ranks 1..P-1 on `threads` (one persistent thread per rank,
        which has set its device). The workers inherit the caller's grad and inference mode, which are
        thread-local in torch. When any rank raises, the others are aborted and the first failure is
        re-raised here (the original exception, so an OOM on rank 2 still reads as an OOM), with a
        note naming the rank. A worker that does not return within the timeout is abandoned and
        reported as stalled.
        """
        if self.world_size == 1:
            return [fn(self.comm(0))]
        if threads is None or threads.world_size != self.world_size:
            raise ValueError(f"ThreadGroup.run: {self.world_size} ranks need a RankThreads of the same size")
        grad = torch.is_grad_enabled()
        inference = torch.is_inference_mode_enabled()

        def rank_main(rank):
            def call():
                try:
                    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                        return fn(self.comm(rank))
                except BaseException as e:
                    self.abort(rank, e)
                    raise
            return call

        for rank in range(1, self.world_size):
            threads.submit(rank, rank_main(rank))
        results = [None] * self.world_size
        errors = {}
        try:
            results[0] = rank_main(0)()
        except BaseException as e:
            errors[0] = e
        for rank in range(1, self.world_size):
            # after rank 0 is done, a healthy worker only has its tail left; a failed group unblocks at once
            try:
                ok, value = threads.result(rank, timeout=self.timeout)
            except queue.Empty:
                stall = CollectiveTimeout(f"rank {rank} ({self.devices[rank]}) did not finish within {self.timeout:g} s")
                self.abort(rank, stall)
                threads.abandon()
                errors[rank] = stall
                continue
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
        if errors:
            failure = self.failure()
            root = failure[1] if failure is not None else errors[min(errors)]
            rank = failure[0] if failure is not None else min(errors)
            if rank is not None and not isinstance(root, CollectiveError):
                _add_note(root, f"raised on rank {rank} ({self.devices[rank]}) of {self.world_size}")
            raise root
        return results

    def _count(self, nbytes: int, rank: int):
        with self._lock:
            self.bytes_moved += nbytes
            self.bytes_received[rank] += nbytes

    def _wait(self, rank: int, op: str):
        try:
            self._barrier.wait(self.timeout)
        except threading.BrokenBarrierError:
            raise self._broken(rank, op) from None

    def _broken(self, rank: int, op: str) -> CollectiveError:
        with self._lock:
            if self._failure is None:
                # nobody aborted: the barrier timed out, so someone never arrived
                mine = self._progress[rank]
                late = [r for r, n in enumerate(self._progress) if n < mine]
                who = ", ".join(f"{r} ({self.devices[r]})" for r in late) or "unknown"
                self._failure = (None, CollectiveTimeout(
                    f"{op}: rank(s) {who} did not reach collective #{mine} within {self.timeout:g} s "
                    "(stalled or died)"))
            failed_rank, exc = self._failure
        if isinstance(exc, CollectiveError):
            # a fresh exception per rank: one object raised in several threads would share a traceback
            return type(exc)(str(exc)) if failed_rank is None else CollectiveError(f"{op} on rank {rank} aborted: {exc}")
        return CollectiveError(f"{op} on rank {rank} aborted: rank {failed_rank} ({self.devices[failed_rank]}) "
                               f"failed with {type(exc).__name__}: {exc}")


class ThreadComm:
    """Rank `rank` of a ThreadGroup: the transport primitives the collectives below are built on."""

    transport = "threads"

    def __init__(self, group: ThreadGroup, rank: int):
        self.group = group
        self.rank = rank
        self.world_size = group.world_size
        self.device = group.devices[rank]

    def _enter(self, op: str):
        g = self.group
        with g._lock:
            g._progress[self.rank] += 1
        if g.failure() is not None:
            raise g._broken(self.rank, op)

    @property
    def bytes_received(self) -> int:
        """Bytes this rank has received from the others so far (its own data excluded)."""
        return self.group.bytes_received[self.rank]

    def _copy_in(self, t: torch.Tensor) -> torch.Tensor:
        # copy=True: on the CPU simulation (and two ranks on one card) .to() would otherwise alias
        self.group._count(t.numel() * t.element_size(), self.rank)
        return t.to(self.device, non_blocking=True, copy=True)

    def _rendezvous(self, op: str, value, take):
        """Publish `value`, let take(slots) copy what this rank needs, and hold `value` until all have copied."""
        g = self.group
        self._enter(op)
        _stream_sync(self.device)
        g._slots[self.rank] = value
        g._wait(self.rank, op)
        out = take(g._slots)
        _stream_sync(self.device)
        g._wait(self.rank, op)
        return out

    def all_gather(self, x: torch.Tensor) -> list:
        """P equal-shape tensors, [i] from rank i, all on this rank's device."""
        return self._rendezvous("all_gather", x, lambda slots: [
            x if i == self.rank else self._copy_in(slots[i]) for i in range(self.world_size)])

    def all_gather_flat(self, x: torch.Tensor, async_op: bool = False):
        """[P * n, ...]: the P equal-shape tensors in rank order, copied straight into one new tensor. async_op:
        (the tensor, a function that returns it), as ProcessComm's; a peer copy waits for both ranks anyway, so
        the tensor is complete when this returns."""
        out = torch.empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=self.device)

        def take(slots):
            for i, part in enumerate(out.chunk(self.world_size)):
                if i != self.rank:
                    self.group._count(x.numel() * x.element_size(), self.rank)
                part.copy_(x if i == self.rank else slots[i], non_blocking=True)
            return out
        out = self._rendezvous("all_gather", x, take)
        return (out, lambda: out) if async_op else out

    def side(self):
        """A communicator for traffic that must not queue behind this one's collectives: with threads, every peer
        copy is its own, so this one serves."""
        return self

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, recv_rows: list, send_rows: list):
        """send's dim-0 blocks (send_rows[j] rows) go to rank j; rank i's block for this rank lands in recv's
        block i (recv_rows[i] rows), copied straight from the sender's buffer (no staging copy)."""
        def take(slots):
            at = 0
            for i, (part, rows) in enumerate(zip(slots, recv_rows)):
                src, src_rows = part
                if src_rows[self.rank] != rows:
                    raise CollectiveError(f"all_to_all: rank {self.rank} expected {rows} rows from rank {i}, "
                                          f"got {src_rows[self.rank]}")
                block = src.narrow(0, sum(src_rows[:self.rank]), rows)
                if i != self.rank:
                    self.group._count(block.numel() * block.element_size(), self.rank)
                recv.narrow(0, at, rows).copy_(block, non_blocking=True)
                at += rows
            return recv
        return self._rendezvous("all_to_all", (send, list(send_rows)), take)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # sum in rank order on every rank, so all ranks hold bit-identical results
        return _sum_in_rank_order(self.all_gather(x), x.dtype)

    def reduce(self, x: torch.Tensor, dst: int):
        def take(slots):
            if self.rank != dst:
                return None
            return _sum_in_rank_order([x if i == dst else self._copy_in(slots[i]) for i in range(self.world_size)],
                                      x.dtype)
        return self._rendezvous("reduce", x, take)

    def gather(self, x: torch.Tensor, dst: int, rows: list):
        """On dst: P tensors, [i] from rank i with rows[i] rows in dim 0; None on the other ranks."""
        def take(slots):
            if self.rank != dst:
                return None
            return [x if i == self.rank else self._copy_in(slots[i]) for i in range(self.world_size)]
        got = self._rendezvous("gather", x, take)
        for i, t in enumerate(got or []):
            if t.shape[0] != rows[i]:
                raise CollectiveError(f"gather: rank {self.rank} expected {rows[i]} rows from rank {i}, "
                                      f"got shape {tuple(t.shape)}")
        return got

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        return self._rendezvous("broadcast", x, lambda slots: x if self.rank == src else self._copy_in(slots[src]))

    def barrier(self):
        self._rendezvous("barrier", None, lambda slots: None)

    def tick(self, label: str):
        """Ranks that are threads have no device progress of their own (the process's is the server's): nothing."""

    def send(self, x: torch.Tensor, dst: int):
        # synchronous send: returns once dst has copied x, so the caller may reuse x afterwards
        g = self.group
        self._enter("send")
        _stream_sync(self.device)
        done = threading.Event()
        with g._lock:
            g._mailbox[(self.rank, dst)].append((x, done))
            g._mail_cv.notify_all()
        deadline = time.monotonic() + g.timeout
        while not done.wait(0.05):
            if g.failure() is not None:
                raise g._broken(self.rank, "send")
            if time.monotonic() > deadline:
                exc = CollectiveTimeout(f"send: rank {dst} ({g.devices[dst]}) did not receive from rank {self.rank} "
                                        f"within {g.timeout:g} s (stalled or died)")
                g.abort(None, exc)
                raise exc

    def recv(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        g = self.group
        self._enter("recv")
        key = (src, self.rank)
        deadline = time.monotonic() + g.timeout
        with g._lock:
            while not g._mailbox[key]:
                if g._failure is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    g._failure = (None, CollectiveTimeout(
                        f"recv: rank {src} ({g.devices[src]}) did not send to rank {self.rank} within {g.timeout:g} s "
                        "(stalled or died)"))
                    g._mail_cv.notify_all()
                    break
                g._mail_cv.wait(left)
            item = g._mailbox[key].popleft() if g._failure is None else None
        if item is None:
            g._barrier.abort()
            raise g._broken(self.rank, "recv")
        x, done = item
        if tuple(x.shape) != tuple(buf.shape) or x.dtype != buf.dtype:
            done.set()
            raise CollectiveError(f"recv: rank {self.rank} expected {tuple(buf.shape)} {buf.dtype} from rank {src}, "
                                  f"got {tuple(x.shape)} {x.dtype}")
        g._count(x.numel() * x.element_size(), self.rank)
        buf.copy_(x, non_blocking=True)
        _stream_sync(self.device)
        done.set()
        return buf


# what this process queued and what its device completed, for its heartbeat (comfy.multinpu_clock)
CollectiveProgress = clock.CollectiveProgress
PROGRESS = clock.PROGRESS
memory_stats = clock.memory_stats
synchronize = clock.synchronize


def tick(comm, label: str):
    """The device advanced without a collective (a DiT block, a VAE decoder block, a text encoder layer): a marker the
    heartbeat reports once the device has done the work queued before it. Ranks that are threads have no own device
    progress (the process's is the server's): ThreadComm.tick does nothing."""
    comm.tick(label)


BEAT_LISTENERS = []     # fn(rank, progress) at each worker beat the driver receives (comfy.multinpu_process)
COMMAND_LISTENERS = []  # fn(program, seconds) after each command that succeeded (comfy.multinpu_runtime_base.run)


def notify(listeners, *args):
    """Call each of `listeners` (monitoring's) with args: one that raises is logged and never fails the caller."""
    for listener in listeners:
        try:
            listener(*args)
        except Exception as e:
            logging.warning(f"MultiNPU: a monitoring listener failed: {e}")


@contextlib.contextmanager
def timed(program: str, installed: dict = None):
    """COMMAND_LISTENERS hear `program`'s seconds when the block ends without an error; with `installed` (a config's
    ranks that hold it) only when the block changed it: a weight install that ran, not one the ranks already held."""
    before, t0 = (None if installed is None else dict(installed)), time.perf_counter()
    yield
    if installed is None or installed != before:
        notify(COMMAND_LISTENERS, program, time.perf_counter() - t0)


VISIBLE_ENVS = ("ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "H3KIT_DEVICES")  # H3KIT_DEVICES: h3kit start's list


def physical_device(local_index: int, environ=None) -> str:
    """The device id the host's tools (npu-smi, npu-exporter, nvidia-smi) give the device this process sees as
    `local_index`: the entry of the visible-devices list the runtime was started with (ASCEND_RT_VISIBLE_DEVICES,
    CUDA_VISIBLE_DEVICES, or the --devices list h3kit start passes as H3KIT_DEVICES, read in that order), else the
    index itself."""
    environ = os.environ if environ is None else environ
    for name in VISIBLE_ENVS:
        items = [x.strip() for x in (environ.get(name) or "").split(",") if x.strip()]
        if items:
            return items[local_index] if 0 <= local_index < len(items) else str(local_index)
    return str(local_index)


class ProcessComm:
    """This process's rank in a torch.distributed process group (hccl, nccl or gloo).

    `group` None means the default group. Ranks passed to send/recv/reduce/broadcast are group-local;
    _global() is the one place they become global ranks. Timeouts come from the process group (set
    them with init_process_comm); errors the backend raises are re-raised as CollectiveError.
    bytes_moved counts the bytes this rank received from the others.
    """

    transport = "process_group"

    def __init__(self, group=None, device=None, timeout: float = DEFAULT_TIMEOUT, parent=None):
        if not torch.distributed.is_initialized():
            raise CollectiveError("ProcessComm: torch.distributed is not initialised (call init_process_comm)")
        self.pg = group
        self.timeout = float(timeout)  # the group's own collective timeout (EMULATE_NO_RELEASE waits it out)
        self.rank = torch.distributed.get_rank(group)
        self.world_size = torch.distributed.get_world_size(group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.bytes_moved = 0
        self._parent = parent     # a side communicator counts its bytes into its parent's
        self._side = None
        self.pairs_used = set()   # the send/recv pairs (low, high) this rank has used on this group
        self.warmed_pairs = None  # those formed at join (comfy.multinpu_links.warm)

    def side(self, options=None):
        """The same ranks on a process group of their own, made once on first use (every rank must call this at
        the same point: making a group is collective). A backend runs one group's collectives in issue order on
        one queue (stream), so the sharded weights' gathers go here, where they do not wait behind the Ulysses
        all-to-alls of the block before (nor those behind them). options: its pg_options (its HCCL buffer)."""
        if self._side is None:
            ranks = (torch.distributed.get_process_group_ranks(self.pg) if self.pg is not None
                     else list(range(self.world_size)))
            extra = {} if options is None else {"pg_options": options}
            pg = self._call("new_group", lambda group=None: torch.distributed.new_group(ranks=ranks, **extra))
            self._side = ProcessComm(pg, self.device, self.timeout, parent=self)
        return self._side

    def _global(self, rank: int) -> int:
        return rank if self.pg is None else torch.distributed.get_global_rank(self.pg, rank)

    def _call(self, op: str, fn, *args, reads: bool = True, **kwargs):
        """Run collective `op` (fn(*args, group=..., **kwargs)) as the device runs it: the host's count moves now, a
        marker before it (the device reached it) and one after it (completed) tell the heartbeat what the device did
        (comfy.multinpu_clock). On the twin it returns at enqueue; the host waits for it when it `reads` the result
        (a barrier does). Returns fn's value, or with reads False on the twin the stream's Work (wait() gives it)."""
        t0 = time.monotonic()
        seq = PROGRESS.enter(op)
        PROGRESS.sample(self.device)
        try:
            clock.DEVICE.before_collective()
            PROGRESS.record(self.device, ("reach", seq, op))
            work = clock.DEVICE.run(lambda: fn(*args, group=self.pg, **kwargs))
            PROGRESS.record(self.device, ("done", seq, op))
            if not reads and clock.DEVICE.stream is not None:
                return work
            return work.wait()
        except RuntimeError as e:
            raise self._failed(op, e, t0) from e
        finally:
            PROGRESS.inside = False

    def _failed(self, op: str, e: RuntimeError, t0: float) -> CollectiveError:
        if os.environ.get(EMULATE_NO_RELEASE_ENV) == "1":
            # HCCL/NCCL semantics on gloo: a peer's error, destroy or death releases nobody; the
            # collective returns only at the group timeout
            time.sleep(max(0.0, t0 + self.timeout - time.monotonic()))
            return CollectiveTimeout(f"{op} on rank {self.rank} of {self.world_size} timed out after "
                                     f"{self.timeout:g} s ({EMULATE_NO_RELEASE_ENV}=1; the backend said: {e})")
        return CollectiveError(f"{op} on rank {self.rank} of {self.world_size} failed: {e}")

    def tick(self, label: str):
        PROGRESS.tick(self.device, label)

    def _count(self, nbytes: int):
        self.bytes_moved += nbytes
        if self._parent is not None:
            self._parent._count(nbytes)

    @property
    def bytes_received(self) -> int:
        return self.bytes_moved

    def all_gather_flat(self, x: torch.Tensor, async_op: bool = False):
        """[P * n, ...]: the P equal-shape tensors in rank order, in one tensor (the backend writes it). async_op:
        (the tensor, a function that waits for it and returns it), so the caller can compute meanwhile."""
        x = x.reshape((1,) + tuple(x.shape)) if x.dim() == 0 else x.contiguous()
        # the concatenated form [P * n, ...]: gloo rejects the stacked one
        out = torch.empty((self.world_size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
        work = self._call("all_gather", gather, out, x, async_op=async_op, reads=not async_op)
        self._count((self.world_size - 1) * x.numel() * x.element_size())
        if not async_op:
            return out

        def wait():
            # on the twin, `work` is its stream's item, which holds the backend's
            self._call("all_gather", lambda group=None: (work.wait() if isinstance(work, clock.Work) else work).wait())
            return out
        return out, wait

    def all_gather(self, x: torch.Tensor) -> list:
        return list(self.all_gather_flat(x).chunk(self.world_size))

    def all_to_all_single(self, recv: torch.Tensor, send: torch.Tensor, recv_rows: list, send_rows: list):
        # the backend writes recv in place: split sizes in rows of dim 0, uneven blocks moved at their own length
        self._call("all_to_all", torch.distributed.all_to_all_single, recv, send.contiguous(),
                   output_split_sizes=list(recv_rows), input_split_sizes=list(send_rows))
        row_bytes = recv[:1].numel() * recv.element_size()
        self._count((sum(recv_rows) - recv_rows[self.rank]) * row_bytes)
        return recv

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # 16-bit partials (the text encoder's tensor-parallel sums) go to the backend's all_reduce in fp32 and are
        # rounded once: a ring all_reduce receives 2 (P-1)/P x 4 bytes an element, where gathering every partial to
        # sum them here received (P-1) x 2 (8x the bytes at 8 ranks: 14 against 3.5)
        acc = ACCUMULATE_DTYPES.get(x.dtype)
        out = x.to(acc, copy=True) if acc is not None else x.clone()
        self._call("all_reduce", torch.distributed.all_reduce, out)
        self._count(2 * (self.world_size - 1) * out.numel() * out.element_size() // self.world_size)
        return out.to(x.dtype) if acc is not None else out

    def reduce(self, x: torch.Tensor, dst: int):
        out = x.to(ACCUMULATE_DTYPES.get(x.dtype, x.dtype), copy=True)
        self._call("reduce", torch.distributed.reduce, out, self._global(dst))
        if self.rank != dst:
            return None
        self._count((self.world_size - 1) * out.numel() * out.element_size())
        return out.to(x.dtype)

    def gather(self, x: torch.Tensor, dst: int, rows: list):
        # point to point: shards of different lengths move at their own length (gather needs equal sizes)
        if self.rank != dst:
            self.send(x, dst)
            return None
        return [x if i == self.rank else self.recv(x.new_empty((rows[i],) + tuple(x.shape[1:])), i)
                for i in range(self.world_size)]

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        out = x.contiguous() if self.rank == src else torch.empty_like(x)
        self._call("broadcast", torch.distributed.broadcast, out, self._global(src))
        if self.rank != src:
            self._count(x.numel() * x.element_size())
        return out

    def barrier(self):
        self._call("barrier", torch.distributed.barrier)

    def _pair(self, peer: int):
        """A send/recv with `peer`: HCCL (torch_npu 7.1.0 on) and NCCL make the pair's communicator at its first use.
        The join warms the programs' pairs (comfy.multinpu_links.warm sets warmed_pairs); one formed after it is
        logged once (docs/multinpu.md, "Links, buffers and the HCCL settings in force")."""
        key = (min(self.rank, peer), max(self.rank, peer))
        if key not in self.pairs_used:
            self.pairs_used.add(key)
            if self.warmed_pairs is not None and key not in self.warmed_pairs:
                logging.warning(f"MultiNPU: rank {self.rank}: send/recv pair {key} was not formed at join: its "
                                f"communicator forms now, inside a command (it may wait for its peer up to "
                                f"HCCL_CONNECT_TIMEOUT)")

    def send(self, x: torch.Tensor, dst: int):
        self._pair(dst)
        # returns at enqueue on the twin (and on a device): nothing to read
        self._call("send", torch.distributed.send, x.contiguous(), self._global(dst), reads=False)

    def recv(self, buf: torch.Tensor, src: int) -> torch.Tensor:
        self._pair(src)
        self._call("recv", torch.distributed.recv, buf, self._global(src))
        self._count(buf.numel() * buf.element_size())
        return buf


def init_process_comm(backend: str, init_method: str, rank: int, world_size: int, device=None,
                      timeout: float = DEFAULT_TIMEOUT) -> ProcessComm:
    """Join the default process group and return this rank's communicator.

    backend is "hccl" on Ascend, "nccl" on CUDA, "gloo" on CPU; init_method e.g. "file:///tmp/rdv" or
    "env://". timeout (seconds) bounds every collective: a peer that stalls or dies makes this rank
    raise CollectiveError instead of waiting forever.
    """
    if device is not None:
        _set_device(torch.device(device))
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                         timeout=datetime.timedelta(seconds=timeout))
    return ProcessComm(device=device)


class RankThreads:
    """One persistent worker thread per rank 1..P-1 (rank 0 is the caller's thread).

    Each worker sets its device once when it starts (set_device, default torch's device module), so
    per-device kernel caches stay warm across forwards; work and results travel through queues as
    (ok, value) pairs, never as exceptions crossing threads. After abandon() (a worker stalled) the
    pool is `broken` and its owner should make a new one.
    """

    def __init__(self, devices, set_device=None, name="multinpu"):
        self.devices = [torch.device(d) for d in devices]
        self.world_size = len(self.devices)
        self.broken = False
        self._set_device = set_device or _set_device
        self._work = {}
        self._results = {}
        self._threads = []
        for rank in range(1, self.world_size):
            self._work[rank] = queue.Queue()
            self._results[rank] = queue.Queue()
            t = threading.Thread(target=self._loop, args=(rank,), name=f"{name}-rank{rank}", daemon=True)
            t.start()
            self._threads.append(t)

    def _loop(self, rank: int):
        work, results = self._work[rank], self._results[rank]
        try:
            self._set_device(self.devices[rank])
        except Exception as e:
            logging.error(f"MultiNPU: failed to set device {self.devices[rank]} for rank {rank}: {e}")
            while (item := work.get()) is not None:
                results.put((False, e))
            return
        while (item := work.get()) is not None:
            try:
                results.put((True, item()))
            except BaseException as e:
                results.put((False, e))

    def submit(self, rank: int, fn):
        if self.broken:
            raise CollectiveError("RankThreads: a worker stalled earlier; create a new pool")
        self._work[rank].put(fn)

    def result(self, rank: int, timeout: float):
        """(ok, value) of the oldest submitted call on `rank`; raises queue.Empty after `timeout` seconds."""
        return self._results[rank].get(timeout=timeout)

    def abandon(self):
        # a stalled worker cannot be killed; it exits on its own once it hits the broken group
        self.broken = True
        self.shutdown()

    def shutdown(self):
        for q in self._work.values():
            q.put(None)

    def join(self, timeout: float) -> bool:
        """After shutdown: wait up to `timeout` seconds in all for the workers to exit; True when all did."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


# ---- collectives: one function each, built on the transport primitives above --------------------

def shard_sizes(total: int, world_size: int) -> list:
    """Rows per rank when `total` rows are split into contiguous shards: the first total % P ranks get one more."""
    base, extra = divmod(total, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def _exchange_sizes(n: int, comm) -> list:
    local = torch.tensor([n], dtype=torch.int64, device=comm.device)
    return [int(t.item()) for t in comm.all_gather(local)]


def _shard_sizes_of(x: torch.Tensor, comm, sizes, dim: int, op: str):
    """(dim normalised, the P shard sizes as ints): exchanged when not given, checked against x."""
    dim = dim % x.dim()
    if sizes is None:
        sizes = _exchange_sizes(x.shape[dim], comm)
    sizes = [int(n) for n in sizes]
    assert len(sizes) == comm.world_size, f"{op}: {len(sizes)} sizes for {comm.world_size} ranks"
    assert x.shape[dim] == sizes[comm.rank], (
        f"{op}: rank {comm.rank} holds x {tuple(x.shape)}, {x.shape[dim]} rows in dim {dim}, "
        f"but sizes[{comm.rank}] = {sizes[comm.rank]}")
    return dim, sizes


def all_gather_v(x: torch.Tensor, comm, sizes=None, dim: int = 0) -> torch.Tensor:
    """Gather uneven shards along `dim`: [.., s_r, ..] on rank r -> [.., S, ..] on every rank, in rank order.

    sizes: the P values s_r if the caller knows them (else they are exchanged first). Portable on every
    backend: each rank pads its shard to max(s) rows, an equal-size all-gather moves P * max(s) rows,
    and the padding is trimmed before concatenating. World size 1 returns x.
    """
    if comm.world_size == 1:
        return x
    dim, sizes = _shard_sizes_of(x, comm, sizes, dim, "all_gather_v")
    rows = x.movedim(dim, 0)                                               # [s_r, ...]
    pad = max(sizes) - sizes[comm.rank]
    if pad:
        rows = torch.cat([rows, rows.new_zeros((pad,) + tuple(rows.shape[1:]))])  # [max s, ...]
    parts = comm.all_gather(rows.contiguous())                             # P x [max s, ...]
    out = torch.cat([p[:n] for p, n in zip(parts, sizes)])                 # [S, ...]
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_gather_flat(x: torch.Tensor, comm) -> torch.Tensor:
    """Equal shards concatenated in rank order on every rank: [n, ...] on each -> [P * n, ...] (one new tensor).

    The DiT's sharded weights: each rank holds one equal slice of a block's bytes. World size 1 returns x.
    """
    return all_gather_flat_start(x, comm)()


def all_gather_flat_start(x: torch.Tensor, comm):
    """all_gather_flat issued now and awaited later: returns a function that waits and returns [P * n, ...].

    Processes: the backend's asynchronous collective (the caller computes while it moves; on gloo a thread of
    the backend's, on hccl/nccl the group's stream); threads: done before this returns (a peer copy waits for
    both ranks anyway). Each communicator says which (all_gather_flat's async_op).
    """
    if comm.world_size == 1:
        return lambda: x
    return comm.all_gather_flat(x.contiguous(), async_op=True)[1]


def gather_v(x: torch.Tensor, comm, sizes=None, dst: int = 0, dim: int = 0):
    """Gather uneven shards onto one rank: [.., s_r, ..] on rank r -> [.., S, ..] on dst, None on the others.

    sizes: the P values s_r if the caller knows them (else they are exchanged first). Each shard moves
    once, at its own length (no padding): S - s_dst rows arrive on dst. World size 1 returns x.
    """
    if comm.world_size == 1:
        return x
    dim, sizes = _shard_sizes_of(x, comm, sizes, dim, "gather_v")
    parts = comm.gather(x.movedim(dim, 0).contiguous(), dst, sizes)    # on dst: P x [s_i, ...]
    if parts is None:
        return None
    out = torch.cat(parts)                                                 # [S, ...]
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def all_to_all_scatter_heads(xs, comm, seq_sizes):
    """Ulysses, before attention: each x [B, H, s_r, D] -> [B, H/P, S, D] (scatter heads, gather sequence).

    xs: one tensor, or several of one shape (q, k, v) exchanged together in one all-to-all; returns the same
    kind. Rank r ends up with heads r*H/P .. (r+1)*H/P - 1 over the whole sequence. seq_sizes are the P values
    s_r (uneven shards are exact: the transport moves each shard at its own length). Two full copies of the
    inputs, as yunchang's all-to-all: the send buffer, packed straight from x, and the receive buffer the
    transport writes. The results are views of the receive buffer ([S, n, B, H/P, D] underneath, so not
    contiguous); attention reads them through their strides.
    """
    single = isinstance(xs, torch.Tensor)
    xs = [xs] if single else list(xs)
    if comm.world_size == 1:
        return xs[0] if single else xs
    b, h, s, d = xs[0].shape
    p = comm.world_size
    assert h % p == 0, f"all_to_all_scatter_heads: {h} heads do not split over {p} ranks (x {tuple(xs[0].shape)})"
    assert s == seq_sizes[comm.rank], (
        f"all_to_all_scatter_heads: rank {comm.rank} holds x {tuple(xs[0].shape)} but seq_sizes[{comm.rank}] = {seq_sizes[comm.rank]}")
    assert all(x.shape == xs[0].shape for x in xs), f"all_to_all_scatter_heads: shapes differ {[tuple(x.shape) for x in xs]}"
    hp, n = h // p, len(xs)
    send = xs[0].new_empty((p, s, n, b, hp, d))                             # block j -> rank j: [s_r, n, B, H/P, D]
    for i, x in enumerate(xs):
        send[:, :, i].copy_(x.unflatten(1, (p, hp)).permute(1, 3, 0, 2, 4))  # [B, P, H/P, s_r, D] -> [P, s_r, B, H/P, D]
    recv = xs[0].new_empty((sum(seq_sizes), n, b, hp, d))                  # block i <- rank i: [s_i, n, B, H/P, D]
    comm.all_to_all_single(recv, send.view(p * s, n, b, hp, d), list(seq_sizes), [s] * p)
    out = [recv[:, i].permute(1, 2, 0, 3) for i in range(n)]               # n x [B, H/P, S, D] views
    return out[0] if single else out


def all_to_all_gather_heads(x: torch.Tensor, comm, seq_sizes) -> torch.Tensor:
    """Ulysses, after attention: [B, S, H/P, D] -> [B, s_r, H, D] (scatter sequence, gather heads).

    The inverse of all_to_all_scatter_heads: heads come back in rank order, so head blocks land where
    they started. Two full copies: the receive buffer and the heads put back in place (rank i's block holds
    heads i*H/P.. of this rank's rows, so the [s_r, H] layout needs one rearrangement); the send buffer is x
    itself when B is 1 (H3's batch), else one more copy.
    """
    if comm.world_size == 1:
        return x
    b, s, hp, d = x.shape
    p = comm.world_size
    assert s == sum(seq_sizes), f"all_to_all_gather_heads: x {tuple(x.shape)} has {s} rows, seq_sizes sum to {sum(seq_sizes)}"
    send = x.transpose(0, 1).contiguous()                                   # [S, B, H/P, D]: a view when B == 1
    r_rows = seq_sizes[comm.rank]
    recv = x.new_empty((p * r_rows, b, hp, d))                              # block i <- rank i: [s_r, B, H/P, D]
    comm.all_to_all_single(recv, send, [r_rows] * p, list(seq_sizes))
    # [P, s_r, B, H/P, D] -> [B, s_r, P, H/P, D] -> [B, s_r, H, D]
    return recv.view(p, r_rows, b, hp, d).permute(2, 1, 0, 3, 4).reshape(b, r_rows, p * hp, d)


def peer_copy(x: torch.Tensor, comm, src: int, dst: int):
    """Move a tensor from rank src to rank dst.

    On src, x is the data (returned unchanged once dst has it); on dst, x is the receive buffer (its
    shape and dtype must match), filled and returned; other ranks return None without waiting.
    """
    if src == dst:
        return x if comm.rank == src else None
    if comm.rank == src:
        comm.send(x, dst)
        return x
    if comm.rank == dst:
        return comm.recv(x, src)
    return None


def all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    """Sum over ranks: [...] on every rank -> [...] sum on every rank (a new tensor; x is unchanged)."""
    if comm.world_size == 1:
        return x
    return comm.all_reduce(x)


def reduce(x: torch.Tensor, comm, dst: int = 0):
    """Sum over ranks onto rank dst: returns the [...] sum on dst, None on the other ranks."""
    if comm.world_size == 1:
        return x
    return comm.reduce(x, dst)


def broadcast(x: torch.Tensor, comm, src: int = 0) -> torch.Tensor:
    """Rank src's x on every rank: src gets x back, the others a copy (their own x is ignored)."""
    if comm.world_size == 1:
        return x
    return comm.broadcast(x, src)


def barrier(comm):
    if comm.world_size > 1:
        comm.barrier()
