"""Parity of the video VAE decode across devices (temporal chunks) and of the audio VAE (one device), against
one device; run by parity_worker.py in the ComfyUI interpreter.

A tiny video VAE loaded by VAELoader decodes latents of 1 to 27 frames (1 to 5 temporal chunks, 2x2 spatial
tiles in one) and an audio latent; gate max_abs == 0 (bit-identical) on every device type: each chunk is
decoded whole by one device, so no arithmetic changes order. The chunks fault zeroes every chunk another device
decoded.
"""

from __future__ import annotations

import time

from h3kit.runtime import parity_common as common

VAE_LAYOUTS = {"image": (1, 3, 4), "5f": (2, 3, 4), "39f": (12, 3, 4), "73f": (22, 5, 6), "90f": (27, 3, 4)}


VAE_TILES = dict(tile_size=64, tile_overlap_min=32)  # 64 px spatial tiles, so the 80x96 px row is tiled


VAE_FAULT_NOTE = "every chunk decoded on a device other than rank 0's zeroed on its way back"


AUDIO_LATENT_T = 10


def _inject_vae_fault():
    import comfy.multinpu_vae
    fetch = comfy.multinpu_vae.fetch_chunk

    def zeroed(chunk, device, src_rank):
        out = fetch(chunk, device, src_rank)
        return out * 0 if src_rank != 0 else out

    common.patch(comfy.multinpu_vae, "fetch_chunk", zeroed)


def run_vae(args):
    common.setup_comfy(args.comfy_home, args.device_type, args.npu_count)
    import torch
    import comfy.multinpu_vae
    node, error = common.node_or_error(args)
    if error:
        return error
    if args.faults != ["none"]:
        _inject_vae_fault()
    common.start_group(args)
    with common.models_dir() as tmp:
        loaded, reads, paths, tiny = common.load_through_nodes(tmp, args.seed, ("dit", "video_vae", "audio_vae"),
                                                               vae_dims=VAE_TILES)
    vae, audio_vae = loaded["video_vae"], loaded["audio_vae"]
    out = node.execute(model=loaded["dit"], npu_count=args.npu_count, vae=vae, audio_vae=audio_vae).args
    par_vae, par_audio = out[2], out[3]
    runner = comfy.multinpu_vae.get_runner(par_vae)
    if runner is not None:
        runner.runtime.timeout = args.timeout  # the process group's: the one it started with
    g = torch.Generator().manual_seed(args.seed)
    layouts = [x for x in args.layouts if x in VAE_LAYOUTS] or list(VAE_LAYOUTS)
    rows = [_video_row(args, layout, torch.randn(1, 24, *VAE_LAYOUTS[layout], generator=g), vae, par_vae, runner,
                       reads[paths["video_vae"]]) for layout in layouts]
    rows.append(_audio_row(args, torch.randn(1, 32, 2, AUDIO_LATENT_T, generator=g), audio_vae, par_audio,
                           reads[paths["audio_vae"]]))
    if runner is not None:
        runner.runtime.release()  # a thread runtime is this run's own; the process group serves all
    config = common.config(args, tiny, {"video_vae": dict(tiny.TINY_VIDEO_VAE, **VAE_TILES),
                                        "gate": "max_abs == 0, weight_reads == 1",
                                        "reads": {c: reads[p] for c, p in paths.items()},
                                        "faults": {"chunks": VAE_FAULT_NOTE} if args.faults != ["none"] else {}})
    return {"ok": all(r["pass"] for r in rows), "rows": rows, "config": config}


def _video_row(args, layout, z, vae, par_vae, runner, weight_reads):
    """One video latent decoded on one device and through the node's VAE, and its verdict."""
    t, h, w = VAE_LAYOUTS[layout]
    t0 = time.perf_counter()
    single = vae.decode(z)
    t1 = time.perf_counter()
    before = (runner.bytes_moved, runner.chunks) if runner else (0, 0)
    parallel = par_vae.decode(z)
    t2 = time.perf_counter()
    row = {"component": "vae", "layout": layout, "latent": [t, h, w], "npu_count": args.npu_count,
           "device_type": args.device_type, "transport": args.transport, "frames": int(single.shape[1]),
           "chunks": (runner.chunks - before[1]) if runner else 0,
           "chunk_ranks": list(runner.chunk_ranks) if runner and t > 1 else [],
           **common.metrics([[single]], [[parallel]]), "weight_reads": weight_reads,
           "bytes_moved": (runner.bytes_moved - before[0]) if runner else 0,
           "seconds_single": round(t1 - t0, 4), "seconds_parallel": round(t2 - t1, 4)}
    # several chunks on several devices must really have been spread (else the node passed the VAE through)
    row["split"] = runner is not None and (row["chunks"] < 2 or any(row["chunk_ranks"]))
    return common.judge(row, [(row["split"], "not spread over the devices"),
                              (row["max_abs"] == 0 and tuple(single.shape) == tuple(parallel.shape),
                               "not bit-identical to one device"),
                              (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times")])


def _audio_row(args, za, audio_vae, par_audio, weight_reads):
    """The audio VAE stays on one device in fp32: the node must hand back the one it got."""
    import torch
    import comfy.multinpu_vae
    t0 = time.perf_counter()
    a_single = audio_vae.decode(za)
    t1 = time.perf_counter()
    a_par = par_audio.decode(za)
    t2 = time.perf_counter()
    row = {"component": "vae", "layout": "audio", "latent": [2, AUDIO_LATENT_T], "npu_count": args.npu_count,
           "device_type": args.device_type, "transport": args.transport, "frames": int(a_single.shape[1]),
           "chunks": 0, "chunk_ranks": [], **common.metrics([[a_single]], [[a_par]]), "weight_reads": weight_reads,
           "bytes_moved": 0, "dtype": str(par_audio.vae_dtype).replace("torch.", ""), "split": False,  # by design
           "seconds_single": round(t1 - t0, 4), "seconds_parallel": round(t2 - t1, 4)}
    return common.judge(row, [(row["max_abs"] == 0, "not identical to one device"),
                              (row["weight_reads"] == 1, f"weight file read {row['weight_reads']} times"),
                              (par_audio.vae_dtype == torch.float32, "not fp32"),
                              (comfy.multinpu_vae.get_runner(par_audio) is None, "split across devices")])
