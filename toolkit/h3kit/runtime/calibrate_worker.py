"""Calibration measurements on the devices themselves, run inside the ComfyUI interpreter.

    python calibrate_worker.py --comfy-home DIR --config JSON --out FILE

`h3kit calibrate` starts this script (h3kit.runtime.calibration builds the config and analyses what it
writes). It uses the installed tree's own code: comfy/multinpu.py for every transfer (the thread
transport the server runs today, and ProcessComm over torch.distributed: hccl, nccl or gloo) and
comfy/ldm/minimax/model.py's DiTBlock for the compute. Four stages, in this order:

process  N real processes (forked on cpu before any torch op, spawned on accelerators) join one group;
         for each tier n >= 2 a subgroup of ranks 0..n-1 times the DiT's three collectives at the
         message sizes h3kit plan predicts (costmodel.exchange_messages): the Ulysses q/k/v all-to-all,
         the output all-to-all, the final gather of the hidden states onto rank 0. Skipped where ranks would
         share a card (H3KIT_SIM_DEVICES on an accelerator: NCCL and HCCL need one device per rank).
copy     thread transport: a buffer copied between every ordered pair of devices, one pair at a time,
         then every device copying to its ring neighbour at once (the same buffer: bandwidth under
         concurrency), for every tier.
threads  the three collectives again, on the thread transport.
block    one DiTBlock with random weights at the configured width, timed on rank 0's device at each
         tier's shard: n = 1 runs the block on the whole sequence; n > 1 runs it on the shard s_r with an
         attention override that does what one Ulysses rank computes (S queries over S keys for H/n
         heads, q/k/v tiled from the shard: the exchange itself is timed by the stages above).

Every timing is the median of `repeats` after one warm-up, with the device synchronised around it; a
collective's time is the slowest rank's. It imports nothing of h3kit but the pure-Python cost model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from h3kit.runtime import costmodel  # h3kit reaches this interpreter through PYTHONPATH (worker.run)

SIM_DEVICES_ENV = "H3KIT_SIM_DEVICES"


def _dtype(torch, cfg):
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg["dtype"]]


def _sync(torch, device):
    if torch.device(device).type != "cpu":
        torch.get_device_module(device).synchronize(device)


def _model_cfg(cfg):
    d = cfg["dims"]
    return dict(costmodel.H3, blocks=1, hidden=d["hidden"], heads=d["heads"], head_dim=d["head_dim"], ffn=d["ffn"])


def _timed(torch, device, repeats, fn, before=None):
    """Median seconds of fn() over `repeats` runs after a warm-up; before() runs untimed ahead of each."""
    times = []
    for i in range(repeats + 1):
        arg = before() if before else None
        _sync(torch, device)
        t0 = time.perf_counter()
        fn(arg) if before else fn()
        _sync(torch, device)
        if i:
            times.append(time.perf_counter() - t0)
    return times


# ---- collectives (both transports) --------------------------------------------------------------------

def time_collectives(comm, torch, mn, cfg, geometry):
    """Per op, this rank's seconds per repeat and the bytes its transport counted, for one tier's messages."""
    m = costmodel.exchange_messages(geometry["seq_len"], comm.world_size, _model_cfg(cfg))
    sizes, r, dtype, dev = m["sizes"], comm.rank, _dtype(torch, cfg), comm.device
    d = cfg["dims"]
    hp = d["heads"] // comm.world_size
    qkv = torch.randn(3, d["heads"], sizes[r], d["head_dim"], device=dev, dtype=dtype)   # [3B, H, s_r, D]
    out = torch.randn(1, geometry["seq_len"], hp, d["head_dim"], device=dev, dtype=dtype)  # [B, S, H/P, D]
    h = torch.randn(sizes[r], d["hidden"], device=dev, dtype=dtype)                       # [s_r, hidden]
    ops = {"scatter": lambda: mn.all_to_all_scatter_heads(list(qkv.unsqueeze(1)), comm, sizes),
           "gather": lambda: mn.all_to_all_gather_heads(out, comm, sizes),
           "final": lambda: mn.gather_v(h, comm, sizes=sizes, dst=0)}
    rows = []
    for op, fn in ops.items():
        counter = comm.group if hasattr(comm, "group") else comm   # threads count per group, processes per rank
        fn()
        mn.barrier(comm)
        before = counter.bytes_moved
        mn.barrier(comm)  # every rank has read the counter before anyone moves bytes again
        times = []
        for _ in range(cfg["repeats"]):
            _sync(torch, dev)
            mn.barrier(comm)
            t0 = time.perf_counter()
            fn()
            _sync(torch, dev)
            times.append(time.perf_counter() - t0)
        mn.barrier(comm)
        counted = (counter.bytes_moved - before) // cfg["repeats"]
        rows.append({"op": op, "world": comm.world_size, "geometry": geometry["name"], "times": times,
                     "bytes_counted": counted, "counted_for": "group" if counter is not comm else "rank"})
    return rows


def _merge_ranks(per_rank):
    """Rows of every rank -> one row per op with the slowest rank's time per repeat (median of those)."""
    merged = []
    for rows in zip(*per_rank):
        row = dict(rows[0])
        slowest = [max(ts) for ts in zip(*(r["times"] for r in rows))]
        row["seconds"] = statistics.median(slowest)
        row["bytes_counted"] = rows[0]["bytes_counted"]
        del row["times"]
        merged.append(row)
    return merged


