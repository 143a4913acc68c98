"""Memory and load at H3's scale, measured on a small DiT: the four figures of issue 21 in one JSON object.

    python benchmarks/multinpu_memory.py --comfy-home TREE [--ranks 4] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches (it writes the checkpoints it
needs into a temporary folder). CPU only: every rank is a process or a thread of this host.

load_host_peak_ratio  A process-transport load at --ranks ranks: a DiT of about 250 MB (fp32) loaded by rank 0
                      and, through the node, by every worker, then one forward. A sampler reads every rank's PSS
                      (/proc/PID/smaps_rollup: a page shared by k processes counts 1/k in each) every 20 ms from
                      before rank 0 reads the file until the forward returned; the figure is the largest sum over
                      the ranks minus the sum before, over the file's bytes. 1.0 is one mapping of the file for the
                      whole host; each private copy a rank makes while loading adds one. The file is written
                      with 64-byte aligned tensors: on a CPU only those are mapped (the CPU kernels round
                      misaligned data differently); an accelerator maps any.
starved_h2d_ratio     The thread transport at --ranks ranks with sharded weights, on a card that holds about 60% of
                      each rank's slices (ComfyUI's loader given that budget): the bytes a rank copies from the
                      host weights to its device per forward (comfy.multinpu_shard's counter at the copy), the
                      largest over the ranks, over the DiT's weight bytes.
exchange_copies       Full copies of q/k/v one Ulysses direction writes on a rank (bytes written / the direction's
                      input, counted by h3kit.runtime.copycount as torch executes it, threads; the larger direction).
                      On the process transport the backend writes the receive buffer in place of the threads'
                      receive copy: the same count.
parity_max_abs        The largest |difference| of those forwards (processes, starved sharded threads) against the
                      same forward on one device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLKIT = HERE.parent / "toolkit"
sys.path.insert(0, str(TOOLKIT))
sys.path.insert(0, str(HERE))
import multinpu_transport as transport  # noqa: E402  (setup, the process group's start, a direct DiT forward)

# about 250 MB of fp32 weights, nearly all in the 4 blocks; 16 heads split over 2, 4 and 8 ranks
DIMS = dict(transport.SMALL, hidden_size=1024, num_layers=4, num_attention_heads=16, attention_head_dim=64,
            ffn_hidden_size=4096)
GEOMETRY = (128, 128, 9, 16)   # width, height, frames, text tokens: a short sequence, the weights dominate
TARGETS = {"load_host_peak_ratio": 1.2, "starved_h2d_ratio": 0.5, "exchange_copies": 2, "parity_max_abs": 0.0}
RESIDENT_SHARE = 0.6


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """The summed PSS of a set of processes, read every `interval` s by a process of its own (rank 0's load holds
    this interpreter's GIL for long stretches): the sum before, and the largest sum seen until the block ends."""

    CODE = ("import sys, time, select\n"
            "sys.path.insert(0, sys.argv[1]); import multinpu_memory as m\n"
            "pids = [int(p) for p in sys.argv[3:]]; interval = float(sys.argv[2]); peak = n = 0\n"
            "while not select.select([sys.stdin], [], [], interval)[0]:\n"
            "    peak = max(peak, sum(m._pss(p) for p in pids)); n += 1\n"
            "print(peak, n)\n")

    def __init__(self, pids, interval=0.005):
        self.pids = list(pids)
        self.interval = interval
        self.before = sum(_pss(p) for p in self.pids)
        self.peak = self.before
        self.samples = 0

    def __enter__(self):
        self._proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(HERE), str(self.interval),
                                       *map(str, self.pids)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        out, _ = self._proc.communicate("stop\n", timeout=60)
        peak, n = out.split()
        self.peak = max(self.peak, int(peak), sum(_pss(p) for p in self.pids))
        self.samples = int(n)


def _inputs(torch, dev):
    from h3kit.runtime import costmodel
    width, height, frames, text = GEOMETRY
    seq = costmodel.packed_sequence(width, height, frames, text)
    lt, lh, lw = seq["latent"]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn((1, 24, lt, lh, lw), generator=g).to(dev),
         torch.randn((1, 32, 2, seq["audio_latents"]), generator=g).to(dev)]
    ctx = torch.randn((1, text, DIMS["hidden_size"]), generator=g).to(dev)  # already refined: skips the refiner
    return x, ctx


def _max_abs(torch, a, b) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def _write_dit(path):
    from h3kit import tiny_models
    # 64-byte aligned tensors: on a CPU only those are mapped (comfy.multinpu_models.ALIGNMENT); an accelerator maps any
    tiny_models.save_aligned(tiny_models.dit_state_dict(0, DIMS), path)
    return os.path.getsize(path)


