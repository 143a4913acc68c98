"""Replicated against sharded DiT weights, side by side in one run: resident weights and bytes moved per rank.

    python benchmarks/multinpu_sharding.py --comfy-home TREE [--device-type cpu|npu|cuda] [--npu-count 4,8]
        [--transport threads,process] [--repeats 5] [--json]

Run it with the interpreter that runs ComfyUI, on a tree with the h3kit patches. measured: a small random-weight
H3 DiT (hidden 512, 8x64 heads, 4 blocks, fp32, saved to a file and loaded by comfy.sd.load_diffusion_model) made
sequence-parallel through apply_sequence_parallel with weights replicated and then sharded, for each N and
transport, loaded by ComfyUI's load_models_gpu and run for --repeats direct DiT forwards after a warm-up. Per
rank (the wrappers' own counters, from the transports and the tensors each rank holds): the weight bytes it
holds, the bytes it received per forward in all and of them for weight gathers; max_abs of the sharded output
against the replicated one; and the cost model's figures for this small model beside them (`equal` says whether
every measured figure is the model's). plan: h3kit plan's figures for the real H3 DiT (50 blocks, hidden 5376) at
768p/5 s and 768p/15 s on 4 and 8 cards, BF16 and INT8, replicated and sharded: weights per device (resident,
and the two gathered blocks), activations, the attention exchange and the weight gathers per step.

On the CPU simulation every rank is the host: the timings are overhead, not a speed-up (a sharded forward also
copies every block's weights between the ranks, memory copies here, HCCL/NCCL on devices, where the next
block's gather overlaps the current block on a second stream).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "toolkit"))
sys.path.insert(0, str(HERE))
from h3kit.runtime import costmodel  # noqa: E402  (pure Python)
import multinpu_transport as transport  # noqa: E402  (its setup, group start and forward helpers)

SMALL = dict(transport.SMALL, num_layers=4)
GEOMETRIES = {"768p/5s": (1344, 768, 124), "768p/15s": (1344, 768, 362)}


def small_cfg() -> dict:
    s = SMALL
    return dict(costmodel.H3, blocks=s["num_layers"], hidden=s["hidden_size"], heads=s["num_attention_heads"],
                head_dim=s["attention_head_dim"], ffn=s["ffn_hidden_size"], text_dim=s["text_dim"],
                refiner_blocks=s["token_refiner_num_layers"], t_in=s["timestep_input_dim"],
                t_hidden=s["time_embed_hidden_size"], t_dim=s["time_embed_dim"], rope_inv_freq=s["rope_inv_freq_len"])


def measured_part(args, tmp):
    if args.device_type == "cpu":
        os.environ["H3KIT_SIM_DEVICES"] = str(max(args.counts))
    transport._setup(args.comfy_home, args.device_type)
    import torch
    import comfy.model_management
    import comfy.multidevice
    import comfy.multinpu_dit
    import comfy.multinpu_process as mp
    import comfy.sd
    import comfy.utils
    from h3kit import tiny_models

    path = os.path.join(tmp, "bench_sharding_dit.safetensors")
    comfy.utils.save_torch_file(tiny_models.dit_state_dict(0, SMALL), path)
    width, height, frames, text = transport.GEOMETRY
    seq = costmodel.packed_sequence(width, height, frames, text)
    lt, lh, lw = seq["latent"]
    g = torch.Generator().manual_seed(1)
    x = [torch.randn((1, 24, lt, lh, lw), generator=g), torch.randn((1, 32, 2, seq["audio_latents"]), generator=g)]
    ctx = torch.randn((1, text, SMALL["hidden_size"]), generator=g)  # already refined: skips the refiner
    cfg = small_cfg()
    exchange_cfg = dict(heads=cfg["heads"], head_dim=cfg["head_dim"], hidden=cfg["hidden"], blocks=cfg["blocks"])
    rows = []
    for kind in args.transports:
        for n in args.counts:
            runtime = transport._start_group(n, args.device_type) if kind == "process" else None
            outputs = {}
            for weights in costmodel.SHARDINGS:
                base = comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})
                dev = base.load_device
                devices = None if runtime else comfy.multidevice.devices_for(dev, n)
                m = comfy.multinpu_dit.apply_sequence_parallel(base, devices, weights=weights)
                comfy.model_management.load_models_gpu([m] + m.get_nested_additional_models())
                wrapper = comfy.multinpu_dit.get_wrapper(m)
                wrapper.count_bytes = True
                xs, c = [t.to(dev) for t in x], ctx.to(dev)
                forwards = args.repeats + 1
                sec, out = transport._timed(lambda: transport._forward(m, xs, c), args.repeats, dev)
                outputs[weights] = torch.cat([o.float().flatten().cpu() for o in out])
                received = [b // forwards for b in wrapper.bytes_received]
                gathers = [b // forwards for b in wrapper.weight_bytes_received]
                plan_w = costmodel.weights_per_device(n, "fp32", weights, cfg, other="fp32")
                plan_x = costmodel.exchange_elements(seq["seq_len"], n, **exchange_cfg)
                row = {"transport": kind, "npu_count": n, "weights": weights, "seconds_per_forward": sec,
                       "resident_bytes": list(wrapper.resident_bytes), "received_per_forward": received,
                       "weight_gathers_per_forward": gathers,
                       "plan": {"resident": plan_w["resident"], "gathers": plan_w["received_per_forward"],
                                "exchange": [v * 4 for v in plan_x["per_device"]]}}
                row["equal"] = (row["resident_bytes"] == [plan_w["resident"]] * n
                                and gathers == [plan_w["received_per_forward"]] * n
                                and [r - w for r, w in zip(received, gathers)] == row["plan"]["exchange"])
                if weights == "sharded":
                    row["max_abs_vs_replicated"] = (outputs["sharded"] - outputs["replicated"]).abs().max().item()
                rows.append(row)
                if runtime is None:
                    wrapper.runtime.shutdown()  # the row's own thread runtime (the process group serves every row)
                comfy.model_management.unload_all_models()
            if runtime is not None:
                mp.stop_runtime()
    return {"dit": SMALL, "geometry": f"{width}x{height}x{frames}, {text} text tokens", "seq_len": seq["seq_len"],
            "device_type": args.device_type, "repeats": args.repeats, "rows": rows}


def plan_part() -> list:
    out = []
    for name, (w, h, f) in GEOMETRIES.items():
        for n in (4, 8):
            for weights in ("bf16", "int8"):
                for sharding in costmodel.SHARDINGS:
                    p = costmodel.plan(w, h, f, n, weights=weights, sharding=sharding)
                    mem = p["memory_per_device"]
                    out.append({"geometry": name, "npu_count": n, "weights": weights, "sharding": sharding,
                                "resident": mem["weights_resident"], "gathered": mem["weights_gathered"],
                                "activations": mem["activations"], "total": mem["total"],
                                "exchange_per_step": p["bytes_per_device_step"],
                                "weight_gathers_per_step": p["weight_bytes_per_device_step"]})
    return out


def _gb(x):
    return f"{x / 1e9:.2f} GB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfy-home", required=True)
    ap.add_argument("--device-type", choices=("cpu", "npu", "cuda"), default="cpu")
    ap.add_argument("--npu-count", default="4,8")
    ap.add_argument("--transport", default="threads,process")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.counts = [int(c) for c in args.npu_count.split(",")]
    args.transports = [t for t in args.transport.split(",") if t]
    with tempfile.TemporaryDirectory(prefix="h3kit-sharding-") as tmp:
        report = {"measured": measured_part(args, tmp), "plan": plan_part()}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        m = report["measured"]
        print(f"measured: DiT hidden {SMALL['hidden_size']}, {SMALL['num_layers']} blocks, fp32, {m['geometry']}, "
              f"S = {m['seq_len']}, {m['device_type']}, median of {m['repeats']}")
        print(f"{'transport':9} {'N':>2} {'weights':10} {'resident/rank':>14} {'received/fwd':>13} {'of it weights':>14} "
              f"{'fwd s':>7} {'vs repl':>8}  plan equal")
        for r in m["rows"]:
            vs = r.get("max_abs_vs_replicated")
            print(f"{r['transport']:9} {r['npu_count']:>2} {r['weights']:10} {r['resident_bytes'][0]:>14,} "
                  f"{r['received_per_forward'][0]:>13,} {r['weight_gathers_per_forward'][0]:>14,} "
                  f"{r['seconds_per_forward']:>7.3f} {'-' if vs is None else f'{vs:g}':>8}  {r['equal']}")
        print("\nplan: the real H3 DiT, one forward per step (BasicGuider), per device")
        print(f"{'geometry':9} {'N':>2} {'weights':7} {'sharding':10} {'resident':>9} {'gathered':>9} {'activ.':>8} "
              f"{'total':>9} {'exchange/step':>14} {'gathers/step':>13}")
        for r in report["plan"]:
            print(f"{r['geometry']:9} {r['npu_count']:>2} {r['weights']:7} {r['sharding']:10} {_gb(r['resident']):>9} "
                  f"{_gb(r['gathered']):>9} {_gb(r['activations']):>8} {_gb(r['total']):>9} "
                  f"{_gb(r['exchange_per_step']):>14} {_gb(r['weight_gathers_per_step']):>13}")
    sys.stdout.flush()
    os._exit(0)  # torch's static destructors can abort once rank threads or a process group have run


if __name__ == "__main__":
    main()
