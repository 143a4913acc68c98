"""Host memory and weight-file reads of H3 on 1 and N devices: h3kit's node against upstream's device clones.

    python benchmarks/multinpu_host_memory.py --comfy-home TREE [--device-type cpu|npu|cuda]
        [--npu-count 1,4] [--cycles 2] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches (h3kit install). It
writes random-weight H3 models of about 0.9 GB (fp32: the Qwen3-VL text encoder with all 50 layers at
width 256, a 4-block DiT at width 1024, the video VAE with an 8-layer decoder at width 512, the audio VAE)
and then, for each device count, in a fresh process:

- h3kit: loads them through the loader nodes (CLIPLoader, VAELoader, UNETLoader), applies
  MultiNPUParallelConfig with npu_count N, runs the tiny t2va pipeline once (text encode, one sampling step,
  video and audio decode), then --cycles times unloads every model (ComfyUI's free_memory) and runs it
  again, so every device copy is loaded, unloaded and reloaded;
- upstream (N > 1 only): loads the same files and makes the N-1 extra device copies the way upstream's
  multi-GPU nodes do (ModelPatcher.deepclone_multigpu, which runs the loader again).

For each run it prints the weight-file reads per model, the host bytes of distinct weight storages behind
every device copy, and the process RSS after loading, after the node (or clones), after the pipeline,
after the unload/reload cycles, and its peak (ru_maxrss), each less the RSS before loading.

On the CPU simulation every device is the host: loading onto a device and unloading move nothing, so the
cycles there show no upstream copy-back (that needs --device-type npu or cuda: there the anchored weights
return to the host copy while upstream's unload allocates a new one per device). Reads, distinct storages
and peak RSS are measured the same way on both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"
TE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=50, num_attention_heads=8, num_key_value_heads=2)
DIT = dict(hidden_size=1024, num_layers=4, num_attention_heads=8, attention_head_dim=128, ffn_hidden_size=4096,
           text_dim=256, timestep_input_dim=256, time_embed_hidden_size=1024, time_embed_dim=512, rope_inv_freq_len=16)
VIDEO_VAE = dict(decoder_layers=8, decoder_heads=8, decoder_dim_head=64)
FILES = {"dit": "bench_dit.safetensors", "te": "bench_te.safetensors", "video_vae": "bench_video_vae.safetensors",
         "audio_vae": "bench_audio_vae.safetensors"}
FOLDERS = {"dit": "diffusion_models", "te": "text_encoders", "video_vae": "vae", "audio_vae": "vae"}


def _setup(comfy_home, device_type, npu_count):
    sys.path.insert(0, str(TOOLKIT))
    from h3kit.runtime.parity_common import setup_comfy  # the parity worker's: --cpu and the simulated devices
    setup_comfy(comfy_home, device_type, npu_count)


def write_models(models_dir):
    import json as _json
    import safetensors.torch
    from h3kit import tiny_models
    for c in ("te", "video_vae", "audio_vae"):
        tiny_models.write(c, str(models_dir / FILES[c]), 0,
                          dims={"te": TE, "video_vae": VIDEO_VAE, "audio_vae": None}[c])
    sd = tiny_models.dit_state_dict(0, DIT)
    safetensors.torch.save_file(sd, str(models_dir / FILES["dit"]), metadata={"config": _json.dumps({})})


def _rss():
    import psutil
    return psutil.Process().memory_info().rss


def _distinct_storage_bytes(modules):
    seen = {}
    for m in modules:
        for t in itertools.chain(m.parameters(), m.buffers()):
            if t.device.type == "cpu":
                s = t.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def child(args):
    _setup(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.model_management
    import comfy.multinpu_weights
    import comfy.multinpu_vae
    import comfy.sample
    import comfy.utils
    import folder_paths
    import nodes
    import comfy_extras.nodes_minimax_h3 as h3
    import comfy_extras.nodes_multinpu as nodes_multinpu

    from h3kit.runtime import reads as read_counter
    reads = read_counter.count(comfy.utils)  # by real path; the files' names differ
    for folder in set(FOLDERS.values()):
        folder_paths.add_model_folder_path(folder, args.models, is_default=True)
    out = {"arm": args.arm, "npu_count": args.npu_count, "device_type": args.device_type}
    base = _rss()
    model = nodes.UNETLoader().load_unet(FILES["dit"], "default")[0]
    clip = nodes.CLIPLoader().load_clip(FILES["te"], type="minimax")[0]
    vae = nodes.VAELoader().load_vae(FILES["video_vae"])[0]
    audio_vae = nodes.VAELoader().load_vae(FILES["audio_vae"])[0]
    out["weights_bytes"] = sum(p.model_size() for p in (model, clip.patcher, vae.patcher, audio_vae.patcher))
    out["rss_loaded"] = _rss() - base

    if args.arm == "upstream":
        patchers = [model, clip.patcher, vae.patcher]
        clones = [p.deepclone_multigpu(new_load_device=p.load_device) for p in patchers for _ in range(args.npu_count - 1)]
        out["rss_after_node"] = _rss() - base
        copies = [p.model for p in patchers + clones] + [audio_vae.patcher.model]
        out["host_weight_bytes"] = _distinct_storage_bytes(copies)
    else:
        node = nodes_multinpu.MultiNPUParallelConfigNode
        problem = node.validate_inputs(npu_count=args.npu_count)
        if problem is not True:
            raise SystemExit(problem)
        model, clip, vae, audio_vae = node.execute(model=model, npu_count=args.npu_count, clip=clip, vae=vae,
                                                   audio_vae=audio_vae).args
        out["rss_after_node"] = _rss() - base

        def pipeline(seed):
            cond, latent = h3.MiniMaxH3ImageToVideo.execute(clip, vae, "A red fox trots through fresh snow.",
                                                            64, 64, 39).args
            noise = comfy.sample.prepare_noise(latent["samples"], seed)
            samples = comfy.sample.sample(model, noise, 1, 1.0, "euler", "simple", cond, cond, latent["samples"],
                                          seed=seed, disable_pbar=True)
            frames = nodes.VAEDecode().decode(vae, {"samples": samples})[0]
            return frames.shape

        out["frames"] = list(pipeline(0))
        out["rss_after_pipeline"] = _rss() - base
        for cycle in range(args.cycles):
            comfy.model_management.free_memory(1e30, None)  # unload every model from every device
            pipeline(cycle + 1)
        out["rss_after_cycles"] = _rss() - base
        # measured with every model back on the host: after a pipeline on a real device the weights sit on
        # the devices and a count of host tensors would miss them (on the CPU simulation this changes nothing)
        comfy.model_management.free_memory(1e30, None)
        copies = [model.model] + _dit_rank_models(model)
        copies += [clip.patcher.model] + _te_rank_models(clip)
        copies.append(vae.patcher.model)
        runner = comfy.multinpu_vae.get_runner(vae)  # the VAE's rank copies: each rank's own decoder
        if runner is not None:
            copies += [c.configs[runner.config.id].model for c in getattr(runner.runtime, "contexts", ())
                       if runner.config.id in c.configs]
        copies.append(audio_vae.patcher.model)
        out["host_weight_bytes"] = _distinct_storage_bytes(copies)
    out["reads"] = {os.path.basename(path): n for path, n in reads.items()}
    out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    with open(args.out, "w") as f:
        json.dump(out, f)


def _dit_rank_models(model):
    """The DiT's rank copies a thread runtime holds, each rank's own (none with one device)."""
    w = comfy.multinpu_dit.get_wrapper(model)
    if w is None:
        return []
    return [c.configs[w.config.id].patcher.model for c in getattr(w.runtime, "contexts", ()) if w.config.id in c.configs]


def _te_rank_models(clip):
    """The text encoder's rank shards a thread runtime holds (none with one device)."""
    import comfy.multinpu_te
    runner = comfy.multinpu_te.get_runner(clip)
    contexts = getattr(runner.runtime, "contexts", []) if runner is not None else []
    return [c.configs[runner.config.id].decoder for c in contexts if runner.config.id in c.configs]