def load_child(args):
    """In a fresh process (the sampler must see a load from a clean start): rank 0 here and ranks-1 workers."""
    transport._setup(args.comfy_home, "cpu")
    import torch
    import comfy.model_management
    import comfy.multinpu_dit
    import comfy.multinpu_process as mp
    import comfy.sd
    out = {}
    ref = json.loads(Path(args.reference).read_text()) if args.reference else None
    runtime = transport._start_group(args.ranks, "cpu")
    pids = [r["pid"] for r in runtime.ranks() if r.get("pid")]
    if os.getpid() not in pids:
        pids.append(os.getpid())
    time.sleep(1.0)  # the workers settle (imports done, heartbeats running)
    with Sampler(pids) as s:
        base = comfy.sd.load_diffusion_model(args.dit, model_options={"dtype": torch.float32})
        m = comfy.multinpu_dit.apply_sequence_parallel(base, None)  # the group started above serves it
        comfy.model_management.load_models_gpu([m], force_full_load=True)
        x, ctx = _inputs(torch, base.load_device)
        got = transport._forward(m, x, ctx)
    out.update(pss_before=s.before, pss_peak=s.peak, samples=s.samples, processes=len(pids))
    if ref is not None:
        out["max_abs"] = max(abs(a - b) for a, b in zip(torch.cat([o.float().flatten() for o in got]).tolist(), ref))
    Path(args.out).write_text(json.dumps(out))
    mp.stop_runtime()


def reference_child(args):
    """The one-device forward the load is compared with, written as a flat list."""
    transport._setup(args.comfy_home, "cpu")
    import torch
    import comfy.model_management
    import comfy.sd
    base = comfy.sd.load_diffusion_model(args.dit, model_options={"dtype": torch.float32})
    comfy.model_management.load_models_gpu([base], force_full_load=True)
    x, ctx = _inputs(torch, base.load_device)
    got = transport._forward(base, x, ctx)
    Path(args.out).write_text(json.dumps(torch.cat([o.float().flatten() for o in got]).tolist()))


def _budget(model_load, nbytes):
    def load(self, lowvram_model_memory=0, force_patch_weights=False):
        # less what the model already holds, as load_models_gpu computes it (every rank loads before each forward)
        return model_load(self, max(0.1, nbytes - self.model_loaded_memory()), force_patch_weights)
    return load


def _count_whole_blocks(shard_mod):
    """Before per-block slices, build_block patched and moved every weight of a block to keep its slice: count those
    bytes at each call, where the new code counts at its copies."""
    real = shard_mod.ShardedBlocks.build_block
    shard_mod.ShardedBlocks.h2d_bytes = 0

    def build_block(self, i, patcher, fault=None):
        self.h2d_bytes += sum(n for slot in self.layouts[i].slots for _, _, _, n in slot.parts)
        return real(self, i, patcher, fault)
    shard_mod.ShardedBlocks.build_block = build_block


def starved_part(args, dit):
    """Threads, sharded, a card that holds about RESIDENT_SHARE of each rank's slices."""
    os.environ["H3KIT_SIM_DEVICES"] = str(args.ranks)
    transport._setup(args.comfy_home, "cpu")
    import torch
    import comfy.model_management as mm
    import comfy.multidevice
    import comfy.multinpu_dit
    import comfy.multinpu_shard
    import comfy.sd
    base = comfy.sd.load_diffusion_model(dit, model_options={"dtype": torch.float32})
    dev = base.load_device
    x, ctx = _inputs(torch, dev)
    mm.load_models_gpu([base], force_full_load=True)
    single = transport._forward(base, x, ctx)
    mm.unload_all_models()
    weight_bytes = base.model_size()

    m = comfy.multinpu_dit.apply_sequence_parallel(base, comfy.multidevice.devices_for(dev, args.ranks),
                                                   weights="sharded")
    w = comfy.multinpu_dit.get_wrapper(m)
    w.runtime.run("dit_empty_cache", None, configs=[w.config])  # every rank sets up its own copy
    ranks = [c.configs[w.config.id].patcher for c in w.runtime.contexts]
    shards = [comfy.multinpu_shard.of(p.model.diffusion_model) for p in ranks]
    slice_bytes = sum(lay.shard for lay in shards[0].layouts)
    other = ranks[0].model_size() - slice_bytes  # what a rank holds outside the blocks
    real = mm.LoadedModel.model_load
    mm.LoadedModel.model_load = _budget(real, int(other + RESIDENT_SHARE * slice_bytes))
    if not hasattr(shards[0], "h2d_bytes"):
        _count_whole_blocks(comfy.multinpu_shard)  # a tree from before per-block slices: today's figure
    try:
        mm.load_models_gpu(ranks)
        loaded = [[b.built_for is not None for b in s.slices()] if hasattr(s, "slices") else [s.built] * len(s.layouts)
                  for s in shards]
        before = [s.h2d_bytes for s in shards]
        forwards = 2
        for _ in range(forwards):
            got = transport._forward(m, x, ctx)
        per_forward = [(s.h2d_bytes - b) / forwards for s, b in zip(shards, before)]
    finally:
        mm.LoadedModel.model_load = real
        wrapper = comfy.multinpu_dit.get_wrapper(m)
        wrapper.runtime.shutdown()
        mm.unload_all_models()
    return {"weight_bytes": weight_bytes, "slice_bytes_per_rank": slice_bytes,
            "resident_share": [sum(r) / len(r) for r in loaded], "h2d_bytes_per_forward": per_forward,
            "starved_h2d_ratio": max(per_forward) / weight_bytes, "max_abs": _max_abs(torch, got, single)}