def _process_rank(rank, world, cfg, comfy_home, rdv, conn):
    try:
        sys.path.insert(0, comfy_home)
        import torch
        import torch.distributed
        import comfy.multinpu as mn
        device = "cpu" if cfg["device_type"] == "cpu" else f"{cfg['device_type']}:{rank}"
        mn.init_process_comm(cfg["backend"], f"file://{rdv}", rank, world, device=device,
                             timeout=cfg["collective_timeout"])
        rows = []
        for n in [t for t in cfg["tiers"] if t > 1]:
            group = torch.distributed.new_group(list(range(n)))  # every rank takes part in creating it
            if rank < n:
                comm = mn.ProcessComm(group=group, device=device)
                for geometry in cfg["geometries"]:
                    rows.append({"world": n, "geometry": geometry["name"],
                                 "rows": time_collectives(comm, torch, mn, cfg, geometry)})
        conn.send({"ok": True, "rows": rows})
    except BaseException as e:
        conn.send({"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    finally:
        conn.close()


def process_stage(cfg, comfy_home, simulated):
    if max(cfg["tiers"]) < 2:
        return {"skipped": "one device: nothing to exchange"}
    if simulated and cfg["device_type"] != "cpu":
        return {"skipped": f"{SIM_DEVICES_ENV} puts every rank on one {cfg['device_type']} card; "
                           f"{cfg['backend']} needs one card per rank"}
    world = max(cfg["tiers"])
    # fork is safe before any torch op and costs milliseconds; accelerator runtimes need a fresh process
    ctx = multiprocessing.get_context("fork" if cfg["device_type"] == "cpu" else "spawn")
    tmp = tempfile.mkdtemp(prefix="h3kit-calibrate-rdv-")
    procs, conns = [], []
    try:
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_process_rank, args=(rank, world, cfg, comfy_home, os.path.join(tmp, "rdv"), child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        end = time.monotonic() + cfg["stage_timeout"]
        answers = []
        for p, conn in zip(procs, conns):
            got = conn.recv() if conn.poll(max(0.0, end - time.monotonic())) else None
            answers.append(got or {"ok": False, "error": "no answer before the deadline (hung or died)"})
        for p in procs:
            p.join(max(0.0, min(10.0, end - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():  # only the ranks this stage started
                p.terminate()
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join(2.0)
        shutil.rmtree(tmp, ignore_errors=True)
    failed = [(r, a) for r, a in enumerate(answers) if not a["ok"]]
    if failed:
        rank, a = failed[0]
        raise RuntimeError(f"process transport ({cfg['backend']}), rank {rank}: {a['error']}\n{a.get('traceback', '')}")
    rows = []
    for entry in answers[0]["rows"]:  # rank 0 takes part in every tier
        per_rank = [next(e["rows"] for e in answers[r]["rows"] if (e["world"], e["geometry"]) ==
                         (entry["world"], entry["geometry"])) for r in range(entry["world"])]
        rows += _merge_ranks(per_rank)
    return {"backend": cfg["backend"], "rows": rows}


# ---- thread transport ---------------------------------------------------------------------------------

def _thread_run(mn, devices, fn, timeout):
    threads = mn.RankThreads(devices, name="calibrate")
    try:
        return mn.ThreadGroup(devices, timeout=timeout).run(fn, threads)
    finally:
        threads.shutdown()


def copy_stage(torch, mn, cfg, devices):
    n_floats = cfg["copy_bytes"] // 4

    def timed_copy(send):
        def fn(comm):
            x = torch.randn(n_floats, device=comm.device)
            times = []
            for i in range(cfg["repeats"] + 1):
                _sync(torch, comm.device)
                mn.barrier(comm)
                t0 = time.perf_counter()
                send(comm, x)
                _sync(torch, comm.device)
                if i:
                    times.append(time.perf_counter() - t0)
            return times
        return fn

    def pair(comm, x):
        mn.peer_copy(x, comm, 0, 1)

    def ring(comm, x):
        p, r = comm.world_size, comm.rank
        # x goes to the next rank, the previous rank's x arrives: one all-to-all whose other blocks are empty
        comm.all_to_all_single(torch.empty_like(x), x, [n_floats if i == (r - 1) % p else 0 for i in range(p)],
                               [n_floats if j == (r + 1) % p else 0 for j in range(p)])

    pairs = []
    for i, j in itertools.permutations(range(len(devices)), 2):
        per_rank = _thread_run(mn, [devices[i], devices[j]], timed_copy(pair), cfg["collective_timeout"])
        pairs.append({"src": i, "dst": j, "bytes": 4 * n_floats,
                      "seconds": statistics.median(max(ts) for ts in zip(*per_rank))})
    rings = []
    for n in [t for t in cfg["tiers"] if t > 1]:
        per_rank = _thread_run(mn, devices[:n], timed_copy(ring), cfg["collective_timeout"])
        rings.append({"world": n, "bytes": 4 * n_floats, "seconds": statistics.median(max(ts) for ts in zip(*per_rank))})
    return {"pairs": pairs, "ring": rings}


def thread_stage(torch, mn, cfg, devices):
    rows = []
    for n in [t for t in cfg["tiers"] if t > 1]:
        for geometry in cfg["geometries"]:
            per_rank = _thread_run(mn, devices[:n], lambda comm: time_collectives(comm, torch, mn, cfg, geometry),
                                   cfg["collective_timeout"])
            rows += _merge_ranks(per_rank)
    return rows


# ---- the DiT block ----------------------------------------------------------------------------------------

class UlyssesCompute:
    """optimized_attention_override doing one Ulysses rank's attention work without the exchange.

    q, k, v arrive as the shard's [1, H, s_r, D]; a Ulysses rank attends all S queries over S keys for
    H/P heads after its all-to-all, so they are tiled to [1, H/P, S, D] (the values do not matter for the
    time), upstream's backend runs on them, and the result comes back as the shard's [1, s_r, H*D].
    """

    def __init__(self, world: int, seq_len: int):
        self.world = world
        self.seq_len = seq_len

    def __call__(self, func, q, k, v, heads, *args, **kwargs):
        b, h, s, d = q.shape
        hp, reps = h // self.world, -(-self.seq_len // s)

        def tiled(t):  # [1, H, s_r, D] -> [1, H/P, S, D]
            return t[:, :hp].repeat(1, 1, reps, 1)[:, :, :self.seq_len].contiguous()

        out = func(tiled(q), tiled(k), tiled(v), hp, *args, **kwargs)       # [1, S, H/P*D]
        out = out.reshape(b, self.seq_len, hp, d)[:, :s]                    # this rank's rows
        return out.repeat(1, 1, self.world, 1).reshape(b, s, h * d)         # [1, s_r, H*D]


def block_stage(torch, cfg, device):
    import comfy.ldm.minimax.model
    import comfy.ops
    d, dtype = cfg["dims"], _dtype(torch, cfg)
    block = comfy.ldm.minimax.model.DiTBlock(d["hidden"], d["heads"], d["head_dim"], d["ffn"], d["t_dim"], 1e-5, 1e-5,
                                             dtype=dtype, device=device, operations=comfy.ops.disable_weight_init)
    block.requires_grad_(False)  # as ComfyUI loads models; the fused in-place RoPE refuses weights that need grad
    with torch.no_grad():
        for name, p in block.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    rot_half = 3 * (d["head_dim"] // 8)  # rotary dims 6 x len(inv_freq), as in H3 (96 of 128)
    rows = []
    with torch.inference_mode():
        t_emb = torch.randn(1, d["t_dim"], device=device, dtype=dtype)
        for geometry in cfg["geometries"]:
            for n in cfg["tiers"]:
                s = costmodel.shard_sizes(geometry["seq_len"], n)[0]
                angles = torch.rand(s, rot_half, device=device) * 100.0
                rope = comfy.ldm.minimax.model.rope_rotation_table(torch.cat([angles, angles], dim=-1), dtype)
                x = torch.randn(s, d["hidden"], device=device, dtype=dtype)
                options = {} if n == 1 else {"optimized_attention_override": UlyssesCompute(n, geometry["seq_len"])}
                times = _timed(torch, device, cfg["repeats"],
                               lambda xi: block(xi, t_emb, [(0, s, 0)], rope, transformer_options=options),
                               before=x.clone)  # the block adds into its input in place
                rows.append({"geometry": geometry["name"], "world": n, "shard": s, "seq_len": geometry["seq_len"],
                             "seconds": statistics.median(times)})
                del x, rope, angles
    return rows


# ---- main ---------------------------------------------------------------------------------------------------

def _devices(torch, cfg):
    kind, n = cfg["device_type"], cfg["npu_count"]
    if kind == "cpu":
        return ["cpu"] * n, True
    module = torch.get_device_module(kind)
    count = module.device_count() if module.is_available() else 0
    if count >= n:
        return [f"{kind}:{i}" for i in range(n)], False
    sim = os.environ.get(SIM_DEVICES_ENV, "")
    if count and sim.isdigit() and int(sim) >= n:
        return [f"{kind}:0"] * n, True
    raise RuntimeError(f"{n} {kind} devices asked, torch sees {count}: expose {n} (ASCEND_RT_VISIBLE_DEVICES / "
                       f"CUDA_VISIBLE_DEVICES), or set {SIM_DEVICES_ENV}={n} to run every rank on one card")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--config", required=True, help="JSON built by h3kit.runtime.calibration.config")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = json.loads(args.config)
    sys.path.insert(0, args.comfy_home)
    os.chdir(args.comfy_home)
    report = {"ok": True}
    try:
        import torch
        import comfy.multinpu as mn  # torch only: forking the process ranks after it is safe
        devices, simulated = _devices(torch, cfg)
        report.update(devices=devices, simulated=simulated, torch=torch.__version__,
                      device_name=(torch.get_device_module(cfg["device_type"]).get_device_name(0)
                                   if cfg["device_type"] != "cpu" else None))
        stages = report["stage_s"] = {}
        t0 = time.monotonic()
        report["process"] = process_stage(cfg, args.comfy_home, simulated)
        stages["process"] = time.monotonic() - t0
        report["copy"] = copy_stage(torch, mn, cfg, devices)
        stages["copy"] = time.monotonic() - t0 - sum(stages.values())
        report["threads"] = thread_stage(torch, mn, cfg, devices)
        stages["threads"] = time.monotonic() - t0 - sum(stages.values())
        import comfy.cli_args
        comfy.cli_args.args.cpu = cfg["device_type"] == "cpu"  # before comfy.model_management is imported
        report["blocks"] = block_stage(torch, cfg, torch.device(devices[0]))
        stages["block"] = time.monotonic() - t0 - sum(stages.values())
        report["elapsed_s"] = time.monotonic() - t0
    except BaseException as e:
        report = {"ok": False, "error": {"message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}}
    Path(args.out).write_text(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