def _gb(x):
    return f"{x / 2**30:.2f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", default="1,4")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", default="h3kit", help=argparse.SUPPRESS)
    ap.add_argument("--models", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.npu_count = int(args.npu_count)
        child(args)
        sys.stdout.flush()
        os._exit(0)  # skip teardown: rank threads make torch's static destructors abort now and then
    counts = [int(x) for x in args.npu_count.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="h3kit-bench-mem-") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        writer = (f"import sys; sys.path.insert(0, {str(TOOLKIT)!r}); sys.path.insert(0, {args.comfy_home!r}); "
                  "import comfy.cli_args; comfy.cli_args.args.cpu = True; "
                  f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); "
                  f"import multinpu_host_memory as b; from pathlib import Path; b.write_models(Path({str(models)!r}))")
        subprocess.run([sys.executable, "-c", writer], cwd=args.comfy_home, check=True)
        for n in counts:
            for arm in ("h3kit", "upstream") if n > 1 else ("h3kit",):
                out = Path(tmp) / f"{arm}-{n}.json"
                subprocess.run([sys.executable, __file__, "--child", "--comfy-home", args.comfy_home, "--device-type",
                                args.device_type, "--npu-count", str(n), "--cycles", str(args.cycles), "--arm", arm,
                                "--models", str(models), "--out", str(out)], check=True)
                results.append(json.loads(out.read_text()))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    w = results[0]["weights_bytes"]
    print(f"models: {_gb(w)} GiB of weights (fp32), {args.device_type}, GiB of RSS above the process before loading")
    print(f"{'run':14} {'reads/file':>10} {'host copies':>11} {'loaded':>7} {'node':>7} {'pipeline':>8} "
          f"{'cycles':>7} {'peak':>7}")
    for r in results:
        reads = sorted(set(r["reads"].values()))
        print(f"{r['arm'] + ' N=' + str(r['npu_count']):14} {'/'.join(map(str, reads)):>10} "
              f"{r['host_weight_bytes'] / w:>11.2f} {_gb(r['rss_loaded']):>7} {_gb(r['rss_after_node']):>7} "
              f"{_gb(r['rss_after_pipeline']) if 'rss_after_pipeline' in r else '-':>8} "
              f"{_gb(r['rss_after_cycles']) if 'rss_after_cycles' in r else '-':>7} {_gb(r['rss_peak']):>7}")
    one = next((r for r in results if r["arm"] == "h3kit" and r["npu_count"] == 1), None)
    for r in results:
        if one and r is not one:
            print(f"peak RSS {r['arm']} N={r['npu_count']} / h3kit N=1: {r['rss_peak'] / one['rss_peak']:.2f}")


if __name__ == "__main__":
    main()