def _old_exchange_copies(comm, mn, head_dim=16):
    import torch
    from h3kit.runtime import copycount
    p, r = comm.world_size, comm.rank
    heads, sizes = 2 * p, mn.shard_sizes(4 * p, p)
    q, k, v = (torch.randn(1, heads, sizes[r], head_dim) for _ in range(3))
    # the DiT's caller concatenated q, k, v before the exchange and split the result
    _, scatter, _ = copycount.copies(lambda: mn.all_to_all_scatter_heads(torch.cat([q, k, v]), comm, sizes).chunk(3),
                                     3 * q.numel() * 4)
    out = torch.randn(1, sum(sizes), heads // p, head_dim)
    _, gather, _ = copycount.copies(lambda: mn.all_to_all_gather_heads(out, comm, sizes), out.numel() * 4)
    return {"scatter": scatter, "gather": gather}


def copies_part(args):
    import torch
    import comfy.multinpu as mn
    sys.path.insert(0, str(HERE.parent / "tests" / "support"))
    import multinpu_cases
    case = multinpu_cases.case_exchange_copies
    if not hasattr(mn.ThreadComm, "all_to_all_single"):
        case = _old_exchange_copies  # a tree from before the two-copy exchange: today's figure
    group = mn.ThreadGroup(["cpu"] * args.ranks, timeout=60.0)
    threads = mn.RankThreads(group.devices)
    try:
        rows = group.run(lambda comm: case(comm, mn), threads)
    finally:
        threads.shutdown()
    return {"per_rank": rows, "exchange_copies": max(max(r.values()) for r in rows)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["load", "reference"], help=argparse.SUPPRESS)
    ap.add_argument("--dit", help=argparse.SUPPRESS)
    ap.add_argument("--reference", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.comfy_home = os.path.abspath(args.comfy_home)
    if args.child:
        return {"load": load_child, "reference": reference_child}[args.child](args)
    with tempfile.TemporaryDirectory(prefix="h3kit-bench-mem-") as tmp:
        dit = os.path.join(tmp, "bench_memory_dit.safetensors")
        writer = (f"import sys; sys.path.insert(0, {str(TOOLKIT)!r}); sys.path.insert(0, {str(HERE)!r}); "
                  f"import multinpu_transport as t; t._setup({args.comfy_home!r}, 'cpu'); "
                  f"import multinpu_memory as m; print(m._write_dit({dit!r}))")
        file_bytes = int(subprocess.run([sys.executable, "-c", writer], cwd=args.comfy_home, check=True,
                                        capture_output=True, text=True).stdout.split()[-1])
        child = [sys.executable, __file__, "--comfy-home", args.comfy_home, "--ranks", str(args.ranks), "--dit", dit]
        ref = os.path.join(tmp, "reference.json")
        subprocess.run(child + ["--child", "reference", "--out", ref], check=True, stdout=sys.stderr)
        load_out = os.path.join(tmp, "load.json")
        subprocess.run(child + ["--child", "load", "--reference", ref, "--out", load_out], check=True, stdout=sys.stderr)
        load = json.loads(Path(load_out).read_text())
        starved = starved_part(args, dit)
        copies = copies_part(args)
    report = {
        "load_host_peak_ratio": (load["pss_peak"] - load["pss_before"]) / file_bytes,
        "starved_h2d_ratio": starved["starved_h2d_ratio"],
        "exchange_copies": copies["exchange_copies"],
        "parity_max_abs": max(load["max_abs"], starved["max_abs"]),
        "targets": TARGETS, "ranks": args.ranks, "dit": DIMS, "file_bytes": file_bytes,
        "load": load, "starved": starved, "copies": copies,
    }
    report["met"] = {k: (report[k] == v if k == "parity_max_abs" else report[k] <= v) for k, v in TARGETS.items()}
    if args.json:
        print(json.dumps(report))
    else:
        for k in TARGETS:
            print(f"{k:22} {report[k]:.4g}  (target {'==' if k == 'parity_max_abs' else '<='} {TARGETS[k]}: "
                  f"{'met' if report['met'][k] else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
