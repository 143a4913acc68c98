"""The process transport against the thread transport, side by side in one run: forward time, bytes, memory.

    python benchmarks/multinpu_transport.py --comfy-home TREE [--device-type cpu|npu|cuda] [--npu-count 2,4]
        [--repeats 20] [--pss 4] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches. Two parts:

forward: a small random-weight H3 DiT (hidden 512, 8x64 heads, 2 blocks, saved to a file and loaded by
comfy.sd.load_diffusion_model, as a worker loads it) runs direct DiT forwards on 1 device, then for each N on
N threads (apply_sequence_parallel with devices: comfy.multinpu_threads) and on N processes (a process group of
N worker ranks driven by this process, apply_sequence_parallel with the runtime): the same worker programs on
both, median of --repeats after a warm-up. Beside each: an empty command's round trip (threads: the packed
header and the closing barrier; processes: the header in the store, /dev/shm, the closing barrier: the fixed
cost a forward pays on top of its collectives), the bytes each rank received per forward against the cost model's figure for
that rank, and max_rel against one device.

pss (--pss N): the host memory of the pipeline's weights (the ~1 GiB set of benchmarks/multinpu_host_memory.py:
DiT, text encoder, video and audio VAEs, fp32) in one process with npu_count 1, against N processes with
npu_count N (every worker loading the same files, comfy.multinpu_models mapping them): the summed PSS
(psutil memory_full_info, proportional set size: a page shared by k processes counts 1/k in each), and the
PSS of an idle worker before it loads anything (the interpreter, torch and ComfyUI modules).

On the CPU simulation all ranks share the host's cores: the timings show the transport's overhead, not a
speed-up. Each process rank gets cores / N intra-op threads (comfy.multinpu_wire.cpu_threads, unless
OMP_NUM_THREADS is set), as the N threads of the thread transport share one process's pool. Numbers vary with the machine's load; run it on an idle host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLKIT = HERE.parent / "toolkit"
sys.path.insert(0, str(TOOLKIT))
from h3kit.runtime import costmodel  # noqa: E402  (pure Python)

SMALL = dict(hidden_size=512, num_layers=2, token_refiner_num_layers=1, num_attention_heads=8, attention_head_dim=64,
             ffn_hidden_size=1024, text_dim=256, timestep_input_dim=256, time_embed_hidden_size=512,
             time_embed_dim=256, rope_inv_freq_len=8)
GEOMETRY = (256, 256, 22, 64)  # width, height, frames, text tokens


def _setup(comfy_home, device_type):
    sys.path.insert(0, comfy_home)
    os.chdir(comfy_home)
    import comfy.cli_args
    comfy.cli_args.args.cpu = device_type == "cpu"
    import comfy.model_management  # noqa: F401


def _start_group(n, device_type, timeout=600.0):
    import comfy.multinpu_wire as wire
    import comfy.multinpu_process as mp
    key = os.environ.setdefault(wire.KEY_ENV, wire.new_key())
    spec = wire.GroupSpec(local_size=n, device_type=device_type, join_timeout=timeout,
                          worker_args=["--cpu"] if device_type == "cpu" else [])
    runtime = mp.start_runtime(spec, key)
    mp.wait_ready(runtime, timeout)
    return runtime


def _forward(patcher, x, ctx):
    import torch
    import comfy.patcher_extension
    to = comfy.patcher_extension.copy_nested_dicts(patcher.model_options["transformer_options"])
    to["wrappers"] = comfy.patcher_extension.copy_nested_dicts(patcher.wrappers)
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, torch.tensor([500.0], device=x[0].device), ctx, transformer_options=to,
                                             minimax_payload={})


def _timed(fn, repeats, device):
    import comfy.multidevice
    fn()  # warm-up: kernels, caches, the workers' first load
    times, out = [], None
    for _ in range(repeats):
        comfy.multidevice.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        comfy.multidevice.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def forward_part(args, tmp):
    if args.device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(max(args.counts))  # the thread transport's simulated devices
    _setup(args.comfy_home, args.device_type)
    import torch
    import comfy.model_management
    import comfy.multidevice
    import comfy.multinpu_dit
    import comfy.multinpu_process as mp
    import comfy.sd
    import comfy.utils
    from h3kit import tiny_models

    path = os.path.join(tmp, "bench_transport_dit.safetensors")
    comfy.utils.save_torch_file(tiny_models.dit_state_dict(0, SMALL), path)
    base = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    width, height, frames, text = GEOMETRY
    seq = costmodel.packed_sequence(width, height, frames, text)
    lt, lh, lw = seq["latent"]
    g = torch.Generator().manual_seed(1)
    dev = base.load_device
    x = [torch.randn((1, 24, lt, lh, lw), generator=g).to(dev), torch.randn((1, 32, 2, seq["audio_latents"]), generator=g).to(dev)]
    ctx = torch.randn((1, text, SMALL["hidden_size"]), generator=g).to(dev)  # already refined: skips the refiner
    cfg = dict(heads=SMALL["num_attention_heads"], head_dim=SMALL["attention_head_dim"], hidden=SMALL["hidden_size"],
               blocks=SMALL["num_layers"])

    comfy.model_management.load_models_gpu([base], force_full_load=True)
    t1, ref = _timed(lambda: _forward(base, x, ctx), args.repeats, dev)
    reference = torch.cat([o.float().flatten().cpu() for o in ref])
    rows = [{"npu_count": 1, "transport": "none", "seconds_per_forward": t1, "max_rel": 0.0}]

    def max_rel(out):
        flat = torch.cat([o.float().flatten().cpu() for o in out])
        return ((flat - reference).abs().max() / reference.abs().max()).item()

    for n in args.counts:
        model = costmodel.exchange_elements(seq["seq_len"], n, **cfg)
        threads = comfy.multinpu_dit.apply_sequence_parallel(base, comfy.multidevice.devices_for(dev, n))
        comfy.model_management.load_models_gpu([threads], force_full_load=True)
        wrapper = comfy.multinpu_dit.get_wrapper(threads)
        wrapper.count_bytes = True  # the same command as the process arm's (every rank's counts to rank 0)
        sec, out = _timed(lambda: _forward(threads, x, ctx), args.repeats, dev)
        empty, _ = _timed(lambda: wrapper.runtime.run("drop", []), args.repeats, dev)
        rows.append({"npu_count": n, "transport": "threads", "seconds_per_forward": sec, "max_rel": max_rel(out),
                     "bytes_per_forward": sum(wrapper.rank_bytes), "rank_bytes_per_forward": wrapper.rank_bytes,
                     "model_bytes_per_forward": model["total"] * 4,
                     "model_rank_bytes_per_forward": [x * 4 for x in model["per_device"]],
                     "empty_command_seconds": empty})
        wrapper.runtime.shutdown()
        comfy.model_management.unload_all_models()
        base = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})

        runtime = _start_group(n, args.device_type)
        proc = comfy.multinpu_dit.apply_sequence_parallel(base, None)  # the group started above serves it
        comfy.model_management.load_models_gpu([proc], force_full_load=True)
        wrapper = comfy.multinpu_dit.get_wrapper(proc)
        wrapper.count_bytes = True
        sec, out = _timed(lambda: _forward(proc, x, ctx), args.repeats, dev)
        empty, _ = _timed(lambda: runtime.run("drop", []), args.repeats, dev)
        rows.append({"npu_count": n, "transport": "process", "seconds_per_forward": sec, "max_rel": max_rel(out),
                     "bytes_per_forward": sum(wrapper.rank_bytes), "rank_bytes_per_forward": wrapper.rank_bytes,
                     "model_bytes_per_forward": model["total"] * 4,
                     "model_rank_bytes_per_forward": [x * 4 for x in model["per_device"]],
                     "empty_command_seconds": empty, "backend": runtime.spec.backend})
        mp.stop_runtime()
        comfy.model_management.unload_all_models()
        base = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
    return {"dit": SMALL, "geometry": f"{width}x{height}x{frames}, {text} text tokens", "seq_len": seq["seq_len"],
            "device_type": args.device_type, "repeats": args.repeats, "rows": rows}


def _pss(pid):
    import psutil
    return psutil.Process(pid).memory_full_info().pss


def pss_child(args):
    """One arm of the pss part, in a fresh process: npu_count 1 here, or N over a process group."""
    _setup(args.comfy_home, args.device_type)
    import psutil
    import comfy.model_management
    import comfy.multinpu_process as mp
    import comfy.sample
    import folder_paths
    import nodes
    import comfy_extras.nodes_minimax_h3 as h3
    import comfy_extras.nodes_multinpu as nodes_multinpu
    sys.path.insert(0, str(HERE))
    import multinpu_host_memory as mem

    n = args.child_count
    out = {"npu_count": n}
    runtime = _start_group(n, args.device_type) if n > 1 else None
    pids = [os.getpid()] + ([r["pid"] for r in runtime.ranks()] if runtime else [])  # the server and every rank
    out["pss_idle"] = [_pss(p) for p in pids]
    for folder in set(mem.FOLDERS.values()):
        folder_paths.add_model_folder_path(folder, args.models, is_default=True)
    model = nodes.UNETLoader().load_unet(mem.FILES["dit"], "default")[0]
    clip = nodes.CLIPLoader().load_clip(mem.FILES["te"], type="minimax")[0]
    vae = nodes.VAELoader().load_vae(mem.FILES["video_vae"])[0]
    audio_vae = nodes.VAELoader().load_vae(mem.FILES["audio_vae"])[0]
    out["weights_bytes"] = sum(p.model_size() for p in (model, clip.patcher, vae.patcher, audio_vae.patcher))
    model, clip, vae, audio_vae = nodes_multinpu.MultiNPUParallelConfigNode.execute(
        model=model, npu_count=n, clip=clip, vae=vae, audio_vae=audio_vae).args
    import torch
    with torch.inference_mode():
        cond, latent = h3.MiniMaxH3ImageToVideo.execute(clip, vae, "A red fox trots through fresh snow.", 64, 64, 39).args
        noise = comfy.sample.prepare_noise(latent["samples"], 0)
        samples = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent["samples"], seed=0,
                                      disable_pbar=True)
        nodes.VAEDecode().decode(vae, {"samples": samples})
    out["pss"] = [_pss(p) for p in pids]
    out["rss"] = [psutil.Process(p).memory_info().rss for p in pids]
    with open(args.out, "w") as f:
        json.dump(out, f)
    mp.stop_runtime()


def pss_part(args, tmp):
    models = Path(tmp) / "models"
    models.mkdir()
    writer = (f"import sys; sys.path.insert(0, {str(TOOLKIT)!r}); sys.path.insert(0, {args.comfy_home!r}); "
              "import comfy.cli_args; comfy.cli_args.args.cpu = True; "
              f"sys.path.insert(0, {str(HERE)!r}); "
              f"import multinpu_host_memory as b; from pathlib import Path; b.write_models(Path({str(models)!r}))")
    subprocess.run([sys.executable, "-c", writer], cwd=args.comfy_home, check=True)
    arms = []
    for n in (1, args.pss):
        out = Path(tmp) / f"pss-{n}.json"
        subprocess.run([sys.executable, __file__, "--child", "--comfy-home", args.comfy_home, "--device-type",
                        args.device_type, "--child-count", str(n), "--models", str(models), "--out", str(out)], check=True)
        arms.append(json.loads(out.read_text()))
    return arms


def _mib(x):
    return f"{x / 2**20:.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", default="2,4")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--pss", type=int, default=0, help="also measure host memory with this many ranks (e.g. 4)")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        pss_child(args)
        sys.stdout.flush()
        os._exit(0)
    args.counts = [int(c) for c in args.npu_count.split(",")]
    report = {}
    with tempfile.TemporaryDirectory(prefix="h3kit-bench-transport-") as tmp:
        if args.pss:
            report["pss"] = pss_part(args, tmp)
        if not args.no_forward:
            report["forward"] = forward_part(args, tmp)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    sys.stdout.flush()
    os._exit(0)


def _print(report):
    f = report.get("forward")
    if f:
        print(f"H3 DiT small (hidden 512, 8x64 heads, 2 blocks), {f['geometry']}, S = {f['seq_len']}, {f['device_type']}, "
              f"median of {f['repeats']}")
        print(f"{'devices':>7} {'transport':>9} {'ms/forward':>11} {'empty cmd ms':>12} {'bytes/forward':>14} "
              f"{'model':>10} {'max_rel':>9}  bytes per rank (model)")
        for r in f["rows"]:
            ranks = (f"{r['rank_bytes_per_forward']} ({r['model_rank_bytes_per_forward']})"
                     if "rank_bytes_per_forward" in r else "")
            print(f"{r['npu_count']:>7} {r['transport']:>9} {r['seconds_per_forward'] * 1e3:>11.2f} "
                  f"{format(r['empty_command_seconds'] * 1e3, '.2f') if 'empty_command_seconds' in r else '-':>12} "
                  f"{r.get('bytes_per_forward', '-'):>14} {r.get('model_bytes_per_forward', '-'):>10} "
                  f"{r['max_rel']:>9.2e}  {ranks}")
    for arm in report.get("pss", []):
        print(f"pss, npu_count {arm['npu_count']}: weights {_mib(arm['weights_bytes'])} MiB; PSS per rank idle "
              f"{', '.join(_mib(p) for p in arm['pss_idle'])} MiB, after the pipeline "
              f"{', '.join(_mib(p) for p in arm['pss'])} MiB, sum {_mib(sum(arm['pss']))} MiB")
    if len(report.get("pss", [])) == 2:
        one, many = report["pss"]
        print(f"summed PSS {many['npu_count']} ranks / 1 process: {sum(many['pss']) / sum(one['pss']):.2f}; weights "
              f"{_mib(one['weights_bytes'])} MiB; idle ranks' own PSS {_mib(sum(many['pss_idle']))} MiB")


if __name__ == "__main__":
    main()
